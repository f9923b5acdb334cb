"""The train stage: plan the topology, then run one segment under the run lock (resume point, launch, result,
lineage)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ckpt.commit import lineage
from ckpt.commit.fsutil import append_jsonl, atomic_write_text, mkdir_durable, quarantine, read_jsonl
from ckpt.commit.layout import RunDir
from ckpt.guards.lock import RunLock
from ckpt.validate.checks import invalid_committed, latest_valid, validate
from ckpt.validate.retention import sweep_leftovers
from launch import LAUNCHERS, LaunchOutcome, LaunchRequest, get_launcher, rank_stopped_at_startup
from launch.base import InPlaceRestart
from schemas import CheckpointManifest, ClusterTopology, RunSpec, SegmentResult
from schemas.errors import CheckpointError, ConfigError, RunLockedError
from schemas.seam import (
    EXIT_REFUSED,
    RANK_ERROR_PREFIX,
    SCRIPT_TRACEBACK_FILE,
    SegmentReport,
    SegmentTimes,
    exit_code_of,
)
from shardkeeper.preflight import cuda_device_count, preflight
from shardkeeper.stages._checks import check_resume_data, fetch_pretrained, keep_run_script, prepare_run_dir
from shardkeeper.stages._where import remote_run

log = logging.getLogger("shardkeeper")


def plan_topology(
    spec: RunSpec,
    nproc: int,
    *,
    nodes: int = 1,
    launcher: str = "local",
    device: str = "auto",
    launcher_options: dict | None = None,
) -> ClusterTopology:
    """Check that ``nodes x nproc`` ranks make sense for the run and the launcher; return the topology."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be at least 1")
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: must be at least 1")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {launcher!r}: choose one of {', '.join(sorted(LAUNCHERS))}")
    problem = spec.world_size_refusal(nodes * nproc)  # None for a script run: it splits its own batches
    if problem is not None:
        flag = f"--nodes {nodes} x --nproc {nproc}" if nodes > 1 else f"--nproc {nproc}"
        raise ConfigError(f"{flag}: {problem}")
    runner = get_launcher(launcher, **(launcher_options or {}))
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose auto, cpu or cuda")
    source = f"--device {device}"
    if device == "auto" and os.environ.get("SHARDKEEPER_DEVICE") in ("cpu", "cuda"):
        device = os.environ["SHARDKEEPER_DEVICE"]
        source = f"SHARDKEEPER_DEVICE={device}"
    if device == "cuda" and launcher == "local" and not cuda_device_count():
        raise ConfigError(
            f"{source}: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
            "use --device cpu (and unset SHARDKEEPER_DEVICE)"
        )
    if launcher == "local":
        cuda = device == "cuda" or (device == "auto" and _cuda_available())
    else:  # this host may have no GPU while the nodes do: the launcher says what "auto" means there
        cuda = device == "cuda" or (device == "auto" and getattr(runner, "has_gpus", lambda: False)())
    topo = ClusterTopology(
        nodes=nodes,
        procs_per_node=nproc,
        device_type="cuda" if cuda else "cpu",
        backend="nccl" if cuda else "gloo",
        launcher=launcher,
    )  # type: ignore[arg-type]
    check = getattr(runner, "preflight", None)
    if check is not None:
        check(topo)
    return topo


def plan_available_topology(
    spec: RunSpec,
    nproc: int,
    *,
    nodes: int,
    launcher: str = "local",
    launcher_options: dict | None = None,
    device: str = "auto",
) -> ClusterTopology:
    """The topology to train on now: ``nodes`` x ``nproc``, or fewer nodes when the launcher has fewer usable
    (Slurm: nodes down or drained) -- the largest count at whose world size the run may train
    (``RunSpec.world_size_refusal``: any, for a script run). What a resume after a lost node runs on; the
    checkpoint reshards to it."""
    usable = getattr(get_launcher(launcher, **(launcher_options or {})), "usable_nodes", lambda: None)()
    if usable is not None and usable < 1:
        raise ConfigError(
            f"--launcher {launcher}: no usable node now (all down or drained); resume when nodes are back"
        )
    start = min(nodes, usable) if usable is not None else nodes
    for n in range(start, 0, -1):
        if spec.world_size_refusal(n * nproc) is not None:
            continue
        if n != nodes:
            log.warning("%d of the %d node(s) asked for are usable: training on %d x %d ranks", start, nodes, n, nproc)
        return plan_topology(spec, nproc, nodes=n, launcher=launcher, device=device, launcher_options=launcher_options)
    return plan_topology(spec, nproc, nodes=nodes, launcher=launcher, device=device, launcher_options=launcher_options)


# What shows a GPU torch.cuda may reach (CUDA or ROCm builds): a device-visibility variable set; NVIDIA's driver
# (/proc/driver/nvidia) or device nodes (/dev/nvidia*, Jetson's /dev/nvhost-* and nvmap, WSL2's /dev/dxg, ROCm's
# /dev/kfd); an NVIDIA or AMD display controller or any processing accelerator on the PCI bus (a driver that loads
# on first use creates its nodes only then). Where none of them is there, torch.cuda sees no GPU, and the launcher
# need not import torch (~1 s) to find that out before the ranks start.
GPU_VISIBILITY_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
GPU_DEVICE_PREFIXES = ("nvidia", "nvhost", "nvmap", "dxg", "kfd")
GPU_PCI_VENDORS = ("0x10de", "0x1002")  # NVIDIA, AMD


def _pci_gpu() -> bool:
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            cls, vendor = (dev / "class").read_text().strip(), (dev / "vendor").read_text().strip()
        except OSError:
            continue
        if cls.startswith("0x12") or (cls.startswith("0x03") and vendor in GPU_PCI_VENDORS):
            return True
    return False


def _gpu_may_be_there() -> bool:
    """True where a GPU may be there (then torch decides); False only where nothing shows one."""
    if any(os.environ.get(v, "").strip() not in ("", "-1", "none", "void") for v in GPU_VISIBILITY_ENV):
        return True
    try:
        return (
            os.path.exists("/proc/driver/nvidia")
            or any(n.startswith(GPU_DEVICE_PREFIXES) for n in os.listdir("/dev"))
            or _pci_gpu()
        )
    except OSError:
        return True  # cannot tell: ask torch


def _cuda_available() -> bool:
    if os.environ.get("SHARDKEEPER_DEVICE") == "cpu":
        return False
    if not _gpu_may_be_there():
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def next_segment_index(run_dir: RunDir) -> int:
    starts = [r for r in read_jsonl(run_dir.segments) if r.get("event") == "start"]
    return len(starts)


def train_segment(
    spec: RunSpec,
    run_dir: str | Path,
    topology: ClusterTopology,
    until_step: int,
    *,
    timeout_s: float | None = None,
    sink: Callable[[str], None] | None = None,
    restart: bool = False,
    cancel_check: Callable[[], bool] | None = None,
    launcher_options: dict | None = None,
    warm_up: bool = False,
    by: str | None = None,
) -> SegmentResult:
    """Run one segment under the run lock: resume from the latest valid checkpoint, train, commit.

    A run whose checkpoints are all invalid is refused (never restarted silently); ``restart`` moves them
    aside (quarantine), rotates metrics.jsonl to ``metrics.before-restart-<segment>.jsonl`` and starts
    from step 0, recorded in segments.jsonl and lineage. With a valid checkpoint ``restart`` is refused.

    ``cancel_check`` (polled by the launcher; a Prefect task passes one that watches its flow run):
    when it turns true the ranks commit a checkpoint and stop, and the segment ends 'cancelled'.

    ``launcher_options``: what the launcher of ``topology.launcher`` takes besides the topology (Slurm:
    ``partition``, ``time_min``, ``extra_args``).

    ``warm_up`` (the CLI's train): the checkpoint readers are imported in a thread while the ranks train. Off for
    callers that may import in other threads meanwhile (a library user's, a flow's): CPython 3.11 can fail a
    submodule import that races a first import of its package in another thread.

    ``by``: who launched the segment (a flow: which flow run, started by whom), recorded in segments.jsonl and in
    the segment's lineage event.

    Ranks that die are restarted in place ``spec.checkpoint.restarts`` times (``trainer.agent``): under the same
    lock, without a new segment; each restart is recorded as it happens (``_record_restart``), and the result says
    how many there were and why."""
    remote = remote_run(run_dir)  # s3://...: the ranks train in its local cache, shardkeeper.remote mirrors it
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
    with RunLock(rd.root), _mirrored(remote, spec) as mirror:
        _no_live_job(rd)
        if restart:  # refused before run.yaml is touched (a later memory snapshot only adds valid checkpoints)
            _refuse_restart(latest_valid(rd))
        recorded = rd.spec_path.read_text(encoding="utf-8") if rd.spec_path.is_file() else None
        prepare_run_dir(rd, spec)
        seg = next_segment_index(rd)
        SegmentReport.clear(rd.root)
        (rd.root / SCRIPT_TRACEBACK_FILE).unlink(missing_ok=True)
        _persist_memory(spec, rd, sink)  # a snapshot newer than storage that a dead launcher left in memory
        before = _resume_point(rd, seg, restart)
        start_step = before[1].step if before else 0
        who = {"by": by} if by else {}
        append_jsonl(
            rd.segments,
            {
                "event": "start",
                "segment": seg,
                "until_step": until_step,
                "start_step": start_step,
                "world_size": topology.world_size,
                "nodes": topology.nodes,
                "launcher": topology.launcher,
                "time": lineage.now_iso(),
                **who,
            },
        )
        launcher = get_launcher(topology.launcher, **(launcher_options or {}))
        req = LaunchRequest(
            run_dir=rd.root,
            until_step=until_step,
            segment=seg,
            topology=topology,
            timeout_s=timeout_s,
            restart=restart,
            cancel_check=_or_lease_lost(cancel_check, mirror),
            data=prepared,
            restarts=spec.checkpoint.restarts,
            on_restart=_record_restart(rd, seg),
        )
        warm = _warm_up_readers() if warm_up else None
        try:
            outcome = launcher.launch(req, sink)
        finally:
            if warm is not None:
                warm.join()  # never leave an import half done in another thread
        _persist_memory(spec, rd, sink)  # before giving up the node: the newest snapshot reaches storage
        result = _segment_result(rd, seg, start_step, topology, outcome)
        if result.status == "refused" and recorded is not None:  # the run's record stays what the last run made it
            atomic_write_text(rd.spec_path, recorded)
        if mirror is not None and result.status in ("preempted", "cancelled"):  # its upload: bounded by the grace
            mirror.stopped(getattr(launcher, "grace_s", None), by_signal=outcome.stop_signal is not None)
        if mirror is not None and mirror.lease_lost:  # another writer holds the run on the store now
            result = result.model_copy(
                update={
                    "status": "failed",
                    "exit_code": RunLockedError.exit_code,
                    "note": None,
                    "failure": mirror.lease_lost,
                }
            )
        _show_held_back(outcome, result.status, sink)
        append_jsonl(rd.segments, {"event": "end", **result.model_dump(mode="json", exclude={"topology"})})
        scheduler = (
            {
                "scheduler_job": outcome.scheduler_job,
                "scheduler_state": outcome.scheduler_state,
                "requeues": outcome.requeues,
            }
            if outcome.scheduler_job
            else {}
        )
        reported = SegmentReport.read(rd.root, seg)  # the performance options as the ranks applied them
        execution = {"execution": reported.execution} if reported and reported.execution else {}
        restarted = {"restarts": result.restarts} if result.restarts else {}
        lineage.record(
            rd,
            "segment",
            f"segment:{seg}",
            parent=(f"checkpoint:step-{start_step:08d}" if before else None),
            step=result.end_step,
            status=result.status,
            world_size=topology.world_size,
            seconds=round(result.seconds, 2),
            until_step=until_step,
            launcher=topology.launcher,
            nodes=topology.nodes,
            **scheduler,
            **execution,
            **who,
            **restarted,
            **_times_record(result.times),
        )
    if remote is not None:
        from shardkeeper.remote import remote_result

        return remote_result(remote, result, mirror)
    return result


def _record_restart(rd: RunDir, seg: int) -> Callable[[InPlaceRestart], None]:
    """What the launcher calls at each restart of the ranks in place, as it happens: one record in segments.jsonl and
    one lineage event ("restarted in place (rank k, cause)"), so that they stand even if this process dies later."""

    def record(r: InPlaceRestart) -> None:
        when = lineage.now_iso()
        append_jsonl(
            rd.segments,
            {
                "event": "restarted-in-place",
                "segment": seg,
                "restart": r.index,
                "of": r.of,
                "rank": r.rank,
                "cause": r.cause,
                "failure": r.line,
                "time": when,
            },
        )
        lineage.record(
            rd,
            "segment",
            f"restart-in-place:segment-{seg}:{r.index}",
            status="restarted",
            action=f"restarted in place ({r.summary})",
            segment=seg,
            rank=r.rank,
            cause=r.cause,
            restart=r.index,
            of=r.of,
            failure=r.line,
        )

    return record


def _warm_up_readers() -> threading.Thread:
    """Import the checkpoint format readers while the ranks train (this process only waits then), so the
    segment's result -- which validates the newest checkpoint -- follows the ranks' exit without ~0.5-1 s of
    imports. Joined before this process imports anything else; an import error here is left for the real
    import to raise."""

    def run() -> None:
        with contextlib.suppress(Exception):
            import ckpt.formats  # noqa: F401

    thread = threading.Thread(target=run, name="warm-up-readers", daemon=False)  # the interpreter waits for it
    thread.start()
    return thread


def _persist_memory(spec: RunSpec, rd: RunDir, sink: Callable[[str], None]) -> None:
    """Before and after the segment (ckpt.memtier.persist.between_segments): a memory snapshot newer than storage's
    newest checkpoint (the ranks died after taking it; or an earlier segment's, in a memory dir this one does not
    use) is validated and persisted to storage, a memory dir the run no longer uses is removed. A snapshot not
    persisted (torn, tampered, another run's) is said on the launcher's own line, shown without -v. Every run gets
    its id here (ckpt.memtier.tier.identity), at its first segment."""
    from ckpt.memtier.persist import between_segments

    for line in between_segments(spec, rd):
        sink(f"shardkeeper: {line}")


def _times_record(times: SegmentTimes | None) -> dict[str, float]:
    """The segment's phase times worth a lineage event: time to the first step, the emergency save."""
    if times is None:
        return {}
    out = {"first_step_s": times.time_to_first_step_s, "emergency_save_s": times.emergency_save_s}
    return {k: round(v, 2) for k, v in out.items() if v is not None}


def _no_live_job(rd: RunDir) -> None:
    """An earlier segment's Slurm job that its killed launching command left pending or running would train
    beside this segment: refused (exit 3) while Slurm holds it."""
    from launch.slurm_ctl import live_job

    job = live_job(rd.root)
    if job is not None:
        raise RunLockedError(
            f"{rd.root}: Slurm job {job.job_id} of an earlier segment is still {job.state.lower()} "
            f"(its launching command was stopped); wait for it to end, or `scancel {job.job_id}`, "
            "then train again"
        )


def _mirrored(remote, spec: RunSpec):
    """Around a segment on the store: pull what the cache lacks, push each checkpoint as it commits."""
    if remote is None:
        return contextlib.nullcontext()
    from shardkeeper.remote import Mirror

    return Mirror(remote, spec, is_valid=lambda p: validate(p).valid)


def _or_lease_lost(cancel_check: Callable[[], bool] | None, mirror) -> Callable[[], bool] | None:
    """The launcher's stop check: a cancellation, or the run's lease on the store lost to another writer (the ranks
    stop; nothing more is uploaded)."""
    if mirror is None:
        return cancel_check

    def check() -> bool:
        return bool(mirror.lease_lost) or bool(cancel_check is not None and cancel_check())

    check.reason = lambda: "the run's lease on the store was lost to another writer" if mirror.lease_lost else None  # type: ignore[attr-defined]
    return check


def _resume_point(rd: RunDir, seg: int, restart: bool) -> tuple[Path, CheckpointManifest] | None:
    """Sweep leftovers, then the checkpoint to resume from; refuses a run whose checkpoints are all invalid
    (or were set aside by a failed load) unless ``restart``, which sets them aside and starts from 0."""
    sweep_leftovers(rd)
    found = latest_valid(rd)
    if found is not None:
        if restart:
            _refuse_restart(found)
        return found
    invalid = invalid_committed(rd)
    acknowledged = {n for r in read_jsonl(rd.segments) if r.get("event") == "restart" for n in r.get("quarantined", [])}
    unacked = [q.name for q in rd.quarantined() if q.name not in acknowledged]
    if not invalid and not unacked:
        return None  # a new run
    if not restart:
        named = [f"{p.name} ({why})" for p, why in reversed(invalid)] + [f"{n} (failed to load)" for n in unacked]
        raise CheckpointError(
            f"{rd.checkpoints}: no valid checkpoint to resume from: {'; '.join(named[:3])[:800]}"
            f"{f' and {len(named) - 3} more' if len(named) > 3 else ''}; refusing to restart "
            "silently from step 0: rerun with --restart to set them aside and start over"
        )
    moved = [quarantine(p, why).name for p, why in invalid]
    rotated = None
    if rd.metrics.exists():  # the new attempt's rows must not mix with the old ones
        rotated = rd.root / f"metrics.before-restart-{seg}.jsonl"
        os.rename(rd.metrics, rotated)
    append_jsonl(
        rd.segments,
        {
            "event": "restart",
            "segment": seg,
            "quarantined": moved + unacked,
            "metrics_rotated_to": rotated.name if rotated else None,
            "time": lineage.now_iso(),
        },
    )
    lineage.record(
        rd,
        "segment",
        f"restart:segment-{seg}",
        step=0,
        status="restart",
        action="restart",
        quarantined=moved + unacked,
        metrics_rotated_to=rotated.name if rotated else None,
    )
    log.warning("restarting %s from step 0: set aside %s", rd.root, ", ".join(moved + unacked))
    return None


def _refuse_restart(found: tuple[Path, CheckpointManifest] | None) -> None:
    """--restart of a run that has a valid checkpoint: bad input (ConfigError), never a silent start from 0."""
    if found is not None:
        raise ConfigError(
            f"--restart: {found[0]} is a valid checkpoint and the run resumes from it; drop "
            "--restart (to train from step 0, use a new --run-dir)"
        )


def _show_held_back(outcome: LaunchOutcome, status: str, sink: Callable[[str], None]) -> None:
    """torchrun's closing lines: all of them for a failure; for a preempted or cancelled segment its
    ChildFailedError/SignalException traceback is noise (the ranks stopped as asked) and is dropped."""
    from launch import without_torchrun_closing

    for line in outcome.held_back if status in ("failed", "refused") else without_torchrun_closing(outcome.held_back):
        sink(line)


def _segment_result(
    rd: RunDir, seg: int, start_step: int, topology: ClusterTopology, outcome: LaunchOutcome
) -> SegmentResult:
    reported = SegmentReport.read(rd.root, seg)
    after = latest_valid(rd)
    rank_status = reported.status if reported and reported.status in ("completed", "preempted") else None
    note = reported.note if reported else None
    # The ranks ended the segment as failed themselves (a non-finite loss or gradient: trainer.nonfinite): their
    # one line is the failure, their exit code the segment's (torchrun turns any rank's code into 1).
    rank_failure = reported if reported and reported.status == "failed" and reported.note else None
    if rank_status == "completed" and outcome.exit_code != 0 and any(RANK_ERROR_PREFIX in ln for ln in outcome.tail):
        # A rank reported its segment completed, then failed on its own (a script's code after its loop raised, or
        # it entered seg.steps() again): the segment failed; its checkpoints stay.
        rank_status = None
    if outcome.cancelled:
        # Cancellation wins even over a segment that completed meanwhile: nothing further may start.
        status = "cancelled"
        if rank_status is None:
            note = _stuck(outcome, _unreported_note(after))
    elif rank_status:
        status = rank_status
    elif (
        (outcome.stop_requested or outcome.scheduler_preempted)
        and (outcome.exit_code != 0 or outcome.stop_signal is not None)
        or (outcome.exit_code != 0 and rank_stopped_at_startup([*outcome.held_back, *outcome.tail]))
    ):
        # Asked to stop before the ranks could report (still starting up, or killed after the grace
        # period): nothing was lost that a checkpoint held; the next segment resumes from the latest one.
        status = "preempted"
        note = _stuck(outcome, outcome.note or _unreported_note(after))
    elif reported is None and _refused_before_first_step(rd, seg, start_step, after, outcome):
        status = "refused"
    else:
        status = "failed"
    if outcome.note and status not in ("failed", "refused") and note != outcome.note:
        note = f"{outcome.note}; {note}" if note else outcome.note
    fallback = rank_failure.exit_code if rank_failure and rank_failure.exit_code else outcome.exit_code
    failure = (
        None if status not in ("failed", "refused") else (rank_failure.note if rank_failure else _failure(outcome))
    )
    if failure and outcome.restarts:
        failure += (
            f" (after {len(outcome.restarts)} restart(s) in place of checkpoint.restarts: "
            f"{outcome.restarts[-1].of}: {'; '.join(r.summary for r in outcome.restarts)})"
        )
    return SegmentResult(
        run_dir=str(rd.root),
        status=status,  # type: ignore[arg-type]
        exit_code=exit_code_of(status, fallback),
        # The ranks may have fallen back past a checkpoint that failed to load: their start step wins, unless
        # the scheduler requeued the job and its last attempt resumed from a checkpoint of this segment.
        segment=seg,
        start_step=min(reported.start_step, start_step) if reported else start_step,
        end_step=after[1].step if after else 0,
        checkpoint=str(after[0]) if after else None,
        topology=topology,
        seconds=outcome.seconds,
        failure=failure,
        traceback=_script_traceback(rd) if status == "failed" else None,
        note=note if status not in ("failed", "refused") else None,
        scheduler_job=outcome.scheduler_job,
        scheduler_state=outcome.scheduler_state,
        requeues=outcome.requeues,
        times=reported.times if reported else None,
        restarts=len(outcome.restarts),
        restart_causes=[r.summary for r in outcome.restarts],
    )


def _refused_before_first_step(
    rd: RunDir, seg: int, start_step: int, after: tuple[Path, CheckpointManifest] | None, outcome: LaunchOutcome
) -> bool:
    """Did the ranks refuse their input before training a step? The first rank to fail exited with the code of bad
    input (a ShardkeeperError such as UsageError: 2, as the controller's own refusals), the segment committed no
    checkpoint and logged no step. What the ranks alone can know ends so: an HF Trainer's max_steps below
    --until-step, a tracked object without state_dict(), the script's own argument parser (exit 2)."""
    from launch import first_rank_exit_code

    if outcome.exit_code == 0 or first_rank_exit_code([*outcome.held_back, *outcome.tail]) != EXIT_REFUSED:
        return False
    if (after[1].step if after else 0) != start_step:
        return False
    return _last_metrics_segment(rd) != seg


def _last_metrics_segment(rd: RunDir) -> int | None:
    """The segment of the newest row of metrics.jsonl (one row per trained step), read from its end."""
    import json

    try:
        with open(rd.metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line, or the cut first one
        return row.get("segment") if isinstance(row, dict) else None
    return None


def _script_traceback(rd: RunDir) -> str | None:
    """The traceback a user's script raised on its first failing rank (trainer.api.script), when it raised."""
    try:
        return (rd.root / SCRIPT_TRACEBACK_FILE).read_text(encoding="utf-8", errors="replace")[-8000:] or None
    except OSError:
        return None


def _stuck(outcome: LaunchOutcome, note: str) -> str:
    """A stop the ranks could not complete within the grace: which rank the others waited for, then the note."""
    return f"{outcome.stuck}; {note}" if outcome.stuck else note


def _unreported_note(after: tuple[Path, CheckpointManifest] | None) -> str:
    if after is None:
        return "stopped before the ranks reported, with nothing committed: no checkpoint; the next segment starts clean"
    return f"stopped before the ranks reported; {after[0].name} stays the latest valid checkpoint"


def _failure(outcome: LaunchOutcome) -> str:
    from launch import failing_rank_lines

    if outcome.exit_code < 0:  # torchrun itself was killed (OOM killer, kill -9): its ranks died with it
        import signal

        name = (
            signal.Signals(-outcome.exit_code).name
            if -outcome.exit_code in signal.Signals._value2member_map_
            else str(-outcome.exit_code)
        )
        return (
            f"torchrun was killed by {name} and its ranks with it; "
            "rerun the same command to resume from the latest valid checkpoint"
        )
    if outcome.failure is None and outcome.exit_code == 0:  # torchrun saw no failure, and the ranks reported no end
        return "the ranks exited with code 0 before their segment ended, and none said why"
    return ("timed out; " if outcome.timed_out else "") + (outcome.failure or failing_rank_lines(outcome.tail))
