"""One Prefect task per pipeline stage, thin and typed, over ``shardkeeper.stages``.

Schemas in, schemas out. torch is imported only when a stage runs (by the stage, when it needs
it), so importing tasks/ and flows/ stays light. Caching is off: a stage re-run with the same
inputs (a resume after a preemption) must really run again. Only ``publish`` retries, because only
it talks to the network; a user mistake (bad target, no token) is never retried.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State
from prefect.tasks import MaterializingTask, Task

from ckpt.commit.layout import RunDir
from schemas import (
    ClusterTopology,
    ExportResult,
    PublishResult,
    ReshardResult,
    RunSpec,
    SegmentResult,
    ValidationReport,
)
from schemas.errors import CheckpointError, ShardkeeperError
from schemas.requests import RunState

log = logging.getLogger(__name__)

PUBLISH_RETRIES = 3
PUBLISH_RETRY_DELAYS_S = [5, 20, 60]
CANCEL_POLL_S = 1.0  # how often a training segment checks whether its flow run was cancelled


class CheckpointInvalid(CheckpointError):
    """Deep validation found a problem: the flow stops before exporting anything."""


@task(name="load-run-spec", cache_policy=NO_CACHE)
def load_spec(
    config: str | None = None,
    spec: RunSpec | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    base_dir: str | None = None,
    script: str | None = None,
    script_args: list[str] | None = None,
) -> RunSpec:
    """The RunSpec a segment of ``run_dir`` trains under, as ``shardkeeper train`` reads it: as given inline; from a
    YAML file (plus ``key=value`` overrides); for a script run without a config, the run's own run.yaml (a run that
    exists: an import the script continues, an earlier segment) or the defaults (a new run); with neither config nor
    script, the run directory's run.yaml (what it was trained with). Relative paths in ``overrides`` resolve against
    ``base_dir`` (the flow parameter), not the worker's working directory."""
    from shardkeeper.config import load_run_spec, train_spec, with_script

    if spec is not None:
        return with_script(spec, script, script_args, base=base_dir)
    if config is not None or script is not None:  # what check_train_request checked, and train would read
        return train_spec(
            config, overrides, run_dir or "", script=script, script_args=script_args, overrides_base=base_dir
        )
    if run_dir is not None and "://" in run_dir:  # a run on the store: its run.yaml, pulled into the cache
        from shardkeeper.remote import lineage_source

        config = str(lineage_source(run_dir)[0].spec_path)
    elif run_dir is not None:
        config = str(RunDir.at(run_dir).spec_path)
    if config is None:
        raise ShardkeeperError("load-run-spec: give a config path, a run directory or an inline spec")
    return load_run_spec(config, overrides, overrides_base=base_dir)


@task(name="inspect-run", cache_policy=NO_CACHE)
def inspect_run(run_dir: str) -> RunState:
    """Newest valid checkpoint and how the last segment ended."""
    from shardkeeper.stages import run_state

    return run_state(run_dir)


@task(name="scan-runs", cache_policy=NO_CACHE)
def scan_runs(roots: list[str], run_dirs: list[str]) -> list[RunState]:
    """The state of every run directory under the ``roots`` folders and in ``run_dirs`` (each once)."""
    from shardkeeper.stages import scan_runs as scan

    return scan(roots, run_dirs)


@task(name="plan-topology", cache_policy=NO_CACHE)
def plan_topology(
    spec: RunSpec, nproc: int, nodes: int = 1, launcher: str = "local", launcher_options: dict | None = None
) -> ClusterTopology:
    """``nodes`` x ``nproc`` ranks, or fewer nodes when the launcher has fewer usable now (Slurm)."""
    from shardkeeper import stages

    return stages.plan_available_topology(
        spec, nproc, nodes=nodes, launcher=launcher, launcher_options=launcher_options
    )


def _train_task_name() -> str:
    from prefect.runtime import task_run

    p = task_run.parameters or {}
    topo = p.get("topology")
    nodes, procs, launcher = (
        (topo.nodes, topo.procs_per_node, topo.launcher) if isinstance(topo, ClusterTopology) else (1, "?", "local")
    )
    where = f"{nodes}x{procs}" if nodes != 1 else f"{procs}"
    return f"train-to-step-{p.get('until_step')}-on-{where}-ranks" + (f"-{launcher}" if launcher != "local" else "")


@task(name="train-segment", cache_policy=NO_CACHE, task_run_name=_train_task_name)
def train_segment(
    spec: RunSpec,
    run_dir: str,
    topology: ClusterTopology,
    until_step: int,
    timeout_s: float | None = None,
    launcher_options: dict | None = None,
    by: str | None = None,
) -> SegmentResult:
    """Launch one segment; every line of the ranks' output goes to this task's log, and its progress to a
    progress artifact and a live table artifact (tasks/live.py), with a checkpoint event per commit.

    ``timeout_s`` is handled by the launcher, not by Prefect: at the timeout the ranks get SIGTERM,
    commit a checkpoint and the segment ends 'preempted' (a hard kill would lose the step).

    Cancelling the flow run (UI/API) stops the ranks the same way and the segment ends 'cancelled'
    (exit code 130); see FlowRunCancelWatch for how the cancellation is seen.

    ``by``: who launches it (which flow run, created by whom), recorded in segments.jsonl and the lineage."""
    from shardkeeper import stages
    from tasks.live import SegmentWatch

    logger = get_run_logger()
    watch = FlowRunCancelWatch.for_current_flow_run()
    live = SegmentWatch(run_dir, spec.name, until_step).start()
    try:
        result = stages.train_segment(
            spec,
            run_dir,
            topology,
            until_step,
            timeout_s=timeout_s,
            sink=lambda line: logger.info("%s", line),
            cancel_check=watch,
            launcher_options=launcher_options,
            by=by,
        )
    finally:
        live.stop()
        if watch is not None:
            watch.stop()
    job = (
        (
            f" [Slurm job {result.scheduler_job} {result.scheduler_state}"
            f"{f', requeued {result.requeues}x' if result.requeues else ''}]"
        )
        if result.scheduler_job
        else ""
    )
    summary = (
        f"segment {result.segment} {result.status}: steps {result.start_step} -> {result.end_step} "
        f"on {topology.world_size} ranks in {result.seconds:.1f} s{job}"
    )
    if result.status == "failed":
        logger.error("%s; last lines:\n%s", summary, result.failure)
    elif result.status == "refused":
        logger.error("%s: refused before its first step: %s", summary, result.failure)
    elif result.status in ("preempted", "cancelled"):
        logger.warning("%s; checkpoint %s%s", summary, result.checkpoint, f" ({result.note})" if result.note else "")
    else:
        logger.info("%s; checkpoint %s", summary, result.checkpoint)
    return result


class FlowRunCancelWatch:
    """The launcher's cancel check for a segment trained inside a flow run: true once the flow run is
    Cancelling or Cancelled.

    How a Prefect 3.8 cancellation reaches the ranks:

    - Flow run executed by a runner (``flow.serve()``, a process worker), the usual case: the runner
      sees the Cancelling state, tells the flow-run process over its control channel that the intent
      is "cancel", then sends it SIGTERM (SIGKILL after 30 s). A sync task runs in the flow's main
      thread, where the launcher owns SIGTERM: it stops the ranks (SIGTERM -> checkpoint) and asks
      this check, which reads the control intent at once (``prefect._internal.control_listener``,
      private, used defensively) and otherwise the flow run's state, so the outcome is 'cancelled',
      not 'preempted'. If the process is SIGKILLed first, PDEATHSIG takes torchrun and the ranks.
    - A flow called in-process (no runner, nobody signals): a daemon thread polls the flow run's
      state every ``period_s`` through the Prefect client; the launcher polls this check and stops
      the ranks when it turns true.
    """

    def __init__(self, flow_run_id: Any, period_s: float = CANCEL_POLL_S):
        self.flow_run_id = flow_run_id
        self.period_s = period_s
        self._cancelled = threading.Event()
        self._done = threading.Event()

    @classmethod
    def for_current_flow_run(cls) -> FlowRunCancelWatch | None:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx is None or ctx.flow_run is None:
            return None
        return cls(ctx.flow_run.id).start()

    def start(self) -> FlowRunCancelWatch:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            self._poll(client)  # a run cancelled between two segments starts no ranks at all
        # The thread runs in a copy of this context: the Prefect settings (API URL) live in contextvars.
        ctx = contextvars.copy_context()
        threading.Thread(target=ctx.run, args=(self._loop,), name="flow-run-cancel-watch", daemon=True).start()
        return self

    def _loop(self) -> None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not self._done.wait(self.period_s) and not self._cancelled.is_set():
                self._poll(client)

    def _poll(self, client: Any) -> None:
        try:
            state = client.read_flow_run(self.flow_run_id).state
        except Exception as e:  # noqa: BLE001 - an API hiccup must not stop training; the next poll retries
            log.debug("cannot read the state of flow run %s: %s", self.flow_run_id, e)
            return
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self._cancelled.set()

    def __call__(self) -> bool:
        if not self._cancelled.is_set() and _runner_intends_cancel():
            self._cancelled.set()
        return self._cancelled.is_set()

    def stop(self) -> None:
        self._done.set()


def _runner_intends_cancel() -> bool:
    try:
        from prefect._internal import control_listener

        return control_listener.get_intent() == "cancel"
    except Exception:  # noqa: BLE001 - private API: absent or changed means "unknown", the state poll decides
        return False


@task(name="validate-checkpoint", cache_policy=NO_CACHE)
def validate(ckpt_dir: str, deep: bool = True) -> ValidationReport:
    """Validate a checkpoint; raise CheckpointInvalid (one line per problem) if it is not whole."""
    from shardkeeper import stages

    report = stages.validate_checkpoint(ckpt_dir, deep=deep)
    if not report.valid:
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise CheckpointInvalid(f"{report.errors[0]}{more}; nothing was exported")
    get_run_logger().info(
        "valid (%s): %s step %s, %d files, %.1f MB hashed, %.2f s",
        "deep" if deep else "quick",
        ckpt_dir,
        report.step,
        report.files_checked,
        report.bytes_checked / 1e6,
        report.seconds,
    )
    return report


@task(name="reshard", cache_policy=NO_CACHE)
def reshard(ckpt_dir: str, world_size: int, spec: RunSpec | None = None) -> ReshardResult:
    """Make ``ckpt_dir`` loadable at ``world_size`` for the next segment, which trains under ``spec`` (its batch
    rule decides whether it may; default: the run's record, run.yaml)."""
    from shardkeeper import stages

    result = stages.reshard(ckpt_dir, world_size, spec=spec)
    get_run_logger().info(
        "%s: %s (world size %d) -> %d", result.method, Path(ckpt_dir).name, result.from_world_size, result.to_world_size
    )
    return result


@task(name="export", cache_policy=NO_CACHE)
def export(
    ckpt_dir: str, out_dir: str, dtype: str = "bfloat16", max_shard_size: str = "5GB", overwrite: bool = True
) -> ExportResult:
    from shardkeeper import stages

    result = stages.export_and_record(
        ckpt_dir, out_dir, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=False
    )
    get_run_logger().info(
        "exported %d tensors (%.1f MB, %s) in %d shard(s) to %s in %.2f s",
        result.num_tensors,
        result.total_bytes / 1e6,
        result.dtype,
        result.num_shards,
        result.out_dir,
        result.seconds,
    )
    return result


def _retry_unless_user_error(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry network trouble; a ShardkeeperError is a user mistake that a retry cannot fix."""
    exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return not isinstance(exc, ShardkeeperError)


@task(
    name="publish",
    cache_policy=NO_CACHE,
    retries=PUBLISH_RETRIES,
    retry_delay_seconds=PUBLISH_RETRY_DELAYS_S,
    retry_condition_fn=_retry_unless_user_error,
)
def publish(export_dir: str, target: str, revision: str | None = None, run_dir: str | None = None) -> PublishResult:
    from shardkeeper import stages

    result = stages.publish_export(export_dir, target, revision=revision, run_dir=run_dir)
    get_run_logger().info("%s", result.line())
    return result


# ----------------------------------------------------------------------------- assets
def default_export_dir(ckpt_dir: str) -> str:
    """Where a checkpoint's export goes unless asked otherwise: RUN_DIR/exports/step-XXXXXXXX (on the store
    too, for a checkpoint at s3://.../checkpoints/step-XXXXXXXX)."""
    if "://" in str(ckpt_dir):
        run_url, _, name = str(ckpt_dir).rstrip("/").rpartition("/checkpoints/")
        return f"{run_url}/exports/{name}"
    return str(RunDir.containing(ckpt_dir).exports / Path(ckpt_dir).name)


def path_asset(path: str | Path) -> str | None:
    """Asset key of a checkpoint or export folder: its file:// URI, or its s3:// URL."""
    if "://" in str(path):
        return _valid_key(str(path).rstrip("/"))
    return _valid_key(Path(path).resolve().as_uri())


def target_asset(target: str, export_name: str) -> str | None:
    """Asset key of a publish: hf://ORG/NAME for the Hub, URL/<export folder name> for fsspec URLs
    (where ckpt.publish puts the folder)."""
    if "://" not in target:
        return _valid_key(f"hf://{target}")
    if target.startswith("hf://"):
        return _valid_key(target)
    return _valid_key(f"{target.rstrip('/')}/{export_name}")


def _valid_key(key: str) -> str | None:
    """None when Prefect would refuse the key (e.g. a path with spaces): assets are a bonus view of
    the lineage, never a reason to fail a run."""
    from prefect.types.names import validate_valid_asset_key

    try:
        return validate_valid_asset_key(key)
    except ValueError:
        log.debug("no Prefect asset for %s: not a valid asset key", key)
        return None


def materializing(
    base: Task[..., Any], assets: list[str | None], deps: list[str | None] | None = None
) -> Task[..., Any]:
    """``base`` as a task that materializes ``assets`` from ``deps`` (Prefect assets); unchanged without keys."""
    keys = [a for a in assets if a]
    if not keys:
        return base
    return MaterializingTask(
        fn=base.fn,
        assets=keys,
        materialized_by="shardkeeper",
        name=base.name,
        task_run_name=base.task_run_name,
        cache_policy=NO_CACHE,
        retries=base.retries,
        retry_delay_seconds=base.retry_delay_seconds,
        retry_condition_fn=base.retry_condition_fn,
        asset_deps=[d for d in deps or [] if d] or None,
    )
