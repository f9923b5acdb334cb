"""The flock primitives every lock of a run directory is built on (``lock``, ``pin``, ``ckpt.plan``, the memory
tier's ``tier.lock``, the export folder's commit lock).

A flock belongs to the open file: the kernel drops it when the last descriptor of that open file is closed, so a
holder that dies never leaves a stale lock. Lock files are opened close-on-exec (a program the holder starts never
inherits the lock). A probe (``is_held``) opens without following a symlink and without blocking on a FIFO, and
takes nothing but a regular file for a lock: a reader that probes a run directory never hangs nor fails on what
was planted there.

Stdlib only: the ranks take their locks before torch is imported.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path

LOCK_SH = fcntl.LOCK_SH
LOCK_EX = fcntl.LOCK_EX
POLL_S = 0.1  # how often ``flock_within`` tries again while another process holds the lock
# How long ``take_exclusive`` waits out a lock held with an empty lock file (a probe holds it for microseconds; a
# real holder writes who it is right after taking it).
PROBE_WAIT_S = 2.0


class FlockRefused(OSError):
    """The file system refused an flock for another reason than another holder (ENOLCK: no lock support there,
    or none left). Its ``errno`` and message are flock's own."""


def open_lock(
    path: str | os.PathLike[str], *, directory: bool = False, append: bool = False, nofollow: bool = False
) -> int:
    """Open a lock file for holding an flock on it, close-on-exec.

    Args:
        path: the lock file, created (mode 0644) when missing; with ``directory`` an existing directory, locked
            itself (opened read-only).
        directory: lock the directory ``path`` rather than a file.
        append: open the file for appending (a holder that adds a line to it, as the ranks add their pids).
        nofollow: refuse a symlink at ``path`` (OSError ELOOP) instead of following it.

    Returns:
        The descriptor; closing it lets go of any flock taken on it.

    Raises:
        OSError: ``path`` cannot be opened or created.
    """
    if directory:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    else:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    return os.open(path, flags | (os.O_NOFOLLOW if nofollow else 0), 0o644)


def try_flock(fd: int, mode: int) -> bool:
    """One non-blocking try at an flock.

    Args:
        fd: an open descriptor (``open_lock``).
        mode: ``LOCK_SH`` or ``LOCK_EX``.

    Returns:
        True once taken; False when another open file holds a conflicting flock.

    Raises:
        FlockRefused: the file system refused the flock (nothing taken).
    """
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        raise FlockRefused(e.errno, e.strerror) from None
    return True


def flock_within(fd: int, mode: int, wait_s: float | None) -> bool:
    """Take an flock of ``mode`` on ``fd``, waiting a bounded time for other holders to let go.

    Args:
        fd: an open descriptor (``open_lock``).
        mode: ``LOCK_SH`` or ``LOCK_EX``.
        wait_s: how long to keep trying (every ``POLL_S``); 0: one try; None: block until taken.

    Returns:
        True once taken; False when others still hold a conflicting flock after ``wait_s``.

    Raises:
        FlockRefused: the file system refused the flock (nothing taken).
    """
    if wait_s is None:
        try:
            fcntl.flock(fd, mode)
        except OSError as e:
            raise FlockRefused(e.errno, e.strerror) from None
        return True
    deadline = time.monotonic() + wait_s
    while not try_flock(fd, mode):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def unlock(fd: int) -> None:
    """Let go of the flock held on ``fd`` (the descriptor stays open). Raises OSError only for a bad ``fd``."""
    fcntl.flock(fd, fcntl.LOCK_UN)


def open_regular(path: str | os.PathLike[str]) -> int | None:
    """Open ``path`` read-only if it is a regular file, never following a symlink nor blocking on a FIFO.

    Args:
        path: the file to open.

    Returns:
        The descriptor (the caller closes it); None when ``path`` is missing, unreadable, a symlink, or anything but
        a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def is_held(path: str | os.PathLike[str], mode: int) -> bool:
    """Would a non-blocking flock of ``mode`` on the lock file ``path`` fail now? A probe: the flock it takes when it
    succeeds is let go at once (``take_exclusive`` waits such a moment out).

    Args:
        path: the lock file; a missing one, a symlink or anything but a regular file holds no lock (False).
        mode: ``LOCK_SH`` (held exclusively by someone) or ``LOCK_EX`` (held at all).

    Returns:
        True when another open file holds a conflicting flock.

    Raises:
        FlockRefused: the file system refused the flock.
    """
    fd = open_regular(path)
    if fd is None:
        return False
    try:
        return not try_flock(fd, mode)
    finally:
        os.close(fd)


def take_exclusive(fd: int) -> str | None:
    """Exclusive flock on a lock file whose holder writes who it is into it right after taking it.

    A holder found with an empty file is a reader's probe (``is_held``), waited out for up to ``PROBE_WAIT_S``.

    Args:
        fd: the lock file, opened read-write (``open_lock``).

    Returns:
        None once taken (the caller writes its record); else the holder's record (empty when a holder kept the
        file empty for ``PROBE_WAIT_S``).

    Raises:
        FlockRefused: the file system refused the flock.
    """
    deadline = time.monotonic() + PROBE_WAIT_S
    while not try_flock(fd, fcntl.LOCK_EX):
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if holder or time.monotonic() >= deadline:
            return holder
        time.sleep(0.001)
    return None


def take_recorded(path: str | os.PathLike[str], record: str, *, nofollow: bool = False) -> tuple[int | None, str]:
    """``take_exclusive`` on the lock file ``path``, then this holder's ``record`` written into it.

    Nothing is left open or held when it fails: the descriptor is closed on every error path.

    Args:
        path: the lock file (created when missing).
        record: what the next one who finds it held reads (one line: who holds it, since when).
        nofollow: refuse a symlink at ``path``.

    Returns:
        ``(fd, "")`` once taken and recorded (let go with ``release_recorded``), or ``(None, holder's record)``
        when another process holds it.

    Raises:
        NotALockFile: ``path`` is not a regular file (a FIFO, a directory, a device).
        OSError: it cannot be opened, flocked (FlockRefused) or written (a full disk).
    """
    fd = open_lock(path, nofollow=nofollow)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotALockFile(path, mode)
        holder = take_exclusive(fd)
        if holder is None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
    except BaseException:
        os.close(fd)  # the flock, if taken, goes with it
        raise
    if holder is not None:
        os.close(fd)
        return None, holder
    return fd, ""


class NotALockFile(OSError):
    """Something other than a regular file sits where a lock file belongs; its message names it and the fix."""

    def __init__(self, path: str | os.PathLike[str], mode: int) -> None:
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        super().__init__(f"{path}: {kind} where a lock file belongs; remove it and retry")


def release_recorded(fd: int) -> None:
    """Let go of a lock file taken with ``take_exclusive``: its holder record emptied, unlocked, closed."""
    os.ftruncate(fd, 0)
    unlock(fd)
    os.close(fd)


class FileLock:
    """An flock on one file (or directory), held by this object between ``acquire`` and ``release``.

    ``with FileLock(path):`` blocks until it holds the lock exclusively and lets go on leaving.
    """

    def __init__(self, path: str | os.PathLike[str], *, directory: bool = False) -> None:
        """Args: path: the lock file (created at the first ``acquire``) or, with ``directory``, the directory."""
        self.path = Path(path)
        self.directory = directory
        self.fd: int | None = None  # while held

    @property
    def held(self) -> bool:
        """Does this object hold the lock now?"""
        return self.fd is not None

    def acquire(self, mode: int = LOCK_EX, wait_s: float | None = 0.0) -> bool:
        """Take the lock (a no-op returning True while this object holds it).

        Args:
            mode: ``LOCK_EX`` or ``LOCK_SH``.
            wait_s: as ``flock_within``: 0 one try, None block until taken.

        Returns:
            True once held; False when another open file holds it after ``wait_s`` (the file is closed again).

        Raises:
            OSError: the lock file cannot be opened (``open_lock``).
            FlockRefused: the file system refused the flock (the file is closed again).
        """
        if self.fd is not None:
            return True
        fd = open_lock(self.path, directory=self.directory)
        try:
            taken = flock_within(fd, mode, wait_s)
        except BaseException:
            os.close(fd)
            raise
        if not taken:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        """Let go of the lock and close the file (nothing when not held)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                unlock(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire(LOCK_EX, None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


__all__ = [
    "LOCK_EX",
    "LOCK_SH",
    "POLL_S",
    "PROBE_WAIT_S",
    "FileLock",
    "FlockRefused",
    "flock_within",
    "is_held",
    "open_lock",
    "open_regular",
    "release_recorded",
    "take_exclusive",
    "try_flock",
    "unlock",
]
