"""The ``resume`` flow, meant for a schedule: find runs whose last segment was preempted, failed or
interrupted before its until_step, and train each to that step at ``nproc`` ranks.

Idempotent: a run that is complete is left alone, and a run whose lock is held (a segment is
training now) is skipped, so overlapping schedules never start a second writer.

    from flows.resume import resume
    resume(roots=["runs"], nproc=2)

Deployed by ``python -m infra.deploy`` with an optional interval schedule and an automation that runs it
for one run directory (``run_dirs``) as soon as a ``shardkeeper.segment.preempted`` event arrives.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from these
# annotations, and in a served or worker-run flow run string annotations are not resolved ("ResumeModel
# is not fully defined"), so every scheduled run failed before it started.


from prefect import flow, get_run_logger
from prefect.states import Cancelled

from pathlib import Path
from typing import Literal

from schemas.errors import RunLockedError, ShardkeeperError
from flows.common import (PipelineError, SegmentCancelled, check_resume_request, default, documented, drive_segment,
                          parse_request)
from schemas.requests import ResumeItem, ResumeRequest, ResumeSummary, RunState, SegmentPlan
from tasks.lineage import mirror_lineage, mirror_runs_overview
from tasks.stage_tasks import load_spec, scan_runs

# Not "cancelled": a run whose last segment was cancelled by a person stays stopped until they train it again.
RESUMABLE = ("preempted", "failed", "interrupted")


class ResumeFailed(PipelineError):
    """At least one run could not be resumed; the message lists each with its reason."""


def triage(state: RunState) -> ResumeItem | None:
    """Why a run is not resumed, or None when it should be."""
    if not state.exists:
        return ResumeItem(run_dir=state.run_dir, action="skipped-not-a-run", reason="no run.yaml or checkpoints")
    if state.locked:
        return ResumeItem(run_dir=state.run_dir, action="skipped-locked", reason="its lock is held: a segment is training")
    if state.last_status not in RESUMABLE or state.last_until_step is None:
        return ResumeItem(run_dir=state.run_dir, action="skipped-done",
                          reason=f"last segment {state.last_status or 'none'}; nothing to resume")
    if state.step >= state.last_until_step:
        return ResumeItem(run_dir=state.run_dir, action="skipped-done",
                          reason=f"at step {state.step}, its until_step {state.last_until_step} is reached")
    return None


def _resume_one(state: RunState, request: ResumeRequest) -> ResumeItem:
    until = state.last_until_step or 0  # triage() made sure it is set
    plan = SegmentPlan(nproc=request.nproc, nodes=request.nodes, until_step=until, timeout_s=request.timeout_s,
                       launcher=request.launcher, slurm_partition=request.slurm_partition,
                       slurm_time_min=request.slurm_time_min)
    spec = load_spec(run_dir=state.run_dir)
    try:
        outcome = drive_segment(spec, state.run_dir, plan, max_preemption_retries=request.max_preemption_retries,
                              backoff_s=request.backoff_s)
        ran = outcome.attempts[-1].topology if outcome.attempts else None
        where = (f"{ran.nodes} x {ran.procs_per_node}" if ran and ran.nodes > 1 else str(ran.procs_per_node if ran else plan.nproc))
        via = f" via {plan.launcher}" if plan.launcher != "local" else ""
        item = ResumeItem(run_dir=state.run_dir, action="resumed", outcome=outcome,
                          reason=f"step {state.step} -> {until} on {where} ranks{via} (was {state.last_status})")
    except RunLockedError as e:  # someone started a segment since the scan
        return ResumeItem(run_dir=state.run_dir, action="skipped-locked", reason=str(e))
    except SegmentCancelled:
        mirror_lineage(state.run_dir, spec.name)
        raise
    except (PipelineError, ShardkeeperError) as e:
        item = ResumeItem(run_dir=state.run_dir, action="failed", reason=str(e).splitlines()[0])
    mirror_lineage(state.run_dir, spec.name)
    return item


def flow_run_name() -> str:
    """``resume <folders>``: which runs a resume flow run looks at."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    names = [Path(str(d)).name for d in [*(params.get("run_dirs") or []), *(params.get("roots") or [])]]
    return "resume " + (", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "") if names else "(nothing)")


R = ResumeRequest


# validate_parameters=False: parse_request gives one line instead of Prefect's list of errors.
@flow(name="resume", flow_run_name=flow_run_name, validate_parameters=False)
@documented(ResumeRequest)
def resume(
    roots: list[str] = default(R, "roots"),
    run_dirs: list[str] = default(R, "run_dirs"),
    nproc: int | None = None,
    nodes: int = default(R, "nodes"),
    launcher: Literal["local", "slurm"] = default(R, "launcher"),
    slurm_partition: str | None = None,
    slurm_time_min: int | None = None,
    max_preemption_retries: int = default(R, "max_preemption_retries"),
    backoff_s: float = default(R, "backoff_s"),
    timeout_s: float | None = None,
    base_dir: str | None = None,
) -> ResumeSummary:
    """Scan -> for each resumable run: (reshard) -> train to its recorded until_step -> lineage artifacts.

    A run whose lock is held (training now) is skipped, as is one whose last segment was cancelled or
    completed. Cancelling the flow run stops the segment training now (checkpoint committed, segment
    'cancelled') and resumes no other run; the flow run ends Cancelled."""
    request = parse_request(ResumeRequest, dict(locals()), "resume").resolved()
    logger = get_run_logger()
    check_resume_request(request)
    items: list[ResumeItem] = []
    for state in scan_runs(request.roots, request.run_dirs):
        try:
            item = triage(state) or _resume_one(state, request)
        except SegmentCancelled as e:
            logger.warning("%s; the remaining runs are not resumed", e)
            return Cancelled(message=str(e))
        logger.info("%s: %s (%s)", item.run_dir, item.action, item.reason)
        items.append(item)
    _overview_best_effort(request)
    failed = [i for i in items if i.action == "failed"]
    if failed:
        raise ResumeFailed(f"{len(failed)} of {len(items)} runs could not be resumed: "
                           + "; ".join(f"{i.run_dir}: {i.reason}" for i in failed))
    return ResumeSummary(items=items)


def _overview_best_effort(request: ResumeRequest) -> None:
    """The runs-overview artifact of what was scanned; a view, never a reason to fail the resume."""
    try:
        mirror_runs_overview(request.roots, request.run_dirs)
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("could not write the runs overview: %s", e)
