"""The export folder's atomic commit (hidden sibling, fsyncs, rename), free-space check, progress bar."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from schemas.errors import ExportError
from ckpt.fsutil import fsync_dir

log = logging.getLogger(__name__)


def check_out_dir(ckpt_dir: Path, out_dir: Path, overwrite: bool) -> None:
    src, dst = ckpt_dir.resolve(), out_dir.resolve()
    if dst == src or src in dst.parents:
        raise ExportError(f"{out_dir}: is inside the checkpoint {ckpt_dir}; export to a folder outside it, e.g. RUN_DIR/exports/")
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ExportError(f"{out_dir}: exists and is not a folder; remove it or choose another output folder")
        if not overwrite:
            raise ExportError(f"{out_dir}: already exists; pass overwrite=True (--overwrite) to replace it or choose another folder")


def temp_dir_for(out_dir: Path) -> Path:
    tmp = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def commit_folder(tmp: Path, out_dir: Path) -> None:
    """fsync the folder, rename it to ``out_dir`` (moving an old one aside first), fsync the parent."""
    fsync_dir(tmp)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_free_space(out_dir: Path, needed: int) -> None:
    parent = next((p for p in [out_dir.parent, *out_dir.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(parent).free
    if free < needed + (64 << 20):
        raise ExportError(f"{parent}: {free / 1e9:.2f} GB free, the export needs {needed / 1e9:.2f} GB; "
                          "free space or export elsewhere")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Casts run on the calling thread: torch's OpenMP workers would spin against the writer and hasher."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


