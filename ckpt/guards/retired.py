"""Readers beside writers: is the checkpoint directory a reader started on still there, and was a missing one a
checkpoint (retired or quarantined by the run's writer) rather than a wrong path? ckpt.validate.checks, the export and
the checkpoint stages ask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpt.commit.layout import RECYCLE_SUFFIX, parse_step


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
        self._fd: int | None = None
        self.missing = False  # nothing at the path when it looked (not a directory it could not open)
        self.adopt()

    def adopt(self) -> None:
        """Watch the directory at the path now, if none is watched yet: a reader that found nothing at first and
        then read a directory committed there meanwhile watches that one from the moment it read it."""
        if self._fd is not None:
            return
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.missing = True
            return
        except OSError:  # not a directory, no permission, ...: the reader's own error says which
            return
        st = os.fstat(self._fd)
        self.identity = (st.st_dev, st.st_ino)
        self.missing = False

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


def retired_message(ckpt_dir: Path, *, before: bool = False) -> str:
    """``before``: it was already gone when the reader looked (else: it went while being read)."""
    run = ckpt_dir.parent.parent if ckpt_dir.parent.name == "checkpoints" else None
    lists = f"`shardkeeper status {run}` lists them" if run is not None else "`shardkeeper status RUN_DIR` lists them"
    when = (
        "no longer there: retired or quarantined by the run's writer"
        if before
        else "retired or quarantined by the run's writer while being read"
    )
    return (
        f"{ckpt_dir}: {when} (retention keeps only the newest checkpoints of a training run); pick a newer step, "
        f"{lists}"
    )


def gone_before(watched: WatchedDir) -> bool:
    """Nothing at the watched path when the reader looked, and a checkpoint was committed there (retired since)."""
    return watched.missing and was_committed(watched.path)


def was_committed(ckpt_dir: Path) -> bool:
    """A missing step directory that was a checkpoint: retention, a quarantine or the memory tier's recycle
    (``step-X.recycle-Y``) left a sibling, or the run's lineage names it."""
    if parse_step(ckpt_dir.name) is None or not ckpt_dir.parent.is_dir():
        return False
    try:
        if any(
            e.name == ckpt_dir.name + ".deleting"
            or e.name.startswith((ckpt_dir.name + ".invalid-", ckpt_dir.name + RECYCLE_SUFFIX))
            for e in os.scandir(ckpt_dir.parent)
        ):
            return True
        return f'"checkpoint:{ckpt_dir.name}"'.encode() in (ckpt_dir.parent.parent / "lineage.jsonl").read_bytes()
    except OSError:
        return False
