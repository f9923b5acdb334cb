"""Stop signals that arrive before a segment's ranks are launched (stdlib only: installed first thing by the
``shardkeeper train`` entry point, before anything heavy is imported)."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
pending_stop: list[int] = []
received_stop: list[int] = []  # every stop signal this process received, whichever handler took it


def install_early_stop_handlers() -> None:
    """For a CLI process: a stop signal that arrives before the ranks are launched (imports, config loading, run
    lock, checks) is remembered instead of killing the process; the launcher then starts nothing and the
    segment ends 'preempted' with the latest checkpoint untouched. Main thread only."""

    def remember(signum: int, _frame: object) -> None:
        pending_stop.append(signum)
        received_stop.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, remember)
