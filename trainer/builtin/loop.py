"""The built-in language-model trainer, shared by both backends: build the model, data and optimizer; the
segment policy (resume with fallback, saves, preemption, the final commit, the report) is the public API's
(``trainer.api.segment.Segment``), which this trainer uses as a user's script does.
``trainer.deepspeed.backend.DeepSpeedTrainer``
swaps the wrapping, optimizer and Checkpointer; ``trainer.segment`` is the rank's entry point.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt.commit.layout import RunDir
from schemas.errors import ConfigError
from schemas.seam import SegmentLaunch
from trainer.api.segment import Segment as ApiSegment
from trainer.api.segment import SegmentPreempted, load_spec
from trainer.builtin.data import GlobalOrderLoader, HeldOutLoader, open_prepared, open_tokens
from trainer.checkpointer.dcp_backend import DCPCheckpointer
from trainer.dist import DistEnv, log0
from trainer.model import build_model, hf_model_record, load_pretrained_shards, materialize, shard_model
from trainer.nonfinite import NonFiniteGuard, NonFiniteStep
from trainer.optim import WarmupCosine, build_optimizer, clip_grad_norm_
from trainer.perf import EXECUTION_KEYS, describe

log = logging.getLogger("shardkeeper.trainer")


def _peak_mib(env: DistEnv) -> float | None:
    if env.device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(env.device) / 2**20, 1)


class Trainer:
    """The built-in language-model trainer: model, data, loss and evaluation of one segment; ``run()`` trains it
    through the public API, like a user's script."""

    def __init__(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv):
        model = self._build(run_dir, until_step, segment, env)
        self.diagnostics = shard_model(model, env.mesh, self.spec)
        if self.pretrained:  # meta-built: allocate this rank's shards only (filled by the checkpoint or start_fresh)
            materialize(model, env.device)
        self.model = model
        self.optimizer = build_optimizer(model, self.spec)
        self.schedule = WarmupCosine(self.optimizer, self.spec)
        self.ckpt = DCPCheckpointer(
            run_dir, self.spec, model, self.optimizer, env, segment=segment, hf_model=self.hf_model
        )
        self.ckpt.data = self.data_record

    def _build(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv) -> torch.nn.Module:
        """What both backends share: the RunSpec, the model as transformers builds it (its export record taken
        before any wrapping renames its class) and the global-order data loader."""
        self.run_dir = run_dir
        self.until_step = until_step
        self.segment_index = segment
        self.env = env
        self.spec = load_spec(run_dir)
        self.local_batch = self.spec.per_rank_batch(env.world_size)
        self.pretrained = self.spec.model.pretrained is not None
        model = build_model(self.spec)
        self.hf_model = hf_model_record(model, self.spec.model)
        self.vocab = model.config.vocab_size
        self._open_data()
        self.tokens_per_step = self.spec.global_batch_size * self.spec.data.seq_len
        self.nonfinite = NonFiniteGuard(self.spec.optim, is_rank0=env.is_rank0)
        return model

    def _open_data(self) -> None:
        """The global-order loader (and the held-out one). A dataset was tokenized by the controller: the ranks
        only open the files the launch names (``SegmentLaunch.data``), and its record goes into every manifest."""
        spec = self.spec
        prepared = None
        if spec.data.source == "dataset":
            launch = SegmentLaunch.from_environ()
            prepared = launch.data if launch is not None else None
        self.data_record = prepared.record() if prepared is not None else None
        mask = None
        if spec.data.source == "dataset":
            tokens, mask = open_prepared(prepared.train if prepared else None)
        else:
            tokens = open_tokens(spec.data, spec.seed, self.vocab)
        self.loader = GlobalOrderLoader(tokens, spec.data.seq_len, spec.seed, spec.global_batch_size, mask=mask)
        self.eval_loader: HeldOutLoader | None = None
        if spec.eval is not None:
            if prepared is None or prepared.eval is None:
                raise ConfigError(
                    "eval: the ranks received no prepared held-out split; start the segment with "
                    "shardkeeper train (it prepares eval.split too)"
                )
            ev_tokens, ev_mask = open_prepared(prepared.eval)
            self.eval_loader = HeldOutLoader(ev_tokens, spec.data.seq_len, spec.eval_batch(), mask=ev_mask)

    def evaluate(self) -> dict[str, float]:
        """Held-out loss (mean over target tokens of eval.batches fixed batches) and perplexity. Per-token losses
        are summed in float64 and the global target count is known to every rank, so the value does not depend
        on the world size (beyond float32 forward differences, ~1e-7)."""
        assert self.spec.eval is not None and self.eval_loader is not None
        loader, env = self.eval_loader, self.env
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for b in range(self.spec.eval.batches):
                inputs, labels = loader.rank_batch(b, env.rank, env.world_size)
                logits = self.model(input_ids=inputs.to(env.device), use_cache=False).logits
                per_token = F.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)), labels.to(env.device).reshape(-1), reduction="none"
                )
                total += per_token.to("cpu", torch.float64).sum()
                count += loader.targets(b)
        self.model.train(was_training)
        dist.all_reduce(total, group=env.ctrl_group)
        loss = float(total) / max(count, 1)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}

    def start_fresh(self) -> None:
        """No checkpoint to resume from: step 0. A pretrained run reads its shards of the base model's weights
        now (never on a resume: the checkpoint has them) and rank 0 hashes the weight files meanwhile for the
        first checkpoint's manifest."""
        if self.pretrained:
            self.ckpt.record_base_model(self.spec.model)
            stats = self.load_pretrained()
            log0(
                self.env,
                "loaded this rank's shards of %s: %.1f MB read in %.2f s",
                self.spec.model.pretrained,
                stats["bytes_read"] / 1e6,
                stats["seconds"],
            )

    def load_pretrained(self) -> dict[str, float]:
        return load_pretrained_shards(self.model, self.spec.model, self.hf_model.tied)

    def log_diagnostics(self) -> None:
        d = self.diagnostics
        log0(
            self.env,
            "[FSDPDiagnostics] fsdp_units=%d (+1 root, %s) total_params=%d world_size=%d device=%s",
            d["fsdp_units"],
            d["block_class"],
            d["total_params"],
            self.env.world_size,
            self.env.device,
        )
        log0(
            self.env,
            "[FSDPDiagnostics] dtypes: master=%s param(compute)=%s reduce=%s",
            d["master_dtype"],
            d["param_dtype"],
            d["reduce_dtype"],
        )
        sizes = [None] * self.env.world_size
        dist.all_gather_object(sizes, d["local_param_MiB"], group=self.env.ctrl_group)
        log0(self.env, "[FSDPDiagnostics] local_trainable_param_MiB per rank: %s", sizes)
        log0(self.env, "[FSDPDiagnostics] execution: %s", describe(d))

    def train_step(self, step: int, phases: dict[str, float | None] | None) -> tuple[float, float, float]:
        lr = self.schedule.set_step(step)
        global_tokens = max(self.loader.targets(step), 1)  # = tokens_per_step unless labels are masked (chat)
        local_sum = torch.zeros((), dtype=torch.float64)
        batches = self.loader.rank_batches(step, self.env.rank, self.env.world_size, self.spec.micro_batch_size)
        if phases is not None:
            phases["batch_start"] = _peak_mib(self.env)
        for inputs, labels in batches:
            inputs, labels = inputs.to(self.env.device), labels.to(self.env.device)
            # use_cache=False: no KV cache in training (it would keep every layer's keys and values alive)
            logits = self.model(input_ids=inputs, use_cache=False).logits
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
            # FSDP averages gradients over ranks; scaling by the world size makes the result the
            # gradient of the mean over the *global* batch, whatever the world size.
            (loss_sum * (self.env.world_size / global_tokens)).backward()
            local_sum += loss_sum.detach().to("cpu", torch.float64)
        if phases is not None:
            phases["after_backward"] = _peak_mib(self.env)
        # The global loss before the update: with the global gradient norm, the non-finite check (trainer.nonfinite)
        # every rank reaches alike, before optimizer.step can apply a NaN.
        dist.all_reduce(local_sum, group=self.env.ctrl_group)
        loss = float(local_sum) / global_tokens
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.spec.optim.grad_clip)
        if phases is not None:
            phases["before_optimizer_step"] = _peak_mib(self.env)
        if not self.nonfinite.check(step + 1, loss, grad_norm):  # raises NonFiniteStep to stop; True: skip the update
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if phases is not None:
            phases["batch_end"] = _peak_mib(self.env)
        return loss, grad_norm, lr

    def run(self) -> int:
        """Train this segment through the public API (``trainer.api.segment.Segment``): the same policy a user's script
        gets
        (resume with fallback, saves, preemption, the final commit, the report); this class brings the model, the
        data order, the loss and the evaluation."""
        seg = ApiSegment(
            run_dir=self.run_dir.root,
            until_step=self.until_step,
            segment=self.segment_index,
            _env=self.env,
            _spec=self.spec,
        )
        seg._attach(self.ckpt, on_fresh=self.start_fresh)
        seg.final_note = self.nonfinite.note  # the status note counts skipped non-finite steps
        seg.execution = {k: self.diagnostics[k] for k in EXECUTION_KEYS if k in self.diagnostics}
        self.log_diagnostics()
        trained = 0
        try:
            for step in seg.steps(tokens_per_step=self.tokens_per_step, samples_per_step=self.spec.global_batch_size):
                phases: dict[str, float | None] | None = (
                    {} if (self.env.device.type == "cuda" and trained < 3) else None
                )
                # a NaN/Inf loss or gradient raises NonFiniteStep before the update (trainer.nonfinite)
                loss, gnorm, lr = self.train_step(step, phases)
                trained += 1
                if phases:
                    log0(self.env, "[FSDPDiagnostics] step %d peak MiB per phase: %s", step + 1, phases)
                row: dict = {"loss": loss, "grad_norm": gnorm, "lr": lr, **self.nonfinite.row()}
                if self.spec.eval is not None and (step + 1) % self.spec.eval.interval == 0:
                    row.update(self.evaluate())
                    self._record_eval({"step": step + 1, **row})
                seg.log(**row)
        except SegmentPreempted as e:
            return int(e.code)
        except NonFiniteStep as e:  # stop here: nothing of this step is saved
            return seg.end_nonfinite(e, skipped=self.nonfinite.skipped)
        return seg.exit_code or 0

    def _record_eval(self, row: dict) -> None:
        if not self.env.is_rank0:
            return
        from ckpt.commit import lineage

        log0(
            self.env,
            "eval at step %d: loss %.4f perplexity %.2f (%d held-out tokens)",
            row["step"],
            row["eval_loss"],
            row["eval_ppl"],
            row["eval_tokens"],
        )
        assert self.spec.eval is not None
        lineage.record(
            self.run_dir,
            "eval",
            f"eval:step-{row['step']:08d}",
            parent=f"segment:{self.segment_index}",
            step=row["step"],
            eval_loss=row["eval_loss"],
            eval_ppl=row["eval_ppl"],
            eval_tokens=row["eval_tokens"],
            split=self.spec.eval.split,
            world_size=self.env.world_size,
            segment=self.segment_index,
        )
