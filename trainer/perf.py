"""The ``performance`` section on the ranks: activation checkpointing and torch.compile of every decoder block,
and AdamW's implementation. Same math, other memory and speed; off by default.

Both block options replace the block's ``forward`` *in place* (an instance attribute in front of the class's
method) instead of wrapping the module: ``checkpoint_wrapper`` would rename every parameter
(``…layers.0._checkpoint_wrapped_module.mlp…``) and ``torch.compile(module)`` would add ``_orig_mod.``, and the
names are the contract of checkpoints, exports, tied-weight discovery and the model signature. In place, the
module tree, its parameters and its state dict are the same with and without the options, so a checkpoint
saved with them loads without them and the other way round.

Order, as torchtitan does: checkpointing inside, compile outside (dynamo traces ``torch.utils.checkpoint`` as
one region), and both before ``fully_shard`` / ``deepspeed.initialize``, whose hooks stay outside the
compiled and checkpointed forward: FSDP2 unshards a block before its forward and again before its backward,
where the recomputation runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from schemas import PerformanceSpec

ADAMW_FLAGS: dict[str, dict[str, bool]] = {
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False, "fused": False},
}


def adamw_kwargs(perf: PerformanceSpec) -> dict[str, bool]:
    """The torch.optim.AdamW flags of ``performance.adamw_implementation``."""
    return dict(ADAMW_FLAGS[perf.adamw_implementation])


def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose activations are recomputed in backward (non-reentrant checkpoint; the RNG state is
    restored for the recomputation, so dropout draws the same mask). Without grad (evaluation) it just runs."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def apply_block_options(blocks: list[nn.Module], perf: PerformanceSpec) -> dict[str, Any]:
    """Activation checkpointing and torch.compile of each block's forward, in place (names unchanged).
    Call before sharding. Returns what was done, for the segment's diagnostics."""
    for block in blocks:
        forward = block.forward
        if perf.activation_checkpointing:
            forward = checkpointed(forward)
        if perf.compile:
            options: dict[str, Any] = {"backend": perf.compile_backend}
            if perf.compile_backend == "inductor":
                options["mode"] = perf.compile_mode
            forward = torch.compile(forward, **options)
        if forward is not block.forward:
            block.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    return execution_diagnostics(blocks, perf)


EXECUTION_KEYS = ("activation_checkpointing", "compiled_blocks", "compile", "adamw_implementation")


def execution_diagnostics(blocks: list[nn.Module], perf: PerformanceSpec) -> dict[str, Any]:
    return {
        "activation_checkpointing": len(blocks) if perf.activation_checkpointing else 0,
        "compiled_blocks": len(blocks) if perf.compile else 0,
        "compile": f"{perf.compile_backend}/{perf.compile_mode}" if perf.compile else "off",
        "adamw_implementation": perf.adamw_implementation,
    }


def describe(d: dict[str, Any]) -> str:
    """The one diagnostics line of the execution options (both backends print it)."""
    return (
        f"activation_checkpointing={d['activation_checkpointing']} blocks, compiled_blocks={d['compiled_blocks']} "
        f"({d['compile']}), adamw={d['adamw_implementation']}"
    )
