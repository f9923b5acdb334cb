"""What ``Segment.track`` builds: the backend Checkpointer for a user's model (FSDP2/plain module through DCP, a
DeepSpeed engine through DeepSpeed's layout) and its export record; the other tracked objects ride along
(``trainer.extras``). What a checkpoint must hold to be loaded is read from the live model by the Checkpointer
(``ckpt.commit.identity``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from schemas import HFModelRecord
from schemas.errors import UsageError

if TYPE_CHECKING:
    from trainer.checkpointer.core import Checkpointer


def is_deepspeed_engine(model: Any) -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def hf_record_of(module: torch.nn.Module) -> HFModelRecord | None:
    """A transformers model's export record (config.json, ties); None for other modules (exported weights only)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return None
    from trainer.model import hf_model_record

    return hf_model_record(module)


def make_checkpointer(seg: Any, model: Any, optimizer: Any, state: Mapping[str, Any]) -> Checkpointer:
    spec, where = seg.spec, seg.run_dir.spec_path
    if is_deepspeed_engine(model):
        from trainer.deepspeed.checkpointer import DeepSpeedCheckpointer

        if spec.backend != "deepspeed":
            raise UsageError(
                f"seg.track(model=<DeepSpeedEngine>): {where} says backend {spec.backend}; start the run "
                "with --set backend=deepspeed (or backend: deepspeed in its config)"
            )
        stage = int(model.zero_optimization_stage())
        if stage not in (1, 2, 3):
            raise UsageError(
                f"seg.track(model=<DeepSpeedEngine>): ZeRO stage {stage}; checkpoints cover ZeRO stages "
                "1, 2 and 3: set zero_optimization.stage in the DeepSpeed config"
            )
        spec = spec.model_copy(update={"deepspeed": spec.deepspeed.model_copy(update={"zero_stage": stage})})
        module = model.module
        ckpt: Checkpointer = DeepSpeedCheckpointer(
            seg.run_dir, spec, model, seg.env, segment=seg.segment, hf_model=hf_record_of(module)
        )
    else:
        from trainer.checkpointer.dcp_backend import DCPCheckpointer

        if not isinstance(model, torch.nn.Module):
            raise UsageError(
                f"seg.track(model=...): a {type(model).__name__} is not a torch.nn.Module or a DeepSpeed engine"
            )
        if spec.backend == "deepspeed":
            raise UsageError(
                f"seg.track(model=<{type(model).__name__}>): {where} says backend deepspeed but the model "
                "is not a DeepSpeed engine; track the engine deepspeed.initialize returned, or start the "
                "run with backend fsdp2"
            )
        if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(
                "seg.track(optimizer=...): a torch.optim.Optimizer is required with an FSDP2 or plain "
                "model (its state is part of every checkpoint)"
            )
        ckpt = DCPCheckpointer(
            seg.run_dir, spec, model, optimizer, seg.env, segment=seg.segment, hf_model=hf_record_of(model)
        )
    ckpt.extra = dict(state)
    return ckpt
