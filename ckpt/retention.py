"""Retention: keep the newest k valid checkpoints and every n-th, never the newest valid one, and never the
newest *verified* one (whose every byte was re-read and matched since its commit: a checkpoint whose
sizes are right can still hold corrupted bytes). Plus the sweep of what crashes and quarantines leave."""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

from ckpt.fsutil import fsync_dir, mkdir_durable, pid_alive
from ckpt.layout import DELETING_SUFFIX, INVALID_RE, RunDir, parse_step
from ckpt.validate import is_verified, validate

log = logging.getLogger(__name__)

KEEP_INVALID = 2  # quarantined checkpoints kept for inspection; older ones are swept
_EXPORT_TMP_RE = re.compile(r"^\..+\.(?:export|replaced)-(\d+)$")  # ckpt.export's temp and replaced folders


def plan_retention(steps: list[int], valid: set[int], *, keep_last: int, keep_every: int | None,
                   protect: set[int] = frozenset()) -> set[int]:  # type: ignore[assignment]
    """Steps to delete among committed ``steps`` (``valid`` ⊆ steps); ``protect`` is never deleted."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest valid checkpoint is the resume point")
    good = sorted(valid)
    keep = set(good[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in good if s % keep_every == 0}
    # Invalid checkpoints newer than the newest valid one are kept for inspection; older ones go.
    newest = good[-1] if good else None
    return {s for s in steps if s not in keep and (newest is not None and s < newest)}


def _remove(path: Path) -> None:
    # Rename first so a crash mid-delete never leaves a manifest beside missing shards.
    t0 = time.perf_counter()
    trash = path.with_name(path.name + DELETING_SUFFIX)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)
    log.info("retention: deleted %s in %.2f seconds", path.name, time.perf_counter() - t0)


def apply_retention(run_dir: RunDir, *, keep_last: int, keep_every: int | None) -> list[Path]:
    """Delete what the policy drops, keeping the newest verified checkpoint whatever the policy says;
    also stale .partial directories older than the newest valid checkpoint."""
    committed = run_dir.committed()
    steps = [parse_step(p.name) or 0 for p in committed]
    valid = {s for s, p in zip(steps, committed) if validate(p).valid}
    verified = [s for s, p in zip(steps, committed) if s in valid and is_verified(run_dir, p)]
    protect = {max(verified)} if verified else set(valid)  # nothing verified yet: prune nothing valid
    doomed = plan_retention(steps, valid, keep_last=keep_last, keep_every=keep_every, protect=protect)
    newest = max(valid) if valid else None
    removed: list[Path] = [path for step, path in zip(steps, committed) if step in doomed]
    for path in run_dir.partials():
        step = parse_step(path.name.removesuffix(".partial"))
        if newest is not None and step is not None and step < newest:
            removed.append(path)
    for path in removed:
        _remove(path)
        step = parse_step(path.name)
        if step is not None:
            run_dir.verified_record(step).unlink(missing_ok=True)
    return removed


def sweep_leftovers(run_dir: RunDir, *, keep_invalid: int = KEEP_INVALID) -> list[Path]:
    """At segment start, under the run lock: remove retention's ``.deleting`` directories, ``.partial`` ones
    older than the newest valid checkpoint, quarantined ``.invalid-*`` beyond the newest ``keep_invalid``,
    export temp folders of dead processes and verification records of vanished checkpoints. Creates
    ``checkpoints/`` durably (fsync of the run directory). Returns what was removed (each one logged)."""
    mkdir_durable(run_dir.checkpoints)
    ck = run_dir.checkpoints
    doomed = [p for p in ck.iterdir() if p.name.endswith(DELETING_SUFFIX)]
    valid = [parse_step(p.name) or 0 for p in run_dir.committed() if validate(p).valid]
    newest = max(valid) if valid else None
    for p in run_dir.partials():
        step = parse_step(p.name.removesuffix(".partial"))
        if newest is not None and step is not None and step < newest:
            doomed.append(p)
    quarantined = run_dir.quarantined()
    doomed += quarantined[: max(0, len(quarantined) - keep_invalid)]
    if run_dir.exports.is_dir():
        doomed += [p for p in run_dir.exports.iterdir()
                   if (m := _EXPORT_TMP_RE.match(p.name)) and not pid_alive(int(m.group(1)))]
    if run_dir.verified.is_dir():
        doomed += [p for p in run_dir.verified.iterdir() if not (ck / p.name.removesuffix(".json")).is_dir()]
    for p in doomed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        log.info("swept %s", p.relative_to(run_dir.root))
    if doomed:
        fsync_dir(ck)
    return doomed


__all__ = ["INVALID_RE", "KEEP_INVALID", "apply_retention", "plan_retention", "sweep_leftovers"]
