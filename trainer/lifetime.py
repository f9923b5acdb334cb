"""A rank never outlives the process that launched its segment (and holds the run lock).

Stdlib only at import (the seam's schema is read once the handlers are in): ``guard_rank`` runs first thing in
``python -m trainer.segment``, before torch is imported, so a rank orphaned during its (slow) start-up dies as early as
one that is training.

Three layers, because each alone has a gap:

1. ``PR_SET_PDEATHSIG=SIGKILL``: the kernel kills the rank when its parent (torchrun) dies. The
   launcher sets the same on torchrun, so SIGKILL of the launcher takes torchrun and then every rank.
   PDEATHSIG fires when the parent *thread* that forked the child exits, not the parent process:
   torchrun starts its ranks from its main thread, and the launcher's Popen runs in the thread that
   then waits on it (the CLI's main thread, or the Prefect task's thread), so both outlive the child.
   A rank restarted in place is the child of the node's fork server (``trainer.forkserver``), which is
   torchrun's child and dies with it: the same chain, one link longer.
2. The race "parent died before prctl": after prctl the rank checks that its parent is still the
   one torchrun it had, and that the launcher (``SegmentLaunch.launcher_pid``) is alive and is
   torchrun's parent.
3. A daemon watchdog thread (every 0.5 s) kills the rank if its parent changes (a subreaper adopted
   it, so PDEATHSIG did not apply) or the launcher is gone (or its pid now names another process).

A SIGTERM/SIGUSR1 that arrives during start-up (before the training loop's PreemptionWatcher is
installed) is recorded here, not fatal: the segment ends 'preempted' at its first agreement point.
Forming the process group is the exception (``rendezvous_window``): a rank waiting there for a peer that
died would wait for torchrun's 30 s teardown (the wait holds the interpreter, so no handler runs), so there
the signals keep their default action and end the rank at once, and a rank that already got one does not
enter rendezvous at all (it exits ``EXIT_PREEMPTED``: nothing was trained, nothing is lost).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from ckpt.commit.fsutil import pid_alive  # stdlib only: safe before torch is imported
from launch.procs import is_zombie, proc_stat, set_pdeathsig  # stdlib only (launch/__init__ imports nothing heavy)
from trainer import timeline  # stdlib only
from trainer.forkserver import FORKED_ENV  # stdlib only

WATCHDOG_PERIOD_S = 0.5
EXIT_STOPPED_IN_STARTUP = 75  # schemas.seam.EXIT_PREEMPTED (this module stays stdlib only)

_stop = threading.Event()
_stop_signum: list[int] = []


def _on_stop_signal(signum: int, _frame: object) -> None:
    timeline.mark("stop_signal")
    _stop_signum.append(signum)
    _stop.set()


def install_early_stop_handlers() -> None:
    """SIGTERM/SIGUSR1 during start-up: remember it (the segment ends 'preempted'), do not die."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_stop_signal)


def restart_count() -> int:
    """How often this segment's ranks were restarted in place before this rank started (torchrun's count)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def stop_requested() -> int | None:
    """The signal that asked this rank to stop during start-up, if any."""
    return _stop_signum[0] if _stop.is_set() and _stop_signum else None


@contextlib.contextmanager
def rendezvous_window() -> Iterator[None]:
    """Around forming the process group: a rank asked to stop before it gets there exits instead (its peers may be
    gone: torchrun SIGTERMs the survivors of a rank that died, and rendezvous would wait for the dead one); inside,
    SIGTERM/SIGUSR1 end the rank at once. Outside a rank started by ``guard_rank`` (a test harness): no change."""
    ours = threading.current_thread() is threading.main_thread() and all(
        signal.getsignal(s) is _on_stop_signal for s in (signal.SIGTERM, signal.SIGUSR1)
    )
    if not ours:
        yield
        return
    if stop_requested() is not None:
        print(
            f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): stop signal during start-up, before the "
            "process group formed; exiting with nothing to save",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_STOPPED_IN_STARTUP)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    try:
        yield
    finally:
        install_early_stop_handlers()


def _die(reason: str) -> None:
    print(
        f"error: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): {reason}; exiting", file=sys.stderr, flush=True
    )
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
        if not pid_alive(self.launcher) or is_zombie(self.launcher):
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


_DOG: list[_Watchdog] = []


def orphaned() -> str | None:
    """Why this rank must not go on (its torchrun or launcher is gone: a kill it has not died of yet), checked
    now; rank 0 asks right before it commits, so a checkpoint is never committed a few milliseconds after the
    launcher that holds the run lock died. None in a process that ``guard_rank`` did not start."""
    return _DOG[0].check() if _DOG else None


def die_orphaned(reason: str) -> None:
    _die(reason)


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
        # torchrun is this rank's parent, or, for a rank the node's fork server forked (a restart in place,
        # trainer.forkserver), its parent's parent: the launcher is torchrun's parent
        torchrun = parent
        if os.environ.get(FORKED_ENV) == str(parent):
            up = proc_stat(parent)
            torchrun = up[0] if up else parent
        stat = proc_stat(torchrun)
        if not pid_alive(launcher) or (stat is not None and stat[0] != launcher):
            _die(f"its launcher (pid {launcher}) died before the rank started")
        own = proc_stat(launcher)
        launcher_start = own[1] if own else None
    if launch is not None and launch.stacks_dir:
        _stacks_on_request(launch.stacks_dir)
    dog = _Watchdog(parent, launcher, launcher_start)
    _DOG[:] = [dog]
    threading.Thread(target=dog.loop, name="shardkeeper-rank-watchdog", daemon=True).start()
    if not argv:
        return None
    from ckpt.guards.lock import hold_ranks_lock

    fd = hold_ranks_lock(argv[0])
    if fd is not None:
        _not_in_forks(fd)
    return fd


_STACKS: list[object] = []  # the open stacks file: faulthandler writes to its descriptor for the rank's life


def _stacks_on_request(folder: str) -> None:
    """The launcher may ask for this rank's Python stacks (schemas.seam.STACKS_SIGNAL) when it does not stop within
    its grace: faulthandler writes every thread's stack to ``folder/rank-R.txt`` from the signal handler itself, so
    it answers even while the main thread waits inside a collective."""
    import faulthandler

    from schemas.seam import STACKS_SIGNAL

    try:
        out = open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.txt"), "w")  # noqa: SIM115 - kept open
    except OSError:
        return
    _STACKS[:] = [out]
    faulthandler.register(STACKS_SIGNAL, file=out, all_threads=True)


def _not_in_forks(fd: int) -> None:
    """A process the rank forks (a multiprocessing helper, a daemon) closes its copy of the ranks lock's descriptor
    at once: a flock belongs to the open file, so a child that outlived its rank would otherwise hold the run's
    ``.lock.ranks`` and keep the next segment out. (A fork from C, past Python's at-fork hooks, is left to the
    launcher, which ends what the ranks leave behind: launch.contain.)"""
    st = os.fstat(fd)
    held = [(fd, st.st_dev, st.st_ino)]

    def in_child() -> None:
        if not held:
            return
        lock_fd, dev, ino = held.pop()  # forks of the child: nothing more to close
        try:
            now = os.fstat(lock_fd)
        except OSError:
            return
        if (now.st_dev, now.st_ino) == (dev, ino):
            os.close(lock_fd)

    os.register_at_fork(after_in_child=in_child)
