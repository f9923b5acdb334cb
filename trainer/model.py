"""Model construction (any transformers causal LM from a config, or from a pretrained folder) and FSDP2 sharding.

From random weights every rank builds the whole model on the CPU with the run's seed, then shards it. From
pretrained weights (``model.pretrained``) no rank ever holds the whole model: the model is built with its
parameters on the meta device (buffers such as rotary frequencies stay real), sharded, its shards allocated
(``to_empty``), and each rank reads only its own rows of every weight from the safetensors files
(``load_pretrained_shards``), or nothing at all when it resumes from a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ckpt.commit.state import tied_weights
from schemas import HFModelRecord, ModelSpec, RunSpec

log = logging.getLogger("shardkeeper.trainer")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config(spec: ModelSpec):
    """The transformers config: model.config for a model from random weights; the pretrained folder's
    config.json with model.config's overrides (dropout, rope scaling, ...) for a pretrained one."""
    from transformers import AutoConfig

    cfg = dict(spec.config)
    cfg.setdefault("attn_implementation", "sdpa")
    if spec.pretrained is not None:
        from ckpt.pretrained import resolve

        folder, _ = resolve(spec, local_files_only=True)
        return AutoConfig.from_pretrained(folder, **cfg)
    return AutoConfig.for_model(spec.model_type, **cfg)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile is moved to the meta device (its storage never touched, its init a
    no-op); buffers stay real, so non-persistent ones (rotary inv_freq) keep their computed values."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_model(spec: RunSpec) -> nn.Module:
    """Build the model on CPU in fp32 with the run's seed, so every rank starts from the same weights; a
    pretrained model with its parameters on the meta device (``materialize`` + ``load_pretrained_shards``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    if spec.model.pretrained is not None:
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=torch.float32)
    model.train()
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters of a meta-built model on ``device``, uninitialised, keeping the buffers'
    values. Every parameter is then overwritten: by the pretrained weights or by a checkpoint."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    # to_empty makes a new Parameter per module from a meta one: a tied pair (lm_head / embed_tokens) would come
    # apart. FSDP2 keeps its own; for a plain module (DeepSpeed) the tie is put back.
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for places in (v for v in shared.values() if len(v) > 1):
        first = places[0][0]._parameters[places[0][1]]
        for module, name in places[1:]:
            if module._parameters[name] is not first:
                module._parameters[name] = first
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's part of parameter ``p``: its local tensor and the rows [start, end) of the full one."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return p.data, 0, (p.shape[0] if p.dim() else 1)
    if any(not (pl.is_replicate() or (isinstance(pl, Shard) and pl.dim == 0)) for pl in p.placements):
        raise ValueError(f"placement {p.placements} is not a row sharding")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if p.dim() == 0:
        return local, 0, 1
    return local, int(offset[0]), int(offset[0]) + int(shape[0])


def load_pretrained_shards(model: nn.Module, spec: ModelSpec, tied: dict[str, str]) -> dict[str, float]:
    """Read this rank's rows of every parameter from the pretrained safetensors files into its (materialized)
    shards; tied parameters are one Parameter, read once from whichever name the files hold. Returns stats."""
    from ckpt.pretrained import find_tensor, read_rows, resolve, tensor_index, weight_files
    from schemas.errors import ConfigError

    t0 = time.perf_counter()
    folder, _ = resolve(spec, local_files_only=True)
    index = tensor_index(weight_files(folder, spec.pretrained or ""))
    used: set[str] = set()
    nbytes = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            st = find_tensor(index, name, tied)
            if st is None:
                raise ConfigError(
                    f"model.pretrained {spec.pretrained}: {folder} has no tensor {name} (nor one tied "
                    "to it); the weights are of another architecture, pass the model's own folder"
                )
            if st.shape != tuple(p.shape):
                raise ConfigError(
                    f"model.pretrained {spec.pretrained}: {st.file.name} holds {name} with shape "
                    f"{list(st.shape)}, the model built from its config.json expects {list(p.shape)}; "
                    "the folder's config and weights disagree"
                )
            used.add(st.name)
            local, start, end = _local_rows(p)
            if local.device.type == "cpu" and local.is_contiguous():
                nbytes += read_rows(st, start, end, local)
            else:  # a GPU shard (or a strided view): read on the host, then copy
                tmp = torch.empty(local.shape, dtype=local.dtype)
                nbytes += read_rows(st, start, end, tmp)
                local.copy_(tmp)
    unused = sorted(set(index) - used)
    if unused:
        log.warning(
            "pretrained weights not used by %s: %s%s",
            type(model).__name__,
            ", ".join(unused[:5]),
            " ..." if len(unused) > 5 else "",
        )
    return {"seconds": time.perf_counter() - t0, "bytes_read": float(nbytes), "folder": str(folder)}  # type: ignore[dict-item]


def pretrained_generation_config(spec: ModelSpec) -> dict[str, Any] | None:
    """The base model's generation_config.json (what its authors set: sampling defaults, stop tokens)."""
    if spec.pretrained is None:
        return None
    from ckpt.pretrained import GENERATION_CONFIG, resolve

    folder, _ = resolve(spec, local_files_only=True)
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: not readable (%s); the export gets a generation config built from config.json", path, e)
        return None
    return data if isinstance(data, dict) else None


def hf_model_record(model: nn.Module, spec: ModelSpec | None = None) -> HFModelRecord:
    """What the export needs from transformers (config.json, generation_config.json, ties), taken once from
    the model as built, before FSDP2 or DeepSpeed wrap it, and recorded in every checkpoint's manifest. A
    pretrained model's generation config is its base model's generation_config.json, when it has one."""
    import transformers
    from transformers import GenerationConfig

    config = copy.deepcopy(model.config)
    from torch.distributed.fsdp import FSDPModule

    # the model's own class: FSDP2 swaps in a dynamic FSDP<Name> subclass when a script tracks a sharded model
    config.architectures = [next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__]
    generation = pretrained_generation_config(spec) if spec is not None else None
    if generation is not None:
        return HFModelRecord(
            config=json.loads(config.to_json_string(use_diff=True)),
            generation_config=generation,
            tied=tied_weights(model),
            transformers_version=transformers.__version__,
        )
    try:
        generation = json.loads(GenerationConfig.from_model_config(config).to_json_string(use_diff=True))
    except (AttributeError, TypeError, ValueError) as e:  # a model without generation settings: none is exported
        log.warning("no generation config recorded for %s: %s", type(model).__name__, e)
    return HFModelRecord(
        config=json.loads(config.to_json_string(use_diff=True)),
        generation_config=generation,
        tied=tied_weights(model),
        transformers_version=transformers.__version__,
    )


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (what FSDP2 shards one by one): transformers' _no_split_modules classes."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__}: found no decoder blocks to shard (_no_split_modules={sorted(names)}); "
            "this model type is not supported"
        )
    return blocks


def shard_model(model: nn.Module, mesh, spec: RunSpec) -> dict[str, Any]:
    """The performance options on each block (in place, names unchanged), fully_shard each block, then the
    root. Returns the diagnostics of what was done."""
    from trainer.perf import apply_block_options

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[spec.precision.compute], reduce_dtype=DTYPES[spec.precision.reduce])
    blocks = block_modules(model)
    block_class = type(blocks[0]).__name__
    execution = apply_block_options(blocks, spec.performance)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    local_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return {
        "fsdp_units": len(blocks),
        "fsdp_instances": len(blocks) + 1,
        "block_class": block_class,
        "total_params": total,
        "local_param_MiB": round(local_bytes / 2**20, 3),
        "param_dtype": str(mp.param_dtype).removeprefix("torch."),
        "reduce_dtype": str(mp.reduce_dtype).removeprefix("torch."),
        "master_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **execution,
    }
