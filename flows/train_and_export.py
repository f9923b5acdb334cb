"""The ``train-and-export`` flow: train in segments (each at its own world size, resumed after
preemptions), validate the final checkpoint deeply, export it to safetensors, publish it, and mirror
the run's lineage into Prefect artifacts. The plan is kept in the run directory (``plan.json``): a resume
flow run that takes the run over after a preemption finishes it (flows/plan.py).

Flat parameters (one per field of ``schemas.requests.TrainExportRequest``), so a deployment's values are
the defaults of its runs and ``--param`` overrides one at a time:

    from flows.train_and_export import train_and_export
    train_and_export(config="configs/tiny.yaml", run_dir="runs/demo",
                     segments=[{"nproc": 2, "until_step": 10}, {"nproc": 3, "until_step": 20}],
                     publish_target="file:///tmp/published")

As a deployment: ``python -m infra.deploy --config ... --run-dir ...`` then
``prefect deployment run 'train-and-export/NAME' --param segments='[{"nproc": 2, "until_step": 40}]'``.
"""

# No `from __future__ import annotations` here: Prefect builds the flow's parameter model from these
# annotations, and in a served or worker-run flow run string annotations are not resolved ("ResumeModel
# is not fully defined"), so every scheduled run failed before it started.

from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.states import Cancelled, Failed

from flows.common import (
    HandedOver,
    PipelineError,
    SegmentCancelled,
    ShardkeeperError,
    check_train_request,
    default,
    documented,
    parse_request,
)
from flows.plan import run_plan
from schemas import RunSpec
from schemas.requests import SegmentPlan, TrainExportRequest, TrainExportSummary
from tasks.lineage import has_lineage, mirror_lineage
from tasks.plan import HANDED_OVER, PlanKeeper, current_driver
from tasks.stage_tasks import load_spec


def flow_run_name() -> str:
    """``<run dir name> → step N on A,B ranks``: what a flow run trains, readable in the runs list."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    run = Path(str(params.get("run_dir") or "run")).name
    segments = params.get("segments") or []
    try:
        plans = [s if isinstance(s, dict) else s.model_dump() for s in segments]
        ranks = ",".join(f"{s['nodes']}x{s['nproc']}" if s.get("nodes", 1) != 1 else str(s["nproc"]) for s in plans)
        return f"{run} → step {plans[-1]['until_step']} on {ranks} ranks"
    except (KeyError, IndexError, TypeError, AttributeError):
        return f"{run} (segments to be checked)"


T = TrainExportRequest


# validate_parameters=False: parse_request gives one line instead of Prefect's list of errors.
@flow(name="train-and-export", flow_run_name=flow_run_name, validate_parameters=False)
@documented(TrainExportRequest)
def train_and_export(
    config: str | None = None,
    run_dir: str | None = None,
    segments: list[SegmentPlan] | None = None,
    overrides: list[str] = default(T, "overrides"),
    spec: RunSpec | None = None,
    script: str | None = None,
    script_args: list[str] = default(T, "script_args"),
    export_dtype: Literal["float32", "bfloat16", "float16"] = default(T, "export_dtype"),
    max_shard_size: str = default(T, "max_shard_size"),
    export_dir: str | None = None,
    overwrite_export: bool = default(T, "overwrite_export"),
    publish_target: str | None = None,
    publish_revision: str | None = None,
    max_preemption_retries: int = default(T, "max_preemption_retries"),
    backoff_s: float = default(T, "backoff_s"),
    deep_validate: bool = default(T, "deep_validate"),
    base_dir: str | None = None,
) -> TrainExportSummary:
    """Segments -> (reshard) -> train, resumed after preemptions -> validate (deep) -> export -> publish -> lineage.

    The plan (segments, export, publish) and its progress are written into the run directory first
    (``RUN_DIR/plan.json``, its lock held by this flow run), so whoever resumes the run after a preemption --
    this flow run up to ``max_preemption_retries`` times, then the resume automation, or the schedule -- goes on
    to the plan's end. A flow run that hands its plan over ends Failed, named ``HandedOver``, with a one-line
    message; the resumer that finishes the plan sets it Completed (see ``handed_over``).

    A cancellation of the flow run (UI, API, ``prefect flow-run cancel``) stops the training segment
    (its ranks commit a checkpoint), starts nothing else and ends the flow run Cancelled."""
    request = parse_request(TrainExportRequest, dict(locals()), "train-and-export").resolved()
    return _train_and_export(request)


def _train_and_export(request: TrainExportRequest) -> TrainExportSummary:
    logger = get_run_logger()
    check_train_request(request)  # before any task: a bad request fails with one line and writes nothing
    spec: RunSpec = load_spec(
        request.config,
        request.spec,
        request.overrides,
        run_dir=request.run_dir,
        base_dir=request.base_dir,
        script=request.script,
        script_args=request.script_args,
    )
    keeper = PlanKeeper.start(request, current_driver("flow"))  # the plan, in the run's record; its lock held
    try:
        run = run_plan(
            keeper,
            spec,
            max_preemption_retries=request.max_preemption_retries,
            backoff_s=request.backoff_s,
            between_segments=lambda: _mirror_best_effort(request.run_dir, spec.name),
        )
    except SegmentCancelled as e:
        _mirror_best_effort(request.run_dir, spec.name)
        logger.warning("%s", e)
        return Cancelled(message=str(e))
    except HandedOver as e:
        _mirror_best_effort(request.run_dir, spec.name)
        return handed_over(e, keeper)
    except ShardkeeperError:
        if not keeper.discard_if_untouched():  # refused before anything was written: no plan left behind either
            _mirror_best_effort(request.run_dir, spec.name)
        raise
    except BaseException:
        _mirror_best_effort(request.run_dir, spec.name)
        raise
    artifacts = mirror_lineage(request.run_dir, spec.name)
    if run.export is None or run.checkpoint is None:  # a new plan has no export recorded: this run made it
        raise PipelineError(f"{request.run_dir}: the plan's export was recorded by another flow run")
    summary = TrainExportSummary(
        run_dir=request.run_dir if "://" in request.run_dir else str(Path(request.run_dir).resolve()),
        run_name=spec.name,
        status="completed",
        final_checkpoint=run.checkpoint,
        final_step=run.step,
        segments=run.segments,
        export=run.export,
        publish=run.publish,
        artifacts=artifacts,
    )
    logger.info(
        "%s: trained to step %d, exported to %s%s; artifacts %s, %s",
        request.run_dir,
        summary.final_step,
        run.export.out_dir,
        f", published to {run.publish.url or run.publish.target}" if run.publish else "",
        artifacts.table_key,
        artifacts.graph_key,
    )
    return summary


def handed_over(error: HandedOver, keeper: PlanKeeper) -> Failed:
    """The final state of a flow run whose plan went to the resume automation: Failed, named ``HandedOver``.

    Why Failed: at this moment the pipeline this flow run stands for has not finished, and whether the resume
    that takes it over will finish it is not known yet; Completed would tell a user (and any automation on
    completed runs) that the model was exported when it was not. The state's name and its one-line message say
    what happened instead of a bare failure: preempted, handed over, where the plan stands. When a resumer
    finishes the plan it sets this flow run to Completed, with a message naming who finished it
    (tasks.plan.complete_handed_over_run), so the run the user started ends green once its pipeline did; the
    flow run's state history keeps both. Calling the flow in-process raises the HandedOver error."""
    plan = keeper.plan
    message = (
        f"{str(error).splitlines()[0]}; the plan goes on there from its record ({plan.where()}); this flow run "
        "turns Completed when it finishes"
    )
    get_run_logger().warning("%s", message)
    return Failed(name=HANDED_OVER, message=message, data=error)


def _mirror_best_effort(run_dir: str, run_name: str) -> None:
    """On failure, still show the lineage up to the failure; never mask the original error."""
    if not has_lineage(run_dir):
        return
    try:
        mirror_lineage(run_dir, run_name)
    except Exception as e:  # noqa: BLE001 - the stage's error is the one to report
        get_run_logger().warning("could not mirror the lineage of %s: %s", run_dir, e)
