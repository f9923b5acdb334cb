"""Checks a training segment on the controller before anything is written or any rank starts.

``preflight`` refuses, with one line naming the field or file and the fix, what would otherwise
fail on every rank after ``run.yaml`` was written (so that the corrected command is then refused
too) or be OOM-killed minutes later: a run directory that cannot be one, a device that is not
there, a model config transformers would not build as meant, a token file that does not fit the
model, a dataset that cannot be trained on (``trainer.builtin.prepare``: missing column, empty split, chat row
without an assistant turn, tokenizer larger than the embeddings; the dataset is tokenized here, into
the data cache outside the run directory), and a model whose training state cannot fit in memory.

The memory estimate is a documented *lower bound* of what a rank must hold, so a refusal is
certain and a run that passes may still need more (allocator slack, the all-gathered block,
communication buffers):

* training state per rank: parameters x 16 B (4 B fp32 master + 4 B fp32 gradient + 8 B AdamW
  moments) / world size for FSDP2 and ZeRO-3; ZeRO-2 keeps the 4 B parameters whole on each rank,
  ZeRO-1 the parameters and the gradients;
* activations of one micro-batch: tokens x layers x (8 x hidden + 4 x intermediate) values
  saved for backward, plus fp32 logits and their gradient (tokens x vocab x 8 B); with
  ``performance.activation_checkpointing`` each block keeps only its input (tokens x layers x hidden) and
  one block's activations are live at a time while it is recomputed (tokens x (8 x hidden + 4 x intermediate));
* every rank first builds the whole model on the host in fp32 (parameters x 4 B) before sharding, except
  a pretrained model under FSDP2 (meta device, then each rank reads its own shards).

Available memory: ``torch.cuda.mem_get_info`` of each local GPU; on the host MemAvailable (psutil
when installed, else /proc/meminfo), capped by the cgroup limit. Ranks of one node share the host.
``SHARDKEEPER_MEMORY_CHECK=0`` skips the memory check (not the others).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt.commit.layout import RunDir
from schemas import MANIFEST_NAME, ClusterTopology, PreparedData, RunSpec
from schemas.errors import ConfigError, RunDirError
from shardkeeper.config import check_model_config, quiet_transformers

if TYPE_CHECKING:
    from ckpt.pretrained import StoredTensor

log = logging.getLogger("shardkeeper")

GIB = 1 << 30
STATE_BYTES = {"master": 4, "grad": 4, "adamw": 8}
DEVICES = ("auto", "cpu", "cuda")


def preflight(spec: RunSpec, topology: ClusterTopology, run_dir: str | Path) -> PreparedData | None:
    """Raise a ShardkeeperError (one line) if the segment cannot run; writes nothing in the run directory.
    A ``data.source: dataset`` is tokenized here (once; then found in the data cache): what it returns is handed
    to the ranks, which only open the token files."""
    if not str(run_dir).strip():  # Path("") is the current directory: never train into it by accident
        raise RunDirError("--run-dir '': empty path; pass the run directory, e.g. --run-dir runs/my-run")
    bad = sorted({c for c in str(run_dir) if ord(c) < 32 or ord(c) == 127})
    if bad:  # a newline in a path ends a line of a generated batch script or manifest: never a run directory
        raise RunDirError(
            f"--run-dir {str(run_dir)!r}: contains control characters ({', '.join(map(repr, bad))}); use a plain path"
        )
    check_run_dir(Path(run_dir))
    check_environment(topology)
    if spec.script is not None:  # the script builds its own model and data: the run's own sections do not apply
        check_script(spec.script.path)
        check_memory_tier(spec, topology, run_dir, None)
        return None
    problem = spec.world_size_refusal(topology.world_size)
    if problem is not None:
        raise ConfigError(f"world size {topology.world_size}: {problem}")
    from shardkeeper import _model_facts

    facts_key = _model_facts.key(spec)
    cfg: Any = _model_facts.load(facts_key, spec)  # the same model section checked before: its numbers, no transformers
    if cfg is not None:
        params = cfg.params
    else:
        cfg = check_model_config(spec)
        model = meta_model(spec, cfg)
        params = sum(p.numel() for p in model.parameters())
        if spec.model.pretrained is not None:
            # a run that has a checkpoint resumes from it and never reads the pretrained weights again
            check_pretrained(spec, cfg, model, weights=not RunDir(Path(run_dir)).committed())
        _model_facts.store(facts_key, params, cfg)
    check_performance(spec, topology)
    prepared = check_data(spec, cfg.vocab_size)
    check_memory(spec, topology, params, cfg)
    check_memory_tier(spec, topology, run_dir, params)
    return prepared


def check_memory_tier(spec: RunSpec, topology: ClusterTopology, run_dir: str | Path, params: int | None) -> None:
    """checkpoint.memory_interval: a writable tmpfs, no run directory, with room for three snapshots of each rank on
    this node (fp32 masters + AdamW moments, as fsdp2 shards them, x1.3); the file system only where the ranks run here
    (the local launcher)."""
    if spec.checkpoint.memory_interval is None:
        return
    from ckpt.memtier.tier import check_memory_tier as check

    state = None if params is None else params * (STATE_BYTES["master"] + STATE_BYTES["adamw"]) / topology.world_size
    check(
        spec,
        RunDir.at(run_dir),
        state_bytes=state,
        ranks_on_node=topology.procs_per_node * (2 if topology.nodes > 1 else 1),  # + the peer node's copy
        here=topology.launcher == "local",
    )


def check_script(path: str) -> None:
    """A user's training script: a readable Python file that compiles (a SyntaxError is found here, not on every
    rank after the launch)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--script {path}: no such file; pass the path of your training script")
    if not p.is_file():
        raise ConfigError(f"--script {path}: not a regular file; pass the path of your training script (a .py file)")
    if p.suffix != ".py":
        raise ConfigError(
            f"--script {path}: not a Python script (.py); shardkeeper runs Python training scripts "
            "that use shardkeeper.Segment"
        )
    try:
        source = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"--script {path}: cannot be read ({e.strerror}); fix its permissions") from None
    try:
        compile(source, str(p), "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ConfigError(f"--script {path} line {e.lineno}: SyntaxError: {e.msg}; fix the script") from None
    except ValueError as e:  # null bytes
        raise ConfigError(f"--script {path}: not Python source ({e}); pass a .py training script") from None


def check_performance(spec: RunSpec, topology: ClusterTopology) -> None:
    """performance: combinations torch cannot run. What depends on the machine (a C++ compiler, Triton, a fused
    AdamW kernel for the device) is checked here only for the local launcher: on Slurm or Kubernetes nodes the
    ranks meet the same condition."""
    perf = spec.performance
    if perf.compile:
        if spec.backend == "deepspeed" and spec.deepspeed.zero_stage == 3:
            raise ConfigError(
                "performance.compile with deepspeed.zero_stage 3: ZeRO-3 gathers each parameter in "
                "hooks that torch.compile cannot trace; use backend fsdp2, zero_stage 1 or 2, or "
                "performance.compile: false"
            )
        if perf.compile_backend != "inductor" and perf.compile_mode != "default":
            raise ConfigError(
                f"performance.compile_mode {perf.compile_mode!r} is an inductor option, but "
                f"performance.compile_backend is {perf.compile_backend!r}; remove compile_mode or "
                "use compile_backend: inductor"
            )
        import torch  # first, whole: a submodule import may race a first import of torch in another thread
        import torch._dynamo
        from torch._dynamo.backends.registry import list_backends

        if not torch._dynamo.is_dynamo_supported():
            raise ConfigError(
                "performance.compile: torch.compile does not run on this Python/platform "
                f"(torch {torch.__version__}); set performance.compile: false"
            )
        known = list_backends(exclude_tags=())
        if perf.compile_backend not in known:
            raise ConfigError(
                f"performance.compile_backend {perf.compile_backend!r}: not a torch.compile backend; "
                "use inductor (or aot_eager to debug)"
            )
        if topology.launcher == "local" and perf.compile_backend == "inductor":
            check_inductor(topology.device_type)
    if perf.adamw_implementation == "fused" and topology.launcher == "local":
        import torch  # noqa: F401  (first, whole: see above)
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        if topology.device_type not in _get_fused_kernels_supported_devices():
            raise ConfigError(
                f"performance.adamw_implementation fused: this torch has no fused AdamW kernel for "
                f"{topology.device_type} parameters; use foreach or for-loop"
            )


def check_inductor(device_type: str) -> None:
    """Inductor compiles C++ on the CPU and Triton kernels on CUDA: either must be there."""
    import torch  # noqa: F401  (first, whole: a submodule import may race a first import of torch in another thread)

    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "performance.compile on CUDA needs Triton (torch.compile's inductor writes Triton "
                "kernels); pip install triton, or set performance.compile: false"
            )
        return
    from torch._inductor import config as inductor_config

    search = (
        inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, (list, tuple)) else (inductor_config.cpp.cxx,)
    )
    import shutil

    if not any(c and shutil.which(c) for c in search):
        names = ", ".join(str(c) for c in search if c) or "g++"
        raise ConfigError(
            f"performance.compile on CPU needs a C++ compiler (inductor looks for {names}; set CXX "
            "to one); install g++, or set performance.compile: false"
        )


def check_run_dir(run_dir: Path) -> None:
    """The run directory is a directory, or can be created: its nearest existing ancestor is a writable directory."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(
            f"{run_dir}: run directory is a file, not a directory; pass a directory path (it is created if missing)"
        )
    probe = run_dir if run_dir.exists() else next((p for p in run_dir.absolute().parents if p.exists()), Path("/"))
    if not probe.is_dir():
        raise RunDirError(f"{run_dir}: cannot create the run directory: {probe} is a file; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"{run_dir}: cannot write in {probe} (permission denied); choose a writable run directory")
    for parent in [run_dir.absolute(), *run_dir.absolute().parents]:  # never write inside a committed checkpoint
        if (
            (parent / MANIFEST_NAME).is_file()
            or parent.name.endswith(".partial")
            and parent.parent.name == "checkpoints"
        ):
            raise RunDirError(
                f"{run_dir}: lies inside the checkpoint {parent}; writing there would corrupt it, "
                "choose a run directory outside every checkpoint"
            )
    spec_path = RunDir(run_dir).spec_path
    if spec_path.exists() and not spec_path.is_file():
        raise RunDirError(f"{spec_path}: is not a file; remove it or choose another run directory")


def check_environment(topology: ClusterTopology) -> None:
    """Variables the launcher and the ranks read: a bad value would fail on every rank."""
    want = os.environ.get("SHARDKEEPER_DEVICE", "")
    if want and want not in DEVICES:
        raise ConfigError(f"SHARDKEEPER_DEVICE={want!r}: choose one of {', '.join(DEVICES)} or unset it")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not (threads.strip().isdigit() and int(threads) >= 1):
        raise ConfigError(
            f"OMP_NUM_THREADS={threads!r}: must be a positive integer; set e.g. OMP_NUM_THREADS=1 or unset it"
        )
    if topology.launcher != "local":  # the ranks run on the scheduler's nodes, not here: the launcher checks those
        return
    if topology.device_type == "cuda" or want == "cuda":
        gpus = cuda_device_count()
        if gpus == 0:
            src = "SHARDKEEPER_DEVICE=cuda" if want == "cuda" else "device cuda"
            raise ConfigError(
                f"{src}: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                "use --device cpu (or unset SHARDKEEPER_DEVICE)"
            )
        if topology.device_type == "cuda" and topology.procs_per_node > gpus:
            raise ConfigError(
                f"--nproc {topology.procs_per_node}: more ranks than GPUs on this node ({gpus}); use --nproc <= {gpus}"
            )


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def count_parameters(spec: RunSpec, cfg: Any) -> int:
    """Parameters of the model the ranks will build, counted on the meta device (no memory, ~1 s for 7B)."""
    return sum(p.numel() for p in meta_model(spec, cfg).parameters())


def meta_model(spec: RunSpec, cfg: Any) -> Any:
    """The model the ranks will build, on the meta device (no memory, ~1 s for 7B)."""
    import torch
    from transformers import AutoModelForCausalLM

    mt = spec.model.model_type
    try:
        with quiet_transformers(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ConfigError(
                f"model.model_type {mt!r}: transformers has no causal LM for it (AutoModelForCausalLM); "
                "use a decoder model type such as llama, qwen2 or mistral"
            ) from None
        raise ConfigError(
            f"model.config: transformers cannot build a {mt} model from it ({_one_line(e)}); fix the values"
        ) from None
    except Exception as e:  # noqa: BLE001 - model code raises anything (AssertionError, RuntimeError, ...)
        raise ConfigError(
            f"model.config: transformers cannot build a {mt} model from it "
            f"({type(e).__name__}: {_one_line(e)}); fix the values"
        ) from None
    return model


def check_pretrained(spec: RunSpec, cfg: Any, model: Any, *, weights: bool = True) -> None:
    """model.pretrained, before any rank starts: weight files that exist and hold every parameter of the model
    its config.json builds, at its shape, with no NaN/Inf value (``weights``: only when the run has no checkpoint to
    resume from); an architecture the backend can shard; a tokenizer that fits."""
    from ckpt.commit.state import tied_weights
    from ckpt.pretrained import find_tensor, resolve, tensor_index, tied_conflict, weight_files

    m = spec.model
    source = m.pretrained or ""
    folder, _ = resolve(m, local_files_only=True)
    check_shardable(spec, model)
    check_tokenizer(spec, cfg)
    if not weights:
        return
    index = tensor_index(weight_files(folder, source))
    tied = tied_weights(model)
    used: dict[str, StoredTensor] = {}
    for name, p in model.named_parameters():
        st = find_tensor(index, name, tied)
        if st is None:
            raise ConfigError(
                f"model.pretrained {source}: the weight files in {folder} have no tensor {name}, "
                f"which its config.json's {type(model).__name__} needs; the folder's weights and "
                "config.json are of different models, re-save it with save_pretrained"
            )
        if st.shape != tuple(p.shape):
            raise ConfigError(
                f"model.pretrained {source}: {st.file.name} holds {name} with shape {list(st.shape)}, "
                f"config.json builds {list(p.shape)}; the folder's weights and config.json disagree"
            )
        used[st.name] = st
    conflict = tied_conflict(index, tied)
    if conflict is not None:
        raise ConfigError(
            f"model.pretrained {source}: config.json ties {conflict[0]} to {conflict[1]}, but the weight "
            f"files in {folder} hold both with different values; set tie_word_embeddings: false in its "
            f"config.json if they are two matrices, or remove one of them from the files"
        )
    check_finite_weights(source, sorted(used.values(), key=lambda st: (str(st.file), st.begin)))


def check_finite_weights(source: str, tensors: list[StoredTensor]) -> None:
    """No NaN/Inf in the weights the model reads (``ckpt.pretrained.StoredTensor``s): the ranks would otherwise start
    and stop at their first step with a non-finite loss. One pass over the files, piece by piece (~1 GB/s or more)."""
    import time

    from ckpt.pretrained import first_nonfinite

    t0 = time.perf_counter()
    found = first_nonfinite(tensors)
    if found is not None:
        st, at, value = found
        raise ConfigError(
            f"model.pretrained {source}: {st.file} holds {st.name} with a non-finite value ({value} at "
            f"element {at} of {st.dtype} {list(st.shape)}); training from it gives a NaN loss at the "
            "first step; re-download or re-export the weights without NaN/Inf"
        )
    nbytes = sum(st.end - st.begin for st in tensors)
    log.debug("pretrained weights: %.1f MB checked for NaN/Inf in %.2f s", nbytes / 1e6, time.perf_counter() - t0)


def check_shardable(spec: RunSpec, model: Any) -> None:
    """FSDP2 shards transformers' decoder blocks (_no_split_modules); DeepSpeed takes any module (ZeRO-1/2 read
    the pretrained weights into full parameters, ZeRO-3 into each rank's partitions: trainer.deepspeed._zero3)."""
    if spec.backend == "deepspeed":
        return
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not any(type(mod).__name__ in names for mod in model.modules()):
        raise ConfigError(
            f"model.pretrained {spec.model.pretrained}: {type(model).__name__} declares no decoder blocks "
            f"FSDP2 can shard one by one (_no_split_modules={sorted(names)}); fine-tune a model type "
            "such as llama, qwen2 or mistral, or use backend deepspeed"
        )


def check_tokenizer(spec: RunSpec, cfg: Any) -> None:
    """A tokenizer (data.tokenizer, else the pretrained folder's) whose ids reach past the embeddings would index
    out of range on the first step."""
    from ckpt.pretrained import pretrained_tokenizer_path

    folder = pretrained_tokenizer_path(spec)
    path = folder / "tokenizer.json" if folder is not None else None
    if path is None or not path.is_file():
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception type
        raise ConfigError(
            f"{path}: not a tokenizer the tokenizers library reads ({_one_line(e)}); re-save it with save_pretrained"
        ) from None
    if size > cfg.vocab_size:
        raise ConfigError(
            f"{path}: the tokenizer has {size} tokens but the model's embeddings have vocab_size "
            f"{cfg.vocab_size} (config.json); use the model's own tokenizer, or resize the embeddings "
            "first (model.resize_token_embeddings + save_pretrained)"
        )


def check_data(spec: RunSpec, vocab_size: int, num_proc: int | None = None) -> PreparedData | None:
    """Synthetic corpus or token file: enough tokens for one global batch; a file that exists, has whole
    tokens of its dtype, and only ids below the vocabulary size (one chunked pass over the memmap).
    A dataset: prepared (trainer.builtin.prepare: its bad input is refused there), then the same count."""
    from trainer.builtin.data import open_token_file, scan_token_ids

    data = spec.data
    prepared = None
    if data.source == "dataset":
        from trainer.builtin.prepare import prepare_data

        prepared = prepare_data(spec, vocab_size=vocab_size, num_proc=num_proc)
        assert prepared is not None
        n, where = prepared.train.tokens, f"data.dataset {data.dataset} [{data.split}]"
        if prepared.train.targets == 0:
            raise ConfigError(f"{where}: no token is a training target (no assistant tokens); fix the data")
        if prepared.eval is not None and (prepared.eval.tokens - 1) // data.seq_len < 1:
            raise ConfigError(
                f"eval.split {prepared.eval.split!r}: {prepared.eval.tokens} tokens make no sample of "
                f"data.seq_len {data.seq_len}; use a larger held-out split or a smaller data.seq_len"
            )
    elif data.source == "synthetic":
        n, where = data.synthetic_tokens, f"data.synthetic_tokens {data.synthetic_tokens}"
    else:
        path = Path(data.path or "")
        tokens = open_token_file(path, data.dtype)
        n, where = len(tokens), f"data.path {path}"
    samples = (n - 1) // data.seq_len
    if samples < spec.global_batch_size:
        raise ConfigError(
            f"{where}: {n} tokens make {samples} samples of data.seq_len {data.seq_len}, fewer than one "
            f"global batch ({spec.global_batch_size}); use more tokens, a smaller data.seq_len or "
            "global_batch_size"
        )
    if data.source == "tokens":
        scan_token_ids(tokens, str(path), vocab_size)
    return prepared


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    state_bytes: float  # per rank: master + grad + AdamW, as the backend shards them
    activation_bytes: float  # per rank: one micro-batch
    build_bytes: float  # per rank, on the host: the whole fp32 model before sharding

    @property
    def train_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes


def estimate_memory(spec: RunSpec, world: int, params: int, cfg: Any) -> MemoryEstimate:
    """Lower bound of one rank's memory (see the module docstring for the formula)."""
    full, shards = STATE_BYTES["master"], STATE_BYTES["grad"] + STATE_BYTES["adamw"]
    if spec.backend == "deepspeed" and spec.deepspeed.zero_stage == 1:
        state = params * (STATE_BYTES["master"] + STATE_BYTES["grad"]) + params * STATE_BYTES["adamw"] / world
    elif spec.backend == "deepspeed" and spec.deepspeed.zero_stage == 2:
        state = params * full + params * shards / world
    else:
        state = params * (full + shards) / world
    micro = spec.micro_batch_size or spec.per_rank_batch(world)
    tokens = micro * spec.data.seq_len
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    elem = 2 if spec.precision.compute == "bf16" else 4
    per_layer = tokens * (8 * hidden + 4 * inter) * elem
    if spec.performance.activation_checkpointing:  # each block keeps its input; one block's are live in backward
        act = tokens * layers * hidden * elem + per_layer + tokens * cfg.vocab_size * 8
    else:
        act = layers * per_layer + tokens * cfg.vocab_size * 8
    # a pretrained model is built on the meta device and read shard by shard (FSDP2), never whole
    build = 0 if spec.model.pretrained is not None and spec.backend == "fsdp2" else params * 4
    return MemoryEstimate(params=params, state_bytes=state, activation_bytes=act, build_bytes=build)


def check_memory(spec: RunSpec, topology: ClusterTopology, params: int, cfg: Any) -> None:
    if os.environ.get("SHARDKEEPER_MEMORY_CHECK", "1") == "0":
        return
    est = estimate_memory(spec, topology.world_size, params, cfg)
    nproc, world = topology.procs_per_node, topology.world_size
    what = (
        f"~{params / 1e9:.2f}B parameters need >= {est.train_bytes / GIB:.1f} GiB per rank "
        f"({est.state_bytes / GIB:.1f} GiB params x 16 B (4 master + 4 grad + 8 AdamW) over {world} rank(s) "
        f"as {spec.backend} shards them + {est.activation_bytes / GIB:.1f} GiB activations)"
    )
    fix = (
        "use a smaller model.config, more ranks or nodes, or a smaller micro_batch_size/data.seq_len; "
        "SHARDKEEPER_MEMORY_CHECK=0 skips this check"
    )
    if topology.launcher != "local":  # this host is not where the ranks run
        return
    if topology.device_type == "cuda":
        free = min(gpu_free_bytes(nproc))
        if est.train_bytes > free:
            raise ConfigError(f"model: {what}, but a GPU here has {free / GIB:.1f} GiB free; {fix}")
        per_rank, need = est.build_bytes, "to build the fp32 model"
    elif est.build_bytes > est.train_bytes:
        per_rank, need = est.build_bytes, f"to build the fp32 model ({what} after sharding)"
    else:
        per_rank, need = est.train_bytes, ""
    host = host_available_bytes()
    if host is not None and nproc * per_rank > host:
        head = what if not need else f"~{params / 1e9:.2f}B parameters need >= {per_rank / GIB:.1f} GiB per rank {need}"
        raise ConfigError(
            f"model: {head}; {nproc} rank(s) on this host need >= {nproc * per_rank / GIB:.1f} GiB, "
            f"but {host / GIB:.1f} GiB is available; {fix}"
        )
    log.debug("memory estimate: %s; host available %s bytes", what, host)


def gpu_free_bytes(n: int) -> list[int]:
    import torch

    return [torch.cuda.mem_get_info(i)[0] for i in range(min(n, torch.cuda.device_count()))]


def host_available_bytes() -> int | None:
    """Memory a new process can still get: MemAvailable, capped by the cgroup (container) limit."""
    avail: int | None = None
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except ImportError:
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
        except OSError:
            pass
    limit = _cgroup_room()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


def _cgroup_room() -> int | None:
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if raw == "max":
            return None
        return int(raw) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
