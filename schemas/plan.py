"""The run's plan: what a ``train-and-export`` flow run set out to do with a run directory, and how far it got.

Written into the run directory (``RUN_DIR/plan.json``, ckpt.plan) when the flow starts and rewritten, whole and
atomically, as each segment, the export and the publish complete. It is the run's record of the pipeline, not
one flow run's memory: whoever resumes the run -- the flow run itself, the interval schedule or the preemption
automation -- reads it and goes on to its end (the remaining segments, then export and publish, each once).

Pydantic only (no torch, no prefect).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.requests import SegmentPlan, TrainExportRequest

PLAN_NAME = "plan.json"
PLAN_FORMAT: Literal[1] = 1

# Who drives a plan (or launched a segment of it):
#   flow        the train-and-export flow run that wrote the plan (its own retries after a preemption included)
#   automation  a resume flow run that the preemption automation created
#   schedule    a resume flow run that the resume deployment's interval schedule created
#   resume      a resume flow run started another way (a person, the API, a script)
DriverKind = Literal["flow", "automation", "schedule", "resume"]

# running      its driver holds the plan lock and works on it now (or died doing so: the lock tells)
# handed-over  its driver was preempted more often than it may retry and left the rest to the resume automation
# stopped      a segment was preempted before it committed anything new: the schedule or a person resumes it
# failed       a segment, the validation, the export or the publish failed; a resumer tries again
# cancelled    a person cancelled it: nobody resumes it until they start it again
# completed    every segment trained, the final checkpoint exported (and published, when a target was given)
PlanStatus = Literal["running", "handed-over", "stopped", "failed", "cancelled", "completed"]
FINISHED: tuple[PlanStatus, ...] = ("completed", "cancelled")  # what no resumer continues


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Driver(_Frozen):
    """Who drove a plan or launched a segment: the kind of flow run and, where known, which one."""

    kind: DriverKind = Field(
        description="flow (the train-and-export flow run), automation, schedule or resume "
        "(a resume flow run started another way)"
    )
    flow_run_id: str | None = Field(None, description="the Prefect flow run's id")
    flow_run_name: str | None = Field(None, description="the Prefect flow run's name")
    source: str | None = Field(
        None, description="what created that flow run: the automation's name, or the deployment of a scheduled run"
    )

    def line(self) -> str:
        """``automation 'resume demo on preemption' (flow run 'resume demo', 0f3c2a1b)``: for logs and tables."""
        what = {"flow": "train-and-export", "automation": "automation", "schedule": "schedule", "resume": "resume"}[
            self.kind
        ]
        if self.source:
            what += f" {self.source!r}"
        run = ", ".join(
            x
            for x in (
                repr(self.flow_run_name) if self.flow_run_name else None,
                self.flow_run_id[:8] if self.flow_run_id else None,
            )
            if x
        )
        return f"{what} (flow run {run})" if run else what


class PlanExport(_Frozen):
    """How the final checkpoint is validated and exported (the train-and-export request's values)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="published dtype of floating tensors")
    max_shard_size: str = Field(description="largest safetensors file, e.g. 5GB")
    export_dir: str | None = Field(None, description="export folder; None: RUN_DIR/exports/step-XXXXXXXX")
    overwrite: bool = Field(True, description="replace an existing export folder (exports are byte-reproducible)")
    deep_validate: bool = Field(True, description="verify every checksum and the fingerprint before exporting")


class PlanPublish(_Frozen):
    """Where the export is published."""

    target: str = Field(description="ORG/NAME or hf://ORG/NAME for the Hub, or an fsspec URL")
    revision: str | None = Field(None, description="branch to publish to (default: main)")


class SegmentProgress(_Frozen):
    """How far one planned segment got."""

    status: Literal["pending", "completed"] = Field(
        "pending", description="completed once the run reached the segment's until_step"
    )
    end_step: int | None = Field(None, description="the step the segment ended at, once completed")
    by: list[Driver] = Field(
        default_factory=list,
        description="who launched it, in order (a preempted segment resumed by the automation lists both)",
    )


class StageDone(_Frozen):
    """The export or the publish of the plan, once done."""

    step: int = Field(ge=0, description="step of the checkpoint exported or published")
    out: str = Field(description="the export folder, or where the publish went")
    by: Driver = Field(description="who did it")
    time: str = Field(description="UTC ISO-8601")


class RunPlan(_Frozen):
    """Written when the flow run starts; rewritten whole, atomically, at every change, only by the flow run that
    holds the plan's lock (``RUN_DIR/.lock.plan``): the train-and-export flow run, or a resume flow run that took
    the plan over."""

    format: Literal[1] = Field(PLAN_FORMAT, description="version of this file's layout")
    id: str = Field(min_length=1, description="a new id for each train-and-export flow run that writes a plan")
    created: str = Field(description="UTC ISO-8601 when the plan was written")
    started_by: Driver = Field(description="the flow run that wrote it")
    segments: list[SegmentPlan] = Field(
        min_length=1, description="the segments in order, each with its own world size and placement"
    )
    export: PlanExport = Field(description="validation and export of the final checkpoint")
    publish: PlanPublish | None = Field(None, description="the publish of the export; None: no publish")
    status: PlanStatus = Field("running", description="where the plan stands (see PlanStatus)")
    note: str = Field("", description="one line: why it stands there (the preemption, the failure, who finished it)")
    driver: Driver | None = Field(None, description="who drives it now, or drove it last")
    updated: str = Field(description="UTC ISO-8601 of the last change")
    progress: list[SegmentProgress] = Field(description="one per planned segment")
    exported: StageDone | None = Field(None, description="the export, once done")
    published: StageDone | None = Field(None, description="the publish, once done")

    @model_validator(mode="after")
    def _one_progress_per_segment(self) -> RunPlan:
        if len(self.progress) != len(self.segments):
            raise ValueError(f"progress has {len(self.progress)} entries for {len(self.segments)} segments")
        return self

    @classmethod
    def from_request(cls, request: TrainExportRequest, *, plan_id: str, started_by: Driver, now: str) -> RunPlan:
        """The plan of a (resolved) train-and-export request, nothing done yet."""
        publish = (
            PlanPublish(target=request.publish_target, revision=request.publish_revision)
            if request.publish_target is not None
            else None
        )
        return cls(
            id=plan_id,
            created=now,
            updated=now,
            started_by=started_by,
            driver=started_by,
            segments=list(request.segments),
            publish=publish,
            export=PlanExport(
                dtype=request.export_dtype,
                max_shard_size=request.max_shard_size,
                export_dir=request.export_dir,
                overwrite=request.overwrite_export,
                deep_validate=request.deep_validate,
            ),
            progress=[SegmentProgress() for _ in request.segments],
        )

    @property
    def finished(self) -> bool:
        """Nothing left for a resumer: completed, or cancelled by a person."""
        return self.status in FINISHED

    def next_segment(self) -> int | None:
        """Index of the first planned segment not completed yet; None when every one is."""
        return next((i for i, p in enumerate(self.progress) if p.status != "completed"), None)

    def where(self) -> str:
        """One line: how far the plan got, e.g. ``1 of 2 segments done; export, publish to come``."""
        done = sum(1 for p in self.progress if p.status == "completed")
        left = [
            x
            for x, todo in (
                ("export", self.exported is None),
                ("publish", self.publish is not None and self.published is None),
            )
            if todo
        ]
        text = f"{done} of {len(self.segments)} segment{'s' if len(self.segments) > 1 else ''} done"
        if left:
            return f"{text}; {', '.join(left)} to come"
        out = f"; exported to {self.exported.out}" if self.exported else ""
        return text + out + (f", published to {self.published.out}" if self.published else "")
