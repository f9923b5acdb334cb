"""Reading a DCP checkpoint's ``.metadata`` through the allow-list: as DCP's own classes for a load
(``ckpt.formats.dcp.read_metadata``, torch), or as stand-ins of them for the quick check (``read_layout``): which
files, which tensors of which shapes and dtypes, without importing torch -- ``status``, a quick ``validate`` and
the launcher's checks before and after a segment then start in a fraction of a second instead of ~3 s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt.formats import safe_pickle
from schemas.errors import CheckpointError


def read_metadata_as(ckpt_dir: Path, data: bytes | None, profile: safe_pickle.Profile, metadata_class: type) -> Any:
    """``ckpt_dir``'s ``.metadata`` (``data``: its bytes, already read by the caller) through the allow-list under
    ``profile``, which must make it a ``metadata_class``."""
    path = ckpt_dir / ".metadata"
    try:
        data = path.read_bytes() if data is None else data
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the DCP checkpoint is incomplete, pick another step") from None
    md = safe_pickle.load(data, profile, where=str(path))
    if not isinstance(md, metadata_class):
        raise CheckpointError(f"{path}: holds {type(md).__name__}, not DCP Metadata; the checkpoint is corrupted, pick another step")
    return md


def read_layout(ckpt_dir: Path, data: bytes | None = None) -> Any:
    """``.metadata`` as stand-ins of DCP's classes (``safe_pickle.DCP_LAYOUT``, no torch): the files and tensors it
    describes, in the shapes the checks below read (anything else is a one-line refusal)."""
    records = safe_pickle.LAYOUT_RECORDS
    md = read_metadata_as(ckpt_dir, data, safe_pickle.DCP_LAYOUT, records["Metadata"])
    where = ckpt_dir / ".metadata"
    storage, tensors = getattr(md, "storage_data", None), getattr(md, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(tensors, dict) or not all(
            type(k) is records["MetadataIndex"] and type(v) is records["_StorageInfo"]
            and type(getattr(v, "relative_path", None)) is str for k, v in storage.items()):
        raise CheckpointError(f"{where}: not the structure DCP writes (storage_data, state_dict_metadata); the "
                              "checkpoint is corrupted, pick another step")
    return md
