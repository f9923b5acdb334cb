"""DeepSpeed ZeRO 1/2/3 backend: the FSDP2 segment's loop, data order, loss and metrics on a DeepSpeed
engine, and its checkpoints under the same commit protocol.

Selected by ``backend: deepspeed`` in the RunSpec (``deepspeed.zero_stage`` 1, 2 or 3); on 2 CPU ranks:

    shardkeeper train --config configs/tiny.yaml --set backend=deepspeed --run-dir runs/ds --nproc 2 --until-step 20

A checkpoint is ``step-XXXXXXXX/`` holding DeepSpeed's own files (``engine.save_checkpoint``), each rank's
RNG state (``rng_rank_XXXXX.pt``) and the counters (``shardkeeper_state.json``); every file is fsynced and
hashed as it is written, and the commit (manifest with format="deepspeed", rename, fsync) is the fsdp2
Checkpointer's. ``checkpoint.async_save`` works as for FSDP2: training waits for one copy of the state into
reused host buffers, the files are written, hashed and committed in the background (``trainer.ds_staging``),
the same bytes a sync save writes. At the saving world size it loads natively and bit-exactly; at another one, rank 0
converts it once to ``step-XXXXXXXX/universal/`` (ckpt.formats.deepspeed_convert, cached, recorded in lineage)
while the others wait, and every rank loads that with DeepSpeed's ``load_universal``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt.state import MOMENTS, reseed
from ckpt import fingerprint as fp
from ckpt.formats.deepspeed import (STATE_FILE, UNIVERSAL_DIR, read_rng, read_state, rng_file, save_torch,
                               write_hashed)
from schemas.errors import CheckpointError
from ckpt.formats.torchzip import check_file
from ckpt.layout import RunDir
from schemas import CheckpointManifest, FileEntry, Fingerprint, HFModelRecord, RunSpec, TensorEntry

from trainer.checkpointer import Checkpointer, TrainState, Written
from trainer.dist import DistEnv, log0
from trainer.ds_staging import Captured, HostStaging, capturing_engine
from trainer.optim import WarmupCosine, build_optimizer
from trainer.loop import Segment
from trainer.model import block_modules, load_pretrained_shards, materialize
from trainer.perf import apply_block_options, describe

log = logging.getLogger("shardkeeper.deepspeed")

_GROUP_HPARAMS = ("weight_decay", "betas", "eps")


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


class DeepSpeedSegment(Segment):
    """A Segment whose model is a DeepSpeed engine; ``run()`` is inherited unchanged."""

    def __init__(self, run_dir: RunDir, until_step: int, segment: int, env: DistEnv):
        deepspeed = _import_deepspeed(env)
        model = self._build(run_dir, until_step, segment, env)
        self.config = ds_config(self.spec, env.world_size)
        if self.pretrained and self.spec.deepspeed.zero_stage == 3:
            # ZeRO-3: rebuilt under zero.Init, every rank holds only its partitions (trainer.ds_zero3); the
            # meta-built model above gave the signature and the export record.
            from trainer.ds_zero3 import build_partitioned

            model = build_partitioned(self.spec, self.config, model)
        elif self.pretrained:
            # ZeRO-1/2 keep every parameter whole on every rank: allocate them (uninitialised; start_fresh reads the
            # pretrained weights, a resume the checkpoint).
            materialize(model, env.device)
        # the performance options before DeepSpeed registers its hooks, as for FSDP2 (in place: names unchanged)
        self.diagnostics = apply_block_options(block_modules(model), self.spec.performance)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, self.spec),
                                               config=self.config)
        self.engine = engine
        self.model = engine
        self.optimizer = engine.optimizer
        self.schedule = WarmupCosine(engine.optimizer, self.spec)  # sets lr in the client AdamW's groups
        self.ckpt = DeepSpeedCheckpointer(run_dir, self.spec, engine, env, segment=segment, signature=self.signature,
                                          hf_model=self.hf_model)
        self.ckpt.data = self.data_record

    def load_pretrained(self) -> dict[str, float]:
        """ZeRO-1/2: read every weight into the engine's (whole) parameters, then refresh this rank's fp32 master
        partition from them, as deepspeed.initialize did from the uninitialised ones. ZeRO-3: each rank reads its
        partitions only (trainer.ds_zero3.fill_partitions)."""
        if self.spec.deepspeed.zero_stage == 3:
            from trainer.ds_zero3 import fill_partitions

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
        log0(self.env, "[DeepSpeedDiagnostics] zero_stage=%d world_size=%d device=%s compute=%s reduce=%s "
             "micro_batch=%d grad_accum=%d clip=%s", self.spec.deepspeed.zero_stage, self.env.world_size,
             self.env.device, self.spec.precision.compute, c["communication_data_type"],
             c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["gradient_clipping"])
        log0(self.env, "[DeepSpeedDiagnostics] execution: %s", describe(self.diagnostics))

    def train_step(self, step: int, phases: dict[str, float | None] | None) -> tuple[float, float, float]:
        lr = self.schedule.set_step(step)
        global_tokens = max(self.loader.targets(step), 1)  # = tokens_per_step unless labels are masked (chat)
        local_sum = torch.zeros((), dtype=torch.float64)
        for inputs, labels in self.loader.rank_batches(step, self.env.rank, self.env.world_size,
                                                       self.spec.micro_batch_size):
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


# -------------------------------------------------------------------------------------- checkpointing
class DeepSpeedCheckpointer(Checkpointer):
    """The Checkpointer over a DeepSpeed engine: same public interface, same commit, DeepSpeed's files.

    ``engine.save_checkpoint`` runs with a capturing checkpoint engine (``trainer.ds_staging``): the snapshot is
    what DeepSpeed would write; a sync save writes it at once, an async one copies it into reused host buffers
    and writes the copy on the background thread; the same bytes either way."""

    FORMAT = "deepspeed"
    BACKEND = "deepspeed"
    SUPPORTS_ASYNC = True

    def __init__(self, run_dir: RunDir, spec: RunSpec, engine: Any, env: DistEnv, *, segment: int, signature: str,
                 hf_model: HFModelRecord | None = None):
        super().__init__(run_dir, spec, engine.module, engine.optimizer, env, segment=segment, signature=signature,
                         hf_model=hf_model)
        self.engine = engine
        self.zero_stage = spec.deepspeed.zero_stage
        self.files = capturing_engine()
        engine.checkpoint_engine = self.files
        self.staging = HostStaging(pin=env.device.type == "cuda")
        # save_checkpoint also copies DeepSpeed's zero_to_fp32.py scripts beside the step directories, into
        # checkpoints/ itself; `shardkeeper convert/export` replace them, and nothing unlisted is written.
        engine._copy_recovery_script = lambda save_path: None
        # Per-group hyperparameters of the RunSpec. ZeRO-3's universal loader copies group 0's onto every
        # group (weight decay onto the no-decay group), so they are put back after every load.
        self.group_hparams = [{k: g[k] for k in _GROUP_HPARAMS} for g in engine.optimizer.param_groups]


    # ----------------------------------------------------------------- fingerprint
    def _fragments(self) -> list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]:
        """Per parameter: this rank's fp32 master fragment and the matching AdamW moment fragments (views of
        the live state; an async save re-points them at its staged copy)."""
        out = []
        empty = torch.zeros(0)
        opt = self.engine.optimizer
        for name, p in self.engine.module.named_parameters():
            if self.zero_stage == 3:
                from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

                # A ZeRO-3 partition is padded to ceil(numel / world) elements on every rank: the padding
                # of the last ranks is not part of the parameter (and is not initialised), so leave it out.
                part = p.ds_tensor.ds_numel
                real = max(0, min(part, p.ds_numel - self.env.rank * part))
                out.append((name, safe_get_local_fp32_param(p).reshape(-1).narrow(0, 0, real),
                            {m: safe_get_local_optimizer_state(p, m).reshape(-1).narrow(0, 0, real) for m in MOMENTS}))
                continue
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:  # all of this parameter lives in other ranks' partitions
                out.append((name, empty, {m: empty for m in MOMENTS}))
                continue
            addr = hp.get_hp_fragment_address()
            flat = opt.single_partition_of_fp32_groups[hp.param_group_index]
            state = opt.optimizer.state[flat]
            out.append((name, flat.narrow(0, addr.start, addr.numel),
                        {m: state[m].narrow(0, addr.start, addr.numel) for m in MOMENTS}))
        return out

    def _optim_step(self) -> float:
        for st in self.engine.optimizer.optimizer.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        return self._fingerprint_of(self._fragments(), self._optim_step(), group, method)

    @staticmethod
    def _fingerprint_of(frags: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]], optim_step: float,
                        group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        """Per-tensor norms of fp32 masters and moments: local fragments in float64, one all-reduce."""
        model = [(n, t) for n, t, _ in frags]
        moments = [(f"{n}.{m}", t) for n, _, ms in frags for m, t in ms.items()]
        names, vec = fp.local_sum_squares(model + moments, method)
        sq = fp.reduce_sum_squares(names, vec, group)
        return fp.make_fingerprint({k: sq[k] for k, _ in model}, {k: sq[k] for k, _ in moments}, optim_step, method)

    def _ds_inventory(self) -> list[TensorEntry]:
        out = []
        for name, p in self.engine.module.named_parameters():
            shape = list(getattr(p, "ds_shape", p.shape))
            out.append(TensorEntry(name=f"model.{name}", shape=shape, dtype="float32"))
            out += [TensorEntry(name=f"optim.state.{name}.{m}", shape=shape, dtype="float32") for m in MOMENTS]
        return out

    # ----------------------------------------------------------------- save hooks
    def snapshot(self, ts: TrainState) -> Captured:
        """``engine.save_checkpoint`` into the capturing engine (DeepSpeed's barriers and tag check run here,
        on the training thread), with the fingerprint's fragments and this rank's RNG state: nothing is copied."""
        partial = self.run_dir.partial(ts.step)
        self.files.captured = []
        self.engine.save_checkpoint(str(partial.parent), tag=partial.name, client_state={}, save_latest=False)
        rng = {"cpu": torch.get_rng_state()}
        if self.env.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.env.device)
        return Captured(self.files.take(str(partial)), self._fragments(), self._optim_step(), rng)

    def stage(self, snapshot: Captured) -> Captured:
        return self.staging.stage(snapshot)

    def prepare_staging(self, ts: TrainState) -> None:
        """Allocate (and touch) the host buffers now, not at the first save; not before AdamW has state,
        whose tensors the first step creates."""
        if not self.staging.buffers and self.engine.optimizer.optimizer.state:
            self.stage(self.snapshot(ts))

    def release(self) -> None:
        self.staging.release()

    def write(self, snapshot: Captured, ts: TrainState, partial: Path) -> Written:
        """Write the captured files into ``partial`` with torch.save through a hashing, fsyncing stream, plus
        this rank's RNG file (and on rank 0 the counters); a failure is reported, not raised, so the commit
        agrees on it."""
        t = time.perf_counter()
        entries: list[FileEntry] = []
        problem = None
        try:
            for rel, state in snapshot.files:
                path = partial / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                size, digest = save_torch(path, state)
                entries.append(FileEntry(path=rel, size=size, xxh3_128=digest, rank=self.env.rank))
            entries += self._save_extras(partial, ts, snapshot.rng)
        except Exception as e:
            problem = self.save_problem(e, partial)
        write_s = time.perf_counter() - t
        fingerprint = self._fingerprint_of(snapshot.fragments, snapshot.optim_step, self.env.ckpt_group)
        return Written(sorted(entries, key=lambda e: e.path), self._ds_inventory(), fingerprint, problem=problem,
                       phases={"write_s": write_s})

    def _save_extras(self, partial: Path, ts: TrainState, rng: dict[str, torch.Tensor]) -> list[FileEntry]:
        """This rank's RNG state; on rank 0 also the counters and the schedule position."""
        size, digest = save_torch(partial / rng_file(self.env.rank), rng)
        out = [FileEntry(path=rng_file(self.env.rank), size=size, xxh3_128=digest, rank=self.env.rank)]
        if self.env.is_rank0:
            state = {"step": ts.step, "tokens": ts.tokens, "samples": ts.samples, "schedule_last_step": ts.step - 1,
                     "zero_stage": self.zero_stage, "world_size": self.env.world_size, "layout": "zero"}
            text = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
            size, digest = write_hashed(partial / STATE_FILE, lambda f: f.write(text))
            out.append(FileEntry(path=STATE_FILE, size=size, xxh3_128=digest, rank=0))
        return out

    # ----------------------------------------------------------------- load hooks
    def restore(self, path: Path, manifest: CheckpointManifest) -> tuple[TrainState, bool]:
        """Natively at the saving world size (bit-exact), else through the universal layout."""
        state = read_state(path)
        native = state["layout"] == "zero" and manifest.topology.world_size == self.env.world_size
        if native:
            problem = self._check_pickles(path, recursive=False)  # every rank agrees before DeepSpeed reads any
            if problem is not None:
                raise CheckpointError(problem)
            self._load_native(path)
        else:
            self._load_universal(self._universal(path, manifest))
        self._repair_after_load()
        self._restore_rng(path, manifest, native)
        return TrainState(step=int(state["step"]), tokens=int(state["tokens"]), samples=int(state["samples"])), native

    def _repair_after_load(self) -> None:
        """Undo two side effects of DeepSpeed's ZeRO-3 universal loader: it copies group 0's hyperparameters
        onto every group, and gives every group the *same* step tensor, which AdamW then increments once
        per group (wrong bias correction). Harmless after the other loads."""
        for group, hp in zip(self.engine.optimizer.param_groups, self.group_hparams):
            group.update(hp)
        for st in self.engine.optimizer.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()

    def check_loadable(self, path: Path, manifest: CheckpointManifest) -> None:
        super().check_loadable(path, manifest)
        saved = manifest.run_spec.deepspeed.zero_stage
        if saved != self.zero_stage and read_state(path)["layout"] == "zero":
            raise CheckpointError(f"{path}: written under ZeRO stage {saved}, this run is configured for stage "
                                  f"{self.zero_stage}; resume with --set deepspeed.zero_stage={saved} (the run's own config)")

    def _load_native(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(str(path.parent), tag=path.name, load_module_strict=True,
                                                load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"{path}: DeepSpeed found no checkpoint files to load; the checkpoint is incomplete")

    def _universal(self, path: Path, manifest: CheckpointManifest) -> Path:
        """Rank 0 converts (or finds the cached conversion) while the others wait; all verify its files."""
        from ckpt.formats.deepspeed_convert import ensure_universal

        error: BaseException | None = None
        message = None
        if self.env.is_rank0:
            try:
                ensure_universal(path, run_dir=self.run_dir, to_world_size=self.env.world_size,
                                 threads=self.spec.checkpoint.io_threads)
            except Exception as e:  # tell the waiting ranks, then fail here too
                error, message = e, f"{type(e).__name__}: {e}"
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
        if error is not None:
            raise error
        if box[0] is not None:
            raise CheckpointError(f"{path}: the universal conversion failed on rank 0 ({box[0]})")
        target = path / UNIVERSAL_DIR
        problem = self.verify_files(target) or self._check_pickles(target)
        if problem is not None:
            raise CheckpointError(problem)
        return target

    def _check_pickles(self, target: Path, *, recursive: bool = True) -> str | None:
        """DeepSpeed reads universal files with an unrestricted torch.load, and a run directory may come
        from someone else: every rank parses its share of the .pt files with the allow-list unpickler
        (nothing executed) before DeepSpeed opens any of them. None when all are plain tensor records."""
        files = sorted(target.rglob("*.pt") if recursive else target.glob("*.pt"))[self.env.rank :: self.env.world_size]
        bad = None
        for f in files:
            try:
                check_file(f)
            except CheckpointError as e:
                bad = str(e)
                break
        found: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(found, bad, group=self.env.ctrl_group)
        return next((b for b in found if b), None)

    def _load_universal(self, target: Path) -> None:
        # load_universal is read only by load_checkpoint, so it is switched on for this load alone.
        # DeepSpeed reads the zero/*.pt files with an unrestricted torch.load; _universal verified their
        # checksums and parsed every one with the allow-list unpickler first (_check_pickles).
        cfg = self.engine._config
        cfg.load_universal_checkpoint = True
        try:
            loaded, _ = self.engine.load_checkpoint(str(target.parent), tag=target.name, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        finally:
            cfg.load_universal_checkpoint = False
        if loaded is None:
            raise CheckpointError(f"{target}: DeepSpeed found no universal checkpoint files to load")

    def _restore_rng(self, path: Path, manifest: CheckpointManifest, native: bool) -> None:
        if not native:
            reseed(self.spec.seed, manifest.step, self.env.rank)
            return
        rng = read_rng(path / rng_file(self.env.rank))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.env.device)
