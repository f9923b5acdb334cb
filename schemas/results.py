"""Results that stages hand to each other: segments, reshards, exports, publishes, lineage events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.run import ClusterTopology
from schemas.seam import SegmentTimes


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# cancelled: stopped on request of the orchestrator (a Prefect flow-run cancellation); its ranks
# committed a checkpoint, but no further segment may start and the resume flow leaves the run alone.
# refused: the ranks refused their input before the first step (what only a user's script knows, e.g. an HF Trainer's
# max_steps below --until-step): exit 2 like any bad input, nothing trained; the run's status stays that of the last
# segment that ran (status, the resume flow's triage and the dashboard skip it), segments.jsonl and lineage keep it.
SegmentStatus = Literal["completed", "preempted", "cancelled", "failed", "refused"]


class SegmentResult(_Frozen):
    run_dir: str = Field(description="run directory")
    status: SegmentStatus = Field(description="how the segment ended")
    exit_code: int = Field(
        description="exit code of the launcher (0 completed, 75 preempted, 130 cancelled, 65 a "
        "non-finite loss or gradient, 2 refused, other failed)"
    )
    segment: int = Field(ge=0, description="segment index within the run")
    start_step: int = Field(ge=0, description="step the segment resumed from")
    end_step: int = Field(ge=0, description="step of the last committed checkpoint")
    checkpoint: str | None = Field(None, description="path of the newest valid checkpoint after the segment")
    topology: ClusterTopology = Field(description="where it ran")
    seconds: float = Field(0.0, description="wall time")
    failure: str | None = Field(
        None, description="failing rank's last lines when status is 'failed'; the ranks' one line when it is 'refused'"
    )
    traceback: str | None = Field(
        None,
        description="a user's script that raised: its own traceback (its frames, not "
        "shardkeeper's), from the first failing rank",
    )
    note: str | None = Field(
        None,
        description="how a preempted or cancelled segment ended, e.g. that it stopped "
        "before its first step with nothing to save",
    )
    scheduler_job: str | None = Field(
        None, description="the batch scheduler's job id (Slurm), when one ran the segment"
    )
    scheduler_state: str | None = Field(None, description="the job's final state as the scheduler reported it")
    requeues: int = Field(
        0,
        ge=0,
        description="times the scheduler requeued the job (each attempt resumed from the latest valid checkpoint)",
    )
    times: SegmentTimes | None = Field(
        None, description="when the ranks reached each phase (start-up, first step, preemption), as they reported it"
    )
    restarts: int = Field(
        0,
        ge=0,
        description="times the segment's ranks were restarted in place after one died "
        "(checkpoint.restarts); each resumed from the newest memory snapshot or checkpoint",
    )
    restart_causes: list[str] = Field(
        default_factory=list,
        description="why each in-place restart happened, in order: "
        "the rank that died first and how, e.g. 'rank 1: SIGKILL'",
    )


class ReshardResult(_Frozen):
    source: str = Field(description="checkpoint resharded")
    target: str = Field(description="checkpoint to load at the new world size (the source itself for DCP)")
    from_world_size: int = Field(ge=1, description="world size at save")
    to_world_size: int = Field(ge=1, description="world size of the next segment")
    method: Literal["dcp-load-time", "deepspeed-universal", "none"] = Field(description="how it is resharded")
    seconds: float = Field(0.0, description="time spent converting")


class ExportResult(_Frozen):
    checkpoint: str = Field(description="source checkpoint")
    out_dir: str = Field(description="export folder")
    step: int | None = Field(None, description="step of the exported checkpoint, from the manifest the export read")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="published dtype of floating tensors")
    files: dict[str, str] = Field(description="file name -> sha256 of every file written")
    num_shards: int = Field(ge=1, description="number of safetensors files")
    total_bytes: int = Field(ge=0, description="bytes of tensor data written")
    num_tensors: int = Field(ge=0, description="tensors exported")
    seconds: float = Field(0.0, description="wall time")
    peak_rss_bytes: int = Field(
        0,
        description="peak resident memory (VmHWM) of the exporting process over its life so far: the export's own "
        "peak when it ran in its own process (`shardkeeper export`, the flow's export task), else bounded below by "
        "whatever the caller held before",
    )


class PublishResult(_Frozen):
    target: str = Field(description="repo id on the Hub, or an fsspec URL")
    revision: str | None = Field(None, description="branch or tag published to")
    commit: str | None = Field(None, description="commit id on the Hub, when one was created")
    url: str | None = Field(None, description="where to see it")
    skipped: bool = Field(False, description="true when the same bytes were already published (idempotent no-op)")
    files: int = Field(0, description="files uploaded")
    tag: str | None = Field(
        None, description="the step's tag on the Hub (step-XXXXXXXX): load it with from_pretrained(repo, revision=tag)"
    )
    tag_only: bool = Field(
        False,
        description="true when an older step than the newest published one was published: "
        "it got its tag, the branch was not moved backwards",
    )
    newest_step: int | None = Field(None, description="the newest step published to the repo before this one")

    def line(self) -> str:
        """What the CLI prints and the flow logs: what was uploaded, where, and whether the branch moved."""
        verb = (
            "already published (same checksums), nothing uploaded" if self.skipped else f"published {self.files} files"
        )
        where = f"{self.url or self.target}" + (f" @ {self.revision}" if self.revision else "")
        if self.tag_only:
            where += (
                f" (tag only: the repo already has the newer step {self.newest_step}; the branch was not moved back)"
            )
        elif self.tag and self.tag != self.revision:
            where += f" (tag {self.tag})"
        return f"{verb}: {where}"


class LineageEvent(_Frozen):
    id: str = Field(description="unique event id, e.g. 'checkpoint:step-00000100'")
    kind: Literal[
        "segment", "checkpoint", "resume", "reshard", "export", "publish", "validate", "eval", "nonfinite", "imported"
    ] = Field(description="what happened")
    parent: str | None = Field(None, description="id of the event this one derives from")
    time: str = Field(description="UTC ISO-8601")
    step: int | None = Field(None, description="training step it concerns")
    uri: str | None = Field(None, description="where the artifact lives (file://, s3://, hf://)")
    data: dict[str, Any] = Field(
        default_factory=dict, description="kind-specific details (world size, loss, dtype, ...)"
    )
