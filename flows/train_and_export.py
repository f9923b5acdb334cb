"""The ``train-and-export`` flow: train in segments (each at its own world size, resumed after
preemptions), validate the final checkpoint deeply, export it to safetensors, publish it, and mirror
the run's lineage into Prefect artifacts.

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
from prefect.states import Cancelled

from flows.common import (PipelineError, SegmentCancelled, check_train_request, default, documented, drive_segment,
                          parse_request)
from schemas import ExportResult, PublishResult, RunSpec
from schemas.requests import SegmentOutcome, SegmentPlan, TrainExportRequest, TrainExportSummary
from tasks.lineage import has_lineage, mirror_lineage
from tasks.stage_tasks import default_export_dir, export, inspect_run, load_spec, materializing, path_asset, publish, target_asset, validate


def _final_checkpoint(run_dir: str, outcomes: list[SegmentOutcome]) -> str:
    """The checkpoint the last segment ended on (or the newest valid one if it had nothing to do)."""
    for outcome in reversed(outcomes):
        if outcome.attempts and outcome.attempts[-1].checkpoint:
            return outcome.attempts[-1].checkpoint
    state = inspect_run(run_dir)
    if state.checkpoint is None:
        raise PipelineError(f"{run_dir}: no valid checkpoint to export; train at least one segment first")
    return state.checkpoint


def _export_and_publish(request: TrainExportRequest, ckpt: str) -> tuple[int, ExportResult, PublishResult | None]:
    ckpt_asset = path_asset(ckpt)
    report = materializing(validate, [ckpt_asset])(ckpt, deep=request.deep_validate)
    step = report.step or 0
    out_dir = request.export_dir or default_export_dir(ckpt)
    export_asset = path_asset(out_dir)
    exported = materializing(export, [export_asset], [ckpt_asset])(
        ckpt, out_dir, dtype=request.export_dtype, max_shard_size=request.max_shard_size,
        overwrite=request.overwrite_export)
    if request.publish_target is None:
        return step, exported, None
    published = materializing(publish, [target_asset(request.publish_target, Path(exported.out_dir).name)], [export_asset])(
        exported.out_dir, request.publish_target, revision=request.publish_revision, run_dir=request.run_dir)
    return step, exported, published


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

    A cancellation of the flow run (UI, API, ``prefect flow-run cancel``) stops the training segment
    (its ranks commit a checkpoint), starts nothing else and ends the flow run Cancelled."""
    request = parse_request(TrainExportRequest, dict(locals()), "train-and-export").resolved()
    return _train_and_export(request)


def _train_and_export(request: TrainExportRequest) -> TrainExportSummary:
    logger = get_run_logger()
    check_train_request(request)  # before any task: a bad request fails with one line and writes nothing
    spec: RunSpec = load_spec(request.config, request.spec, request.overrides, run_dir=request.run_dir,
                              base_dir=request.base_dir, script=request.script, script_args=request.script_args)
    outcomes: list[SegmentOutcome] = []
    try:
        for i, plan in enumerate(request.segments):
            outcomes.append(drive_segment(spec, request.run_dir, plan, max_preemption_retries=request.max_preemption_retries,
                                        backoff_s=request.backoff_s))
            if i < len(request.segments) - 1:
                _mirror_best_effort(request.run_dir, spec.name)  # the dashboard moves with the run, segment by segment
        ckpt = _final_checkpoint(request.run_dir, outcomes)
        step, exported, published = _export_and_publish(request, ckpt)
    except SegmentCancelled as e:
        _mirror_best_effort(request.run_dir, spec.name)
        logger.warning("%s", e)
        return Cancelled(message=str(e))
    except BaseException:
        _mirror_best_effort(request.run_dir, spec.name)
        raise
    artifacts = mirror_lineage(request.run_dir, spec.name)
    summary = TrainExportSummary(
        run_dir=request.run_dir if "://" in request.run_dir else str(Path(request.run_dir).resolve()), run_name=spec.name, status="completed", final_checkpoint=ckpt,
        final_step=step, segments=outcomes, export=exported, publish=published,
        artifacts=artifacts,
    )
    logger.info("%s: trained to step %d, exported to %s%s; artifacts %s, %s", request.run_dir, summary.final_step,
                exported.out_dir, f", published to {published.url or published.target}" if published else "",
                artifacts.table_key, artifacts.graph_key)
    return summary


def _mirror_best_effort(run_dir: str, run_name: str) -> None:
    """On failure, still show the lineage up to the failure; never mask the original error."""
    if not has_lineage(run_dir):
        return
    try:
        mirror_lineage(run_dir, run_name)
    except Exception as e:  # noqa: BLE001 - the stage's error is the one to report
        get_run_logger().warning("could not mirror the lineage of %s: %s", run_dir, e)
