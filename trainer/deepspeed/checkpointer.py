"""The DeepSpeed ZeRO 1/2/3 Checkpointer: DeepSpeed's own files under the shared commit protocol
(``trainer.checkpointer.core``).

A checkpoint is ``step-XXXXXXXX/`` holding DeepSpeed's own files (``engine.save_checkpoint``), each rank's RNG state
(``rng_rank_XXXXX.pt``, which also carries the packed states of a script's tracked objects) and the counters
(``shardkeeper_state.json``); every file is fsynced and hashed as it is written. At the saving world size it loads
natively and bit-exactly; at another one, rank 0 converts it once to ``step-XXXXXXXX/universal/``
(ckpt.formats.deepspeed.convert, cached, recorded in lineage) while the others wait, and every rank loads that with
DeepSpeed's ``load_universal``. Used by the built-in trainer (``trainer.deepspeed.backend``) and by a script that
tracks a
DeepSpeed engine (``trainer.api._tracked``).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt.commit import fingerprint as fp
from ckpt.commit.layout import RunDir
from ckpt.commit.state import MOMENTS, reseed
from ckpt.formats.deepspeed.zero import (
    STATE_FILE,
    UNIVERSAL_DIR,
    read_rng,
    read_state,
    rng_file,
    save_torch,
    write_hashed,
)
from ckpt.formats.pickle.torchzip import check_file
from schemas import CheckpointManifest, DtypePolicy, FileEntry, Fingerprint, HFModelRecord, RunSpec, TensorEntry
from schemas.errors import CheckpointError, ModelMismatch
from trainer.checkpointer.core import Checkpointer, TrainState, Written
from trainer.deepspeed._staging import Captured, HostStaging, capturing_engine
from trainer.dist import DistEnv

log = logging.getLogger("shardkeeper.deepspeed")

_GROUP_HPARAMS = ("weight_decay", "betas", "eps")


class DeepSpeedCheckpointer(Checkpointer):
    """The Checkpointer over a DeepSpeed engine: same public interface, same commit, DeepSpeed's files.

    ``engine.save_checkpoint`` runs with a capturing checkpoint engine (``trainer.deepspeed._staging``): the snapshot is
    what DeepSpeed would write; a sync save writes it at once, an async one copies it into reused host buffers
    and writes the copy on the background thread; the same bytes either way."""

    FORMAT = "deepspeed"
    BACKEND = "deepspeed"
    SUPPORTS_ASYNC = True

    def __init__(
        self,
        run_dir: RunDir,
        spec: RunSpec,
        engine: Any,
        env: DistEnv,
        *,
        segment: int,
        hf_model: HFModelRecord | None = None,
    ):
        super().__init__(run_dir, spec, engine.module, engine.optimizer, env, segment=segment, hf_model=hf_model)
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
                out.append(
                    (
                        name,
                        safe_get_local_fp32_param(p).reshape(-1).narrow(0, 0, real),
                        {m: safe_get_local_optimizer_state(p, m).reshape(-1).narrow(0, 0, real) for m in MOMENTS},
                    )
                )
                continue
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:  # all of this parameter lives in other ranks' partitions
                out.append((name, empty, {m: empty for m in MOMENTS}))
                continue
            addr = hp.get_hp_fragment_address()
            flat = opt.single_partition_of_fp32_groups[hp.param_group_index]
            state = opt.optimizer.state[flat]
            out.append(
                (
                    name,
                    flat.narrow(0, addr.start, addr.numel),
                    {m: state[m].narrow(0, addr.start, addr.numel) for m in MOMENTS},
                )
            )
        return out

    def _optim_step(self) -> float:
        for st in self.engine.optimizer.optimizer.state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        return self._fingerprint_of(self._fragments(), self._optim_step(), group, method)

    @staticmethod
    def _fingerprint_of(
        frags: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]],
        optim_step: float,
        group: dist.ProcessGroup | None,
        method: str = fp.METHOD,
    ) -> Fingerprint:
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

    def live_model_inventory(self) -> list[TensorEntry]:
        return [e for e in self._ds_inventory() if e.name.startswith("model.")]

    def live_dtype_policy(self) -> DtypePolicy:
        from trainer.precision import engine_policy

        return engine_policy(self.engine)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(getattr(p, "ds_shape", None) or p.shape)) for n, p in self.engine.module.named_parameters()]

    def named_param_groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """ZeRO keeps each group's parameters aside (its optimizer's groups hold flat partitions): ZeRO-1/2 in
        ``bit16_groups``, ZeRO-3 in sub-groups of ``fp16_groups`` mapped to their group."""
        from ckpt.commit.identity import canonical

        opt = self.engine.optimizer
        if self.zero_stage == 3:
            groups: list[list[Any]] = [[] for _ in opt.param_groups]
            for sub, params in enumerate(opt.fp16_groups):
                groups[opt.sub_group_to_group_id[sub]] += list(params)
        else:
            groups = [list(g) for g in opt.bit16_groups]
        names = {id(p): canonical(n) for n, p in self.engine.module.named_parameters()}
        return [[(names[id(p)], tuple(getattr(p, "ds_shape", None) or p.shape)) for p in g] for g in groups]

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
        if self.extra:  # the tracked objects' packed states ride in this rank's RNG file (uint8 tensors too)
            from trainer.extras import EXTRA_PREFIX, pack_all

            rng.update({EXTRA_PREFIX + k: v for k, v in pack_all(self.extra).items()})
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
        return Written(
            sorted(entries, key=lambda e: e.path),
            self._ds_inventory(),
            fingerprint,
            problem=problem,
            phases={"write_s": write_s},
        )

    def _save_extras(self, partial: Path, ts: TrainState, rng: dict[str, torch.Tensor]) -> list[FileEntry]:
        """This rank's RNG state; on rank 0 also the counters and the schedule position."""
        size, digest = save_torch(partial / rng_file(self.env.rank), rng)
        out = [FileEntry(path=rng_file(self.env.rank), size=size, xxh3_128=digest, rank=self.env.rank)]
        if self.env.is_rank0:
            state = {
                "step": ts.step,
                "tokens": ts.tokens,
                "samples": ts.samples,
                "schedule_last_step": ts.step - 1,
                "zero_stage": self.zero_stage,
                "world_size": self.env.world_size,
                "layout": "zero",
            }
            text = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
            size, digest = write_hashed(partial / STATE_FILE, lambda f: f.write(text))
            out.append(FileEntry(path=STATE_FILE, size=size, xxh3_128=digest, rank=0))
        return out

    # ----------------------------------------------------------------- load hooks
    def restore(self, path: Path, manifest: CheckpointManifest) -> tuple[TrainState, bool]:
        """Natively at the saving world size (bit-exact), else through the universal layout: also when another kind
        of run wrote it, whose optimizer groups (DeepSpeed's flat partitions follow them) need not be this run's;
        the universal layout holds each parameter on its own."""
        state = read_state(path)
        native = (
            state["layout"] == "zero"
            and manifest.topology.world_size == self.env.world_size
            and self.other_kind(manifest) is None
        )
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
        from ckpt.commit import identity

        live = [e.name for e in self.model_inventory()]
        names = identity.renames(live, [e.name for e in manifest.tensors if e.name.startswith(identity.MODEL_PREFIX)])
        if names:  # DeepSpeed loads by the names it saved under (the module's state dict, the universal folders)
            mine, theirs = next(iter(names.items()))
            raise ModelMismatch(
                f"{path}: holds {theirs[len(identity.MODEL_PREFIX) :]} where this run's model has "
                f"{mine[len(identity.MODEL_PREFIX) :]} (a wrapper's prefix); DeepSpeed loads by the "
                "saved names: wrap the model as the run that wrote it did (engine.compile() instead "
                "of torch.compile before deepspeed.initialize keeps the names)"
            )
        saved = manifest.run_spec.deepspeed.zero_stage
        if saved != self.zero_stage and read_state(path)["layout"] == "zero" and self.other_kind(manifest) is None:
            raise CheckpointError(
                f"{path}: written under ZeRO stage {saved}, this run is configured for stage "
                f"{self.zero_stage}; resume with --set deepspeed.zero_stage={saved} (the run's own config)"
            )

    def _load_native(self, path: Path) -> None:
        loaded, _ = self.engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if loaded is None:
            raise CheckpointError(f"{path}: DeepSpeed found no checkpoint files to load; the checkpoint is incomplete")

    def _universal(self, path: Path, manifest: CheckpointManifest) -> Path:
        """Rank 0 converts (or finds the cached conversion) while the others wait; all verify its files."""
        from ckpt.formats.deepspeed.convert import ensure_universal

        error: BaseException | None = None
        message = None
        if self.env.is_rank0:
            try:
                ensure_universal(
                    path,
                    run_dir=self.run_dir,
                    to_world_size=self.env.world_size,
                    threads=self.spec.checkpoint.io_threads,
                )
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
            loaded, _ = self.engine.load_checkpoint(
                str(target.parent), tag=target.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        finally:
            cfg.load_universal_checkpoint = False
        if loaded is None:
            raise CheckpointError(f"{target}: DeepSpeed found no universal checkpoint files to load")

    def read_extras(self, path: Path, rank: int) -> dict[str, torch.Tensor]:
        from trainer.extras import EXTRA_PREFIX

        rng = read_rng(path / rng_file(rank))
        return {k[len(EXTRA_PREFIX) :]: v for k, v in rng.items() if k.startswith(EXTRA_PREFIX)}

    def _restore_rng(self, path: Path, manifest: CheckpointManifest, native: bool) -> None:
        if not native:
            reseed(self.spec.seed, manifest.step, self.env.rank)
            return
        rng = read_rng(path / rng_file(self.env.rank))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.env.device)
