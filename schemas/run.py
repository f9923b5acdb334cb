"""RunSpec: everything that determines a training run, and ClusterTopology: where a segment runs.

These are the contracts between stages; they import neither torch nor prefect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

# The most optimizer steps a run, a schedule or a segment may name: far beyond any real run, far below what the
# int64 step/sample counters of a checkpoint hold (2**63 - 1), so a typo such as --until-step 1e15 is refused.
MAX_STEPS = 10**12


class _Frozen(BaseModel):
    # allow_inf_nan=False: an lr of .inf trains NaN weights into a checkpoint; refuse it as a field error.
    # strict=True: a value is taken as typed (see RunSpec's docstring): an integer field refuses true, "8" and 2.5,
    # a boolean field refuses 1 and "yes", a string field refuses numbers; a number (float) field takes integers.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


def control_chars(value: str) -> list[str]:
    """The control characters (C0 and DEL) in ``value``, each once, as repr()s: a newline in a path ends a line
    of a generated batch script, manifest or log, so no path a person gives may hold one."""
    return [repr(c) for c in sorted({c for c in value if ord(c) < 32 or ord(c) == 127})]


def plain_path(value: str | None, what: str) -> str | None:
    """``value`` unless it holds control characters (ValueError naming ``what``)."""
    bad = control_chars(value) if value is not None else []
    if bad:
        raise ValueError(f"{what} {value!r}: contains control characters ({', '.join(bad)}); use a plain path")
    return value


# What model.config may change in a pretrained model's config: settings that do not change the weights' names
# or shapes (regularisation, positions, attention kernel). Anything else would not match the weight files.
PRETRAINED_OVERRIDES = frozenset(
    {
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "summary_dropout",
        "rope_scaling",
        "rope_parameters",
        "rope_theta",
        "max_position_embeddings",
        "sliding_window",
        "use_cache",
        "attn_implementation",
        "initializer_range",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
    }
)


class ModelSpec(_Frozen):
    model_type: str = Field(
        "llama",
        description="transformers model type, as in AutoConfig.for_model (llama, qwen2, mistral, ...); "
        "with model.pretrained it is taken from the pretrained config.json when not given",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the transformers config (hidden_size, num_hidden_layers, vocab_size, ...); "
        "with model.pretrained only overrides of: " + ", ".join(sorted(PRETRAINED_OVERRIDES)),
    )
    pretrained: str | None = Field(
        None,
        description="start from these weights: a local save_pretrained folder (config.json + *.safetensors) "
        "or a Hugging Face Hub model id (ORG/NAME, resolved through the huggingface_hub cache); the first "
        "segment loads them, resumes load the checkpoint",
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) of model.pretrained; only for a Hub id"
    )
    base_model_id: str | None = Field(
        None,
        description="Hub id recorded as base_model in the model card when model.pretrained is a local folder "
        "(e.g. the id it was downloaded from); a Hub id in model.pretrained is recorded as itself",
    )

    @field_validator("pretrained", "revision", "base_model_id")
    @classmethod
    def _not_blank(cls, v: str | None, info: Any) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(f"model.{info.field_name} is blank; set it or remove it")
        return plain_path(v, f"model.{info.field_name}")

    @field_validator("config")
    @classmethod
    def _vocab_size(cls, v: dict[str, Any]) -> dict[str, Any]:
        vocab = v.get("vocab_size")
        if "vocab_size" in v and (type(vocab) is not int or vocab < 2):
            raise ValueError(
                f"model.config.vocab_size {vocab!r}: must be a whole number of at least 2 (a language "
                "model chooses among tokens); set it to the tokenizer's size, e.g. 32000"
            )
        return v

    @model_validator(mode="after")
    def _pretrained_overrides(self) -> ModelSpec:
        if self.pretrained is None:
            if self.revision is not None:
                raise ValueError(
                    "model.revision is set without model.pretrained; set model.pretrained to a Hub id "
                    "or remove model.revision"
                )
            return self
        bad = sorted(k for k in self.config if k not in PRETRAINED_OVERRIDES)
        if bad:
            raise ValueError(
                f"model.config.{bad[0]} cannot override the architecture of model.pretrained "
                f"(the weights fix it); remove it (overridable: {', '.join(sorted(PRETRAINED_OVERRIDES))})"
            )
        return self


class DataSpec(_Frozen):
    source: Literal["synthetic", "tokens", "dataset"] = Field(
        "synthetic",
        description="'synthetic': a deterministic generated corpus; 'tokens': a flat token file (.bin uint16/uint32 "
        "or .npy); 'dataset': a text or chat dataset (data.dataset), tokenized once into a cached token file",
    )
    path: str | None = Field(None, description="token file for source='tokens' (.bin or .npy, memory-mapped)")
    dtype: Literal["uint16", "uint32", "int32", "int64"] = Field(
        "uint16", description="element type of a raw .bin token file (ignored for .npy)"
    )
    seq_len: int = Field(64, gt=1, description="tokens per training sample (inputs; one more is read for labels)")
    synthetic_tokens: int = Field(1 << 20, gt=1024, description="length of the generated corpus for source='synthetic'")
    dataset: str | None = Field(
        None,
        description="for source='dataset': a local .json/.jsonl/.parquet/.txt/.csv file, a folder of them "
        "(splits from the file names: train.jsonl, validation.jsonl, ...), or a Hugging Face Hub dataset id",
    )
    split: str = Field("train", min_length=1, description="split to train on; slices work, e.g. 'train[:95%]'")
    format: Literal["text", "chat"] = Field(
        "text",
        description="'text': every row's text_column, concatenated with EOS between documents; 'chat': "
        "every row's messages_column rendered by the tokenizer's chat template, loss on assistant tokens only",
    )
    text_column: str = Field("text", min_length=1, description="column holding the text (format 'text')")
    messages_column: str = Field(
        "messages",
        min_length=1,
        description="column holding the conversation, a list of {role, content} (format 'chat')",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer folder or Hub id; default: model.pretrained (the base model's tokenizer)"
    )
    append_eos: bool = Field(True, description="format 'text': end every document with the tokenizer's EOS token")

    @field_validator("path", "dataset", "tokenizer")
    @classmethod
    def _not_blank(cls, v: str | None, info) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(f"data.{info.field_name} is blank; set it or remove it")
        return plain_path(v, f"data.{info.field_name}")

    @model_validator(mode="after")
    def _path_for_tokens(self) -> DataSpec:
        if self.source == "tokens" and not self.path:
            raise ValueError("data.path is required when data.source is 'tokens'; set it to a .bin or .npy token file")
        if self.source == "dataset" and not self.dataset:
            raise ValueError(
                "data.dataset is required when data.source is 'dataset'; set it to a .jsonl/.json/"
                ".parquet/.txt file, a folder of them, or a Hub dataset id"
            )
        return self


class EvalSpec(_Frozen):
    interval: int = Field(gt=0, description="compute the held-out loss after every this many optimizer steps")
    batches: int = Field(1, gt=0, description="held-out batches per evaluation (always the same ones, in order)")
    split: str = Field(
        "validation",
        min_length=1,
        description="split of data.dataset to evaluate on, e.g. 'validation' or 'train[95%:]'",
    )
    batch_size: int | None = Field(
        None,
        gt=0,
        description="samples per held-out batch, over all ranks; "
        "null = global_batch_size (must divide by the world size)",
    )


class OptimSpec(_Frozen):
    name: Literal["adamw"] = Field("adamw", description="optimizer; AdamW is the one the checkpoint contract covers")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    # a YAML or JSON list ([0.9, 0.95]) is the way to write a pair: the pair itself is lax, its numbers strict
    betas: tuple[Annotated[float, Strict()], Annotated[float, Strict()]] = Field(
        (0.9, 0.95), strict=False, description="AdamW betas, a list of two numbers"
    )
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="max global L2 norm of gradients; null disables clipping")
    on_nonfinite: Literal["stop", "skip_step"] = Field(
        "stop",
        description="a step whose loss or global gradient norm is NaN/Inf is never applied nor "
        "committed: 'stop' ends the segment there (failed, exit 65; the newest checkpoint stays the resume point); "
        "'skip_step' drops that update (no optimizer step; data and LR schedule move on), counts it (metrics.jsonl "
        'row "skipped": true) and stops only after optim.max_skipped such steps in a row; may change between segments',
    )
    max_skipped: int = Field(
        5,
        ge=0,
        strict=True,
        description="with on_nonfinite 'skip_step': at most this many non-finite steps in a row "
        "are skipped; the next one in a row stops the segment as 'stop' would (0: never skip)",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"AdamW betas {list(v)} must each be in [0, 1), e.g. [0.9, 0.95]")
        return v


class ScheduleSpec(_Frozen):
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS, description="linear warm-up steps from 0 to the peak LR")
    total_steps: int = Field(
        1000,
        gt=0,
        le=MAX_STEPS,
        description="steps over which the cosine decays to min_lr_ratio * lr; at least warmup_steps",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR as a fraction of the peak LR")

    @model_validator(mode="after")
    def _warmup_within_total(self) -> ScheduleSpec:
        if self.total_steps < self.warmup_steps:
            raise ValueError(
                f"schedule.total_steps {self.total_steps} is less than schedule.warmup_steps "
                f"{self.warmup_steps} (the LR would never reach its peak); raise total_steps or lower "
                "warmup_steps"
            )
        return self


class PrecisionSpec(_Frozen):
    compute: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of forward/backward; master weights and optimizer state stay fp32 either way"
    )
    reduce: Literal["fp32", "bf16"] = Field("fp32", description="dtype of gradient reduction")


class CheckpointPolicy(_Frozen):
    interval: int = Field(50, gt=0, description="commit a checkpoint every this many optimizer steps")
    async_save: bool = Field(False, description="write checkpoints in the background (at most one in flight)")
    keep_last: int = Field(3, ge=1, description="keep the newest k valid checkpoints")
    keep_every: int | None = Field(
        None, gt=0, description="also keep every checkpoint whose step is a multiple of this (milestones)"
    )
    io_threads: int = Field(2, ge=1, le=16, description="writer threads per rank")
    background_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU niceness of an async save's background threads (write, hashing, "
        "fingerprint, the re-read after a commit; Linux): where training keeps every core busy, the save takes "
        "the time training leaves idle instead of slowing its steps; 0 = training's own priority. Sync and "
        "emergency saves run on the training thread, at its priority",
    )
    memory_interval: int | None = Field(
        None,
        gt=0,
        description="also snapshot the state into host shared memory every this many optimizer steps "
        "(the memory tier; null = off): each snapshot is a checkpoint under the same commit protocol (manifest, "
        "checksums, fingerprint, atomic rename) in memory_dir, costs training one copy of the state (written in "
        "the background like an async save) and outlives the rank processes, so a segment restarted on the same "
        "node after a rank crash resumes from it without reading storage; the newest one or two are kept. Storage "
        "checkpoints (interval) are then persisted from the snapshot of their step in the background, and a "
        "snapshot newer than storage is persisted by the launcher when a segment dies (also by a later segment "
        "that runs with the memory tier off or another memory_dir, which then removes the dir it left)",
    )
    restarts: int = Field(
        3,
        ge=0,
        le=100,
        description="how many times a segment restarts its ranks in place when one of them dies "
        "while its node lives (killed by a signal: SIGKILL, the OOM killer, a segfault, an abort; or a collective "
        "that timed out or lost its peer because of such a death): the launcher does not exit and keeps the run "
        "lock, the node's agent starts the ranks again (from a fork server that has imported torch already) and "
        "they resume from the newest memory snapshot (else storage's newest checkpoint); each restart is recorded "
        "in lineage and segments.jsonl. An error of the rank's own (a Python exception, bad input, a non-finite "
        "loss, an exit code) is never restarted: it would fail again. After this many restarts the segment fails "
        "as it would without any; 0 = never restart (the segment ends at the first death)",
    )
    memory_dir: str | None = Field(
        None,
        min_length=1,
        description="where the memory tier keeps its snapshots, on a RAM-backed file system "
        "(tmpfs); null = /dev/shm/shardkeeper/<run name>-<hash of its run directory>. Needs room "
        "for three snapshots of every rank on the node (two kept, one being written; preflight checks it), and a "
        "directory of the run's own: never a run directory (preflight refuses one), and a non-empty directory that "
        "is not a memory tier is never used nor emptied",
    )

    @field_validator("memory_dir")
    @classmethod
    def _plain_memory_dir(cls, v: str | None) -> str | None:
        return plain_path(v, "checkpoint.memory_dir")


class DeepSpeedSpec(_Frozen):
    zero_stage: Literal[1, 2, 3] = Field(2, description="ZeRO stage for backend='deepspeed'")

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _whole_number(cls, v: Any) -> Any:
        if type(v) is not int:  # a Literal of ints takes true (== 1) and 2.0 (== 2) even in strict mode
            raise ValueError(f"deepspeed.zero_stage {v!r}: write 1, 2 or 3 (a whole number, no quotes)")
        return v


class PerformanceSpec(_Frozen):
    """How the ranks execute the same math: faster or leaner, never a different model, data order or optimizer
    update rule. A resume may switch any of these on or off (they are not part of the run's identity); each is
    off by default and recorded in the segment's diagnostics (log lines, the segment report, its lineage event)."""

    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder block's forward during backward instead of keeping its "
        "activations (non-reentrant torch.utils.checkpoint per block, parameter names unchanged): activation "
        "memory drops from every layer's to one block's inputs per layer, for about one more forward (~+30% step time)",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder block's forward (in place, before sharding, names "
        "unchanged): fused elementwise kernels and fewer launches on GPUs, for a compilation at the start of every "
        "segment (seconds to minutes); needs a C++ compiler (CPU) or Triton (CUDA); not with deepspeed.zero_stage 3",
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode of performance.compile ('max-autotune*' compile longer)"
    )
    compile_backend: str = Field(
        "inductor",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="torch.compile backend of performance.compile (inductor; aot_eager to debug)",
    )
    adamw_implementation: Literal["foreach", "fused", "for-loop"] = Field(
        "foreach",
        description="torch.optim.AdamW implementation: 'foreach' (one batched op per step over all of a rank's "
        "parameters; temporaries as large as the rank's shards), 'fused' (one fused kernel, fastest on GPUs, no "
        "large temporaries), 'for-loop' (one parameter at a time: the smallest host-memory temporaries, slowest)",
    )


class ScriptSpec(_Frozen):
    """A user's training script run as the segment's ranks (``shardkeeper train --script``): it trains with the
    public API (``shardkeeper.Segment``); the model, data, optim, schedule, precision and eval sections and the batch
    geometry (global_batch_size, micro_batch_size) do not apply: the script builds its own model and splits its own
    batches, so a script run trains at any world size (``RunSpec.world_size_refusal``)."""

    path: str = Field(
        min_length=1,
        description="the Python script every rank runs as __main__: an absolute path (made "
        "so by shardkeeper train), or one relative to the ranks' working directory (a path in a container image)",
    )
    args: list[str] = Field(default_factory=list, description="its command-line arguments (sys.argv[1:])")

    @field_validator("path")
    @classmethod
    def _plain(cls, v: str) -> str:
        return plain_path(v, "script.path")  # type: ignore[return-value]


# What a script run (RunSpec.script set) never reads: its script builds its own data and batches, LR schedule and
# precision, and the performance options are the built-in trainer's. A --set of one of them is refused for a script
# run (it would change nothing), and a change of them between two segments of a script run is no change of the run.
SCRIPT_UNUSED = ("global_batch_size", "micro_batch_size", "data", "schedule", "precision", "eval", "performance")


class RunSpec(_Frozen):
    """Everything that determines a training run. Values are taken as typed, never converted: an integer key
    (seed, global_batch_size, checkpoint.interval, ...) takes a whole number only (not `true`, `"8"` or `2.0`); a
    boolean key takes only `true` or `false` (not `yes`, `on` or `1`: the YAML reader follows YAML 1.2, where
    `yes` is a string); a string key refuses numbers (quote them: `name: "123"`); a number key (optim.lr,
    schedule.min_lr_ratio, ...) takes decimals and integers alike (`lr: 1` is 1.0), in any notation (`1e-3`).
    `--set KEY=VALUE` reads VALUE by the same YAML rules: `--set seed=7` is an integer, `--set seed=true` is
    refused. A key given twice in one YAML mapping is refused with its line."""

    name: str = Field(
        "run", min_length=1, pattern=r"\S", description="human name of the run (shown in lineage and model cards)"
    )
    backend: Literal["fsdp2", "deepspeed"] = Field("fsdp2", description="sharding backend")
    seed: int = Field(1234, ge=0, lt=2**63, description="seed of initialisation and of the global sample order")
    global_batch_size: int = Field(
        8,
        gt=0,
        description="samples per optimizer step, over all ranks (the built-in "
        "trainer; a script run splits its own batches and does not use it)",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="samples per rank per forward pass (gradient accumulation); null = all of the rank's share",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="the model")
    data: DataSpec = Field(default_factory=DataSpec, description="the data")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="the optimizer")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="the LR schedule")
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec, description="compute/reduce dtypes")
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy, description="checkpoint policy")
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec, description="DeepSpeed options")
    performance: PerformanceSpec = Field(
        default_factory=PerformanceSpec,
        description="execution options (activation checkpointing, torch.compile, "
        "AdamW kernel): same math, may change between segments",
    )
    eval: EvalSpec | None = Field(
        None,
        description="held-out loss and perplexity every eval.interval steps "
        "(data.source 'dataset' only); null = no evaluation",
    )
    script: ScriptSpec | None = Field(
        None,
        description="train with a user's script instead of the built-in trainer (shardkeeper train --script); "
        "null = the built-in language-model trainer",
    )

    @model_validator(mode="after")
    def _eval_needs_dataset(self) -> RunSpec:
        if self.eval is not None and self.data.source != "dataset":
            raise ValueError(
                f"eval needs a held-out split of a dataset, but data.source is {self.data.source!r}; "
                "set data.source: dataset (with data.dataset) or remove the eval section"
            )
        return self

    def eval_batch(self) -> int:
        """Samples per held-out batch over all ranks."""
        return (self.eval.batch_size if self.eval and self.eval.batch_size else None) or self.global_batch_size

    def world_size_refusal(self, world_size: int, *, choose: str = "--nproc") -> str | None:
        """Why the next segment of this run cannot train on ``world_size`` ranks (one line naming the field and the
        fix), or None when it can. The one home of the batch rule: every stage that places or prepares a segment
        (``train``'s topology plan and preflight, ``reshard``, the flows, the schedule, the automation, Kubernetes
        manifests) asks this method of the run's own record, never a config default.

        The built-in trainer splits ``global_batch_size`` (and ``eval.batch_size``) evenly over the ranks, and
        ``micro_batch_size`` must divide each rank's share. A script run (``script`` set) has no batch of
        shardkeeper's: the script splits its own batches, so every world size of at least 1 is allowed (its
        ``global_batch_size`` is an unused default). ``choose``: how the message names what the user picks
        (``--nproc``, ``--world-size``, ``--nodes x --nproc``)."""
        if world_size < 1:
            return "a world size must be at least 1 rank"
        if self.script is not None:
            return None
        if self.global_batch_size % world_size:
            return (
                f"global_batch_size {self.global_batch_size} is not divisible by {world_size} ranks; "
                f"choose {choose} among {divisors(self.global_batch_size)} or change global_batch_size"
            )
        if self.eval is not None and self.eval.batch_size and self.eval.batch_size % world_size:
            return (
                f"eval.batch_size {self.eval.batch_size} is not divisible by {world_size} ranks; "
                f"choose {choose} among {divisors(self.eval.batch_size)} or change eval.batch_size"
            )
        local = self.global_batch_size // world_size
        micro = self.micro_batch_size or local
        if local % micro:
            return (
                f"micro_batch_size {micro} does not divide the per-rank batch {local} at {world_size} ranks; "
                "set micro_batch_size to a divisor of it or null"
            )
        return None

    def per_rank_batch(self, world_size: int) -> int:
        """Samples each rank of the built-in trainer processes per optimizer step; raises ValueError (the line of
        ``world_size_refusal``) if the batch does not split over ``world_size`` ranks. Not for a script run: its
        script splits its own batches (ValueError)."""
        if self.script is not None:
            raise ValueError("a script run has no per-rank batch of shardkeeper's: its script splits its own batches")
        problem = self.world_size_refusal(world_size)
        if problem is not None:
            raise ValueError(problem)
        return self.global_batch_size // world_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ClusterTopology(_Frozen):
    nodes: int = Field(1, ge=1, description="number of nodes")
    procs_per_node: int = Field(1, ge=1, description="ranks per node")
    device_type: Literal["cpu", "cuda"] = Field("cpu", description="device each rank computes on")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="collective backend")
    launcher: Literal["local", "slurm", "kubernetes"] = Field("local", description="how the ranks are started")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node
