"""AdamW, a warm-up + cosine schedule that is a pure function of the step, and sharded grad clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from schemas import RunSpec
from trainer.perf import adamw_kwargs


def build_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer:
    """AdamW over two groups (no weight decay on vectors), with performance.adamw_implementation's kernel:
    the update rule, hyperparameters and state (exp_avg, exp_avg_sq, step) are the same for all three."""
    decay, no_decay = [], []
    for p in model.parameters():
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter's own shape is empty
        (decay if ndim >= 2 else no_decay).append(p)
    o = spec.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, **adamw_kwargs(spec.performance))


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give AdamW the per-parameter state its first step would create (step 0, zero moments), without a step.

    A load needs the state to exist to have somewhere to put the checkpoint's; torch's ``get_state_dict``
    would otherwise create it by running a whole optimizer step on zero gradients (``_init_optim_state``:
    gradients allocated and zeroed, the AdamW arithmetic over every parameter), seconds at 250M parameters.
    The load then overwrites every tensor and the step (DCP refuses a checkpoint missing any of them)."""
    from torch.optim.optimizer import _get_scalar_dtype

    if optimizer.state or not isinstance(optimizer, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            return  # a device-hosted step: leave it to torch's own initialisation
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = {
                "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),  # as AdamW's _init_group makes it
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


class WarmupCosine:
    """LR at step s (0-based step about to be taken). Stateless apart from the step it was last set for."""

    def __init__(self, optimizer: torch.optim.Optimizer, spec: RunSpec):
        self.optimizer = optimizer
        self.peak = spec.optim.lr
        self.s = spec.schedule
        self.last_step = -1

    def lr_at(self, step: int) -> float:
        s = self.s
        if s.warmup_steps and step < s.warmup_steps:
            return self.peak * (step + 1) / s.warmup_steps
        span = max(1, s.total_steps - s.warmup_steps)
        progress = min(1.0, (step - s.warmup_steps) / span)
        floor = self.peak * s.min_lr_ratio
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def set_step(self, step: int) -> float:
        lr = self.lr_at(step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.last_step = step
        return lr

    def state_dict(self) -> dict[str, int]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_step = int(state["last_step"])


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float | None) -> float:
    """Global L2 norm over sharded (DTensor) gradients, then clip. Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    full_tensor = getattr(total, "full_tensor", None)
    if full_tensor is not None:  # DTensor with a Partial placement: reduce over the shards
        total = full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total)
