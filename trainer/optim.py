"""AdamW, a warm-up + cosine schedule that is a pure function of the step, and sharded grad clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from schemas import RunSpec


def build_optimizer(model: nn.Module, spec: RunSpec) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        ndim = len(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partitioned parameter's own shape is empty
        (decay if ndim >= 2 else no_decay).append(p)
    o = spec.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=True)


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
