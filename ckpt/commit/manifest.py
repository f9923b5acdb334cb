"""Reading and writing manifest.json (schemas.CheckpointManifest)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from ckpt.commit.fsutil import atomic_write_text
from schemas import MANIFEST_NAME, MANIFEST_SCHEMA_VERSION, CheckpointManifest
from schemas.errors import CheckpointError


def read_manifest(ckpt_dir: str | Path) -> CheckpointManifest:
    """Parse a checkpoint's manifest or raise CheckpointError naming the file and the fix."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST_NAME
    if ckpt_dir.name.endswith(".partial"):
        raise CheckpointError(
            f"{ckpt_dir}: is a .partial directory (a save that never committed); use a step-XXXXXXXX directory"
        )
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so {ckpt_dir.name} is not a committed checkpoint; pick another step")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, and UnicodeDecodeError of bytes that are no UTF-8
        raise CheckpointError(
            f"{path}: unreadable JSON ({e}); the checkpoint is corrupted, pick another step"
        ) from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != MANIFEST_SCHEMA_VERSION:
        raise CheckpointError(
            f"{path}: schema_version {version!r}, this shardkeeper reads {MANIFEST_SCHEMA_VERSION}; upgrade shardkeeper"
        )
    try:
        return CheckpointManifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise CheckpointError(
            f"{path}: field {loc}: {err['msg']}; the manifest is corrupted, pick another step"
        ) from None


def write_manifest(ckpt_dir: str | Path, manifest: CheckpointManifest) -> None:
    atomic_write_text(Path(ckpt_dir) / MANIFEST_NAME, manifest.model_dump_json(indent=2) + "\n")
