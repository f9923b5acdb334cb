"""A rank never outlives the process that launched its segment (and holds the run lock).

Stdlib only at import (the seam's schema is read once the handlers are in): ``guard_rank`` runs first thing in ``python -m trainer.segment``, before torch is
imported, so a rank orphaned during its (slow) start-up dies as early as one that is training.

Three layers, because each alone has a gap:

1. ``PR_SET_PDEATHSIG=SIGKILL``: the kernel kills the rank when its parent (torchrun) dies. The
   launcher sets the same on torchrun, so SIGKILL of the launcher takes torchrun and then every rank.
   PDEATHSIG fires when the parent *thread* that forked the child exits, not the parent process:
   torchrun starts its ranks from its main thread, and the launcher's Popen runs in the thread that
   then waits on it (the CLI's main thread, or the Prefect task's thread), so both outlive the child.
2. The race "parent died before prctl": after prctl the rank checks that its parent is still the
   one torchrun it had, and that the launcher (``SegmentLaunch.launcher_pid``) is alive and is
   torchrun's parent.
3. A daemon watchdog thread (every 0.5 s) kills the rank if its parent changes (a subreaper adopted
   it, so PDEATHSIG did not apply) or the launcher is gone (or its pid now names another process).

A SIGTERM/SIGUSR1 that arrives during start-up (before the training loop's PreemptionWatcher is
installed) is recorded here, not fatal: the segment ends 'preempted' at its first agreement point.
Until the process group has formed there is no agreement point to reach if a peer died (torchrun
SIGTERMs the survivors of a rank that failed during start-up, and they would wait in rendezvous for
the dead one): a rank that got a stop signal and has not formed its group ``STARTUP_STOP_S`` later
exits at once (``EXIT_PREEMPTED``: it had nothing to save). The watchdog sees the signal through the
interpreter's wakeup fd, so it also sees one the main thread cannot handle while blocked in C++.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from ckpt.fsutil import pid_alive  # stdlib only: safe before torch is imported
from launch.procs import proc_stat, set_pdeathsig  # stdlib only (launch/__init__ imports nothing heavy)
from trainer import timeline  # stdlib only

WATCHDOG_PERIOD_S = 0.5
STARTUP_STOP_S = 3.0  # a stop signal before the process group formed: exit this long after it
EXIT_STOPPED_IN_STARTUP = 75  # schemas.seam.EXIT_PREEMPTED (pydantic is not imported this early)

_stop = threading.Event()
_stop_signum: list[int] = []
_group_formed = threading.Event()
_wakeup: list[int] = []  # the read end of the interpreter's signal wakeup fd, once set


def group_formed() -> None:
    """The rank's process group (and its subgroups) formed: a stop signal now reaches an agreement point."""
    _group_formed.set()


def _on_stop_signal(signum: int, _frame: object) -> None:
    timeline.mark("stop_signal")
    _stop_signum.append(signum)
    _stop.set()


def install_early_stop_handlers() -> None:
    """SIGTERM/SIGUSR1 during start-up: remember it (the segment ends 'preempted'), do not die."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_stop_signal)
    if not _wakeup and threading.current_thread() is threading.main_thread():
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            _wakeup.append(r)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)


def _signal_seen() -> float | None:
    """When this rank first saw a stop signal (the handler's mark, or now for a byte on the wakeup fd)."""
    got = False
    if _wakeup:
        try:
            data = os.read(_wakeup[0], 64)
        except (BlockingIOError, OSError):
            data = b""
        got = any(b in (int(signal.SIGTERM), int(signal.SIGUSR1)) for b in data)
    if got or _stop.is_set():
        return timeline.mark_time("stop_signal")
    return None


def stop_requested() -> int | None:
    """The signal that asked this rank to stop during start-up, if any."""
    return _stop_signum[0] if _stop.is_set() and _stop_signum else None


def _die(reason: str) -> None:
    print(f"error: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): {reason}; exiting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _Watchdog:
    def __init__(self, parent: int, launcher: int | None, launcher_start: int | None):
        self.parent = parent
        self.launcher = launcher
        self.launcher_start = launcher_start

    def check(self) -> str | None:
        """Why this rank must die now, or None."""
        if os.getppid() != self.parent:
            return f"its parent {self.parent} is gone"
        if self.launcher is None:
            return None
        if not pid_alive(self.launcher):
            return f"its launcher (pid {self.launcher}) is gone"
        if self.launcher_start is not None:
            stat = proc_stat(self.launcher)
            if stat is None or stat[1] != self.launcher_start:
                return f"its launcher (pid {self.launcher}) is gone"
        return None

    def loop(self) -> None:
        event = threading.Event()
        while not event.wait(WATCHDOG_PERIOD_S):
            reason = self.check()
            if reason:
                _die(reason)
            if not _group_formed.is_set():
                self.check_startup_stop()

    @staticmethod
    def check_startup_stop() -> None:
        """A stop signal and no process group ``STARTUP_STOP_S`` later: a peer may be gone (torchrun is tearing
        the group down) and rendezvous would wait for it: exit now, nothing was trained."""
        seen = _signal_seen()
        if seen is None or time.time() - seen < STARTUP_STOP_S or _group_formed.is_set():
            return
        print(f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): stop signal during start-up and no process "
              f"group {STARTUP_STOP_S:g} s later; exiting with nothing to save", file=sys.stderr, flush=True)
        os._exit(EXIT_STOPPED_IN_STARTUP)


def guard_rank(argv: list[str]) -> int | None:
    """Rank start-up: stop signals recorded, PDEATHSIG set, parent and launcher checked, the watchdog
    started and the shared run-directory lock taken. Returns the lock's fd (None without a run dir)."""
    install_early_stop_handlers()
    set_pdeathsig(signal.SIGKILL)
    parent = os.getppid()
    from schemas.seam import SegmentLaunch  # pydantic: imported once the stop signals are recorded

    launch = SegmentLaunch.from_environ()
    launcher = launch.launcher_pid if launch else None
    launcher_start = None
    if launcher is not None:
        stat = proc_stat(parent)
        if not pid_alive(launcher) or (stat is not None and stat[0] != launcher):
            _die(f"its launcher (pid {launcher}) died before the rank started")
        own = proc_stat(launcher)
        launcher_start = own[1] if own else None
    dog = _Watchdog(parent, launcher, launcher_start)
    threading.Thread(target=dog.loop, name="shardkeeper-rank-watchdog", daemon=True).start()
    if not argv:
        return None
    from ckpt.lock import hold_ranks_lock

    return hold_ranks_lock(argv[0])
