"""The export folder's atomic commit (hidden sibling, fsyncs, rename), free-space check, progress bar."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ckpt.commit.fsutil import fsync_dir, rename_noreplace
from ckpt.guards.flock import FileLock
from schemas.errors import ExportError

log = logging.getLogger(__name__)


def check_out_dir(ckpt_dir: Path, out_dir: Path, overwrite: bool) -> None:
    src, dst = ckpt_dir.resolve(), out_dir.resolve()
    if dst == src or src in dst.parents:
        raise ExportError(
            f"{out_dir}: is inside the checkpoint {ckpt_dir}; export to a folder outside it, e.g. RUN_DIR/exports/"
        )
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ExportError(f"{out_dir}: exists and is not a folder; remove it or choose another output folder")
        if not overwrite:
            raise ExportError(
                f"{out_dir}: already exists; pass overwrite=True (--overwrite) to replace it or choose another folder"
            )


def _sibling(out_dir: Path, kind: str) -> Path:
    """``.NAME.<kind>-<pid>-<token>``: the pid lets the segment-start sweep remove those of dead processes; the
    token keeps two exports of one process (threads) apart."""
    return out_dir.with_name(f".{out_dir.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temp_dir_for(out_dir: Path) -> Path:
    tmp = _sibling(out_dir, "export")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def commit_folder(tmp: Path, out_dir: Path, *, overwrite: bool = False) -> None:
    """fsync the folder, rename it to ``out_dir``, fsync the parent. Without ``overwrite`` nothing is replaced: an
    ``out_dir`` that appeared since the export began (another export into it finished first) fails this one with
    ExportError, and that one stays whole. With it, the old folder is moved aside first, then removed."""
    fsync_dir(tmp)
    old = None
    with FileLock(out_dir.parent, directory=True):  # exports committing into one folder take turns
        if not overwrite:
            try:
                rename_noreplace(tmp, out_dir)
            except FileExistsError:
                raise ExportError(
                    f"{out_dir}: already exists (another export into it finished first); nothing was "
                    "replaced: pass --overwrite to replace it or choose another folder"
                ) from None
        else:
            if out_dir.exists() or out_dir.is_symlink():
                old = _sibling(out_dir, "replaced")
                os.rename(out_dir, old)
            os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_free_space(out_dir: Path, needed: int) -> None:
    parent = next((p for p in [out_dir.parent, *out_dir.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(parent).free
    if free < needed + (64 << 20):
        raise ExportError(
            f"{parent}: {free / 1e9:.2f} GB free, the export needs {needed / 1e9:.2f} GB; "
            "free space or export elsewhere"
        )


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Casts run on the calling thread: torch's OpenMP workers would spin against the writer and hasher."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
