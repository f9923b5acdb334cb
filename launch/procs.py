"""Process primitives every launcher and every rank share (stdlib only): the kernel's parent-death
signal and /proc parent/start-time lookups. A launcher ties torchrun to itself with ``pdeathsig_preexec``;
a rank ties itself to torchrun with ``set_pdeathsig`` (trainer.lifetime)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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


