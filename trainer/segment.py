"""One training segment on every rank: resume from the latest valid checkpoint, train until a step,
commit a checkpoint at the end (or on preemption).

Launched by ``shardkeeper train`` through torchrun; by hand, on 2 CPU ranks:

    torchrun --standalone --nproc-per-node 2 -m trainer.segment RUN_DIR 20 0

(RUN_DIR must hold run.yaml; positional arguments only, because torchrun claims options that
prefix its own.) Exit codes: 0 completed, 75 preempted (checkpoint committed, or nothing to save
when stopped before the first step), 1 failed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # A rank: tie its life to torchrun and the launcher, record early SIGTERMs and take the shared run
    # lock before the heavy imports below (seconds on a busy node); see trainer.lifetime.
    from schemas.errors import ShardkeeperError
    from trainer.lifetime import guard_rank

    try:
        _RANKS_LOCK_FD = guard_rank(sys.argv[1:2])
    except ShardkeeperError as _e:
        print(f"error: {_e}", file=sys.stderr)
        sys.exit(_e.exit_code)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from schemas.errors import ShardkeeperError  # noqa: E402
from ckpt.fsutil import append_jsonl, atomic_write_json, load_yaml  # noqa: E402
from ckpt.layout import RunDir  # noqa: E402
from schemas import RunSpec  # noqa: E402

from trainer.checkpointer import Checkpointer, TrainState  # noqa: E402
from trainer.data import GlobalOrderLoader, open_tokens  # noqa: E402
from trainer.dist import DistEnv, init_distributed, log0  # noqa: E402
from trainer.model import build_model, hf_model_record, model_signature, shard_model  # noqa: E402
from trainer.optim import WarmupCosine, build_optimizer, clip_grad_norm_  # noqa: E402
from trainer import lifetime  # noqa: E402
from trainer.signals import EXIT_PREEMPTED, PreemptionWatcher  # noqa: E402

log = logging.getLogger("shardkeeper.trainer")

STATUS_FILE = ".segment-status.json"


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
        self.model = model
        self.optimizer = build_optimizer(model, self.spec)
        self.schedule = WarmupCosine(self.optimizer, self.spec)
        self.ckpt = Checkpointer(run_dir, self.spec, model, self.optimizer, env, segment=segment, signature=self.signature,
                                 hf_model=self.hf_model)

    def _build(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv) -> torch.nn.Module:
        """What both backends share: the RunSpec, the model as transformers builds it (signature and
        export record taken before any wrapping renames its class) and the global-order data loader."""
        self.run_dir = run_dir
        self.until_step = until_step
        self.segment_index = segment
        self.env = env
        self.spec = load_spec(run_dir)
        self.local_batch = self.spec.per_rank_batch(env.world_size)
        model = build_model(self.spec)
        self.signature = model_signature(self.spec.model, model)
        self.hf_model = hf_model_record(model)
        self.vocab = model.config.vocab_size
        tokens = open_tokens(self.spec.data, self.spec.seed, self.vocab)
        self.loader = GlobalOrderLoader(tokens, self.spec.data.seq_len, self.spec.seed, self.spec.global_batch_size)
        self.tokens_per_step = self.spec.global_batch_size * self.spec.data.seq_len
        return model

    def log_diagnostics(self) -> None:
        d = self.diagnostics
        log0(self.env, "[FSDPDiagnostics] fsdp_units=%d (+1 root, %s) total_params=%d world_size=%d device=%s",
             d["fsdp_units"], d["block_class"], d["total_params"], self.env.world_size, self.env.device)
        log0(self.env, "[FSDPDiagnostics] dtypes: master=%s param(compute)=%s reduce=%s",
             d["master_dtype"], d["param_dtype"], d["reduce_dtype"])
        sizes = [None] * self.env.world_size
        dist.all_gather_object(sizes, d["local_param_MiB"], group=self.env.ctrl_group)
        log0(self.env, "[FSDPDiagnostics] local_trainable_param_MiB per rank: %s", sizes)

    def train_step(self, step: int, phases: dict[str, float | None] | None) -> tuple[float, float, float]:
        lr = self.schedule.set_step(step)
        global_tokens = self.tokens_per_step
        local_sum = torch.zeros((), dtype=torch.float64)
        batches = self.loader.rank_batches(step, self.env.rank, self.env.world_size, self.spec.micro_batch_size)
        if phases is not None:
            phases["batch_start"] = _peak_mib(self.env)
        for inputs, labels in batches:
            inputs, labels = inputs.to(self.env.device), labels.to(self.env.device)
            logits = self.model(input_ids=inputs).logits
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
            # FSDP averages gradients over ranks; scaling by the world size makes the result the
            # gradient of the mean over the *global* batch, whatever the world size.
            (loss_sum * (self.env.world_size / global_tokens)).backward()
            local_sum += loss_sum.detach().to("cpu", torch.float64)
        if phases is not None:
            phases["after_backward"] = _peak_mib(self.env)
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.spec.optim.grad_clip)
        if phases is not None:
            phases["before_optimizer_step"] = _peak_mib(self.env)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if phases is not None:
            phases["batch_end"] = _peak_mib(self.env)
        dist.all_reduce(local_sum, group=self.env.ctrl_group)
        return float(local_sum) / global_tokens, grad_norm, lr

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
        ts = self.ckpt.load_latest() or TrainState()
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
        status = "completed"
        while ts.step < self.until_step:
            t0 = time.perf_counter()
            phases: dict[str, float | None] | None = {} if (env.device.type == "cuda" and ts.step - start < 3) else None
            loss, gnorm, lr = self.train_step(ts.step, phases)
            ts = TrainState(step=ts.step + 1, tokens=ts.tokens + self.tokens_per_step,
                            samples=ts.samples + self.spec.global_batch_size)
            if phases:
                log0(env, "[FSDPDiagnostics] step %d peak MiB per phase: %s", ts.step, phases)
            if env.is_rank0:
                append_jsonl(self.run_dir.metrics, {
                    "step": ts.step, "loss": loss, "grad_norm": gnorm, "lr": lr, "world_size": env.world_size,
                    "segment": self.segment_index, "tokens": ts.tokens, "step_seconds": round(time.perf_counter() - t0, 4),
                })
            if watcher.should_stop():
                log0(env, "preemption signal received: committing a checkpoint at step %d", ts.step)
                self.ckpt.save(ts, reason="preempted", blocking=True)
                status = "preempted"
                break
            if ts.step % self.spec.checkpoint.interval == 0 and ts.step < self.until_step:
                self.ckpt.save(ts, reason="interval")
        if status == "completed":
            self.ckpt.save(ts, reason="end", blocking=True)
        self.ckpt.close()
        self._write_status(status, start, ts.step)
        return EXIT_PREEMPTED if status == "preempted" else 0

    def _write_status(self, status: str, start: int, end: int, note: str | None = None) -> None:
        write_status(self.run_dir, self.env, self.segment_index, status, start, end, note)


def stopped_early_note(step: int) -> str:
    if step == 0:
        return "stopped before the first step with nothing trained: no checkpoint; the next segment starts clean"
    return f"stopped before the first step: nothing new to save; step-{step:08d} (loaded) stays the latest checkpoint"


def write_status(run_dir: RunDir, env: DistEnv, segment: int, status: str, start: int, end: int,
                 note: str | None = None) -> None:
    """The segment's report to the launcher (rank 0): RUN_DIR/.segment-status.json."""
    if env.is_rank0:
        ckpt = run_dir.checkpoint(end)
        atomic_write_json(run_dir.root / STATUS_FILE, {
            "segment": segment, "status": status, "start_step": start, "end_step": end,
            "checkpoint": str(ckpt) if end and ckpt.exists() else None, "world_size": env.world_size,
            "topology": env.topology.model_dump(mode="json"), "note": note,
        })


def build_segment(run_dir: RunDir, until_step: int, segment: int, env: DistEnv) -> Segment:
    """The segment of the run's backend: FSDP2 here, DeepSpeed ZeRO in trainer.ds_backend (same loop)."""
    if load_spec(run_dir).backend == "deepspeed":
        from trainer.ds_backend import DeepSpeedSegment

        return DeepSpeedSegment(run_dir, until_step, segment, env)
    return Segment(run_dir, until_step, segment, env)


def run_segment(run_dir: str | Path, until_step: int, segment: int = 0) -> int:
    """Entry for one rank (torchrun or a spawn harness sets RANK/WORLD_SIZE/MASTER_*). Returns the exit code."""
    env = init_distributed()
    try:
        rd = RunDir.at(run_dir)
        if stop_agreed(env):  # a SIGTERM during start-up: do not build (and load) a model only to drop it
            return _preempted_before_build(rd, env, segment)
        seg = build_segment(rd, until_step, segment, env)
        return seg.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def stop_agreed(env: DistEnv) -> bool:
    """Did any rank get a stop signal during start-up? (A collective: every rank calls it.)"""
    flag = torch.tensor([0 if lifetime.stop_requested() is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=env.ctrl_group)
    return bool(flag.item())


def _preempted_before_build(run_dir: RunDir, env: DistEnv, segment: int) -> int:
    from ckpt.validate import latest_valid

    found = latest_valid(run_dir) if env.is_rank0 else None
    step = found[1].step if found else 0
    note = stopped_early_note(step)
    log0(env, "preemption signal received during start-up: %s", note)
    write_status(run_dir, env, segment, "preempted", step, step, note)
    return EXIT_PREEMPTED


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m trainer.segment RUN_DIR UNTIL_STEP [SEGMENT]", file=sys.stderr)
        return 2
    _setup_logging()
    try:
        torch.set_num_threads(_threads())
        return run_segment(argv[0], int(argv[1]), int(argv[2]) if len(argv) == 3 else 0)
    except ShardkeeperError as e:
        _report_failure(f"{e}", e.exit_code)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - any rank failure reaches the user as one line
        import traceback

        traceback.print_exc(file=sys.stderr)  # the full story, for `shardkeeper train -v`
        _report_failure(f"{type(e).__name__}: {' '.join(str(e).split())[:400]}; see the rank's traceback "
                        "(shardkeeper train -v)", 1)
        return 1


def _threads() -> int:
    raw = os.environ.get("OMP_NUM_THREADS", "1")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ShardkeeperError(f"OMP_NUM_THREADS={raw!r}: must be a positive integer; set e.g. OMP_NUM_THREADS=1")
    return int(raw)


def _report_failure(cause: str, code: int) -> None:
    """The last line this rank writes: the launcher shows the first such line as the segment's failure."""
    from launch.local import RANK_ERROR_PREFIX

    rank = os.environ.get("RANK", "0")
    sys.stderr.flush()
    print(f"{RANK_ERROR_PREFIX} rank {rank}: {cause}", file=sys.stderr, flush=True)
    log.debug("rank %s exits with code %d", rank, code)


if __name__ == "__main__":
    sys.exit(main())
