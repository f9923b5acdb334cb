"""The training loop of one segment, shared by both backends: build the model, data and optimizer,
resume from the latest valid checkpoint, train until a step, commit a checkpoint at the end (or on
preemption), and report to the launcher (a ``SegmentReport``). ``trainer.ds_backend.DeepSpeedSegment``
swaps the wrapping, optimizer and Checkpointer; ``trainer.segment`` is the rank's entry point.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt.fsutil import append_jsonl, load_yaml
from ckpt.layout import RunDir
from schemas import RunSpec
from schemas.errors import ConfigError
from schemas.seam import EXIT_PREEMPTED, SegmentLaunch, SegmentReport
from trainer.checkpointer import TrainState
from trainer.dcp_backend import DCPCheckpointer
from trainer.data import GlobalOrderLoader, HeldOutLoader, open_prepared, open_tokens
from trainer.dist import DistEnv, log0
from trainer.nonfinite import NonFiniteGuard, NonFiniteStep, end_segment
from trainer.model import (build_model, hf_model_record, load_pretrained_shards, materialize, model_signature,
                           shard_model)
from trainer.optim import WarmupCosine, build_optimizer, clip_grad_norm_
from trainer.perf import EXECUTION_KEYS, describe
from trainer.signals import PreemptionWatcher
from trainer import timeline

log = logging.getLogger("shardkeeper.trainer")


def load_spec(run_dir: RunDir) -> RunSpec:
    return RunSpec.model_validate(load_yaml(run_dir.spec_path.read_text()))


def _peak_mib(env: DistEnv) -> float | None:
    if env.device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(env.device) / 2**20, 1)


class Segment:
    """Holds the pieces of one segment; ``run()`` is the training loop."""

    def __init__(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv):
        model = self._build(run_dir, until_step, segment, env)
        self.diagnostics = shard_model(model, env.mesh, self.spec)
        if self.pretrained:  # meta-built: allocate this rank's shards only (filled by the checkpoint or start_fresh)
            materialize(model, env.device)
        self.model = model
        self.optimizer = build_optimizer(model, self.spec)
        self.schedule = WarmupCosine(self.optimizer, self.spec)
        self.ckpt = DCPCheckpointer(run_dir, self.spec, model, self.optimizer, env, segment=segment, signature=self.signature,
                                 hf_model=self.hf_model)
        self.ckpt.data = self.data_record

    def _build(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv) -> torch.nn.Module:
        """What both backends share: the RunSpec, the model as transformers builds it (signature and
        export record taken before any wrapping renames its class) and the global-order data loader."""
        self.run_dir = run_dir
        self.until_step = until_step
        self.segment_index = segment
        self.env = env
        self.spec = load_spec(run_dir)
        self.local_batch = self.spec.per_rank_batch(env.world_size)
        self.pretrained = self.spec.model.pretrained is not None
        model = build_model(self.spec)
        self.signature = model_signature(self.spec.model, model)
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
                raise ConfigError("eval: the ranks received no prepared held-out split; start the segment with "
                                  "shardkeeper train (it prepares eval.split too)")
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
                per_token = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.to(env.device).reshape(-1),
                                            reduction="none")
                total += per_token.to("cpu", torch.float64).sum()
                count += loader.targets(b)
        self.model.train(was_training)
        dist.all_reduce(total, group=env.ctrl_group)
        loss = float(total) / max(count, 1)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}

    def start_fresh(self) -> TrainState:
        """No checkpoint to resume from: step 0. A pretrained run reads its shards of the base model's weights
        now (never on a resume: the checkpoint has them) and rank 0 hashes the weight files meanwhile for the
        first checkpoint's manifest."""
        if self.pretrained:
            self.ckpt.record_base_model(self.spec.model)
            stats = self.load_pretrained()
            log0(self.env, "loaded this rank's shards of %s: %.1f MB read in %.2f s", self.spec.model.pretrained,
                 stats["bytes_read"] / 1e6, stats["seconds"])
        return TrainState()

    def load_pretrained(self) -> dict[str, float]:
        return load_pretrained_shards(self.model, self.spec.model, self.hf_model.tied)

    def log_diagnostics(self) -> None:
        d = self.diagnostics
        log0(self.env, "[FSDPDiagnostics] fsdp_units=%d (+1 root, %s) total_params=%d world_size=%d device=%s",
             d["fsdp_units"], d["block_class"], d["total_params"], self.env.world_size, self.env.device)
        log0(self.env, "[FSDPDiagnostics] dtypes: master=%s param(compute)=%s reduce=%s",
             d["master_dtype"], d["param_dtype"], d["reduce_dtype"])
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
        # Installed before the load: a SIGTERM while loading is a preemption, never a crash.
        watcher = PreemptionWatcher(self.env.ctrl_group).install()
        try:
            return self._run(watcher)
        finally:
            watcher.uninstall()

    def _run(self, watcher: PreemptionWatcher) -> int:
        env = self.env
        self.log_diagnostics()
        ts = self.ckpt.load_latest() or self.start_fresh()
        timeline.mark("loaded")
        self.ckpt.warm_up(ts)
        start = ts.step
        if start >= self.until_step:
            log0(env, "nothing to do: the run is at step %d, --until-step is %d", start, self.until_step)
            self._write_status("completed", start, start)
            return 0
        if watcher.should_stop():  # asked to stop during start-up or load: the loaded state is committed already
            note = stopped_early_note(start)
            log0(env, "preemption signal received before the first step: %s", note)
            self._write_status("preempted", start, start, note=note)
            return EXIT_PREEMPTED
        log0(env, "segment %d: steps %d -> %d on %d ranks", self.segment_index, start, self.until_step, env.world_size)
        progress = ProgressLine(start, self.until_step, self.tokens_per_step)
        status = "completed"
        while ts.step < self.until_step:
            t0 = time.perf_counter()
            phases: dict[str, float | None] | None = {} if (env.device.type == "cuda" and ts.step - start < 3) else None
            try:  # a NaN/Inf loss or gradient: stop here, nothing of this step saved (trainer.nonfinite)
                loss, gnorm, lr = self.train_step(ts.step, phases)
            except NonFiniteStep as e:
                return self._end_nonfinite(e, start)
            timeline.mark("first_step")  # the first mark wins: the segment's first optimizer step, on every rank
            ts = TrainState(step=ts.step + 1, tokens=ts.tokens + self.tokens_per_step,
                            samples=ts.samples + self.spec.global_batch_size)
            if phases:
                log0(env, "[FSDPDiagnostics] step %d peak MiB per phase: %s", ts.step, phases)
            row = {"step": ts.step, "loss": loss, "grad_norm": gnorm, "lr": lr, "world_size": env.world_size,
                   "segment": self.segment_index, "tokens": ts.tokens, "step_seconds": round(time.perf_counter() - t0, 4),
                   **self.nonfinite.row()}
            if self.spec.eval is not None and ts.step % self.spec.eval.interval == 0:
                row.update(self.evaluate())
                self._record_eval(row)
            if env.is_rank0:
                append_jsonl(self.run_dir.metrics, row)
                line = progress.update(ts.step, loss)
                if line:
                    log0(env, "%s", line)
            if watcher.should_stop():
                log0(env, "preemption signal received: committing a checkpoint at step %d", ts.step)
                self.ckpt.save(ts, reason="preempted", blocking=True)
                timeline.mark("emergency_saved")
                status = "preempted"
                break
            if ts.step % self.spec.checkpoint.interval == 0 and ts.step < self.until_step:
                self.ckpt.save(ts, reason="interval")
        if status == "completed":
            self.ckpt.save(ts, reason="end", blocking=True)
        self.ckpt.close()
        self._write_status(status, start, ts.step, note=self.nonfinite.note())
        return EXIT_PREEMPTED if status == "preempted" else 0

    def _record_eval(self, row: dict) -> None:
        if not self.env.is_rank0:
            return
        from ckpt import lineage

        log0(self.env, "eval at step %d: loss %.4f perplexity %.2f (%d held-out tokens)", row["step"], row["eval_loss"],
             row["eval_ppl"], row["eval_tokens"])
        assert self.spec.eval is not None
        lineage.record(self.run_dir, "eval", f"eval:step-{row['step']:08d}", parent=f"segment:{self.segment_index}",
                       step=row["step"], eval_loss=row["eval_loss"], eval_ppl=row["eval_ppl"],
                       eval_tokens=row["eval_tokens"], split=self.spec.eval.split, world_size=self.env.world_size,
                       segment=self.segment_index)

    def _end_nonfinite(self, err: NonFiniteStep, start: int) -> int:
        """Stop at a non-finite step without saving it (trainer.nonfinite.end_segment); returns EXIT_NONFINITE."""
        return end_segment(err, ckpt=self.ckpt, run_dir=self.run_dir, is_rank0=self.env.is_rank0,
                           segment=self.segment_index, start=start, lr=self.spec.optim.lr, write_status=self._write_status,
                           skipped=self.nonfinite.skipped)

    def _write_status(self, status: str, start: int, end: int, note: str | None = None, exit_code: int | None = None) -> None:
        execution = {k: self.diagnostics[k] for k in EXECUTION_KEYS if k in self.diagnostics}
        write_status(self.run_dir, self.env, self.segment_index, status, start, end, note, execution=execution,
                     exit_code=exit_code)


def stopped_early_note(step: int, *, loaded: bool = True) -> str:
    """``loaded``: the ranks loaded ``step`` before the signal (False: stopped during start-up, before the build)."""
    if step == 0:
        return "stopped before the first step with nothing trained: no checkpoint; the next segment starts clean"
    how = "(loaded)" if loaded else "(not loaded: stopped during start-up)"
    return f"stopped before the first step: nothing new to save; step-{step:08d} {how} stays the latest checkpoint"


def write_status(run_dir: RunDir, env: DistEnv, segment: int, status: str, start: int, end: int,
                 note: str | None = None, execution: dict | None = None, exit_code: int | None = None) -> None:
    """The segment's report to the launcher (rank 0): a SegmentReport (schemas.seam), with the time every phase
    was reached (a collective: every rank's marks are gathered)."""
    timeline.mark("closed")
    marks: list[dict[str, float]] = [{} for _ in range(env.world_size)]
    dist.all_gather_object(marks, timeline.local_marks(), group=env.ctrl_group)
    if env.is_rank0:
        launch = SegmentLaunch.from_environ()
        ckpt = run_dir.checkpoint(end)
        SegmentReport(segment=segment, status=status, start_step=start, end_step=end,  # type: ignore[arg-type]
                      checkpoint=str(ckpt) if end and ckpt.exists() else None, world_size=env.world_size,
                      topology=env.topology, note=note, exit_code=exit_code, execution=execution or None,
                      times=timeline.summarize(marks, launch.launched_at if launch else None)).write(run_dir.root)


class ProgressLine:
    """Rank 0's periodic progress line: step, loss, tokens/s and ETA, at the first step, then at most every
    ``every_s`` seconds (SHARDKEEPER_PROGRESS_S, default 10), and at the last step."""

    def __init__(self, start: int, until: int, tokens_per_step: int, every_s: float | None = None):
        import os

        self.start, self.until, self.tokens_per_step = start, until, tokens_per_step
        self.every_s = float(os.environ.get("SHARDKEEPER_PROGRESS_S", "10")) if every_s is None else every_s
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def update(self, step: int, loss: float) -> str | None:
        now = time.perf_counter()
        if self.last is not None and step < self.until and now - self.last < self.every_s:
            return None
        self.last = now
        done = step - self.start
        rate = done / max(now - self.t0, 1e-9)  # steps per second over this segment
        eta = (self.until - step) / rate if rate > 0 else 0.0
        return (f"step {step}/{self.until} loss {loss:.4f} {rate * self.tokens_per_step:,.0f} tokens/s "
                f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
