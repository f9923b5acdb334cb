"""Corruptions applied to copies of real checkpoints (shared by the reliability tests; not a test module)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.hashing import hash_file


def edit_manifest(ckpt_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = ckpt_dir / "manifest.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def entry(raw: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in raw["files"] if e["path"] == name)


def rehash(ckpt_dir: Path) -> None:
    """Refresh sizes and checksums in the manifest after a test edited files on purpose."""
    def change(raw: dict[str, Any]) -> None:
        for e in raw["files"]:
            e["size"], e["xxh3_128"] = hash_file(ckpt_dir / e["path"])
    edit_manifest(ckpt_dir, change)


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, by: int = 10) -> None:
    path.write_bytes(path.read_bytes()[:-by])


def model_item_offset(ckpt_dir: Path) -> tuple[Path, int]:
    """A byte in the middle of a model tensor's record in a .distcp file (so export's CRC check sees it)."""
    from ckpt.formats.dcp import read_metadata

    md = read_metadata(ckpt_dir)
    index, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
                       if i.fqn.startswith("model."))
    return ckpt_dir / info.relative_path, info.offset + info.length // 2


def symlink_outside(path: Path, outside_dir: Path) -> None:
    """Replace ``path`` by a symlink to an identical copy outside the checkpoint (same size and bytes)."""
    outside_dir.mkdir(parents=True, exist_ok=True)
    target = outside_dir / path.name
    shutil.copy(path, target)
    path.unlink()
    os.symlink(target, path)


def scale_fingerprint(ckpt_dir: Path, section: str = "optim", factor: float = 1.001) -> str:
    """Edit one norm of the manifest's fingerprint (what a misplaced shard looks like); returns its key."""
    raw = json.loads((ckpt_dir / "manifest.json").read_text())
    key = sorted(raw["fingerprint"][section])[0]
    raw["fingerprint"][section][key] *= factor
    (ckpt_dir / "manifest.json").write_text(json.dumps(raw))
    return key
