"""Pins: a checkpoint that a live process still reads out of a run directory, kept by retention until it is done.

The uploader of an ``s3://`` run (shardkeeper.remote.Mirror) pushes each checkpoint from the local cache while the
ranks keep committing and pruning there; on a link slower than the commits, retention would delete the checkpoint
being uploaded, and the next, and the store would receive nothing. The uploader pins the one it pushes::

    RUN_DIR/.pins/upload.json   {"step": 20, "pid": ..., "host": ..., "since": ...}   replaced atomically
    RUN_DIR/.pins/upload.lock   exclusive flock of the pinning process, for as long as it holds the pin

A pin counts only while its lock is held (``pinned_steps``): the kernel drops a flock when its holder dies, so the
pin a crashed process left protects nothing (it is ignored, and replaced by the next holder). A reader's probe of
the lock holds it for a moment only (as ``ckpt.guards.lock`` probes the run lock). Stdlib only: the ranks' retention
reads it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from ckpt.commit.fsutil import atomic_write_json
from ckpt.guards.flock import LOCK_EX, LOCK_SH, FileLock, is_held, open_regular
from schemas.errors import RunLockedError

PINS_DIR = ".pins"
MAX_PIN_BYTES = 4096  # a pin is ~100 bytes; a bigger file is not one (never read whole)


def pins_dir(root: str | os.PathLike[str]) -> Path:
    return Path(root) / PINS_DIR


class Pin:
    """One named pin of a run directory, held by this process between ``acquire`` and ``release``."""

    def __init__(self, root: str | os.PathLike[str], name: str = "upload", *, wait_s: float = 5.0):
        self.path = pins_dir(root) / f"{name}.json"
        self.lock_path = pins_dir(root) / f"{name}.lock"
        self.wait_s = wait_s
        self._lock = FileLock(self.lock_path)
        self._mu = threading.Lock()

    def acquire(self) -> Pin:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._lock.held:  # acquiring again would remove this holder's own live pin
            raise RunLockedError(f"{self.lock_path}: already held by this pin; release it first")
        if not self._lock.acquire(LOCK_EX, self.wait_s):
            raise RunLockedError(
                f"{self.lock_path}: held by another live process for {self.wait_s:g} s; stop the "
                "other `shardkeeper train` on this run directory's cache, then retry"
            )
        self.path.unlink(missing_ok=True)  # a dead holder's pin
        return self

    def set(self, step: int) -> None:
        """Pin ``step`` (replacing what was pinned): from now on retention keeps it."""
        with self._mu:
            if self._lock.held:
                atomic_write_json(
                    self.path,
                    {
                        "step": step,
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    },
                )

    def clear(self) -> None:
        with self._mu:
            if self._lock.held:
                self.path.unlink(missing_ok=True)

    def release(self) -> None:
        with self._mu:
            if self._lock.held:
                self.path.unlink(missing_ok=True)
                self._lock.release()


def pinned_steps(root: str | os.PathLike[str]) -> set[int]:
    """The steps pinned in the run directory ``root`` by live processes (a pin whose lock nobody holds is stale).
    Whatever else a pin file or its lock is (a FIFO, a symlink, a huge or malformed file) pins nothing: the ranks'
    retention reads them and must neither hang nor fail on them."""
    found: set[int] = set()
    folder = pins_dir(root)
    if not folder.is_dir():
        return found
    for doc in folder.glob("*.json"):
        step = _pinned_step(doc)
        if step is not None and _lock_held(doc.with_suffix(".lock")):
            found.add(step)
    return found


def _pinned_step(doc: Path) -> int | None:
    fd = open_regular(doc)
    if fd is None:
        return None
    try:
        if os.fstat(fd).st_size > MAX_PIN_BYTES:
            return None
        raw = os.read(fd, MAX_PIN_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        step = json.loads(raw).get("step")
    except (ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _lock_held(path: Path) -> bool:
    """Does a live process hold the pin's lock? (A shared flock for a moment, as ``ckpt.guards.lock`` probes its
    locks; a lock the file system refuses to take pins nothing.)"""
    try:
        return is_held(path, LOCK_SH)
    except OSError:
        return False


__all__ = ["PINS_DIR", "Pin", "pinned_steps", "pins_dir"]
