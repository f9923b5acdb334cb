"""Retention: keep the newest k valid checkpoints and every n-th, never the newest valid one, and never the
newest *verified* one (whose every byte was re-read and matched since its commit: a checkpoint whose
sizes are right can still hold corrupted bytes), and never one a live process pinned (``ckpt.guards.pin``: the
uploader of an ``s3://`` run pushing it from the cache). Plus the sweep of what crashes and quarantines leave.

Planning validates lazily (``plan``): a checkpoint is validated only when its validity can change the
decision, newest first, and at most once per plan -- the newest valid one, the newest verified one that is
valid, and each one that a rule would keep if it were valid; one that goes whether valid or not (older than the
newest ``keep_last`` valid ones, not an every-n-th step, not protected) is not read. The result is the
one ``plan_retention`` gives over every checkpoint's validity (tests/test_units.py checks both agree).
Quick validation remembers, in this process, the manifest and ``.metadata`` bytes that passed, so a plan
over checkpoints seen before re-checks only their files (``ckpt.validate.checks``)."""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.commit.fsutil import fsync_dir, mkdir_durable, pid_alive
from ckpt.commit.layout import DELETING_SUFFIX, INVALID_RE, RunDir, parse_step
from ckpt.guards.pin import pinned_steps
from ckpt.validate.checks import is_verified, validate

log = logging.getLogger(__name__)

KEEP_INVALID = 2  # quarantined checkpoints kept for inspection; older ones are swept
_EXPORT_TMP_RE = re.compile(
    r"^\..+\.(?:export|replaced)-(\d+)(?:-[0-9a-f]+)?$"
)  # ckpt.export's temp and replaced folders


def plan_retention(
    steps: list[int], valid: set[int], *, keep_last: int, keep_every: int | None, protect: set[int] = frozenset()
) -> set[int]:  # type: ignore[assignment]
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


def remove_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory (or a leftover of one) so that a half-deleted one never looks like a checkpoint.

    It is renamed to ``NAME.deleting`` first, a name no reader takes for a checkpoint (a crash mid-delete never
    leaves a manifest beside missing shards; the segment-start sweep removes what a crash left), then removed; what
    cannot be removed stays under that name. One already named ``*.deleting`` is removed where it is. Storage
    retention (``apply_retention``) and the memory tier's (``ckpt.memtier.tier.retain``) both delete through it.

    Args:
        path: the directory to delete.

    Raises:
        OSError: the rename failed (``path`` is gone, or a directory of the ``.deleting`` name is in the way);
            nothing was removed.
    """
    trash = path if path.name.endswith(DELETING_SUFFIX) else path.with_name(path.name + DELETING_SUFFIX)
    if trash != path:
        path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove(path: Path) -> None:
    t0 = time.perf_counter()
    remove_checkpoint_dir(path)
    log.info("retention: deleted %s in %.2f seconds", path.name, time.perf_counter() - t0)


@dataclass
class RetentionPlan:
    """What retention deletes among the committed checkpoints, and what it learned deciding it."""

    doomed: set[int]
    newest_valid: int | None
    protected: int | None  # the newest verified valid checkpoint (None: nothing verified yet, nothing valid pruned)
    validity: dict[int, bool] = field(default_factory=dict)  # the checkpoints it had to validate, by step


def plan(run_dir: RunDir, *, keep_last: int, keep_every: int | None) -> RetentionPlan:
    """The retention decision over ``run_dir``'s committed checkpoints, validating only what can change it."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest valid checkpoint is the resume point")
    committed = run_dir.committed()
    steps = [parse_step(p.name) or 0 for p in committed]
    validity: dict[int, bool] = {}

    def ok(i: int) -> bool:
        if i not in validity:
            validity[i] = validate(committed[i]).valid
        return validity[i]

    order = sorted(range(len(steps)), key=lambda i: steps[i], reverse=True)  # newest first
    # the newest verified checkpoint that is valid; none: every valid checkpoint is protected
    protected = next((steps[i] for i in order if is_verified(run_dir, committed[i]) and ok(i)), None)
    newest: int | None = None
    recent = 0  # valid checkpoints kept by keep_last so far
    doomed: set[int] = set()
    for i in order:
        s = steps[i]
        if newest is None:
            if ok(i):  # newer invalid ones are kept for inspection
                newest, recent = s, 1
            continue
        could_keep = (
            recent < keep_last or bool(keep_every and s % keep_every == 0) or s == protected or protected is None
        )
        if not could_keep:
            doomed.add(s)  # goes whether valid or not: not read
        elif ok(i):
            recent += recent < keep_last
        elif s < newest:
            doomed.add(s)
    return RetentionPlan(doomed, newest, protected, {steps[i]: v for i, v in validity.items()})


def apply_retention(run_dir: RunDir, *, keep_last: int, keep_every: int | None) -> list[Path]:
    """Delete what the policy drops, keeping the newest verified checkpoint and the pinned ones (read last, right
    before deleting) whatever the policy says; also stale .partial directories older than the newest valid one."""
    decided = plan(run_dir, keep_last=keep_last, keep_every=keep_every)
    newest = decided.newest_valid
    doomed = decided.doomed - pinned_steps(run_dir.root) if decided.doomed else decided.doomed
    removed: list[Path] = [path for path in run_dir.committed() if (parse_step(path.name) or 0) in doomed]
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


def newest_valid(run_dir: RunDir) -> int | None:
    """Step of the newest committed checkpoint that passes quick validation (older ones are not read)."""
    for path in reversed(run_dir.committed()):
        if validate(path).valid:
            return parse_step(path.name) or 0
    return None


def sweep_leftovers(run_dir: RunDir, *, keep_invalid: int = KEEP_INVALID) -> list[Path]:
    """At segment start, under the run lock: remove retention's ``.deleting`` directories, ``.partial`` ones
    older than the newest valid checkpoint, quarantined ``.invalid-*`` beyond the newest ``keep_invalid``,
    export temp folders of dead processes and verification records of vanished checkpoints. Creates
    ``checkpoints/`` durably (fsync of the run directory). Returns what was removed (each one logged)."""
    mkdir_durable(run_dir.checkpoints)
    ck = run_dir.checkpoints
    doomed = [p for p in ck.iterdir() if p.name.endswith(DELETING_SUFFIX)]
    newest = newest_valid(run_dir)
    for p in run_dir.partials():
        step = parse_step(p.name.removesuffix(".partial"))
        if newest is not None and step is not None and step < newest:
            doomed.append(p)
    quarantined = run_dir.quarantined()
    doomed += quarantined[: max(0, len(quarantined) - keep_invalid)]
    if run_dir.exports.is_dir():
        doomed += [
            p
            for p in run_dir.exports.iterdir()
            if (m := _EXPORT_TMP_RE.match(p.name)) and not pid_alive(int(m.group(1)))
        ]
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


__all__ = [
    "INVALID_RE",
    "KEEP_INVALID",
    "RetentionPlan",
    "apply_retention",
    "newest_valid",
    "plan",
    "plan_retention",
    "remove_checkpoint_dir",
    "sweep_leftovers",
]
