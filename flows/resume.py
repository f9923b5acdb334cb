"""The ``resume`` flow, meant for a schedule and for the preemption automation: find runs whose last segment
was preempted, failed or interrupted before its until_step -- or whose plan (``RUN_DIR/plan.json``, written by
train-and-export) is not finished -- and take each to its end.

A run with a plan goes on to the plan's end: the segment that stopped, at the world size the plan gives it,
then the plan's remaining segments, then validation, export and publish, each once (flows/plan.py). A run
without a plan is trained to its last segment's until_step, at ``nproc`` x ``nodes`` (``launcher``) where given,
else at the world size and launcher of the segment that was preempted.

Idempotent and race-free: a run whose plan is finished, or whose last segment completed, is left alone; a run
whose plan lock or run lock is held (another flow run drives it, a segment trains now) is skipped as "already
running", so overlapping schedules and the automation never start a second writer.

    from flows.resume import resume
    resume(roots=["runs"])

Deployed by ``python -m infra.deploy`` with an optional interval schedule and an automation that runs it
for one run directory (``run_dirs``) as soon as a ``shardkeeper.segment.preempted`` event arrives.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from these
# annotations, and in a served or worker-run flow run string annotations are not resolved ("ResumeModel
# is not fully defined"), so every scheduled run failed before it started.

from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.states import Cancelled

from flows.common import (
    HandedOver,
    PipelineError,
    SegmentCancelled,
    check_resume_request,
    default,
    documented,
    drive_segment,
    parse_request,
)
from flows.plan import run_plan
from schemas.errors import RunLockedError, ShardkeeperError
from schemas.plan import Driver, RunPlan
from schemas.requests import ResumeItem, ResumeRequest, ResumeSummary, RunState, SegmentPlan
from tasks.lineage import mirror_lineage, mirror_runs_overview
from tasks.plan import PlanKeeper, complete_handed_over_run, current_driver, peek_plan
from tasks.stage_tasks import load_spec, scan_runs

# Not "cancelled": a run whose last segment was cancelled by a person stays stopped until they train it again.
RESUMABLE = ("preempted", "failed", "interrupted")


class ResumeFailed(PipelineError):
    """At least one run could not be resumed; the message lists each with its reason."""


def triage(state: RunState) -> ResumeItem | None:
    """Why a run without a plan is not resumed, or None when it should be."""
    if not state.exists:
        return ResumeItem(run_dir=state.run_dir, action="skipped-not-a-run", reason="no run.yaml or checkpoints")
    if state.locked:
        return ResumeItem(
            run_dir=state.run_dir, action="skipped-locked", reason="its lock is held: a segment is training"
        )
    if state.last_status not in RESUMABLE or state.last_until_step is None:
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-done",
            reason=f"last segment {state.last_status or 'none'}; nothing to resume",
        )
    if state.step >= state.last_until_step:
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-done",
            reason=f"at step {state.step}, its until_step {state.last_until_step} is reached",
        )
    return None


def triage_plan(state: RunState, plan: RunPlan, holder: str) -> ResumeItem | None:
    """Why a run with a plan is not resumed (finished, or already running), or None when it should be: a plan
    that is not finished is resumed whatever its last segment did (it may have completed one segment of several)."""
    if plan.status == "completed":
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-done",
            plan_status=plan.status,
            reason=f"its plan is completed: {plan.note or plan.where()}",
        )
    if plan.status == "cancelled":
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-done",
            plan_status=plan.status,
            reason=f"its plan was cancelled: {plan.note}; start train-and-export again to go on",
        )
    if holder:
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-locked",
            plan_status=plan.status,
            reason=f"already running: its plan is driven by {holder}",
        )
    if state.locked:
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-locked",
            plan_status=plan.status,
            reason="already running: its lock is held (a segment is training)",
        )
    return None


def _resume_run(state: RunState, request: ResumeRequest, driver: Driver) -> ResumeItem:
    """What this flow run does with one scanned run: skip it, resume it, or go on with its plan."""
    if not state.exists:
        return triage(state)  # type: ignore[return-value] - a missing run always has a reason
    try:
        plan, holder = peek_plan(state.run_dir)
    except ShardkeeperError as e:  # a plan.json that is not a plan: this run only
        return ResumeItem(run_dir=state.run_dir, action="failed", reason=str(e))
    if plan is None:
        return triage(state) or _resume_one(state, request, driver)
    return triage_plan(state, plan, holder) or _resume_plan(state, request, driver)


def placement(state: RunState, request: ResumeRequest) -> SegmentPlan:
    """The segment a run without a plan resumes: to its last until_step, at the request's nproc, nodes and
    launcher where given, else at those of the segment that was preempted (segments.jsonl)."""
    nodes = request.nodes or state.last_nodes or 1
    per_node = (state.last_world_size // (state.last_nodes or 1)) if state.last_world_size else (state.world_size or 1)
    return SegmentPlan(
        nproc=request.nproc or max(per_node, 1),
        nodes=nodes,
        until_step=state.last_until_step or 1,
        timeout_s=request.timeout_s,
        launcher=request.launcher or state.last_launcher or "local",
        slurm_partition=request.slurm_partition,
        slurm_time_min=request.slurm_time_min,
    )


def _where(outcome: object, plan: SegmentPlan) -> str:
    """``2 ranks`` / ``2 x 4 ranks via slurm``: where a segment ran (or was to run)."""
    attempts = getattr(outcome, "attempts", None) or []
    ran = attempts[-1].topology if attempts else None
    where = (
        f"{ran.nodes} x {ran.procs_per_node}"
        if ran and ran.nodes > 1
        else str(ran.procs_per_node if ran else plan.nproc)
    )
    return f"{where} ranks" + (f" via {plan.launcher}" if plan.launcher != "local" else "")


def _resume_one(state: RunState, request: ResumeRequest, driver: Driver) -> ResumeItem:
    until = state.last_until_step or 0  # triage() made sure it is set
    plan = placement(state, request)
    spec = load_spec(run_dir=state.run_dir)
    try:
        outcome = drive_segment(
            spec,
            state.run_dir,
            plan,
            max_preemption_retries=request.max_preemption_retries,
            backoff_s=request.backoff_s,
            by=driver.line(),
        )
        item = ResumeItem(
            run_dir=state.run_dir,
            action="resumed",
            outcome=outcome,
            reason=f"step {state.step} -> {until} on {_where(outcome, plan)} (was {state.last_status})",
        )
    except RunLockedError as e:  # someone started a segment since the scan
        return ResumeItem(run_dir=state.run_dir, action="skipped-locked", reason=str(e))
    except SegmentCancelled:
        mirror_lineage(state.run_dir, spec.name)
        raise
    except HandedOver as e:
        item = ResumeItem(run_dir=state.run_dir, action="handed-over", reason=str(e).splitlines()[0])
    except (PipelineError, ShardkeeperError) as e:
        item = ResumeItem(run_dir=state.run_dir, action="failed", reason=str(e).splitlines()[0])
    mirror_lineage(state.run_dir, spec.name)
    return item


def _resume_plan(state: RunState, request: ResumeRequest, driver: Driver) -> ResumeItem:
    """Take the run's plan over (its lock) and drive it to its end; a second resumer gets "already running"."""
    try:
        keeper = PlanKeeper.take_over(state.run_dir, driver)
    except RunLockedError as e:  # another resumer took it since the scan: it goes on to the end without us
        return ResumeItem(run_dir=state.run_dir, action="skipped-locked", reason=f"already running: {e}")
    if keeper is None:  # the plan went away since the scan
        return triage(state) or _resume_one(state, request, driver)
    if keeper.plan.finished:  # finished by another resumer between the scan and the lock
        keeper.release()
        return triage_plan(state, keeper.plan, "") or ResumeItem(run_dir=state.run_dir, action="skipped-done")
    was = keeper.plan.status
    try:
        spec = load_spec(run_dir=state.run_dir)
    except ShardkeeperError as e:  # its run.yaml cannot be read: this run only, the plan left as it stood
        keeper.release()
        return ResumeItem(run_dir=state.run_dir, action="failed", reason=str(e), plan_status=was)
    except BaseException:
        keeper.release()
        raise
    action, reason = "resumed", ""
    try:
        run = run_plan(
            keeper,
            spec,
            max_preemption_retries=request.max_preemption_retries,
            backoff_s=request.backoff_s,
            between_segments=lambda: mirror_lineage(state.run_dir, spec.name),
        )
    except RunLockedError as e:
        return ResumeItem(
            run_dir=state.run_dir,
            action="skipped-locked",
            reason=f"already running: {e}",
            plan_status=keeper.plan.status,
        )
    except SegmentCancelled:
        mirror_lineage(state.run_dir, spec.name)
        raise
    except HandedOver as e:
        action, reason, run = "handed-over", str(e).splitlines()[0], None
    except (PipelineError, ShardkeeperError) as e:
        action, reason, run = "failed", str(e).splitlines()[0], None
    plan = keeper.plan
    if run is not None:
        segs = "; ".join(
            f"step {o.attempts[0].start_step} -> {o.plan.until_step} on {_where(o, o.plan)}"
            for o in run.segments
            if not o.skipped
        )
        reason = f"plan ({was}) taken to its end: {segs or 'no segment left'}; {plan.where()}"
        message = complete_handed_over_run(plan)
        if message:
            get_run_logger().info(
                "flow run %s of the plan set to Completed: %s", plan.started_by.flow_run_name, message
            )
    mirror_lineage(state.run_dir, spec.name)
    first = run.segments[0] if run is not None and run.segments else None
    return ResumeItem(
        run_dir=state.run_dir,
        action=action,
        reason=reason,
        outcome=first,  # type: ignore[arg-type]
        segments=run.segments if run else [],
        export=run.export if run else None,
        publish=run.publish if run else None,
        plan_status=plan.status,
    )


def flow_run_name() -> str:
    """``resume <folders>``: which runs a resume flow run looks at."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    names = [Path(str(d)).name for d in [*(params.get("run_dirs") or []), *(params.get("roots") or [])]]
    return "resume " + (
        ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "") if names else "(nothing)"
    )


R = ResumeRequest


# validate_parameters=False: parse_request gives one line instead of Prefect's list of errors.
@flow(name="resume", flow_run_name=flow_run_name, validate_parameters=False)
@documented(ResumeRequest)
def resume(
    roots: list[str] = default(R, "roots"),
    run_dirs: list[str] = default(R, "run_dirs"),
    nproc: int | None = None,
    nodes: int | None = None,
    launcher: Literal["local", "slurm"] | None = None,
    slurm_partition: str | None = None,
    slurm_time_min: int | None = None,
    max_preemption_retries: int = default(R, "max_preemption_retries"),
    backoff_s: float = default(R, "backoff_s"),
    timeout_s: float | None = None,
    base_dir: str | None = None,
) -> ResumeSummary:
    """Scan -> for each resumable run: (reshard) -> train to its recorded until_step, or to its plan's end
    (remaining segments, export, publish) -> lineage artifacts.

    A run whose plan or run lock is held (another flow run drives it, a segment trains now) is skipped as
    already running, as is one whose plan is finished or whose last segment was cancelled or completed.
    Preempted again past max_preemption_retries after progress, a run is handed over to the automation (not a
    failure of this flow run). Cancelling the flow run stops the segment training now (checkpoint committed,
    segment 'cancelled') and resumes no other run; the flow run ends Cancelled."""
    request = parse_request(ResumeRequest, dict(locals()), "resume").resolved()
    logger = get_run_logger()
    check_resume_request(request)
    driver = current_driver("resume")
    items: list[ResumeItem] = []
    for state in scan_runs(request.roots, request.run_dirs):
        try:
            item = _resume_run(state, request, driver)
        except SegmentCancelled as e:
            logger.warning("%s; the remaining runs are not resumed", e)
            return Cancelled(message=str(e))
        logger.info("%s: %s (%s)", item.run_dir, item.action, item.reason)
        items.append(item)
    _overview_best_effort(request)
    failed = [i for i in items if i.action == "failed"]
    if failed:
        raise ResumeFailed(
            f"{len(failed)} of {len(items)} runs could not be resumed: "
            + "; ".join(f"{i.run_dir}: {i.reason}" for i in failed)
        )
    return ResumeSummary(items=items)


def _overview_best_effort(request: ResumeRequest) -> None:
    """The runs-overview artifact of what was scanned; a view, never a reason to fail the resume."""
    try:
        mirror_runs_overview(request.roots, request.run_dirs)
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("could not write the runs overview: %s", e)
