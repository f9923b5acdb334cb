"""Export options (dtype, shard size) and the checks made before anything is written."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ckpt.validate.checks import checked_manifest
from schemas import CheckpointManifest
from schemas.errors import ExportError
from schemas.requests import SIZE_RE

log = logging.getLogger(__name__)


EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# Module wrappers whose names appear inside parameter names: torch.compile, activation checkpointing, FSDP1.
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
MODEL_PREFIX = "model."  # the top-level DCP key the trainer saves the model under

PIECE_BYTES = 16 << 20  # unit of streaming: read, cast, write and hash
POOL_PIECES = 4  # pieces in flight between the reader and the writer/hasher threads
STAGE_BYTES = 16 << 20  # O_DIRECT staging buffer of the writer thread (a multiple of ALIGN)
ALIGN = 4096  # O_DIRECT alignment of buffer addresses, offsets and lengths (covers 512-byte devices)
O_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def export_dtype(name: str) -> tuple[str, torch.dtype]:
    """Canonical name and torch dtype of an export dtype; one-line ExportError for anything else."""
    canonical = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canonical not in EXPORT_DTYPES:
        raise ExportError(f"dtype {name!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    return canonical, EXPORT_DTYPES[canonical]


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like '5GB' (10**9), '500MB', '2GiB' (2**30)."""
    if isinstance(size, bool):
        raise ExportError(f"max_shard_size {size!r} is not a size; give bytes as an int or a string like '5GB'")
    if isinstance(size, int):
        value = size
    else:
        m = SIZE_RE.match(str(size))
        if not m:
            raise ExportError(
                f"max_shard_size {size!r} is not a size; give bytes as an int or a string like '5GB' or '500MB'"
            )
        value = int(float(m.group(1)) * SIZE_UNITS[(m.group(2) or "b").lower()])
    if value < 1:
        raise ExportError(f"max_shard_size {size!r} must be at least 1 byte; use e.g. '5GB'")
    return value


def check_checkpoint(ckpt_dir: Path, deep: bool) -> CheckpointManifest:
    """The checkpoint's manifest, read once and validated (CheckpointRetired when a writer retired it)."""
    return checked_manifest(ckpt_dir, deep=deep)


F32 = torch.float32.itemsize
