"""The dtype policy a checkpoint records (``manifest.dtype_policy``): what the live model actually computes and
reduces in, read from the model itself rather than from the run's config, so that a script's own FSDP2
``MixedPrecisionPolicy`` or DeepSpeed ``bf16`` section is recorded as it is used.

- FSDP2: the ``MixedPrecisionPolicy`` that manages most of the parameters (``param_dtype``, ``reduce_dtype``; either
  left unset means the parameters' own dtype, and ``reduce_dtype`` unset means ``param_dtype``);
- a DeepSpeed engine: its ``bf16`` / ``fp16`` section and its communication dtype; masters are fp32 unless it keeps
  bf16 (``bf16_master_weights_and_grads``) or fp16 masters;
- a plain module (single process, DDP): the dtype of most of its parameters, for all three.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from schemas import DtypePolicy


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _params_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of the model's parameter elements (float32 for a model without parameters)."""
    count: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        count[p.dtype] += p.numel()
    return count.most_common(1)[0][0] if count else torch.float32


def module_policy(model: torch.nn.Module) -> DtypePolicy:
    """An FSDP2-sharded or plain module's policy as it runs (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    master = _params_dtype(model)
    policies = {name: _mp_policy(m) for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    weight: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
    for name, p in model.named_parameters():
        # the FSDP module that manages the parameter: the deepest one whose name prefixes it
        owner = max((m for m in policies if m == "" or name.startswith(m + ".")), key=len, default=None)
        mp = policies.get(owner) if owner is not None else None
        param = (getattr(mp, "param_dtype", None) or p.dtype) if mp is not None else p.dtype
        reduce = (getattr(mp, "reduce_dtype", None) or param) if mp is not None else param
        weight[(param, reduce)] += p.numel()
    compute, reduce = weight.most_common(1)[0][0] if weight else (master, master)
    return DtypePolicy(master=dtype_name(master), compute=dtype_name(compute), reduce=dtype_name(reduce))


def _mp_policy(module: Any) -> Any:
    """The MixedPrecisionPolicy ``fully_shard`` gave ``module`` (None if this torch keeps it elsewhere)."""
    try:
        return getattr(module._get_fsdp_state(), "_mp_policy", None)
    except Exception:  # noqa: BLE001 - a private attribute: without it the parameters' dtype is recorded
        return None


def engine_policy(engine: Any) -> DtypePolicy:
    """A DeepSpeed engine's policy: its bf16/fp16 section, its communication dtype, its masters' dtype."""
    compute = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    masters_low = {
        torch.bfloat16: "bf16_master_weights_and_gradients",
        torch.float16: "fp16_master_weights_and_gradients",
    }.get(compute)
    low = masters_low is not None and bool(getattr(engine, masters_low, lambda: False)())
    reduce = engine.communication_data_type or compute
    return DtypePolicy(
        master=dtype_name(compute if low else torch.float32), compute=dtype_name(compute), reduce=dtype_name(reduce)
    )


__all__ = ["dtype_name", "engine_policy", "module_policy"]
