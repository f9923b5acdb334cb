"""An ``Accelerator``'s prepared objects under ``shardkeeper.Segment``: commits, validation and resume at another
world size, in place of ``accelerator.save_state`` / ``load_state``.

    import shardkeeper as sk
    from shardkeeper.integrations import accelerate as sk_accelerate

    seg = sk.Segment()                                   # before the Accelerator: it joins the process group
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    sk_accelerate.track(seg, accelerator, model=model, optimizer=opt, scheduler=sched)
    batches = sk_accelerate.batches(seg, accelerator, loader)   # the data position follows from the step
    for step in seg.steps():
        loss = model(**next(batches)).loss
        accelerator.backward(loss); opt.step(); sched.step(); opt.zero_grad()
        seg.log(loss=...)

``track`` unwraps what ``prepare`` returned and tracks the real objects: an FSDP2 module (Accelerate's FSDP
plugin with ``fsdp_version=2``, or a module sharded by hand with ``fully_shard``) or a replicated (DDP) one
through DCP, which reshards at load; a DeepSpeed engine through DeepSpeed's layout (the run needs
``backend: deepspeed``); the torch optimizer inside ``AcceleratedOptimizer``; the scheduler inside
``AcceleratedScheduler``; the gradient scaler (fp16); and what ``accelerator.register_for_checkpointing`` holds.
A checkpoint thus has sharded model and optimizer states that load at any world size, with checksums and a
fingerprint checked before training continues: the seed-000 loss spike (an optimizer state that does not match
its parameters after a sharded resume) is refused instead of trained on.

World size changes: keep the global batch (per-rank batch * ranks) and step the scheduler once per optimizer
step (``step_scheduler_with_optimizer=False``): Accelerate's default steps it once per *process* per step, which
makes the schedule depend on the world size. The data position is the step (``batches``), not a per-rank loader
state; a stateful loader (``use_stateful_dataloader=True``) is per rank and resumes only at its world size.
Python's and NumPy's RNG are not restored (torch's is, at the same world size; reseeded otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

from schemas.errors import UsageError
from trainer.api.segment import Segment

log = logging.getLogger("shardkeeper.integrations.accelerate")

__all__ = ["batches", "track", "unwrap"]


def unwrap(accelerator: Any, obj: Any) -> Any:
    """Return the object Accelerate wrapped in ``obj``, or ``obj`` itself when it wraps nothing.

    Args:
        accelerator: The ``Accelerator`` that prepared ``obj`` (not read; kept for a uniform call).
        obj: What ``accelerator.prepare`` returned.

    Returns:
        The torch optimizer of an ``AcceleratedOptimizer``, the scheduler of an ``AcceleratedScheduler``, the
        module inside DDP; an FSDP2 module, a DeepSpeed engine or anything else as it is.
    """
    if isinstance(obj, AcceleratedOptimizer):
        return obj.optimizer
    if isinstance(obj, AcceleratedScheduler):
        return obj.scheduler
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        return obj.module
    return obj


def _is_deepspeed(accelerator: Any) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def track(
    seg: Segment, accelerator: Any, *, model: Any, optimizer: Any = None, scheduler: Any = None, **state: Any
) -> Segment:
    """Track what ``accelerator.prepare`` returned in ``seg``, unwrapped: ``seg.track`` for an Accelerate script.

    The Accelerator's objects registered with ``register_for_checkpointing`` and its gradient scaler (fp16) are
    tracked too, as ``registered_N`` and ``grad_scaler``. Under Accelerate's DeepSpeed plugin the engine brings its
    optimizer and the run needs ``backend: deepspeed``. One warning line when the scheduler is stepped once per
    process (``step_scheduler_with_optimizer=True`` on several ranks): its schedule would depend on the world size.

    Args:
        seg: The segment, created before the ``Accelerator``.
        accelerator: The ``Accelerator`` that prepared the objects.
        model: The prepared model (a DDP or FSDP2 module, or the DeepSpeed engine).
        optimizer: The prepared optimizer; required unless the model is a DeepSpeed engine (then ignored).
        scheduler: The prepared LR scheduler, if any.
        **state: Other objects with ``state_dict()`` and ``load_state_dict()``, by name (as in ``seg.track``).

    Returns:
        ``seg``.

    Raises:
        UsageError: No ``optimizer`` without DeepSpeed; under DeepSpeed a ``model`` that is not the engine
            ``prepare`` returned; or anything ``seg.track`` refuses (called twice, after ``steps()``, names that
            differ between ranks, an object without ``state_dict()``).

    Example:
        ```python
        model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
        sk_accelerate.track(seg, accelerator, model=model, optimizer=opt, scheduler=sched)
        ```
    """
    sched = unwrap(accelerator, scheduler) if scheduler is not None else None
    if isinstance(scheduler, AcceleratedScheduler):
        if scheduler.step_with_optimizer and not scheduler.split_batches and seg.world_size > 1:
            log.warning(
                "Accelerator(step_scheduler_with_optimizer=True) steps the LR scheduler %d times per step "
                "on %d ranks: the schedule then depends on the world size, and a resume on another number "
                "of ranks continues another schedule; pass step_scheduler_with_optimizer=False",
                seg.world_size,
                seg.world_size,
            )
    extra = dict(state)
    if sched is not None:
        extra["scheduler"] = sched
    for i, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        extra[f"registered_{i}"] = obj
    if getattr(accelerator, "scaler", None) is not None:
        extra["grad_scaler"] = accelerator.scaler
    if _is_deepspeed(accelerator):
        if type(model).__name__ != "DeepSpeedEngine":
            raise UsageError(
                "sk_accelerate.track(model=...): under Accelerate's DeepSpeed plugin track the model "
                "accelerator.prepare returned (the DeepSpeed engine)"
            )
        return seg.track(model=model, **extra)  # the engine brings its optimizer
    if optimizer is None:
        raise UsageError(
            "sk_accelerate.track(optimizer=...): the prepared optimizer is required (its state is part "
            "of every checkpoint)"
        )
    return seg.track(model=unwrap(accelerator, model), optimizer=unwrap(accelerator, optimizer), **extra)


def batches(seg: Segment, accelerator: Any, loader: Any) -> Iterator[Any]:
    """Yield the prepared loader's batches from the segment's step on, epoch after epoch, without end.

    The data position is the step: the first batch is from epoch ``step // len(loader)``, with that epoch's first
    ``step % len(loader)`` batches skipped (``accelerator.skip_first_batches``: nothing is loaded for them), so a
    resume at another world size continues where the run was. ``seg.step`` is read at the first ``next()``, so
    call that inside ``for step in seg.steps()``, after the load. The order must depend on the epoch only: a
    seedable sampler (``DataLoaderConfiguration(use_seedable_sampler=True)``) or no shuffling.

    Args:
        seg: The segment whose step sets the start.
        accelerator: The ``Accelerator`` that prepared ``loader``.
        loader: The prepared data loader.

    Yields:
        One batch per ``next()``.

    Raises:
        UsageError: The loader is empty on this rank (raised at the first ``next()``).

    Example:
        ```python
        batches = sk_accelerate.batches(seg, accelerator, loader)
        for step in seg.steps():
            loss = model(**next(batches)).loss
        ```
    """
    per_epoch = len(loader)
    if per_epoch == 0:
        raise UsageError("sk_accelerate.batches(): the data loader is empty on this rank")
    epoch, skip = divmod(seg.step, per_epoch)
    while True:
        loader.set_epoch(epoch)
        yield from (accelerator.skip_first_batches(loader, skip) if skip else loader)
        epoch, skip = epoch + 1, 0
