"""shardkeeper: resumable, verified, elastic sharded checkpoints for PyTorch training.

The public API for one's own training loop (rank side; imported on first use, so ``import shardkeeper`` stays light):

    import shardkeeper as sk

    seg = sk.Segment()
    seg.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
    for step in seg.steps():
        ...
        seg.log(loss=float(loss))

Run the script with ``shardkeeper train --script train.py --run-dir RUN --until-step N --nproc 2``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Segment", "SegmentPreempted", "SegmentStopped", "UsageError"]


def __getattr__(name: str) -> Any:
    if name in ("Segment", "SegmentPreempted", "SegmentStopped"):
        from trainer.api import segment as api

        return getattr(api, name)
    if name == "UsageError":
        from schemas.errors import UsageError

        return UsageError
    raise AttributeError(f"module 'shardkeeper' has no attribute {name!r}")
