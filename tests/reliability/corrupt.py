"""Corruptions applied to copies of real checkpoints (shared by the reliability tests; not a test module)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.commit.hashing import hash_file


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


def flip_byte(path: Path, offset: int | None = None, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= mask
    path.write_bytes(bytes(data))


def prepend(path: Path, data: bytes) -> None:
    path.write_bytes(data + path.read_bytes())


def truncate(path: Path, by: int = 10) -> None:
    path.write_bytes(path.read_bytes()[:-by])


def model_item_offset(ckpt_dir: Path, rank: int | None = None, longer_than: int = 0) -> tuple[Path, int]:
    """A byte in the middle of a model tensor's record in a .distcp file (so export's CRC check sees it): the first
    by name, in ``rank``'s file when given, of a record longer than ``longer_than`` bytes."""
    from ckpt.formats.dcp.reader import read_metadata

    md = read_metadata(ckpt_dir)
    index, info = next(
        (i, s)
        for i, s in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn)
        if i.fqn.startswith("model.")
        and (rank is None or s.relative_path.startswith(f"__{rank}_"))
        and s.length > longer_than
    )
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


# ------------------------------------------------------------------------------------------ crafted layouts
def edit_metadata(ckpt_dir: Path, change: Callable[[Any], None]) -> None:
    """Edit a DCP ``.metadata`` as DCP's own classes (``change(md)``) and write it back the way DCP pickles it;
    a shardkeeper checkpoint's manifest is refreshed, so only the layout check can tell. (The file is one this
    test suite wrote: the standard unpickler is fine here.)"""
    import pickle

    path = ckpt_dir / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md))
    if (ckpt_dir / "manifest.json").exists():
        rehash(ckpt_dir)


def tensor_meta(md: Any, fqn: str) -> Any:
    return md.state_dict_metadata[fqn]


def move_chunk(
    md: Any, fqn: str, i: int, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None
) -> None:
    """Give chunk ``i`` of ``fqn`` other offsets and/or sizes; its storage record keeps its bytes (and is re-keyed
    to the new offsets, as a writer of that layout would have keyed it)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    meta = tensor_meta(md, fqn)
    old = meta.chunks[i]
    new = ChunkStorageMetadata(
        offsets=torch.Size(offsets if offsets is not None else old.offsets),
        sizes=torch.Size(sizes if sizes is not None else old.sizes),
    )
    meta.chunks[i] = new
    info = md.storage_data.pop(MetadataIndex(fqn, old.offsets))
    md.storage_data.setdefault(MetadataIndex(fqn, new.offsets), info)


def record_of(md: Any, fqn: str, i: int = 0) -> Any:
    """The storage record (``_StorageInfo``: relative_path, offset, length) of chunk ``i`` of ``fqn``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return md.storage_data[MetadataIndex(fqn, tensor_meta(md, fqn).chunks[i].offsets)]


def plain_dcp_source(ckpt_dir: Path, out: Path) -> Path:
    """A shardkeeper DCP checkpoint as a plain ``dcp.save({"model": ..., "optimizer": ...})`` folder of another
    tool: the same ``.distcp`` files, ``.metadata`` with the optimizer keys another tool's ``get_state_dict`` gives
    (``optimizer.state.<fqn>.exp_avg``), no manifest. What ``shardkeeper import`` reads as the "dcp" layout,
    without a launch to write one."""
    import pickle

    out.mkdir(parents=True)
    for f in ckpt_dir.glob("*.distcp"):
        shutil.copy(f, out / f.name)

    def rename(fqn: str) -> str:
        return "optimizer.state." + fqn[len("optim.state.") :] if fqn.startswith("optim.state.") else fqn

    md = pickle.loads((ckpt_dir / ".metadata").read_bytes())
    md.state_dict_metadata = {rename(k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {type(k)(rename(k.fqn), k.offset, k.index): v for k, v in md.storage_data.items()}
    (out / ".metadata").write_bytes(pickle.dumps(md))
    return out


def deepspeed_source(ckpt_dir: Path, out: Path, step: int) -> Path:
    """A shardkeeper deepspeed checkpoint's native files as ``engine.save_checkpoint`` lays them out for another
    tool (``latest`` + ``global_stepN/``, no manifest)."""
    tag = out / f"global_step{step}"
    tag.mkdir(parents=True)
    for f in ckpt_dir.iterdir():
        if f.name.endswith("_optim_states.pt") or f.name.endswith("_model_states.pt"):
            shutil.copy(f, tag / f.name)
    (out / "latest").write_text(tag.name)
    return out


def edit_torch_save(path: Path, change: Callable[[Any], None]) -> None:
    """Load a torch.save file this suite wrote (a DeepSpeed model states file: its classes need the full
    unpickler), ``change`` it and save it back."""
    import torch

    obj = torch.load(path, weights_only=False)
    change(obj)
    torch.save(obj, path)


def make_fifo(path: Path) -> Path:
    """Replace ``path`` by a named pipe (opening one for reading blocks until something writes into it)."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path
