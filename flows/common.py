"""One training segment as a composition of tasks, shared by the train-and-export and resume flows:
plan the topology, reshard if the world size changes, train, and resume after a preemption with
back-off. Decisions are taken on result schemas only (RunState, SegmentResult)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from prefect import get_run_logger
from prefect.exceptions import ParameterTypeError
from pydantic import BaseModel, ValidationError

from schemas import RunSpec, SegmentResult
from schemas.errors import (
    ConfigError,
    PipelineError,
    SegmentCancelled,
    SegmentFailed,
    SegmentPreempted,  # noqa: F401
    ShardkeeperError,
)
from schemas.requests import ResumeRequest, SegmentOutcome, SegmentPlan, TrainExportRequest
from shardkeeper.config import explain
from tasks.events import emit_segment
from tasks.stage_tasks import inspect_run, plan_topology, reshard, train_segment

MAX_BACKOFF_S = 600.0
M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])


class RequestError(ParameterTypeError):
    """The flow's parameters are wrong: one line naming the field, raised before any task runs. (The one
    error type outside schemas/errors.py: Prefect reports a ParameterTypeError as a bad parameter.)"""

    def __init__(self, msg: str):
        super().__init__(" ".join(msg.split()))


def parse_request(model: type[M], value: object, source: str = "request") -> M:
    """The flow parameters as ``model``, or a RequestError with one line (Prefect's own message is a list).
    ``value``: a model, or a dict of flat parameters (None = not given: the field's default)."""
    if isinstance(value, model):
        return value
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise RequestError(explain(e, source, model).replace("key ", "parameter ", 1)) from None


def documented(model: type[BaseModel]) -> Callable[[F], F]:
    """Append an ``Args:`` section built from ``model``'s field descriptions to a flow function's docstring:
    Prefect shows these descriptions beside each parameter (UI form, ``prefect deployment inspect``)."""

    def wrap(fn: F) -> F:
        names = inspect.signature(fn).parameters
        lines = [f"    {name}: {model.model_fields[name].description}" for name in names if name in model.model_fields]
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nArgs:\n" + "\n".join(lines) + "\n"
        return fn

    return wrap


def default(model: type[BaseModel], field: str) -> Any:
    """The schema's default of a field: the flow signature shows it, the schema stays its one home."""
    return model.model_fields[field].get_default(call_default_factory=True)


def check_train_request(request: TrainExportRequest) -> RunSpec:
    """Everything about a train-and-export request that can be known before a task runs (no Prefect server
    needed): the config file and its overrides (one a script run never reads is refused; so is a change an
    existing run cannot take), every segment's world size, the run directory, the model, the data and the
    memory of the largest segment. Raises a ShardkeeperError (one line); writes nothing."""
    from shardkeeper.config import train_spec, with_script
    from shardkeeper.preflight import preflight
    from shardkeeper.stages import check_spec_change, keep_run_script
    from shardkeeper.stages import plan_topology as plan

    if request.config is not None and not Path(request.config).is_file():
        _missing("config", request.config, "a RunSpec YAML file", "configs/tiny.yaml")
    if request.spec is not None:
        spec = with_script(request.spec, request.script, request.script_args)
    else:
        spec = train_spec(
            request.config, request.overrides, request.run_dir, script=request.script, script_args=request.script_args
        )
    spec = keep_run_script(spec, request.run_dir)
    check_spec_change(request.run_dir, spec)  # an existing run: what the segment would refuse, refused now
    if request.export_dir is not None and Path(request.export_dir).is_file():
        raise ConfigError(f"export_dir {request.export_dir}: is a file; give a folder to create")
    topologies = {}
    for i, seg in enumerate(request.segments):
        key = (seg.nproc, seg.nodes, seg.launcher, seg.slurm_partition, seg.slurm_time_min)
        try:
            topologies.setdefault(
                key,
                plan(spec, seg.nproc, nodes=seg.nodes, launcher=seg.launcher, launcher_options=seg.launcher_options()),
            )
        except ShardkeeperError as e:
            raise ConfigError(f"segments[{i}]{_field_of(str(e))}: {e}") from None
    for topo in topologies.values():
        preflight(spec, topo, request.run_dir)
    return spec


_FLAG_FIELDS = {
    "--nproc": "nproc",
    "--nodes": "nodes",
    "--slurm-partition": "slurm_partition",
    "--slurm-time": "slurm_time_min",
    "--launcher": "launcher",
}


def _field_of(message: str) -> str:
    """``.nproc`` for a CLI-worded error about --nproc: the request's field that holds the value."""
    flag = message.split(" ", 1)[0].rstrip(":")
    return f".{_FLAG_FIELDS[flag]}" if flag in _FLAG_FIELDS else ""


def check_resume_request(request: ResumeRequest) -> None:
    """The resume flow's folders exist (relative paths were resolved against base_dir)."""
    for i, d in enumerate(request.roots):
        if "://" not in d and not Path(d).is_dir():  # a store is checked when it is scanned
            _missing(f"roots[{i}]", d, "the folder that holds the run directories", "/data/runs")
    for i, d in enumerate(request.run_dirs):
        if "://" not in d and not Path(d).is_dir():
            _missing(f"run_dirs[{i}]", d, "a run directory", "/data/runs/demo")


def _missing(field: str, value: str, what: str, example: str) -> None:
    p = Path(value)
    state = "is a file" if p.is_file() else ("is not a folder" if p.exists() else "does not exist")
    raise ConfigError(
        f"parameter {field} {value}: {state}; give {what} (an absolute path, or relative to the "
        f"parameter base_dir), e.g. {example}"
    )


def backoff_delay(backoff_s: float, attempt: int) -> float:
    """Seconds to wait before resume number ``attempt`` (0-based): backoff_s, 2x, 4x ..., capped."""
    return min(backoff_s * (2**attempt), MAX_BACKOFF_S)


def resumed_by(
    result: SegmentResult, attempts: int, max_preemption_retries: int
) -> Literal["flow", "automation", "none"]:
    """Who resumes a segment that just ended: this flow run (retries left), the resume automation (it gave up
    after the segment made progress), or nobody (not preempted; or preempted before committing anything new,
    where an automatic resume could loop without end: the schedule or a person resumes it)."""
    if result.status != "preempted":
        return "none"
    if attempts <= max_preemption_retries:
        return "flow"
    return "automation" if result.end_step > result.start_step else "none"


class HandedOver(SegmentPreempted):
    """Preempted more often than the flow run may resume by itself, after the segment made progress: the
    preemption event (label ``shardkeeper.resumed-by: automation``) leaves the rest to the resume automation."""


def drive_segment(
    spec: RunSpec,
    run_dir: str,
    plan: SegmentPlan,
    *,
    max_preemption_retries: int,
    backoff_s: float,
    by: str | None = None,
    on_stop: Callable[[PipelineError | ConfigError], None] | None = None,
) -> SegmentOutcome:
    """Train ``run_dir`` up to ``plan.until_step`` on ``plan.nodes`` x ``plan.nproc`` ranks; raise on failure.

    Each attempt (the first, and each resume after a preemption) is placed on the nodes usable then: a Slurm
    node drained or lost since makes the next attempt train on fewer nodes, the checkpoint resharded to it.

    ``by`` (who launches it) is recorded with each attempt. ``on_stop`` is called with the error about to be
    raised (HandedOver, SegmentPreempted, SegmentFailed, SegmentCancelled) *before* the segment's event is sent:
    a plan handed over to the automation must be free (its lock released) when the automation's flow run starts.

    Raises:
        HandedOver: preempted more than ``max_preemption_retries`` times, after progress (the automation resumes).
        SegmentPreempted: the same before anything new was committed (the schedule or a person resumes it).
        SegmentFailed: the ranks failed. SegmentCancelled: the flow run was cancelled."""
    logger = get_run_logger()
    state = inspect_run(run_dir)
    if state.step >= plan.until_step:
        logger.info("%s is at step %d already (until_step %d): nothing to train", run_dir, state.step, plan.until_step)
        return SegmentOutcome(plan=plan, skipped=True)
    resharded = None
    attempts: list[SegmentResult] = []
    while True:
        topology = plan_topology(spec, plan.nproc, plan.nodes, plan.launcher, plan.launcher_options())
        state = inspect_run(run_dir) if attempts else state
        if state.checkpoint is not None and state.world_size != topology.world_size:
            resharded = reshard(state.checkpoint, topology.world_size, spec)  # the rule of the spec it trains under
        result = train_segment(
            spec,
            run_dir,
            topology,
            plan.until_step,
            timeout_s=plan.timeout_s,
            launcher_options=plan.launcher_options(),
            by=by,
        )
        attempts.append(result)
        who = resumed_by(result, len(attempts), max_preemption_retries)
        error = _segment_error(result, run_dir, plan, topology.world_size, len(attempts), max_preemption_retries, who)
        if error is not None and on_stop is not None:
            on_stop(error)
        emit_segment(run_dir, spec.name, result, plan.until_step, topology.world_size, resumed_by=who)
        if result.status == "completed":
            return SegmentOutcome(plan=plan, reshard=resharded, attempts=attempts)
        if error is not None:
            raise error
        delay = backoff_delay(backoff_s, len(attempts) - 1)
        logger.warning(
            "segment %d preempted at step %d; resuming from %s in %.1f s (retry %d of %d)",
            result.segment,
            result.end_step,
            result.checkpoint,
            delay,
            len(attempts),
            max_preemption_retries,
        )
        time.sleep(delay)


def _segment_error(
    result: SegmentResult,
    run_dir: str,
    plan: SegmentPlan,
    world_size: int,
    preemptions: int,
    max_preemption_retries: int,
    who: str,
) -> PipelineError | ConfigError | None:
    """The error a segment's end raises (None: it completed, or the flow run resumes it itself)."""
    if result.status == "refused":  # bad input only the ranks could see: the run stays as it was
        return ConfigError(
            f"segment {result.segment} of {run_dir} refused before its first step on {world_size} "
            f"ranks: {result.failure}"
        )
    if result.status == "cancelled":
        return SegmentCancelled(
            f"segment {result.segment} of {run_dir} cancelled at step {result.end_step} "
            f"(checkpoint {result.checkpoint}); no further segment is started"
        )
    if result.status == "failed":
        return SegmentFailed(
            f"segment {result.segment} failed on {world_size} ranks after step {result.end_step} "
            f"(exit code {result.exit_code}); failing rank's last lines:\n{result.failure}"
        )
    if result.status != "preempted" or preemptions <= max_preemption_retries:
        return None
    times = f"{preemptions} time{'s' if preemptions > 1 else ''}"
    where = f"{run_dir}: preempted {times} before step {plan.until_step} (last checkpoint at step {result.end_step})"
    if who == "automation":
        return HandedOver(
            f"{where}; handed over to the resume flow (a deployment from infra.deploy runs it on the preemption event)"
        )
    return SegmentPreempted(
        f"{where}, nothing new committed since the last resume; resume it with the resume flow "
        "(its schedule does) or raise max_preemption_retries"
    )
