"""One training segment as a composition of tasks, shared by the train-and-export and resume flows:
plan the topology, reshard if the world size changes, train, and resume after a preemption with
back-off. Decisions are taken on result schemas only (RunState, SegmentResult)."""

from __future__ import annotations

import time

from prefect import get_run_logger

from schemas import RunSpec, SegmentResult
from schemas.requests import SegmentOutcome, SegmentPlan
from tasks.stages import inspect_run, plan_topology, reshard, train_segment

MAX_BACKOFF_S = 600.0


class PipelineError(RuntimeError):
    """A stage ended in a way the flow cannot continue from; the message says what and where."""


class SegmentFailed(PipelineError):
    """The ranks failed: the message carries the failing rank's last lines."""


class SegmentCancelled(PipelineError):
    """The flow run was cancelled while a segment trained: its ranks committed a checkpoint and
    stopped; no further segment starts (the flow ends Cancelled)."""


class SegmentPreempted(PipelineError):
    """Preempted more often than the request allows; the run can be resumed later (resume flow)."""


def backoff_delay(backoff_s: float, attempt: int) -> float:
    """Seconds to wait before resume number ``attempt`` (0-based): backoff_s, 2x, 4x ..., capped."""
    return min(backoff_s * (2 ** attempt), MAX_BACKOFF_S)


def run_segment(spec: RunSpec, run_dir: str, plan: SegmentPlan, *, max_preemption_retries: int,
                backoff_s: float) -> SegmentOutcome:
    """Train ``run_dir`` up to ``plan.until_step`` on ``plan.nproc`` ranks; raise on failure."""
    logger = get_run_logger()
    topology = plan_topology(spec, plan.nproc)
    state = inspect_run(run_dir)
    if state.step >= plan.until_step:
        logger.info("%s is at step %d already (until_step %d): nothing to train", run_dir, state.step, plan.until_step)
        return SegmentOutcome(plan=plan, skipped=True)
    resharded = None
    if state.checkpoint is not None and state.world_size != topology.world_size:
        resharded = reshard(state.checkpoint, topology.world_size)
    attempts: list[SegmentResult] = []
    while True:
        result = train_segment(spec, run_dir, topology, plan.until_step, timeout_s=plan.timeout_s)
        attempts.append(result)
        if result.status == "completed":
            return SegmentOutcome(plan=plan, reshard=resharded, attempts=attempts)
        if result.status == "cancelled":
            raise SegmentCancelled(f"segment {result.segment} of {run_dir} cancelled at step {result.end_step} "
                                   f"(checkpoint {result.checkpoint}); no further segment is started")
        if result.status == "failed":
            raise SegmentFailed(f"segment {result.segment} failed on {topology.world_size} ranks after step "
                                f"{result.end_step} (exit code {result.exit_code}); failing rank's last lines:\n"
                                f"{result.failure}")
        preemptions = len(attempts)
        if preemptions > max_preemption_retries:
            raise SegmentPreempted(f"{run_dir}: preempted {preemptions} times before step {plan.until_step} "
                                   f"(last checkpoint at step {result.end_step}); resume it later (resume flow) "
                                   "or raise max_preemption_retries")
        delay = backoff_delay(backoff_s, preemptions - 1)
        logger.warning("segment %d preempted at step %d; resuming from %s in %.1f s (retry %d of %d)", result.segment,
                       result.end_step, result.checkpoint, delay, preemptions, max_preemption_retries)
        time.sleep(delay)
