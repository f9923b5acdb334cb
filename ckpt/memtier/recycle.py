"""The memory tier's page reuse: before a snapshot is written, the node's leader retires the older of the two kept
snapshots into ``step-OLD.recycle-STEP``; the new snapshot's writers (``ckpt.formats.dcp.direct_io.take_over``, and
``ckpt.memtier.replicate`` for files received from the peer node) overwrite its files in place. ``ckpt.memtier.tier``
holds
the rest of the tier (ownership, retention, persisting); its retention removes what was not taken.

When snapshots are staged straight into their files (``ckpt.memtier.stage``), the older snapshot is retired
right after a commit instead, into ``step-OLD.recycle-next`` (the stage dir): the next snapshot's files are laid out
there before it is due, and its writers move them into its ``.partial``.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

from ckpt.commit.layout import RECYCLE_SUFFIX, RunDir, parse_step, step_dir_name
from ckpt.commit.layout import STAGE_SUFFIX as STAGE_TAG
from ckpt.memtier.tier import KEEP, owner_problem
from schemas import MANIFEST_NAME

log = logging.getLogger(__name__)


def recycle_path(mem: RunDir, old: int, step: int) -> Path:
    """Where the snapshot of step ``old`` is retired while the snapshot of ``step`` is written:
    ``step-OLD.recycle-STEP`` (the old name first, so a reader of it learns it was retired; the new step last, so
    the writers of ``step`` find exactly the dir their leader made)."""
    return mem.checkpoints / f"{step_dir_name(old)}{RECYCLE_SUFFIX}-{step:08d}"


def recycle(mem: RunDir, step: int, run_dir: RunDir, keep: int = KEEP, staged: bool = False) -> Path | None:
    """The node's leader, before the snapshot of ``step`` is written: the oldest committed snapshot before
    ``step``, the one retention removes once the new one commits, is renamed to ``step-OLD.recycle-STEP`` (one
    rename: from then on nobody takes it for a snapshot) and its manifest removed; the new snapshot's writers then
    take its data files over one by one (``ckpt.formats.dcp.direct_io``) and overwrite them in place. A tmpfs file's
    pages are reused that way: none is allocated, zeroed, or freed by retention, CPU time a busy host's training
    pays for. Only when ``keep`` (>= 2) snapshots before ``step`` are committed, so that the newest of them stays
    whole while the new one is written; never a snapshot at or after ``step`` (a newer one the run could not use is
    left alone), and only in a memory dir this run owns. What the writers did not take is removed by the next
    retention (or the next recycle). ``staged``: this process laid the snapshot's files out in the stage dir
    (kept; else a stage dir is a leftover, removed). Returns the recycle dir, or None (the new snapshot's files
    are created)."""
    for stale in _recycle_entries(mem):
        if not (staged and stale.name.endswith(STAGE_TAG)):
            _remove_entry(stale)
    if keep < 2 or owner_problem(mem, run_dir) is not None:
        return None
    older = [p for p in mem.committed() if (parse_step(p.name) or 0) < step]
    if len(older) < keep:
        return None
    try:
        return _retire(older[0], recycle_path(mem, parse_step(older[0].name) or 0, step))
    except OSError as e:  # a reader's quarantine or retention took it first: the new files are created
        log.debug("memory tier: %s not recycled: %s", older[0].name, e)
        return None


def recycle_dir(mem: RunDir, step: int) -> Path | None:
    """The recycle dir the node's leader made for the snapshot of ``step`` (every rank on the node asks): exactly
    one real directory named ``*.recycle-STEP``, else None (nothing is taken over)."""
    return _the_dir(mem, f"{RECYCLE_SUFFIX}-{step:08d}")


def retire_for_stage(mem: RunDir, step: int, run_dir: RunDir, keep: int = KEEP) -> Path | None:
    """The node's leader, right after the snapshot of ``step`` committed: a fresh stage dir for the next snapshot
    (``step-OLD.recycle-next``; an earlier one removed). With ``keep`` snapshots committed, the oldest one is it
    (renamed, its manifest removed: no longer a snapshot; its files' pages are reused); else an empty dir named
    after ``step``. Only in a memory dir this run owns; None when there is none."""
    for old in _recycle_entries(mem):
        if old.name.endswith(STAGE_TAG):
            _remove_entry(old)
    if owner_problem(mem, run_dir) is not None:
        return None
    older = [p for p in mem.committed() if (parse_step(p.name) or 0) <= step]
    if len(older) >= keep >= 2:
        return _retire(older[0], mem.checkpoints / f"{older[0].name}{STAGE_TAG}")
    stage = mem.checkpoints / f"{step_dir_name(step)}{STAGE_TAG}"
    os.mkdir(stage)
    return stage


def _retire(snapshot: Path, to: Path) -> Path:
    """Rename a committed snapshot to ``to`` (one rename: from then on nobody takes it for a snapshot) and remove its
    manifest. Raises OSError when the rename fails."""
    os.rename(snapshot, to)
    try:
        os.unlink(to / MANIFEST_NAME)
    except OSError:
        pass
    return to


def stage_dir(mem: RunDir) -> Path | None:
    """The stage dir the node's leader made (every rank asks): exactly one real directory, else None."""
    return _the_dir(mem, STAGE_TAG)


def _the_dir(mem: RunDir, ending: str) -> Path | None:
    """The one entry of the memory dir whose name ends with ``ending``, if it is a real directory (not followed)."""
    found = [p for p in _recycle_entries(mem) if p.name.endswith(ending)]
    if len(found) != 1:
        return None
    try:
        st = os.lstat(found[0])
    except OSError:
        return None
    return found[0] if stat.S_ISDIR(st.st_mode) else None


def _recycle_entries(mem: RunDir) -> list[Path]:
    try:
        return sorted(p for p in mem.checkpoints.iterdir() if RECYCLE_SUFFIX in p.name)
    except OSError:
        return []


def _remove_entry(path: Path) -> None:
    """A directory is removed with what it holds; anything else (a symlink included: never followed) is unlinked."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
