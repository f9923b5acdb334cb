"""The pipeline's stages as plain functions: schemas in, schemas out.

The CLI calls them directly; tasks/ wraps each in a Prefect task. Nothing here imports prefect,
and torch is imported only inside the stages that need it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ckpt import lineage
from schemas.errors import CheckpointError, CheckpointRetired, ConfigError, RunDirError, RunLockedError, ShardkeeperError
from ckpt.fsutil import append_jsonl, load_yaml, mkdir_durable, quarantine, read_jsonl
from ckpt.layout import RunDir, parse_step
from ckpt.lock import LOCK_NAME, RANKS_LOCK_NAME, RunLock
from ckpt.registry import get_format
from ckpt.manifest import read_manifest
from ckpt.retention import sweep_leftovers
from ckpt.validate import (WatchedDir, checked_manifest, invalid_committed, latest_valid, retired_message, validate,
                           was_committed)
from launch import LAUNCHERS, LaunchOutcome, LaunchRequest, get_launcher
from schemas.seam import SCRIPT_TRACEBACK_FILE, SegmentReport, SegmentTimes, exit_code_of
from schemas import (CheckpointManifest, ClusterTopology, PreparedData, ReshardResult, RunSpec, SegmentResult,
                     ValidationReport, data_change)
from schemas.requests import RunState
from shardkeeper.config import dump_run_spec, spec_from_dict
from shardkeeper.preflight import cuda_device_count, preflight

log = logging.getLogger("shardkeeper")

# Fields of a run's RunSpec that may change between segments without breaking exact resume.
# eval only reads the model (no RNG, no state): its interval, batches or split may change too.
# performance (activation checkpointing, torch.compile, AdamW's implementation) changes how the ranks compute,
# not the model, data order or update rule: not part of the run's identity.
MUTABLE_SECTIONS = ("checkpoint", "eval", "performance", "script")
# Fields of other sections that may change too: what happens to a non-finite step (it is never applied either way),
# and the peak LR -- lowering it is the fix for a run whose loss blew up (trainer.nonfinite's line says so); the
# schedule is a pure function of the step, so the run continues from its checkpoint on the new curve.
MUTABLE_FIELDS = {"optim": ("lr", "on_nonfinite", "max_skipped")}


def plan_topology(spec: RunSpec, nproc: int, *, nodes: int = 1, launcher: str = "local",
                  device: str = "auto", launcher_options: dict | None = None) -> ClusterTopology:
    """Check that ``nodes x nproc`` ranks make sense for the run and the launcher; return the topology."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be at least 1")
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: must be at least 1")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: choose one of {', '.join(sorted(LAUNCHERS))}")
    world = nodes * nproc
    try:
        if spec.script is None:  # a script splits its own batches
            spec.per_rank_batch(world)
    except ValueError as e:
        flag = f"--nodes {nodes} x --nproc {nproc}" if nodes > 1 else f"--nproc {nproc}"
        raise ConfigError(f"{flag}: {e}") from None
    runner = get_launcher(launcher, **(launcher_options or {}))
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose auto, cpu or cuda")
    source = f"--device {device}"
    if device == "auto" and os.environ.get("SHARDKEEPER_DEVICE") in ("cpu", "cuda"):
        device = os.environ["SHARDKEEPER_DEVICE"]
        source = f"SHARDKEEPER_DEVICE={device}"
    if device == "cuda" and launcher == "local" and not cuda_device_count():
        raise ConfigError(f"{source}: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                          "use --device cpu (and unset SHARDKEEPER_DEVICE)")
    if launcher == "local":
        cuda = device == "cuda" or (device == "auto" and _cuda_available())
    else:  # this host may have no GPU while the nodes do: the launcher says what "auto" means there
        cuda = device == "cuda" or (device == "auto" and getattr(runner, "has_gpus", lambda: False)())
    topo = ClusterTopology(nodes=nodes, procs_per_node=nproc, device_type="cuda" if cuda else "cpu",
                           backend="nccl" if cuda else "gloo", launcher=launcher)  # type: ignore[arg-type]
    check = getattr(runner, "preflight", None)
    if check is not None:
        check(topo)
    return topo


def plan_available_topology(spec: RunSpec, nproc: int, *, nodes: int, launcher: str = "local",
                            launcher_options: dict | None = None, device: str = "auto") -> ClusterTopology:
    """The topology to train on now: ``nodes`` x ``nproc``, or fewer nodes when the launcher has fewer usable
    (Slurm: nodes down or drained) -- the largest count whose world size divides the global batch. What a
    resume after a lost node runs on; the checkpoint reshards to it."""
    usable = getattr(get_launcher(launcher, **(launcher_options or {})), "usable_nodes", lambda: None)()
    if usable is not None and usable < 1:
        raise ConfigError(f"--launcher {launcher}: no usable node now (all down or drained); resume when nodes are back")
    start = min(nodes, usable) if usable is not None else nodes
    for n in range(start, 0, -1):
        try:
            if spec.script is None:
                spec.per_rank_batch(n * nproc)
        except ValueError:
            continue
        if n != nodes:
            log.warning("%d of the %d node(s) asked for are usable: training on %d x %d ranks", start, nodes, n, nproc)
        return plan_topology(spec, nproc, nodes=n, launcher=launcher, device=device, launcher_options=launcher_options)
    return plan_topology(spec, nproc, nodes=nodes, launcher=launcher, device=device, launcher_options=launcher_options)


def _cuda_available() -> bool:
    if os.environ.get("SHARDKEEPER_DEVICE") == "cpu":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def prepare_run_dir(run_dir: RunDir, spec: RunSpec) -> RunSpec:
    """First segment: write run.yaml. Later ones: the run keeps its spec; only MUTABLE_SECTIONS may change."""
    run_dir.root.mkdir(parents=True, exist_ok=True)
    if not run_dir.spec_path.exists():
        found = latest_valid(run_dir)
        if found:  # checkpoints without run.yaml: take the spec they were written with
            _check_same_model(run_dir, found[1].run_spec, spec)
        run_dir.spec_path.write_text(dump_run_spec(spec))
        return spec
    old = spec_from_dict(load_yaml(run_dir.spec_path.read_text()) or {}, str(run_dir.spec_path))
    _check_same_model(run_dir, old, spec)
    old_d, new_d = old.model_dump(mode="json"), spec.model_dump(mode="json")
    changed = sorted(k for k in new_d if _fixed_part(k, new_d[k]) != _fixed_part(k, old_d[k]) and k not in MUTABLE_SECTIONS)
    if changed:
        k = changed[0]
        raise RunDirError(f"{run_dir.spec_path}: the run was started with a different {k} ({old_d[k]!r} vs {new_d[k]!r}); "
                          "resume with the run's own config, or start a new --run-dir")
    if old.optim.lr != spec.optim.lr:
        log.warning("optim.lr changes from %g to %g: the run continues from its latest checkpoint with the new peak "
                    "learning rate", old.optim.lr, spec.optim.lr)
    if old_d != new_d:
        run_dir.spec_path.write_text(dump_run_spec(spec))
    return spec


def _fixed_part(section: str, value: object) -> object:
    """A RunSpec section without the fields that may change between segments (MUTABLE_FIELDS)."""
    if not isinstance(value, dict) or section not in MUTABLE_FIELDS:
        return value
    return {k: v for k, v in value.items() if k not in MUTABLE_FIELDS[section]}


def _check_same_model(run_dir: RunDir, old: RunSpec, new: RunSpec) -> None:
    if old.model != new.model or old.backend != new.backend:
        what = "backend" if old.backend != new.backend else "model"
        o = getattr(old, what)
        n = getattr(new, what)
        raise RunDirError(f"{run_dir.root}: holds another {what} ({o!r} there, {n!r} in the config); "
                          "use a new --run-dir for a different model")


def next_segment_index(run_dir: RunDir) -> int:
    starts = [r for r in read_jsonl(run_dir.segments) if r.get("event") == "start"]
    return len(starts)


def train_segment(spec: RunSpec, run_dir: str | Path, topology: ClusterTopology, until_step: int, *,
                  timeout_s: float | None = None, sink: Callable[[str], None] | None = None,
                  restart: bool = False, cancel_check: Callable[[], bool] | None = None,
                  launcher_options: dict | None = None) -> SegmentResult:
    """Run one segment under the run lock: resume from the latest valid checkpoint, train, commit.

    A run whose checkpoints are all invalid is refused (never restarted silently); ``restart`` moves them
    aside (quarantine), rotates metrics.jsonl to ``metrics.before-restart-<segment>.jsonl`` and starts
    from step 0, recorded in segments.jsonl and lineage. With a valid checkpoint ``restart`` is refused.

    ``cancel_check`` (polled by the launcher; a Prefect task passes one that watches its flow run):
    when it turns true the ranks commit a checkpoint and stop, and the segment ends 'cancelled'.

    ``launcher_options``: what the launcher of ``topology.launcher`` takes besides the topology (Slurm:
    ``partition``, ``time_min``, ``extra_args``)."""
    remote = _remote_run(run_dir)  # s3://...: the ranks train in its local cache, shardkeeper.remote mirrors it
    if remote is not None:
        run_dir = remote.local.root
    spec = keep_run_script(spec, run_dir)
    fetch_pretrained(spec)  # a Hub id not yet in the huggingface_hub cache: downloaded once, here, never by a rank
    prepared = preflight(spec, topology, run_dir)  # before anything is written: a refused segment leaves no trace
    if remote is not None:
        remote.check_writable()  # unreachable, no credentials, no bucket, read-only: one line, nothing written
    rd = RunDir.at(run_dir)
    check_resume_data(rd, prepared)
    mkdir_durable(rd.root)
    sink = sink or (lambda line: log.info("%s", line))
    with RunLock(rd.root), _mirrored(remote, spec):
        _no_live_job(rd)
        prepare_run_dir(rd, spec)
        seg = next_segment_index(rd)
        SegmentReport.clear(rd.root)
        (rd.root / SCRIPT_TRACEBACK_FILE).unlink(missing_ok=True)
        before = _resume_point(rd, seg, restart)
        start_step = before[1].step if before else 0
        append_jsonl(rd.segments, {"event": "start", "segment": seg, "until_step": until_step, "start_step": start_step,
                                   "world_size": topology.world_size, "time": lineage.now_iso()})
        launcher = get_launcher(topology.launcher, **(launcher_options or {}))
        req = LaunchRequest(run_dir=rd.root, until_step=until_step, segment=seg, topology=topology, timeout_s=timeout_s,
                            restart=restart, cancel_check=cancel_check, data=prepared)
        outcome = launcher.launch(req, sink)
        result = _segment_result(rd, seg, start_step, topology, outcome)
        _show_held_back(outcome, result.status, sink)
        append_jsonl(rd.segments, {"event": "end", **result.model_dump(mode="json", exclude={"topology"})})
        scheduler = ({"scheduler_job": outcome.scheduler_job, "scheduler_state": outcome.scheduler_state,
                      "requeues": outcome.requeues} if outcome.scheduler_job else {})
        reported = SegmentReport.read(rd.root, seg)  # the performance options as the ranks applied them
        execution = {"execution": reported.execution} if reported and reported.execution else {}
        lineage.record(rd, "segment", f"segment:{seg}", parent=(f"checkpoint:step-{start_step:08d}" if before else None),
                       step=result.end_step, status=result.status, world_size=topology.world_size,
                       seconds=round(result.seconds, 2), until_step=until_step, launcher=topology.launcher,
                       nodes=topology.nodes, **scheduler, **execution,
                       **_times_record(result.times))
    if remote is not None:
        from shardkeeper.remote import remote_result

        return remote_result(remote, result)
    return result


def keep_run_script(spec: RunSpec, run_dir: str | Path) -> RunSpec:
    """A resume without --script of a run that a script trains keeps the run's script (and its arguments)."""
    if spec.script is not None or _is_remote(run_dir):
        return spec
    path = RunDir.at(run_dir).spec_path
    if not path.is_file():
        return spec
    try:
        old = spec_from_dict(load_yaml(path.read_text()) or {}, str(path))
    except ShardkeeperError:
        return spec  # prepare_run_dir reports a broken run.yaml
    return spec.model_copy(update={"script": old.script}) if old.script is not None else spec


def _times_record(times: SegmentTimes | None) -> dict[str, float]:
    """The segment's phase times worth a lineage event: time to the first step, the emergency save."""
    if times is None:
        return {}
    out = {"first_step_s": times.time_to_first_step_s, "emergency_save_s": times.emergency_save_s}
    return {k: round(v, 2) for k, v in out.items() if v is not None}


def _is_remote(path: str | Path) -> bool:
    from ckpt.objstore import is_remote

    return is_remote(path)


def _remote_run(run_dir: str | Path):
    """A RemoteRun for an object-store URL (``s3://bucket/prefix``), None for a local path."""
    from ckpt.objstore import RemoteRun, is_remote

    return RemoteRun(str(run_dir)) if is_remote(run_dir) else None


def _no_live_job(rd: RunDir) -> None:
    """An earlier segment's Slurm job that its killed launching command left pending or running would train
    beside this segment: refused (exit 3) while Slurm holds it."""
    from launch.slurm import live_job

    job = live_job(rd.root)
    if job is not None:
        raise RunLockedError(f"{rd.root}: Slurm job {job.job_id} of an earlier segment is still {job.state.lower()} "
                             f"(its launching command was stopped); wait for it to end, or `scancel {job.job_id}`, "
                             "then train again")


def _mirrored(remote, spec: RunSpec):
    """Around a segment on the store: pull what the cache lacks, push each checkpoint as it commits."""
    if remote is None:
        return contextlib.nullcontext()
    from shardkeeper.remote import Mirror

    return Mirror(remote, spec, is_valid=lambda p: validate(p).valid)


def check_resume_data(rd: RunDir, prepared: PreparedData | None) -> None:
    """A resume trains on the data the run's latest checkpoint was trained on: refused (one line naming what
    changed: the dataset's files, the tokenizer's, a setting) before anything is written or launched."""
    if prepared is None or not rd.checkpoints.is_dir():
        return
    found = latest_valid(rd)
    if found is None or found[1].data is None:
        return
    changed = data_change(found[1].data, prepared.record())
    if changed:
        raise ConfigError(f"{found[0]}: the run was trained on other data: {changed}; resume with the data the run "
                          "started with, or start a new --run-dir")


def fetch_pretrained(spec: RunSpec) -> None:
    """model.pretrained names a Hub id that is not in the cache: download it (config, weights, tokenizer files)
    unless HF_HUB_OFFLINE is set; then, or when the Hub cannot be reached, preflight's one line says what to do."""
    import os

    from ckpt.pretrained import is_hub_id, resolve
    from schemas.errors import ConfigError

    m = spec.model
    if m.pretrained is None or not is_hub_id(m.pretrained):
        return
    try:
        resolve(m, local_files_only=True)
        return
    except ConfigError:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            return
    log.info("downloading %s%s into the Hugging Face cache", m.pretrained, f" @ {m.revision}" if m.revision else "")
    resolve(m, local_files_only=False)


def _resume_point(rd: RunDir, seg: int, restart: bool) -> tuple[Path, CheckpointManifest] | None:
    """Sweep leftovers, then the checkpoint to resume from; refuses a run whose checkpoints are all invalid
    (or were set aside by a failed load) unless ``restart``, which sets them aside and starts from 0."""
    sweep_leftovers(rd)
    found = latest_valid(rd)
    if found is not None:
        if restart:
            raise ConfigError(f"--restart: {found[0]} is a valid checkpoint and the run resumes from it; drop "
                              "--restart (to train from step 0, use a new --run-dir)")
        return found
    invalid = invalid_committed(rd)
    acknowledged = {n for r in read_jsonl(rd.segments) if r.get("event") == "restart" for n in r.get("quarantined", [])}
    unacked = [q.name for q in rd.quarantined() if q.name not in acknowledged]
    if not invalid and not unacked:
        return None  # a new run
    if not restart:
        named = [f"{p.name} ({why})" for p, why in reversed(invalid)] + [f"{n} (failed to load)" for n in unacked]
        raise CheckpointError(f"{rd.checkpoints}: no valid checkpoint to resume from: {'; '.join(named[:3])[:800]}"
                              f"{f' and {len(named) - 3} more' if len(named) > 3 else ''}; refusing to restart "
                              "silently from step 0: rerun with --restart to set them aside and start over")
    moved = [quarantine(p, why).name for p, why in invalid]
    rotated = None
    if rd.metrics.exists():  # the new attempt's rows must not mix with the old ones
        rotated = rd.root / f"metrics.before-restart-{seg}.jsonl"
        os.rename(rd.metrics, rotated)
    append_jsonl(rd.segments, {"event": "restart", "segment": seg, "quarantined": moved + unacked,
                               "metrics_rotated_to": rotated.name if rotated else None, "time": lineage.now_iso()})
    lineage.record(rd, "segment", f"restart:segment-{seg}", step=0, status="restart", action="restart",
                   quarantined=moved + unacked, metrics_rotated_to=rotated.name if rotated else None)
    log.warning("restarting %s from step 0: set aside %s", rd.root, ", ".join(moved + unacked))
    return None


def _show_held_back(outcome: LaunchOutcome, status: str, sink: Callable[[str], None]) -> None:
    """torchrun's closing lines: all of them for a failure; for a preempted or cancelled segment its
    ChildFailedError/SignalException traceback is noise (the ranks stopped as asked) and is dropped."""
    from launch import without_torchrun_closing

    for line in outcome.held_back if status == "failed" else without_torchrun_closing(outcome.held_back):
        sink(line)


def _segment_result(rd: RunDir, seg: int, start_step: int, topology: ClusterTopology, outcome: LaunchOutcome) -> SegmentResult:
    reported = SegmentReport.read(rd.root, seg)
    after = latest_valid(rd)
    rank_status = reported.status if reported and reported.status in ("completed", "preempted") else None
    note = reported.note if reported else None
    # The ranks ended the segment as failed themselves (a non-finite loss or gradient: trainer.nonfinite): their
    # one line is the failure, their exit code the segment's (torchrun turns any rank's code into 1).
    rank_failure = reported if reported and reported.status == "failed" and reported.note else None
    if outcome.cancelled:
        # Cancellation wins even over a segment that completed meanwhile: nothing further may start.
        status = "cancelled"
        if rank_status is None:
            note = _unreported_note(after)
    elif rank_status:
        status = rank_status
    elif (outcome.stop_requested or outcome.scheduler_preempted) and (outcome.exit_code != 0 or outcome.stop_signal is not None):
        # Asked to stop before the ranks could report (still starting up, or killed after the grace
        # period): nothing was lost that a checkpoint held; the next segment resumes from the latest one.
        status = "preempted"
        note = outcome.note or _unreported_note(after)
    else:
        status = "failed"
    if outcome.note and status != "failed" and note != outcome.note:
        note = f"{outcome.note}; {note}" if note else outcome.note
    fallback = rank_failure.exit_code if rank_failure and rank_failure.exit_code else outcome.exit_code
    return SegmentResult(
        run_dir=str(rd.root), status=status,  # type: ignore[arg-type]
        exit_code=exit_code_of(status, fallback),
        # The ranks may have fallen back past a checkpoint that failed to load: their start step wins, unless
        # the scheduler requeued the job and its last attempt resumed from a checkpoint of this segment.
        segment=seg, start_step=min(reported.start_step, start_step) if reported else start_step,
        end_step=after[1].step if after else 0,
        checkpoint=str(after[0]) if after else None, topology=topology, seconds=outcome.seconds,
        failure=None if status != "failed" else (rank_failure.note if rank_failure else _failure(outcome)),
        traceback=_script_traceback(rd) if status == "failed" else None,
        note=note if status != "failed" else None,
        scheduler_job=outcome.scheduler_job, scheduler_state=outcome.scheduler_state, requeues=outcome.requeues,
        times=reported.times if reported else None,
    )


def _script_traceback(rd: RunDir) -> str | None:
    """The traceback a user's script raised on its first failing rank (trainer.script), when it raised."""
    try:
        return (rd.root / SCRIPT_TRACEBACK_FILE).read_text(encoding="utf-8", errors="replace")[-8000:] or None
    except OSError:
        return None


def _unreported_note(after: tuple[Path, CheckpointManifest] | None) -> str:
    if after is None:
        return "stopped before the ranks reported, with nothing trained: no checkpoint; the next segment starts clean"
    return f"stopped before the ranks reported; {after[0].name} stays the latest valid checkpoint"


def _failure(outcome: LaunchOutcome) -> str:
    from launch import failing_rank_lines

    if outcome.exit_code < 0:  # torchrun itself was killed (OOM killer, kill -9): its ranks died with it
        import signal

        name = signal.Signals(-outcome.exit_code).name if -outcome.exit_code in signal.Signals._value2member_map_ else str(-outcome.exit_code)
        return f"torchrun was killed by {name} and its ranks with it; rerun the same command to resume from the latest valid checkpoint"
    return ("timed out; " if outcome.timed_out else "") + failing_rank_lines(outcome.tail)


def validate_checkpoint(ckpt_dir: str | Path, *, deep: bool = False) -> ValidationReport:
    if _is_remote(ckpt_dir):
        from shardkeeper.remote import validate_remote

        return validate_remote(str(ckpt_dir), deep=deep, validate=validate)
    report = validate(ckpt_dir, deep=deep)
    run_root = RunDir.containing(ckpt_dir)
    # A verdict on a checkpoint's bytes is recorded; one retired by the run's writer while (or before) it was
    # read, or a path that holds no checkpoint, is no such verdict.
    if deep and not report.retired and Path(ckpt_dir).is_dir() and run_root.has_lineage():
        lineage.record(run_root, "validate", f"validate:{Path(ckpt_dir).name}:{int(time.time())}",
                       parent=f"checkpoint:{Path(ckpt_dir).name}", step=report.step, valid=report.valid,
                       errors=report.errors[:3])
    return report


def reshard(ckpt_dir: str | Path, world_size: int) -> ReshardResult:
    """Make a checkpoint loadable at ``world_size``. DCP reshards at load time: a recorded no-op.
    DeepSpeed: converted once to ``<ckpt>/universal/`` (cached, recorded in lineage)."""
    if _is_remote(ckpt_dir):  # s3://: resharded in the run's local cache, where the next segment's ranks load it
        from shardkeeper.remote import materialize_checkpoint

        _, local = materialize_checkpoint(str(ckpt_dir))
        res = reshard(local, world_size)
        return res.model_copy(update={"source": str(ckpt_dir)})
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError:
        if not ckpt_dir.is_dir() and was_committed(ckpt_dir):  # the run's retention took it: say so
            raise CheckpointRetired(retired_message(ckpt_dir)) from None
        raise
    try:  # the next segment must be able to split the global batch, whatever the format
        manifest.run_spec.per_rank_batch(world_size)
    except ValueError as e:
        raise ConfigError(f"--world-size {world_size}: {e}") from None
    target, method, seconds = get_format(manifest.format).reshard(ckpt_dir, manifest, world_size)
    return ReshardResult(source=str(ckpt_dir), target=str(target), from_world_size=manifest.topology.world_size,
                         to_world_size=world_size, method=method, seconds=seconds)


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
        try:
            return _convert(ckpt_dir, to, out, run_root, zero_stage)
        except Exception as e:
            _remove_new_run_dir(created)
            if isinstance(e, CheckpointRetired) or not watched.vanished():
                raise
            # the run's writer retired it while it was read: whatever its missing files caused says nothing of it
            raise CheckpointRetired(retired_message(ckpt_dir)) from None


def _convert(ckpt_dir: Path, to: str, out: Path, run_root: RunDir | None, zero_stage: int | None) -> Path:
    if read_manifest(ckpt_dir).format == to:  # the request itself is wrong, whatever state the checkpoint is in
        raise ConfigError(f"{ckpt_dir}: already a {to} checkpoint; nothing to convert")
    manifest = checked_manifest(ckpt_dir)
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
        lineage.record(run_root, "checkpoint", step_id, step=manifest.step, uri=done.resolve().as_uri(),
                       reason="converted", format=to, source=src.resolve().as_uri(), world_size=1,
                       source_world_size=manifest.topology.world_size)
    src_root = RunDir.of_checkpoint(src)
    if src_root is not None:
        lineage.record(src_root, "reshard", f"convert:{src.name}:{to}:{int(time.time())}", parent=step_id,
                       step=manifest.step, uri=done.resolve().as_uri(), method=f"convert-to-{to}")


def export_and_record(ckpt_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32",
                      max_shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = False,
                      tokenizer_from: str | Path | bool | None = None):
    """Checkpoint (DCP or DeepSpeed ZeRO) -> safetensors folder (ckpt.export), recorded in the run's lineage.

    A ZeRO checkpoint exports in one pass like a DCP one: each fp32 master weight streams straight from
    its byte ranges in the ``*_optim_states.pt`` partitions; no intermediate checkpoint is written."""
    from ckpt.export import export_checkpoint as _export

    if _is_remote(ckpt_dir) or _is_remote(out_dir):
        from shardkeeper.remote import export_remote

        return export_remote(str(ckpt_dir), str(out_dir), export=_export, dtype=dtype, max_shard_size=max_shard_size,
                             overwrite=overwrite, progress=progress)
    ckpt_dir = Path(ckpt_dir)
    res = _export(ckpt_dir, out_dir, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress,
                  tokenizer_from=tokenizer_from)
    root = RunDir.of_checkpoint(ckpt_dir)
    if root is not None:  # res.step: the manifest the export read (the checkpoint may be retired by now)
        lineage.record(root, "export", f"export:{Path(res.out_dir).name}:{res.dtype}", parent=f"checkpoint:{ckpt_dir.name}",
                       step=res.step, uri=Path(res.out_dir).resolve().as_uri(), dtype=res.dtype,
                       num_shards=res.num_shards, bytes=res.total_bytes, seconds=round(res.seconds, 2))
    return res


def publish_export(export_dir: str | Path, target: str, *, revision: str | None = None, run_dir: str | Path | None = None):
    """Export folder -> Hub repo or fsspec URL (ckpt.publish), recorded in the run's lineage."""
    from ckpt.publish import publish as _publish

    export_dir = Path(export_dir)
    root = RunDir.at(run_dir) if run_dir else RunDir.containing(export_dir)
    events = lineage.read_events(root) if root.has_lineage() else None
    res = _publish(export_dir, target, revision=revision, lineage=events)
    if events is not None:
        parents = [e.id for e in events if e.kind == "export" and e.uri == export_dir.resolve().as_uri()]
        lineage.record(root, "publish", f"publish:{res.target}@{res.revision or 'main'}:{export_dir.name}",
                       parent=parents[-1] if parents else None, uri=res.url, target=res.target,
                       revision=res.revision, skipped=res.skipped, commit=res.commit)
    return res


# ------------------------------------------------------------------------------------------ run state
def run_state(run_dir: str | Path) -> RunState:
    """Newest valid checkpoint and how the last segment ended (plain function: the resume scan uses it)."""
    if _is_remote(run_dir):
        from shardkeeper.remote import run_state_remote

        return run_state_remote(str(run_dir), is_locked=lambda root: RunLock(root).is_locked())
    rd = RunDir.at(run_dir)
    exists = rd.spec_path.exists() or bool(rd.committed())
    if not exists:
        return RunState(run_dir=str(rd.root), exists=False)
    found = latest_valid(rd)
    records = read_jsonl(rd.segments)
    starts = [r for r in records if r.get("event") == "start"]
    locked = RunLock(rd.root).is_locked()
    last_status = None
    if records:
        last = records[-1]
        last_status = last.get("status") if last.get("event") == "end" else ("running" if locked else "interrupted")
    return RunState(
        run_dir=str(rd.root), exists=True, checkpoint=str(found[0]) if found else None,
        step=found[1].step if found else 0,
        world_size=found[1].topology.world_size if found else None,
        last_status=last_status, last_until_step=starts[-1].get("until_step") if starts else None, locked=locked,
    )


def run_dirs_under(root: Path) -> list[Path]:
    """The run directories (a run.yaml or a checkpoints/ folder) directly under ``root``."""
    if not root.is_dir():
        raise ShardkeeperError(f"resume root {root}: no such folder; pass the folder that holds the run directories")
    return sorted(p for p in root.iterdir() if p.is_dir() and (RunDir(p).spec_path.exists() or RunDir(p).checkpoints.is_dir()))


def scan_runs(roots: str | list[str] | None, run_dirs: list[str]) -> list[RunState]:
    """The state of every run directory under ``roots`` (one folder or several) and in ``run_dirs`` (each once)."""
    roots = [roots] if isinstance(roots, str) else list(roots or [])
    found: list[str | Path] = []
    for root in roots:
        if _is_remote(root):  # s3://bucket/prefix: the runs on the store (manifest-committed checkpoints only)
            from shardkeeper.remote import remote_run_urls

            found += remote_run_urls(root)
        else:
            found += run_dirs_under(Path(root))
    seen: dict[str | Path, None] = {}
    for p in [*found, *run_dirs]:
        seen.setdefault(str(p).rstrip("/") if _is_remote(p) else Path(p).resolve(), None)
    return [run_state(p) for p in seen]
