"""What the Prefect flows take and return: requests (flow parameters) and summaries.

Pydantic only (no torch, no prefect): a bad request fails validation before anything runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from schemas.results import ExportResult, PublishResult, ReshardResult, SegmentResult, SegmentStatus
from schemas.run import MAX_STEPS, RunSpec, control_chars


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Typed(_Frozen):
    """What a person types (a deployment's parameters, the UI form, ``prefect deployment run --param``): taken as
    typed, as RunSpec's values are: an integer parameter refuses true, "2" and 2.5, a boolean one refuses 1 and
    "yes", a number (float) one takes integers too."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def _absolute(path: str | None, base: str | None) -> str | None:
    """``path`` made absolute against ``base`` (or the current directory); URLs and None unchanged."""
    if path is None or "://" in path:
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path(base or Path.cwd()).expanduser() / p)


class _FlowParameters(_Typed):
    """A flow's parameters as one model: each field is one flat flow parameter."""

    base_dir: str | None = Field(
        None,
        description="folder that relative paths resolve against; default: the flow run's working directory "
        "(`python -m infra.deploy` sets it to the folder it was run from)",
    )

    def parameters(self) -> dict[str, Any]:
        """The flat flow parameters (JSON values) that differ from the defaults: for a call or a deployment."""
        return self.model_dump(mode="json", exclude_defaults=True)


Launcher = Literal["local", "slurm"]


class _Placement(_Typed):
    """Where segments run: the launcher and its options (what ``shardkeeper train --launcher`` takes)."""

    launcher: Launcher = Field(
        "local",
        description="local: torchrun on the worker's machine; slurm: an sbatch job "
        "(the worker's machine runs sbatch, the run directory is on storage the nodes share)",
    )
    slurm_partition: str | None = Field(None, min_length=1, description="Slurm partition (default: the cluster's)")
    slurm_time_min: int | None = Field(
        None, gt=0, description="Slurm time limit in minutes (the ranks get SIGTERM before it and commit a checkpoint)"
    )

    def launcher_options(self) -> dict[str, Any]:
        """The keyword options of the launcher (launch.get_launcher)."""
        if self.launcher == "slurm":
            return {"partition": self.slurm_partition, "time_min": self.slurm_time_min}
        return {}


class SegmentPlan(_Placement):
    nproc: int = Field(ge=1, description="ranks per node the segment trains on")
    until_step: int = Field(ge=1, le=MAX_STEPS, description="train until this many optimizer steps are done in total")
    nodes: int = Field(
        1,
        ge=1,
        description="nodes (world size = nodes x nproc); a resumed attempt uses the nodes usable then, if fewer",
    )
    timeout_s: float | None = Field(
        None, gt=0, description="stop the segment (with a checkpoint: it ends 'preempted') after this many seconds"
    )


SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)  # a shard size: "5GB", "500MiB", "100"


def _not_blank(v: str | None, what: str) -> str | None:
    if v is not None and not v.strip():
        raise ValueError(f"{what} is blank; give a path (or leave it out)")
    bad = control_chars(v) if v is not None else []
    if bad:
        raise ValueError(f"{what} {v!r}: contains control characters ({', '.join(bad)}); use a plain path")
    return v


class TrainExportRequest(_FlowParameters):
    """Parameters of the ``train-and-export`` flow."""

    config: str | None = Field(None, description="path of a RunSpec YAML, e.g. configs/tiny.yaml (or give spec)")
    spec: RunSpec | None = Field(None, description="an inline RunSpec instead of a config path")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides, as the CLI's --set")
    script: str | None = Field(
        None,
        description="train with your own script (it uses shardkeeper.Segment), as "
        "shardkeeper train --script; config or spec then give name, seed and checkpoint "
        "policy, or leave both out for the defaults",
    )
    script_args: list[str] = Field(default_factory=list, description="the script's arguments (sys.argv[1:])")
    run_dir: str = Field(min_length=1, description="run directory (created; resumed if it holds checkpoints)")
    segments: list[SegmentPlan] = Field(
        min_length=1, description="segments in order; until_step strictly increasing, each at its own world size"
    )
    max_preemption_retries: int = Field(3, ge=0, description="times a preempted segment is resumed before giving up")
    backoff_s: float = Field(5.0, ge=0, description="wait before a resume; doubles after each preemption of a segment")
    deep_validate: bool = Field(True, description="verify every checksum and the fingerprint of the final checkpoint")
    export_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="published dtype of floating tensors"
    )
    max_shard_size: str = Field("5GB", min_length=1, description="largest safetensors file, e.g. 5GB, 500MB")
    export_dir: str | None = Field(
        None, description="export folder; default RUN_DIR/exports/step-XXXXXXXX of the final checkpoint"
    )
    overwrite_export: bool = Field(
        True, description="replace an existing export folder (exports are byte-reproducible, so re-runs are safe)"
    )
    publish_target: str | None = Field(
        None,
        description="ORG/NAME or hf://ORG/NAME for the Hub, or an fsspec URL (file:///..., s3://...); none: no publish",
    )
    publish_revision: str | None = Field(None, description="branch to publish to (default: main)")

    @field_validator("config", "script", "run_dir", "export_dir", "publish_target", "publish_revision", "base_dir")
    @classmethod
    def _paths_not_blank(cls, v: str | None, info: ValidationInfo) -> str | None:
        return _not_blank(v, str(info.field_name))

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if not SIZE_RE.match(v) or float(SIZE_RE.match(v).group(1)) <= 0:  # type: ignore[union-attr]
            raise ValueError(f"max_shard_size {v!r} is not a size; give e.g. '5GB', '500MB' or '2GiB'")
        return v

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, v: list[str]) -> list[str]:
        for item in v:
            key, sep, _ = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"overrides item {item!r}: expected key.path=value, e.g. optim.lr=1e-3")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainExportRequest:
        if self.config is not None and self.spec is not None:
            raise ValueError("give exactly one of config (a RunSpec YAML path) or spec (an inline RunSpec), not both")
        if self.config is None and self.spec is None and self.script is None:
            raise ValueError(
                "give exactly one of config (a RunSpec YAML path) or spec (an inline RunSpec), or a "
                "script (your training script)"
            )
        if self.script_args and self.script is None:
            raise ValueError("script_args without script; give script (your training script) or drop script_args")
        if self.overrides and self.spec is not None:
            raise ValueError("overrides apply to a config file; put the values in the inline spec instead")
        steps = [s.until_step for s in self.segments]
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                raise ValueError(
                    f"segments[{i}].until_step {steps[i]} must be greater than segments[{i - 1}].until_step "
                    f"{steps[i - 1]}; list segments in training order with strictly increasing until_step"
                )
        return self

    def resolved(self) -> TrainExportRequest:
        """The same request with config, run_dir and export_dir absolute (against base_dir)."""
        b = self.base_dir
        return self.model_copy(
            update={
                "config": _absolute(self.config, b),
                "run_dir": _absolute(self.run_dir, b),
                "script": _absolute(self.script, b),
                "export_dir": _absolute(self.export_dir, b),
            }
        )


class ResumeRequest(_FlowParameters, _Placement):
    """Parameters of the ``resume`` flow (meant for a schedule, or an automation on a preemption event).

    Where a resumed segment runs: a run with a plan (``RUN_DIR/plan.json``, written by train-and-export) resumes
    each segment at the world size and placement its plan gives it, and ``nproc``, ``nodes`` and ``launcher`` are
    not used for it. A run without a plan resumes at ``nproc``, ``nodes`` and ``launcher`` where given, and
    otherwise at those of the segment that was preempted (from the run's segments.jsonl) -- never at a default
    that has nothing to do with the run."""

    roots: list[str] = Field(
        default_factory=list,
        description='folders whose immediate subfolders are run directories to scan, e.g. ["/data/runs"]',
    )
    run_dirs: list[str] = Field(default_factory=list, description="run directories to scan (in addition to roots)")
    nproc: int | None = Field(
        None,
        ge=1,
        description="ranks per node to resume a run without a plan on (resharded if "
        "the world size differs); default: the preempted segment's. A planned run resumes at "
        "its plan's world size",
    )
    nodes: int | None = Field(
        None,
        ge=1,
        description="nodes to resume a run without a plan on (with launcher slurm, "
        "fewer when fewer are usable now); default: the preempted segment's",
    )
    launcher: Launcher | None = Field(  # type: ignore[assignment]  # optional here: the preempted segment's
        None,
        description="local (torchrun here) or slurm (sbatch from here) for a run "
        "without a plan; default: the preempted segment's",
    )
    max_preemption_retries: int = Field(3, ge=0, description="times a preempted segment is resumed before giving up")
    backoff_s: float = Field(5.0, ge=0, description="wait before a resume; doubles after each preemption")
    timeout_s: float | None = Field(None, gt=0, description="stop each resumed segment after this many seconds")

    @field_validator("roots", "run_dirs")
    @classmethod
    def _not_blank_items(cls, v: list[str], info: ValidationInfo) -> list[str]:
        for i, d in enumerate(v):
            _not_blank(d, f"{info.field_name}[{i}]")
        return v

    @model_validator(mode="after")
    def _check(self) -> ResumeRequest:
        if not self.roots and not self.run_dirs:
            raise ValueError("give roots (folders of run directories) or run_dirs (run directories); both are empty")
        return self

    def resolved(self) -> ResumeRequest:
        """The same request with every folder absolute (against base_dir)."""
        b = self.base_dir
        return self.model_copy(
            update={
                "roots": [_absolute(r, b) for r in self.roots],
                "run_dirs": [_absolute(d, b) for d in self.run_dirs],
            }
        )


class RunState(_Frozen):
    """Where a run directory stands: its newest valid checkpoint and its last segment."""

    run_dir: str = Field(description="run directory")
    exists: bool = Field(description="the run directory holds a run (run.yaml or checkpoints)")
    checkpoint: str | None = Field(None, description="newest valid checkpoint")
    step: int = Field(0, ge=0, description="step of that checkpoint (0 when there is none)")
    world_size: int | None = Field(None, description="world size that checkpoint was written at")
    tier: Literal["memory", "storage"] | None = Field(
        None,
        description="where that checkpoint lives: 'storage' (the run directory) or 'memory' (a snapshot of "
        "checkpoint.memory_interval newer than storage's newest, on this host)",
    )
    last_status: SegmentStatus | Literal["running", "interrupted"] | None = Field(
        None, description="how the last segment ended; 'running' if its lock is held, 'interrupted' if it never ended"
    )
    last_until_step: int | None = Field(None, description="until_step the last segment was started with")
    locked: bool = Field(False, description="another process holds the run lock now")
    last_world_size: int | None = Field(None, description="world size the last segment was started with")
    last_nodes: int | None = Field(None, description="nodes the last segment was started on")
    last_launcher: Launcher | None = Field(None, description="launcher of the last segment (local or slurm)")
    reread: bool | None = Field(
        None,
        description="on an object store: every object of that checkpoint was downloaded and matched its "
        "manifest's checksums since its upload (False: committed, not re-read); None for a local run directory",
    )


def ran_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """segments.jsonl's records less those of segments the ranks refused before their first step (SegmentStatus
    'refused'): they trained and committed nothing, so the run stands where the last segment that ran left it."""
    refused = {r.get("segment") for r in records if r.get("event") == "end" and r.get("status") == "refused"}
    return [r for r in records if r.get("segment") not in refused] if refused else records


def last_segment(records: list[dict[str, Any]], *, locked: bool) -> tuple[str | None, int | None]:
    """How the last segment that ran ended ('running' while the run lock is held, 'interrupted' if it never ended)
    and the until_step it was started with, from segments.jsonl's records. Segments the ranks refused before
    their first step (SegmentStatus 'refused') trained and committed nothing: the run stands where the last
    segment that ran left it, for ``status``, the resume flow's triage and the dashboard alike."""
    ran = ran_records(records)
    starts = [r for r in ran if r.get("event") == "start"]
    if not ran:
        return None, None
    last = ran[-1]
    status = last.get("status") if last.get("event") == "end" else ("running" if locked else "interrupted")
    return status, starts[-1].get("until_step") if starts else None


def last_placement(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the last segment ran, from its start record in segments.jsonl (RunState's ``last_world_size``,
    ``last_nodes``, ``last_launcher``): what a resume without a plan or a given nproc runs on. A record written
    before nodes and launcher were recorded counts as one node, local. Segments the ranks refused before their
    first step are not where the run last trained (as in ``last_segment``)."""
    starts = [r for r in ran_records(records) if r.get("event") == "start"]
    if not starts:
        return {}
    last = starts[-1]
    world, nodes, launcher = last.get("world_size"), last.get("nodes", 1), last.get("launcher", "local")
    if not isinstance(world, int) or world < 1:
        return {}
    if not isinstance(nodes, int) or nodes < 1 or world % nodes:
        nodes = 1
    return {
        "last_world_size": world,
        "last_nodes": nodes,
        "last_launcher": launcher if launcher in ("local", "slurm") else "local",
    }


class SegmentOutcome(_Frozen):
    plan: SegmentPlan = Field(description="the segment as requested")
    reshard: ReshardResult | None = Field(None, description="reshard before the segment, when the world size changed")
    attempts: list[SegmentResult] = Field(
        default_factory=list, description="each launch: preempted ones, then the last"
    )
    skipped: bool = Field(False, description="the run was already at until_step: nothing launched")


class LineageArtifacts(_Frozen):
    table_key: str = Field(description="key of the table artifact of lineage events")
    graph_key: str = Field(description="key of the markdown artifact with the lineage graph (PNG) and checkpoints now")
    checkpoints_key: str | None = Field(None, description="key of the table artifact of the checkpoints on disk now")
    graph_png: str | None = Field(None, description="the lineage graph PNG written into the run directory")
    loss_key: str | None = Field(None, description="key of the markdown artifact with the loss curve, if any metrics")
    loss_png: str | None = Field(None, description="the loss curve PNG written into the run directory")
    events: int = Field(ge=0, description="lineage events mirrored")
    plan_key: str | None = Field(None, description="key of the markdown artifact of the run's plan, when it has one")


class TrainExportSummary(_Frozen):
    run_dir: str = Field(description="run directory")
    run_name: str = Field(description="RunSpec.name")
    status: Literal["completed"] = Field(description="the flow raises instead of returning anything else")
    final_checkpoint: str = Field(description="checkpoint that was validated and exported")
    final_step: int = Field(ge=0, description="its step")
    segments: list[SegmentOutcome] = Field(description="what each requested segment did")
    export: ExportResult = Field(description="the export")
    publish: PublishResult | None = Field(None, description="the publish, when a target was given")
    artifacts: LineageArtifacts = Field(description="Prefect artifacts that mirror the lineage")


class ResumeItem(_Frozen):
    run_dir: str = Field(description="run directory")
    action: Literal["resumed", "handed-over", "skipped-locked", "skipped-done", "skipped-not-a-run", "failed"] = Field(
        description="what the flow did with it: resumed (and, for a planned run, went on to the plan's end); "
        "handed-over (preempted again more often than max_preemption_retries, after progress: the automation "
        "resumes it); skipped-locked (already running: another flow run or process drives it); skipped-done "
        "(nothing to resume, or its plan is finished); failed"
    )
    reason: str = Field("", description="one line: why")
    outcome: SegmentOutcome | None = Field(None, description="the resumed segment, when one ran")
    segments: list[SegmentOutcome] = Field(
        default_factory=list, description="a planned run: every segment this flow run trained, the resumed one first"
    )
    export: ExportResult | None = Field(None, description="a planned run: the export, when this flow run made it")
    publish: PublishResult | None = Field(None, description="a planned run: the publish, when this flow run made it")
    plan_status: str | None = Field(
        None,
        description="a planned run: where its plan stands after this flow run "
        "(schemas.plan.PlanStatus); None for a run without a plan",
    )


class ResumeSummary(_Frozen):
    items: list[ResumeItem] = Field(description="one per run directory scanned")
