"""The checkpointing of what a script tracks besides model and optimizer (``state_dict``/``load_state_dict``:
LR scheduler, data loader position, ...): one packed tensor per rank and name (``ckpt.formats.packed``: no pickle).

At the saving world size each rank gets its own state back. At another world size an object whose state was the
same on every rank (an LR scheduler) is restored from rank 0's; one whose state differed per rank (a data loader
over a rank's shard) cannot be split onto another number of ranks, and the resume is refused before anything is
loaded, naming the object and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt.formats.packed import UnpackableState, pack, unpack
from schemas import CheckpointManifest
from schemas.errors import CheckpointError, UsageError

EXTRA_PREFIX = "extra."  # DeepSpeed: keys of the per-rank RNG file; DCP: the state dict's "extra" section


def pack_all(extra: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every tracked object's state now (copies), by name."""
    out = {}
    for name, obj in extra.items():
        try:
            out[name] = pack(obj.state_dict(), where=name)
        except UnpackableState as e:
            raise UsageError(f"seg.track({name}=...): its state_dict() holds {e}; only tensors, numbers, strings, "
                             "lists, tuples and dicts are checkpointed") from None
    return out


ReadRank = Callable[[int], Mapping[str, torch.Tensor]]  # saved rank -> {name: packed tensor}


def check_restorable(extra: Mapping[str, Any], path: Path, manifest: CheckpointManifest, world_size: int,
                     read: ReadRank) -> None:
    """Before any load: every tracked object has a state in the checkpoint, and at another world size each one's
    state was the same on every saving rank."""
    if not extra:
        return
    saved = dict(read(0))
    missing = sorted(set(extra) - set(saved))
    if missing:
        raise CheckpointError(f"{path}: holds no state of tracked '{missing[0]}' (it holds: "
                              f"{', '.join(sorted(saved)) or 'none'}); track the same objects as the segment that "
                              "saved it, or start a new --run-dir")
    old = manifest.topology.world_size
    if old == world_size:
        return
    for r in range(1, old):
        other = read(r)
        for name in extra:
            if name not in other or not torch.equal(other[name], saved[name]):
                raise CheckpointError(
                    f"{path}: tracked '{name}' held a different state on each of the {old} saving ranks (a rank's "
                    f"data position?), which cannot be split onto {world_size} ranks; resume on {old} ranks, or "
                    "derive that state from the step instead of tracking it")


def restore_all(extra: Mapping[str, Any], path: Path, manifest: CheckpointManifest, rank: int, world_size: int,
                read: ReadRank) -> None:
    """Load each tracked object's saved state: this rank's at the saving world size, else rank 0's (equal on all)."""
    if not extra:
        return
    blobs = read(rank if manifest.topology.world_size == world_size else 0)
    for name, obj in extra.items():
        obj.load_state_dict(unpack(blobs[name], f"{path} (tracked '{name}')"))
