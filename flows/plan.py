"""Drive a run's plan (``RUN_DIR/plan.json``) from where it stands to its end: the remaining segments, each at the
world size the plan gives it, then validation, export and publish -- each once. The train-and-export flow runs
it for the plan it just wrote; the resume flow for a plan it took over (from the automation, the schedule or a
person). Decisions are taken on result schemas and the plan's record only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prefect import get_run_logger

from flows.common import HandedOver, PipelineError, SegmentCancelled, SegmentFailed, SegmentPreempted, drive_segment
from schemas import ExportResult, PublishResult, RunSpec
from schemas.errors import ConfigError, RunLockedError
from schemas.plan import PlanStatus
from schemas.requests import SegmentOutcome
from tasks.plan import PlanKeeper
from tasks.stage_tasks import (
    default_export_dir,
    export,
    inspect_run,
    materializing,
    path_asset,
    publish,
    target_asset,
    validate,
)


@dataclass
class PlanRun:
    """What one flow run did for a plan."""

    segments: list[SegmentOutcome] = field(default_factory=list)  # the segments it trained (or found done)
    checkpoint: str | None = None  # the final checkpoint
    step: int = 0
    export: ExportResult | None = None  # None: exported before (the plan's record says where)
    publish: PublishResult | None = None


def stop_status(error: PipelineError) -> PlanStatus:
    """Where a plan stands after a segment ended with ``error``."""
    if isinstance(error, SegmentCancelled):
        return "cancelled"
    if isinstance(error, HandedOver):
        return "handed-over"
    if isinstance(error, SegmentPreempted):
        return "stopped"
    return "failed"


def run_plan(
    keeper: PlanKeeper,
    spec: RunSpec,
    *,
    max_preemption_retries: int,
    backoff_s: float,
    between_segments: Callable[[], None] = lambda: None,
) -> PlanRun:
    """Drive ``keeper.plan`` to its end and mark it completed; returns what this flow run did.

    A segment that ends the plan here (preempted past the retries, failed, cancelled) records the plan's status
    and releases its lock before its event is sent (drive_segment's ``on_stop``); any other failure records
    'failed'. The lock is released in every case.

    Raises:
        HandedOver, SegmentPreempted, SegmentFailed, SegmentCancelled: as drive_segment.
        RunLockedError: a segment's run lock is held by another process (the plan is left as it stood).
        PipelineError, ShardkeeperError: validation, export or publish failed (the plan records 'failed')."""
    logger = get_run_logger()
    run = PlanRun()
    run_dir = keeper.run_dir
    try:
        if keeper.plan.driver != keeper.driver or keeper.plan.status != "running":
            keeper.driving()  # a plan taken over: the record says who drives it now
        for i, seg in enumerate(keeper.plan.segments):
            if keeper.plan.progress[i].status == "completed":
                continue

            def stopped(error: PipelineError | ConfigError, i: int = i) -> None:
                keeper.segment_stopped(i, stop_status(error), str(error).splitlines()[0])

            outcome = drive_segment(
                spec,
                run_dir,
                seg,
                max_preemption_retries=max_preemption_retries,
                backoff_s=backoff_s,
                by=keeper.driver.line(),
                on_stop=stopped,
            )
            run.segments.append(outcome)
            end = outcome.attempts[-1].end_step if outcome.attempts else inspect_run(run_dir).step
            keeper.segment_done(i, end, ran=not outcome.skipped)
            if i < len(keeper.plan.segments) - 1:
                between_segments()
        run.checkpoint = _final_checkpoint(run_dir, run.segments)
        _export_and_publish(keeper, run)
        keeper.complete()
        logger.info("%s: plan completed by %s (%s)", run_dir, keeper.driver.line(), keeper.plan.where())
        return run
    except (SegmentCancelled, SegmentPreempted, SegmentFailed, RunLockedError):
        raise  # recorded by on_stop (a segment's end), or not this flow run's to record (another holds the run)
    except BaseException as e:
        keeper.stop("failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        keeper.release()


def _final_checkpoint(run_dir: str, outcomes: list[SegmentOutcome]) -> str:
    """The checkpoint the last segment ended on (or the newest valid one if it had nothing to do)."""
    for outcome in reversed(outcomes):
        if outcome.attempts and outcome.attempts[-1].checkpoint:
            return outcome.attempts[-1].checkpoint
    state = inspect_run(run_dir)
    if state.checkpoint is None:
        raise PipelineError(f"{run_dir}: no valid checkpoint to export; train at least one segment first")
    return state.checkpoint


def _export_and_publish(keeper: PlanKeeper, run: PlanRun) -> None:
    """Validate and export the final checkpoint unless the plan records its export, then publish it unless the
    plan records its publish: each once, whoever drives the plan."""
    plan, ckpt = keeper.plan, str(run.checkpoint)
    ckpt_asset = path_asset(ckpt)
    if plan.exported is None:
        report = materializing(validate, [ckpt_asset])(ckpt, deep=plan.export.deep_validate)
        run.step = report.step or 0
        out_dir = plan.export.export_dir or default_export_dir(ckpt)
        run.export = materializing(export, [path_asset(out_dir)], [ckpt_asset])(
            ckpt,
            out_dir,
            dtype=plan.export.dtype,
            max_shard_size=plan.export.max_shard_size,
            overwrite=plan.export.overwrite,
        )
        keeper.exported(run.step, run.export.out_dir)
        out = run.export.out_dir
    else:
        get_run_logger().info(
            "%s: exported already by %s to %s", keeper.run_dir, plan.exported.by.line(), plan.exported.out
        )
        run.step, out = plan.exported.step, plan.exported.out
    if plan.publish is None or plan.published is not None:
        return
    run.publish = materializing(publish, [target_asset(plan.publish.target, Path(out).name)], [path_asset(out)])(
        out, plan.publish.target, revision=plan.publish.revision, run_dir=keeper.run_dir
    )
    keeper.published(run.step, run.publish.url or run.publish.target)
