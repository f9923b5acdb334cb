"""DeepSpeed ZeRO-3 from pretrained weights: each rank builds, allocates and reads only its own partitions.

Build: the model is constructed under ``deepspeed.zero.Init``, which partitions every module's parameters as
soon as that module's ``__init__`` returns, so at most one module's parameters exist whole, and only for the
moment of construction (transformers' ``no_init_weights`` skips their random init: the values are replaced
anyway). ``override_module_apply`` is off for this build, so transformers' ``post_init`` does not all-gather
each parameter to initialise it.

Fill (first segment only; a resume loads the checkpoint instead): a ZeRO-3 parameter's ``ds_tensor`` is this
rank's contiguous slice ``[rank * n, (rank + 1) * n)`` of the flattened parameter, ``n = ceil(numel / world)``
(aligned), zero-padded past the end. That element range is read straight from the safetensors file
(``ckpt.pretrained.read_elements``) into the partition and into the optimizer's fp32 master partition
(``safe_set_local_fp32_param``: exact even when the partitions are bf16). No parameter is gathered. A
persistent parameter (small ones ZeRO-3 keeps whole on every rank, ``ds_persist``) also gets its full value,
which is at most ``param_persistence_threshold`` elements. Tied weights are one parameter under ZeRO-3 too
(``named_parameters`` yields it once); it is read from whichever name the files hold.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from schemas import RunSpec


def build_partitioned(spec: RunSpec, ds_config: dict[str, Any], meta_built: nn.Module) -> nn.Module:
    """The model of a pretrained run, built under ``deepspeed.zero.Init`` (partitions only, values unset).

    ``meta_built`` is the same model with its parameters on the meta device: its buffers (rotary frequencies)
    are copied over, as ``no_init_weights`` may leave them to an init that is skipped here."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from trainer.model import hf_config

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        try:
            from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]
        except ImportError:
            no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    import torch.distributed as dist

    # zero.Init reads the world size from deepspeed.comm: wrap the process group the segment already made
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    zero = {**ds_config["zero_optimization"], "override_module_apply": False}
    dtype = torch.bfloat16 if spec.precision.compute == "bf16" else torch.float32
    torch.manual_seed(spec.seed)
    # no dtype= to zero.Init: it then takes the config's (bf16 or fp32); an explicit one is overridden on
    # accelerators without fp16 (DeepSpeed 0.19's Init._set_dtype)
    with deepspeed.zero.Init(config_dict_or_path={**ds_config, "zero_optimization": zero}), no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=dtype)
    model.tie_weights()  # skipped with the weight init: lm_head / embed_tokens become one (partitioned) parameter
    buffers = dict(meta_built.named_buffers())
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    model.train()
    return model


def fill_partitions(model: nn.Module, spec: RunSpec, tied: dict[str, str]) -> dict[str, Any]:
    """Read this rank's partition of every parameter (and its fp32 master partition) from the pretrained
    safetensors files. Call after ``deepspeed.initialize``. Returns stats."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_set_local_fp32_param

    from ckpt.pretrained import find_tensor, read_elements, read_rows, resolve, tensor_index, weight_files
    from schemas.errors import ConfigError

    t0 = time.perf_counter()
    source = spec.model.pretrained or ""
    folder, _ = resolve(spec.model, local_files_only=True)
    index = tensor_index(weight_files(folder, source))
    nbytes = 0
    largest = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            st = find_tensor(index, name, tied)
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if st is None or st.shape != shape:
                what = "no tensor" if st is None else f"shape {list(st.shape)} for"
                raise ConfigError(
                    f"model.pretrained {source}: {folder} has {what} {name} (the model expects "
                    f"{list(shape)}); the folder's config and weights disagree"
                )
            part = p.ds_tensor
            size = part.numel()
            start = size * dist.get_rank(group=p.ds_process_group)
            count = max(0, min(size, p.ds_numel - start))
            master = torch.zeros(size, dtype=torch.float32)  # the padding past the end stays 0, as DeepSpeed's
            nbytes += read_elements(st, start, count, master[:count])
            largest = max(largest, size)
            part.copy_(master.to(part.device))
            if p.ds_status == ZeroParamStatus.AVAILABLE:  # kept whole on every rank (ds_persist): small
                whole = torch.empty(shape, dtype=torch.float32)
                nbytes += read_rows(st, 0, shape[0] if shape else 1, whole)
                p.data.copy_(whole.to(p.device))
            if p.requires_grad:
                safe_set_local_fp32_param(p, master.to(part.device))
    return {
        "seconds": time.perf_counter() - t0,
        "bytes_read": float(nbytes),
        "folder": str(folder),
        "largest_partition": largest,
    }
