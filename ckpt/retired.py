"""Readers beside writers: is the checkpoint directory a reader started on still there, and was a missing one a
checkpoint (retired or quarantined by the run's writer) rather than a wrong path? ckpt.validate, the export and
the checkpoint stages ask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt.layout import RECYCLE_SUFFIX, parse_step

# Readers (status, lineage, validate, export, the scans) run beside a training segment whose retention renames a
# checkpoint to ``.deleting`` and removes it, or whose failed load renames it to ``.invalid-<time>``, at any
# moment. A reader notes the directory's identity before it reads and looks again when a check fails: a
# directory that is no longer the one it started on was retired meanwhile -- reported as that, never as corrupted.
def dir_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory at ``path`` now; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class WatchedDir:
    """The directory at ``path`` held open while it is read: ``vanished()`` says whether the path still leads to
    it. (Held open, its inode number cannot be handed to a checkpoint committed again at the same step.)"""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.identity: tuple[int, int] | None = None
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        else:
            st = os.fstat(self._fd)
            self.identity = (st.st_dev, st.st_ino)

    @property
    def existed(self) -> bool:
        return self.identity is not None

    def vanished(self) -> bool:
        """True when the directory that was at the path (a retired or quarantined checkpoint) is no longer there."""
        return self.identity is not None and dir_identity(self.path) != self.identity

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WatchedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def retired_message(ckpt_dir: Path) -> str:
    run = ckpt_dir.parent.parent if ckpt_dir.parent.name == "checkpoints" else None
    lists = f"`shardkeeper status {run}` lists them" if run is not None else "`shardkeeper status RUN_DIR` lists them"
    return (f"{ckpt_dir}: retired or quarantined by the run's writer while being read (retention keeps only the "
            f"newest checkpoints of a training run); pick a newer step, {lists}")


def was_committed(ckpt_dir: Path) -> bool:
    """A missing step directory that was a checkpoint: retention, a quarantine or the memory tier's recycle
    (``step-X.recycle-Y``) left a sibling, or the run's lineage names it."""
    if parse_step(ckpt_dir.name) is None or not ckpt_dir.parent.is_dir():
        return False
    try:
        if any(e.name == ckpt_dir.name + ".deleting" or e.name.startswith((ckpt_dir.name + ".invalid-",
                                                                           ckpt_dir.name + RECYCLE_SUFFIX))
               for e in os.scandir(ckpt_dir.parent)):
            return True
        return f'"checkpoint:{ckpt_dir.name}"'.encode() in (ckpt_dir.parent.parent / "lineage.jsonl").read_bytes()
    except OSError:
        return False
