"""DeepSpeed ZeRO 1/2/3 backend: the FSDP2 segment's loop, data order, loss and metrics on a DeepSpeed
engine, and its checkpoints under the same commit protocol.

Selected by ``backend: deepspeed`` in the RunSpec (``deepspeed.zero_stage`` 1, 2 or 3); on 2 CPU ranks:

    shardkeeper train --config configs/tiny.yaml --set backend=deepspeed --run-dir runs/ds --nproc 2 --until-step 20

Checkpoints: ``trainer.deepspeed.checkpointer`` (DeepSpeed's own files under the shared commit protocol).
``checkpoint.async_save`` works as for FSDP2: training waits for one copy of the state into
reused host buffers, the files are written, hashed and committed in the background (``trainer.deepspeed._staging``),
the same bytes a sync save writes. At the saving world size it loads natively and bit-exactly; at another one, rank 0
converts it once to ``step-XXXXXXXX/universal/`` (ckpt.formats.deepspeed.convert, cached, recorded in lineage)
while the others wait, and every rank loads that with DeepSpeed's ``load_universal``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt.commit.layout import RunDir
from schemas import RunSpec
from trainer.builtin.loop import Trainer
from trainer.deepspeed.checkpointer import DeepSpeedCheckpointer
from trainer.dist import DistEnv, log0
from trainer.model import block_modules, load_pretrained_shards, materialize
from trainer.optim import WarmupCosine, build_optimizer
from trainer.perf import apply_block_options, describe

log = logging.getLogger("shardkeeper.deepspeed")


def ds_config(spec: RunSpec, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of a RunSpec at a world size (batch, accumulation, ZeRO stage, dtypes, clipping)."""
    local = spec.per_rank_batch(world_size)
    micro = spec.micro_batch_size or local
    return {
        "train_batch_size": spec.global_batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": local // micro,
        "gradient_clipping": spec.optim.grad_clip or 0.0,
        "zero_optimization": {"stage": spec.deepspeed.zero_stage},
        # torch.optim.AdamW is the client optimizer (the one the checkpoint contract covers)
        "zero_allow_untested_optimizer": True,
        # check_grad_overflow: engine.step drops a step whose global gradient norm is NaN/Inf (fp32 and ZeRO-3 always
        # do); trainer.nonfinite relies on it so that no non-finite update is ever applied.
        "bf16": {"enabled": spec.precision.compute == "bf16", "check_grad_overflow": True},
        "communication_data_type": "bf16" if spec.precision.reduce == "bf16" else "fp32",
        "steps_per_print": 1 << 40,
        "wall_clock_breakdown": False,
    }


def _import_deepspeed(env: DistEnv) -> Any:
    # DeepSpeed picks its accelerator at import: on CPU ranks say so (it then uses gloo, as we do).
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if not os.environ.get("SHARDKEEPER_DS_VERBOSE"):
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


class DeepSpeedTrainer(Trainer):
    """The built-in trainer on a DeepSpeed engine; ``run()`` is inherited unchanged."""

    def __init__(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv):
        deepspeed = _import_deepspeed(env)
        model = self._build(run_dir, until_step, segment, env)
        self.config = ds_config(self.spec, env.world_size)
        if self.pretrained and self.spec.deepspeed.zero_stage == 3:
            # ZeRO-3: rebuilt under zero.Init, every rank holds only its partitions (trainer.deepspeed._zero3); the
            # meta-built model above gave the export record.
            from trainer.deepspeed._zero3 import build_partitioned

            model = build_partitioned(self.spec, self.config, model)
        elif self.pretrained:
            # ZeRO-1/2 keep every parameter whole on every rank: allocate them (uninitialised; start_fresh reads the
            # pretrained weights, a resume the checkpoint).
            materialize(model, env.device)
        # the performance options before DeepSpeed registers its hooks, as for FSDP2 (in place: names unchanged)
        self.diagnostics = apply_block_options(block_modules(model), self.spec.performance)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=build_optimizer(model, self.spec), config=self.config
        )
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer
        self.schedule = WarmupCosine(engine.optimizer, self.spec)  # sets lr in the client AdamW's groups
        self.ckpt = DeepSpeedCheckpointer(run_dir, self.spec, engine, env, segment=segment, hf_model=self.hf_model)
        self.ckpt.data = self.data_record

    def load_pretrained(self) -> dict[str, float]:
        """ZeRO-1/2: read every weight into the engine's (whole) parameters, then refresh this rank's fp32 master
        partition from them, as deepspeed.initialize did from the uninitialised ones. ZeRO-3: each rank reads its
        partitions only (trainer.deepspeed._zero3.fill_partitions)."""
        if self.spec.deepspeed.zero_stage == 3:
            from trainer.deepspeed._zero3 import fill_partitions

            return fill_partitions(self.engine.module, self.spec, self.hf_model.tied)
        stats = load_pretrained_shards(self.engine.module, self.spec.model, self.hf_model.tied)
        if self.spec.precision.compute == "fp32":
            self.engine.optimizer.refresh_fp32_params()
            return stats
        # bf16 parameters would round the fp32 masters: set each master fragment from the file's values instead
        from deepspeed.utils import safe_set_full_fp32_param

        from ckpt.pretrained import find_tensor, read_rows, resolve, tensor_index, weight_files

        folder, _ = resolve(self.spec.model)
        index = tensor_index(weight_files(folder, self.spec.model.pretrained or ""))
        for name, p in self.engine.module.named_parameters():
            st = find_tensor(index, name, self.hf_model.tied)
            assert st is not None  # load_pretrained_shards found every one
            full = torch.empty(st.shape, dtype=torch.float32)
            read_rows(st, 0, st.shape[0] if st.shape else 1, full)
            safe_set_full_fp32_param(p, full)
        return stats

    def log_diagnostics(self) -> None:
        c = self.config
        log0(
            self.env,
            "[DeepSpeedDiagnostics] zero_stage=%d world_size=%d device=%s compute=%s reduce=%s "
            "micro_batch=%d grad_accum=%d clip=%s",
            self.spec.deepspeed.zero_stage,
            self.env.world_size,
            self.env.device,
            self.spec.precision.compute,
            c["communication_data_type"],
            c["train_micro_batch_size_per_gpu"],
            c["gradient_accumulation_steps"],
            c["gradient_clipping"],
        )
        log0(self.env, "[DeepSpeedDiagnostics] execution: %s", describe(self.diagnostics))

    def train_step(self, step: int, phases: dict[str, float | None] | None) -> tuple[float, float, float]:
        lr = self.schedule.set_step(step)
        global_tokens = max(self.loader.targets(step), 1)  # = tokens_per_step unless labels are masked (chat)
        local_sum = torch.zeros((), dtype=torch.float64)
        for inputs, labels in self.loader.rank_batches(
            step, self.env.rank, self.env.world_size, self.spec.micro_batch_size
        ):
            inputs, labels = inputs.to(self.env.device), labels.to(self.env.device)
            logits = self.engine(input_ids=inputs, use_cache=False).logits  # no KV cache in training
            loss_sum = F.cross_entropy(logits.float().reshape(-1, self.vocab), labels.reshape(-1), reduction="sum")
            # DeepSpeed averages gradients over ranks (as FSDP does): scaling by the world size makes the
            # result the gradient of the mean over the *global* batch; the 1/accumulation is in
            # global_tokens already, so DeepSpeed must not divide again (scale_wrt_gas=False).
            scale = self.env.world_size / global_tokens
            # A non-finite loss on this rank (checked before its backward, on the device: no host sync) makes every
            # gradient NaN; engine.step's own check of the global gradient norm (DeepSpeed's overflow check, on for
            # fp32/bf16 ZeRO-1/2 and for ZeRO-3) then drops the update on every rank before the optimizer runs.
            scale_t = torch.where(torch.isfinite(loss_sum.detach()), scale, float("nan"))
            self.engine.backward(loss_sum * scale_t, scale_wrt_gas=False)
            self.engine.step()  # an optimizer step only at the accumulation boundary (none for a non-finite norm)
            local_sum += loss_sum.detach().to("cpu", torch.float64)
        norm = self.engine.get_global_grad_norm()
        dist.all_reduce(local_sum, group=self.env.ctrl_group)
        loss, grad_norm = float(local_sum) / global_tokens, float(norm if norm is not None else 0.0)
        applied = self.engine.was_step_applied()
        # Raises NonFiniteStep to stop (trainer.nonfinite); a skipped step needs nothing more: the engine dropped it
        # and zeroed the gradients. Had the engine applied a non-finite step, the guard stops whatever the policy.
        self.nonfinite.check(step + 1, loss, grad_norm, dropped=not applied, applied=applied)
        return loss, grad_norm, lr
