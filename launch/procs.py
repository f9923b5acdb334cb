"""Process primitives every launcher and every rank share (stdlib only): the kernel's parent-death
signal, /proc parent/start-time lookups, and a launcher's wait (by pid) for what its torchrun started.
A launcher ties torchrun to itself with ``pdeathsig_preexec``; a rank ties itself to torchrun with
``set_pdeathsig`` (trainer.lifetime)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 1


def _prctl():  # noqa: ANN202 - a ctypes function or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits. False where the
    platform has no prctl (macOS, Windows): the watchdog is then the only guard."""
    prctl = _prctl()
    return bool(prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def pdeathsig_preexec(parent_pid: int):  # noqa: ANN201 - a preexec_fn for subprocess.Popen
    """A ``preexec_fn`` that ties the child to ``parent_pid`` (the launcher): PDEATHSIG=SIGKILL, then
    exit at once if the parent already died between fork and prctl. The prctl function is looked up
    here, before the fork, so the child only makes the one foreign call."""
    prctl = _prctl()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(EXIT_ORPHANED)

    return preexec


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid`` from /proc, or None (gone, or no /proc)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm)": state ppid ... starttime is field 22
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), from /proc; [] when gone or without /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


class Descendants:
    """Every process started under one root (torchrun), by (pid, start time): recorded while the root lives, so
    that after it is gone the launcher can wait for each of them by pid, not by sleeping a fixed time."""

    def __init__(self, root: int):
        self.root = root
        self.seen: dict[int, int] = {}  # pid -> start time in clock ticks

    def scan(self) -> None:
        todo = children(self.root)
        while todo:
            pid = todo.pop()
            stat = proc_stat(pid)
            if stat is None or pid in self.seen:
                continue
            self.seen[pid] = stat[1]
            todo += children(pid)

    def live(self) -> list[int]:
        """Recorded processes still running (same pid and start time, not a zombie)."""
        return [pid for pid, start in self.seen.items() if _running(pid, start)]


def _state(pid: int) -> bytes | None:
    """The one-letter state of ``pid`` from /proc (b"R", b"S", b"Z", ...), or None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:][:1]


def is_zombie(pid: int) -> bool:
    """Exited, not reaped yet by its parent: gone, though kill(pid, 0) still finds it."""
    return _state(pid) in (b"Z", b"X")


def _running(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    if stat is None or stat[1] != start:
        return False
    state = _state(pid)
    return state is not None and state not in (b"Z", b"X")


def reap_orphans(procs: Descendants, timeout_s: float = 60.0) -> list[int]:
    """After the root is gone: SIGKILL what it left (the kernel's PDEATHSIG has normally done so already) and
    block on each process's pidfd until it has exited. Returns the pids still running after ``timeout_s``
    (a process stuck in the kernel); [] in every ordinary case, however loaded the machine."""
    import select

    left = procs.live()
    fds: list[int] = []
    for pid in left:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or no pidfd (old kernel / not Linux): polled below
            fd = -1
        if fd >= 0 and not _running(pid, procs.seen[pid]):  # the pid was reused between the check and the open
            os.close(fd)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if fd >= 0:
            fds.append(fd)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        pending = set(fds)
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                poller.unregister(fd)
                pending.discard(fd)
        while time.monotonic() < deadline and procs.live():  # without pidfds
            time.sleep(0.05)
    finally:
        for fd in fds:
            os.close(fd)
    return procs.live()
