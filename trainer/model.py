"""Model construction (any transformers causal LM from a config) and FSDP2 sharding."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ckpt.state import tied_weights
from schemas import HFModelRecord, ModelSpec, RunSpec

log = logging.getLogger("shardkeeper.trainer")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config(spec: ModelSpec):
    from transformers import AutoConfig

    cfg = dict(spec.config)
    cfg.setdefault("attn_implementation", "sdpa")
    return AutoConfig.for_model(spec.model_type, **cfg)


def build_model(spec: RunSpec) -> nn.Module:
    """Build the model on CPU in fp32 with the run's seed, so every rank starts from the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=torch.float32)
    model.train()
    return model


def hf_model_record(model: nn.Module) -> HFModelRecord:
    """What the export needs from transformers (config.json, generation_config.json, ties), taken once from
    the model as built, before FSDP2 or DeepSpeed wrap it, and recorded in every checkpoint's manifest."""
    import transformers
    from transformers import GenerationConfig

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    generation = None
    try:
        generation = json.loads(GenerationConfig.from_model_config(config).to_json_string(use_diff=True))
    except (AttributeError, TypeError, ValueError) as e:  # a model without generation settings: none is exported
        log.warning("no generation config recorded for %s: %s", type(model).__name__, e)
    return HFModelRecord(config=json.loads(config.to_json_string(use_diff=True)), generation_config=generation,
                         tied=tied_weights(model), transformers_version=transformers.__version__)


def model_signature(spec: ModelSpec, model: nn.Module) -> str:
    """sha256 over model type, config and parameter names/shapes: identifies the architecture."""
    shapes = [(n, list(getattr(p, "shape", ()))) for n, p in model.named_parameters()]
    blob = json.dumps({"type": spec.model_type, "config": spec.config, "params": shapes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


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
    """fully_shard each block, then the root. Returns the diagnostics of what was done."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[spec.precision.compute], reduce_dtype=DTYPES[spec.precision.reduce])
    blocks = block_modules(model)
    block_class = type(blocks[0]).__name__
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
    }
