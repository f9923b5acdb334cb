"""CheckpointManifest and ValidationReport: what makes a step directory a checkpoint."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from schemas.data import DataRecord
from schemas.run import ClusterTopology, RunSpec

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# One path component of a checkpoint file: letters, digits and ._+=@- (DeepSpeed's universal folders are
# named after parameters, e.g. model.layers.0.mlp.up_proj.weight), never "." or "..".
_PART_RE = re.compile(r"^[A-Za-z0-9_.+=@-]{1,255}$")
MAX_PATH_DEPTH = 3  # zero/<parameter>/<key>.pt, the deepest layout shardkeeper writes


def check_relative_path(path: str) -> str:
    """``path`` if it is a plain relative POSIX path inside a checkpoint directory, else ValueError.
    Absolute paths, "..", ".", empty components, backslashes and control characters are refused."""
    if not isinstance(path, str) or not path:
        raise ValueError("empty path")
    parts = path.split("/")
    if path.startswith("/") or len(parts) > MAX_PATH_DEPTH:
        raise ValueError(f"{path!r} is not a plain relative path inside the checkpoint directory")
    for part in parts:
        if part in ("", ".", "..") or not _PART_RE.match(part):
            raise ValueError(f"{path!r} is not a plain relative path inside the checkpoint directory")
    return path


class FileEntry(_Frozen):
    path: str = Field(
        description="path relative to the checkpoint directory: plain names joined by '/', "
        "no '..', not absolute (at most 3 components)"
    )
    size: int = Field(ge=0, description="size in bytes")
    xxh3_128: str = Field(pattern=r"^[0-9a-f]{32}$", description="hex xxh3-128 digest of the whole file")
    rank: int | None = Field(None, ge=0, description="rank that wrote (and hashed) the file; None for rank-0 metadata")

    @field_validator("path")
    @classmethod
    def _confined(cls, v: str) -> str:
        return check_relative_path(v)


class TensorEntry(_Frozen):
    name: str = Field(description="fully qualified key in the checkpoint (model.*, optim.state.*)")
    shape: list[int] = Field(description="global (unsharded) shape")
    dtype: str = Field(description="torch dtype name, e.g. float32")


class Fingerprint(_Frozen):
    method: Literal["l2-per-tensor-f64", "l2-per-tensor-f64-blocked"] = Field(
        "l2-per-tensor-f64",
        description="per-tensor L2 norms accumulated in float64 over all shards: "
        "-blocked in 32,768-element blocks (written now), plain (checkpoints written before); a load "
        "recomputes the checkpoint's own method",
    )
    model: dict[str, float] = Field(description="L2 norm of each model parameter")
    optim: dict[str, float] = Field(description="L2 norm of each optimizer moment (exp_avg, exp_avg_sq) by key")
    optim_step: float = Field(description="AdamW step counter (the same for every parameter)")
    cross_world_rtol: float = Field(
        1e-9, description="relative tolerance when compared at a different world size (reduction order differs)"
    )


class DtypePolicy(_Frozen):
    """The dtypes the model was trained in, read from the live model at save (its FSDP2 MixedPrecisionPolicy,
    its DeepSpeed bf16/fp16 section, or its parameters' dtype), not from the run's config."""

    master: str = Field(
        "float32", description="torch dtype name of the weights (and optimizer state) in the checkpoint, e.g. float32"
    )
    compute: str = Field(description="torch dtype name used for forward/backward, e.g. bfloat16")
    reduce: str = Field(description="torch dtype name used for gradient reduction, e.g. float32")


class HFModelRecord(_Frozen):
    """What the export needs from transformers, recorded once from the model the trainer built, so that
    exporting a checkpoint never has to import transformers (seconds) to rebuild the model."""

    config: dict[str, Any] = Field(
        description="config.json content as save_pretrained writes it (model.config.to_json_string(use_diff=True) "
        "parsed), with architectures set to the model class name, e.g. ['LlamaForCausalLM']; the export sets dtype"
    )
    generation_config: dict[str, Any] | None = Field(
        None,
        description="generation_config.json content (GenerationConfig.from_model_config(config), diff form); "
        "None when it could not be built (the export then rebuilds the model with transformers)",
    )
    tied: dict[str, str] = Field(
        default_factory=dict,
        description="tied state_dict name -> the name it is tied to "
        "(e.g. lm_head.weight -> model.embed_tokens.weight); empty when nothing is tied",
    )
    transformers_version: str = Field(description="transformers version that built the model and wrote this record")


class BaseModelRecord(_Frozen):
    """The pretrained model a run started from (model.pretrained), recorded by the first segment and carried by
    every later checkpoint of the run: resumes load the checkpoint, never these weights again."""

    source: str = Field(description="model.pretrained as given: a local folder or a Hub id")
    revision: str | None = Field(None, description="model.revision as given (Hub ids only)")
    resolved_revision: str | None = Field(None, description="the Hub commit the cache resolved it to (Hub ids only)")
    local_path: str = Field(description="the folder the weights were read from (the cache snapshot for a Hub id)")
    hub_id: str | None = Field(
        None,
        description="the Hub id of the base model, for the model card: the source "
        "itself for a Hub id, else model.base_model_id",
    )
    weights: dict[str, str] = Field(description="weight file name -> sha256 of its bytes")
    weights_bytes: int = Field(ge=0, description="total size of the weight files")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="config, generation config and tokenizer file "
        "name -> sha256, as they were when training started (the export checks what it carries)",
    )


class CheckpointManifest(_Frozen):
    schema_version: int = Field(MANIFEST_SCHEMA_VERSION, description="manifest format version")
    format: Literal["dcp", "deepspeed"] = Field(description="on-disk layout of the tensors")
    run_name: str = Field(description="RunSpec.name of the run that wrote it")
    step: int = Field(ge=0, description="optimizer steps completed")
    tokens: int = Field(ge=0, description="training tokens consumed")
    samples: int = Field(ge=0, description="training samples consumed (the data loader position)")
    segment: int = Field(ge=0, description="index of the training segment that wrote it")
    reason: Literal["interval", "preempted", "end", "converted"] = Field(description="why it was written")
    created_at: str = Field(description="UTC ISO-8601 time of the commit")
    files: list[FileEntry] = Field(description="every file of the checkpoint, with size and checksum")
    tensors: list[TensorEntry] = Field(description="inventory of the tensors saved")
    model_signature: str = Field(
        description="sha256 of the model tensors' canonical names, global shapes and dtypes "
        "(ckpt.commit.identity.signature): the same for every kind of run and both backends; "
        "older checkpoints carry another digest. Recorded, never compared: a resume "
        "compares the tensors themselves"
    )
    topology: ClusterTopology = Field(description="where it was written")
    dtype_policy: DtypePolicy = Field(description="dtypes at save")
    parent: str | None = Field(None, description="name of the checkpoint this run resumed from before writing it")
    code_version: str = Field(description="shardkeeper version (and git commit when known)")
    fingerprint: Fingerprint = Field(description="cheap digest of model and optimizer state, checked after every load")
    run_spec: RunSpec = Field(description="the RunSpec that produced it")
    save_seconds: float = Field(0.0, ge=0, description="wall time from the start of the save to the commit")
    async_save: bool = Field(False, description="written in the background")
    hf_model: HFModelRecord | None = Field(
        None,
        description="transformers config, generation config and ties of the model, recorded at save for the "
        "export; None in checkpoints written before it was recorded (the export then rebuilds the model)",
    )
    data: DataRecord | None = Field(
        None,
        description="the dataset and tokenizer the run trains on (content key and what it is made of), for "
        "data.source 'dataset'; a resume refuses a checkpoint whose key differs from the data prepared now",
    )
    base_model: BaseModelRecord | None = Field(
        None,
        description="the pretrained model the run started from (model.pretrained); None for a run started "
        "from random weights",
    )
    source_world_size: int | None = Field(
        None,
        ge=1,
        description="a converted checkpoint (reason 'converted'): the world size of the training "
        "checkpoint it was converted from (its topology is the conversion's: one process); None otherwise",
    )
    run_id: str | None = Field(
        None,
        description="the random id of the run that wrote it (RUN_DIR/.run-id): a memory snapshot is persisted "
        "and resumed only by that run; None in checkpoints written before it was recorded",
    )

    @field_validator("source_world_size")
    @classmethod
    def _only_converted(cls, v: int | None, info: ValidationInfo) -> int | None:
        # a conversion's record: on any other checkpoint it would be a false claim about where the state was trained
        reason = info.data.get("reason")
        if v is not None and reason != "converted":
            raise ValueError(f"{v} on a checkpoint whose reason is {reason!r}: only a converted checkpoint records one")
        return v


class ValidationReport(_Frozen):
    path: str = Field(description="checkpoint directory checked")
    valid: bool = Field(description="true when every check passed")
    deep: bool = Field(description="checksums of every byte and the fingerprint were verified")
    step: int | None = Field(None, description="step of the checkpoint, when the manifest could be read")
    errors: list[str] = Field(default_factory=list, description="one line per problem, naming the file and the cause")
    files_checked: int = Field(0, description="files whose size (and with deep, checksum) was verified")
    bytes_checked: int = Field(0, description="bytes hashed (deep only)")
    seconds: float = Field(0.0, description="time the validation took")
    retired: bool = Field(
        False,
        description="true when the checkpoint was retired or quarantined by a writer while "
        "it was being read (or before): no verdict on its bytes, never recorded "
        "as invalid",
    )
