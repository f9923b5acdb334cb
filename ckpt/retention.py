"""Retention: keep the newest k valid checkpoints and every n-th, never the newest valid one."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from ckpt.layout import RunDir, parse_step
from ckpt.validate import validate

log = logging.getLogger(__name__)


def plan_retention(steps: list[int], valid: set[int], *, keep_last: int, keep_every: int | None) -> set[int]:
    """Steps to delete among committed ``steps`` (``valid`` ⊆ steps)."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest valid checkpoint is the resume point")
    good = sorted(valid)
    keep = set(good[-keep_last:])
    if keep_every:
        keep |= {s for s in good if s % keep_every == 0}
    # Invalid checkpoints newer than the newest valid one are kept for inspection; older ones go.
    newest = good[-1] if good else None
    return {s for s in steps if s not in keep and (newest is not None and s < newest)}


def apply_retention(run_dir: RunDir, *, keep_last: int, keep_every: int | None) -> list[Path]:
    """Delete what the policy drops; also stale .partial directories older than the newest valid checkpoint."""
    committed = run_dir.committed()
    steps = [parse_step(p.name) or 0 for p in committed]
    valid = {s for s, p in zip(steps, committed) if validate(p).valid}
    doomed = plan_retention(steps, valid, keep_last=keep_last, keep_every=keep_every)
    newest = max(valid) if valid else None
    removed: list[Path] = []
    for step, path in zip(steps, committed):
        if step in doomed:
            removed.append(path)
    for path in run_dir.partials():
        step = parse_step(path.name.removesuffix(".partial"))
        if newest is not None and step is not None and step < newest:
            removed.append(path)
    for path in removed:
        t0 = time.perf_counter()
        # Rename first so a crash mid-delete never leaves a manifest beside missing shards.
        trash = path.with_name(path.name + ".deleting")
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        log.info("retention: deleted %s in %.2f seconds", path.name, time.perf_counter() - t0)
    return removed
