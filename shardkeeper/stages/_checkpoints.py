"""The checkpoint stages: validate (the verdict recorded in lineage), reshard to another world size, convert
to the other backend's format."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from ckpt.commit import lineage
from ckpt.commit.fsutil import load_yaml
from ckpt.commit.layout import RunDir, parse_step
from ckpt.commit.manifest import read_manifest
from ckpt.guards.lock import LOCK_NAME, RANKS_LOCK_NAME, RunLock
from ckpt.registry import get_format
from ckpt.validate.checks import WatchedDir, checked_manifest, gone_before, retired_message, validate
from schemas import CheckpointManifest, ReshardResult, RunSpec, ValidationReport
from schemas.errors import CheckpointError, CheckpointRetired, ConfigError
from shardkeeper.config import dump_run_spec, spec_from_dict
from shardkeeper.stages._checks import _check_same_model, run_record
from shardkeeper.stages._where import is_remote


def validate_checkpoint(ckpt_dir: str | Path, *, deep: bool = False) -> ValidationReport:
    if is_remote(ckpt_dir):
        from shardkeeper.remote import validate_remote

        return validate_remote(str(ckpt_dir), deep=deep, validate=validate)
    report = validate(ckpt_dir, deep=deep)
    run_root = RunDir.containing(ckpt_dir)
    # A verdict on a checkpoint's bytes is recorded; one retired by the run's writer while (or before) it was
    # read, or a path that holds no checkpoint, is no such verdict.
    if deep and not report.retired and Path(ckpt_dir).is_dir() and run_root.has_lineage():
        lineage.record(
            run_root,
            "validate",
            f"validate:{Path(ckpt_dir).name}:{int(time.time())}",
            parent=f"checkpoint:{Path(ckpt_dir).name}",
            step=report.step,
            valid=report.valid,
            errors=report.errors[:3],
        )
    return report


def reshard(ckpt_dir: str | Path, world_size: int, *, spec: RunSpec | None = None) -> ReshardResult:
    """Make a checkpoint loadable at ``world_size`` by the run's next segment. DCP reshards at load time: a recorded
    no-op. DeepSpeed: converted once to ``<ckpt>/universal/`` (cached, recorded in lineage).

    Whether the next segment may train at ``world_size`` is the rule of the RunSpec it trains under
    (``RunSpec.world_size_refusal``; none for a script run): ``spec`` when the caller knows it (a flow passes the
    one it trains with), else the run's record (``run_record``: the run.yaml of the run directory holding the
    checkpoint), else -- a checkpoint outside a run directory -- the RunSpec in the checkpoint's manifest.

    Raises:
        ConfigError: the next segment cannot train at ``world_size`` (one line: the field and the fix).
        CheckpointError: no committed checkpoint at ``ckpt_dir`` (CheckpointRetired: a writer retired it)."""
    if is_remote(ckpt_dir):  # s3://: resharded in the run's local cache, where the next segment's ranks load it
        from shardkeeper.remote import materialize_checkpoint

        _, local = materialize_checkpoint(str(ckpt_dir))  # with the run's metadata: its run.yaml too
        res = reshard(local, world_size, spec=spec)
        return res.model_copy(update={"source": str(ckpt_dir)})
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError:
        with WatchedDir(ckpt_dir) as now:  # nothing at the path (not something it cannot open) where a checkpoint was
            if gone_before(now):
                raise CheckpointRetired(retired_message(ckpt_dir, before=True)) from None
        raise
    rule = spec or run_record(RunDir.containing(ckpt_dir).root) or manifest.run_spec
    problem = rule.world_size_refusal(world_size, choose="--world-size")  # whatever the format
    if problem is not None:
        raise ConfigError(f"--world-size {world_size}: {problem}")
    target, method, seconds = get_format(manifest.format).reshard(ckpt_dir, manifest, world_size)
    return ReshardResult(
        source=str(ckpt_dir),
        target=str(target),
        from_world_size=manifest.topology.world_size,
        to_world_size=world_size,
        method=method,
        seconds=seconds,
    )


def convert_checkpoint(ckpt_dir: str | Path, to: str, out: str | Path, *, zero_stage: int | None = None) -> Path:
    """Convert a checkpoint to the other backend's format (``to``: "dcp" or "deepspeed").

    ``out`` is a ``step-XXXXXXXX`` directory to create, or a run directory: then the checkpoint becomes
    ``out/checkpoints/step-XXXXXXXX`` beside a run.yaml for the new backend, ready for ``shardkeeper train``.
    Returns the committed checkpoint directory."""
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    if to not in ("dcp", "deepspeed"):
        raise ConfigError(f"--to {to!r}: choose dcp (fsdp2) or deepspeed")
    if zero_stage is not None and zero_stage not in (1, 2, 3):
        raise ConfigError(f"--zero-stage {zero_stage}: choose 1, 2 or 3")
    run_root = None if parse_step(out.name) is not None else RunDir.at(out)
    # the folders this conversion would create: removed again if it fails (no empty run directory left behind)
    created = [p for p in ([run_root.root, run_root.checkpoints] if run_root else [out.parent]) if not p.exists()]
    with WatchedDir(ckpt_dir) as watched:
        if gone_before(watched):
            raise CheckpointRetired(retired_message(ckpt_dir, before=True))
        try:
            return _convert(ckpt_dir, to, out, run_root, zero_stage, watched)
        except BaseException as e:  # also DCP's CheckpointException and an interrupt: no empty output left behind
            _remove_new_run_dir(created)
            # it went while being read, or before the directory committed meanwhile could be watched (adopt)
            if isinstance(e, CheckpointRetired) or not (watched.vanished() or gone_before(watched)):
                raise
            # the run's writer retired it while it was read: whatever its missing files caused says nothing of it
            raise CheckpointRetired(retired_message(ckpt_dir)) from None


def _refuse_same_format(ckpt_dir: Path, to: str) -> None:
    try:
        same = read_manifest(ckpt_dir).format == to
    except CheckpointError:
        return
    if same:
        raise ConfigError(f"{ckpt_dir}: already a {to} checkpoint; nothing to convert")


def _convert(
    ckpt_dir: Path, to: str, out: Path, run_root: RunDir | None, zero_stage: int | None, watched: WatchedDir
) -> Path:
    try:
        manifest = checked_manifest(ckpt_dir)
    except CheckpointRetired:
        raise
    except CheckpointError:
        _refuse_same_format(ckpt_dir, to)  # the request itself is wrong, whatever state the checkpoint is in
        raise
    watched.adopt()  # committed after the conversion looked: the directory read from here on is watched
    if manifest.format == to:
        raise ConfigError(f"{ckpt_dir}: already a {to} checkpoint; nothing to convert")
    if zero_stage is not None and to != "deepspeed":
        raise ConfigError("--zero-stage applies to --to deepspeed only")
    target = run_root.checkpoint(manifest.step) if run_root else out
    with RunLock(run_root.root) if run_root else contextlib.nullcontext():
        spec = _converted_spec(run_root, manifest, to, zero_stage) if run_root else None
        done = get_format(to).convert_from(ckpt_dir, target, zero_stage=zero_stage)
        if run_root and spec and not run_root.spec_path.exists():  # written last: no run.yaml without its checkpoint
            run_root.spec_path.write_text(dump_run_spec(spec))
        _record_conversion(ckpt_dir, manifest, done, to, run_root)
    return done


def _remove_new_run_dir(new: list[Path]) -> None:
    """A refused conversion into a run directory leaves nothing behind: the folders it made (the run directory
    with its lock files, checkpoints/) are removed if they hold nothing else (status would list an empty run)."""
    for path in reversed(new):  # checkpoints/ first, then the run directory (with its lock files)
        if not any(path.glob("checkpoints")):
            for name in (LOCK_NAME, RANKS_LOCK_NAME):
                (path / name).unlink(missing_ok=True)
        try:
            path.rmdir()
        except OSError:  # something else was put there meanwhile: not ours to remove
            pass


def _converted_spec(run_root: RunDir, manifest: CheckpointManifest, to: str, zero_stage: int | None) -> RunSpec:
    """The RunSpec of the converted run; refuses a run directory that holds another model or backend."""
    spec = manifest.run_spec.model_copy(update={"backend": "fsdp2" if to == "dcp" else "deepspeed"})
    if zero_stage is not None:
        spec = spec.model_copy(update={"deepspeed": spec.deepspeed.model_copy(update={"zero_stage": zero_stage})})
    if run_root.spec_path.exists():
        old = spec_from_dict(load_yaml(run_root.spec_path.read_text()) or {}, str(run_root.spec_path))
        _check_same_model(run_root, old, spec)
    return spec


def _record_conversion(src: Path, manifest: CheckpointManifest, done: Path, to: str, run_root: RunDir | None) -> None:
    step_id = lineage.checkpoint_event_id(manifest.step)
    if run_root is not None:
        lineage.record(
            run_root,
            "checkpoint",
            step_id,
            step=manifest.step,
            uri=done.resolve().as_uri(),
            reason="converted",
            format=to,
            source=src.resolve().as_uri(),
            world_size=1,
            source_world_size=manifest.topology.world_size,
        )
    src_root = RunDir.of_checkpoint(src)
    if src_root is not None:
        lineage.record(
            src_root,
            "reshard",
            f"convert:{src.name}:{to}:{int(time.time())}",
            parent=step_id,
            step=manifest.step,
            uri=done.resolve().as_uri(),
            method=f"convert-to-{to}",
        )
