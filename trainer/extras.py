"""The checkpointing of what a script tracks besides model and optimizer (``state_dict``/``load_state_dict``:
LR scheduler, data loader position, ...): one packed tensor per rank and name (``ckpt.formats.packed``: no pickle).

At the saving world size each rank gets its own state back. At another world size an object whose state was the
same on every rank (an LR scheduler) is restored from rank 0's; one whose state differed per rank (a data loader
over a rank's shard) cannot be split onto another number of ranks, and the resume is refused before anything is
loaded, naming the object and the fix.

A checkpoint that another kind of run wrote (an import, a conversion, the built-in trainer, another script) holds
no state of the objects this run tracks: each starts at the checkpoint's step where that is well defined (an LR
scheduler fast-forwarded, an object with ``start_at_step``), else fresh, and one warning line names them. A
checkpoint of the same kind that lacks one of its own tracked objects is refused, as above.
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
            raise UsageError(
                f"seg.track({name}=...): its state_dict() holds {e}; only tensors, numbers, strings, "
                "lists, tuples and dicts are checkpointed"
            ) from None
    return out


ReadRank = Callable[[int], Mapping[str, torch.Tensor]]  # saved rank -> {name: packed tensor}


def check_restorable(
    extra: Mapping[str, Any],
    path: Path,
    manifest: CheckpointManifest,
    world_size: int,
    read: ReadRank,
    *,
    other_kind: str | None = None,
) -> None:
    """Before any load: every tracked object has a state in the checkpoint, and at another world size each one's
    state was the same on every saving rank. ``other_kind``: the checkpoint was written by another kind of run
    (``trainer.checkpointer.resumer.Resumer.other_kind``), which never had this run's objects: those it lacks start at
    its step (``restore_all``) instead of being refused."""
    if not extra:
        return
    saved = dict(read(0))
    missing = sorted(set(extra) - set(saved))
    if missing and other_kind is None:
        raise CheckpointError(
            f"{path}: holds no state of tracked '{missing[0]}' (it holds: "
            f"{', '.join(sorted(saved)) or 'none'}); track the same objects as the segment that "
            "saved it, or start a new --run-dir"
        )
    old = manifest.topology.world_size
    if old == world_size:
        return
    for r in range(1, old):
        other = read(r)
        for name in extra:
            if name in saved and (name not in other or not torch.equal(other[name], saved[name])):
                raise CheckpointError(
                    f"{path}: tracked '{name}' held a different state on each of the {old} saving ranks (a rank's "
                    f"data position?), which cannot be split onto {world_size} ranks; resume on {old} ranks, or "
                    "derive that state from the step instead of tracking it"
                )


def restore_all(
    extra: Mapping[str, Any], path: Path, manifest: CheckpointManifest, rank: int, world_size: int, read: ReadRank
) -> list[str]:
    """Load each tracked object's saved state: this rank's at the saving world size, else rank 0's (equal on all).
    An object the checkpoint holds no state of (written by another kind of run: ``check_restorable`` refused it
    otherwise) starts at the checkpoint's step (``start_at``). Returns what each of those did, one phrase each."""
    if not extra:
        return []
    blobs = read(rank if manifest.topology.world_size == world_size else 0)
    started = []
    for name, obj in extra.items():
        if name in blobs:
            obj.load_state_dict(unpack(blobs[name], f"{path} (tracked '{name}')"))
        else:
            started.append(f"'{name}' {start_at(obj, manifest.step)}")
    return started


def start_at(obj: Any, step: int) -> str:
    """Bring a tracked object that has no saved state to ``step`` where that is well defined: an LR scheduler is
    stepped ``step`` times from its initial learning rate (the LR is then the one of that step, as in a run that
    trained from 0); an object with a ``start_at_step(step)`` method is asked to; anything else keeps its fresh
    state. Returns what was done, for the log line."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, LRScheduler) and not isinstance(obj, ReduceLROnPlateau):  # (that one follows a metric)
        fast_forward(obj, step)
        return f"fast-forwarded to step {step} (lr {obj.get_last_lr()[0]:.6g})"
    hook = getattr(obj, "start_at_step", None)
    if callable(hook):
        hook(step)
        return f"set to step {step}"
    return "starts fresh"


def fast_forward(sched: Any, step: int) -> None:
    """Step a freshly built LR scheduler ``step`` times, from the learning rates it started with (a load may have
    written another run's into the optimizer's groups): the same LR, bit for bit, as after ``step`` steps."""
    import warnings

    for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
        group["lr"] = lr
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": no optimizer step is meant
        warnings.simplefilter("ignore")
        for _ in range(step - sched.last_epoch):
            sched.step()
