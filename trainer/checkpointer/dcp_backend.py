"""The FSDP2 backend's Checkpointer: DCP checkpoints of the sharded model, AdamW, counters and RNG.

Save: the state dict (DTensor shards of FSDP2) is written by ``dcp.save`` through the hashing O_DIRECT
writer (``ckpt.formats.dcp.direct_io``) while the fingerprint's local sums are computed beside it. Async: the
state is first copied into reusable CPU buffers (``stage``), and the write runs on the Checkpointer's
background thread over its own gloo group. Load: ``dcp.load`` through the allow-list reader, verified in one
pass (``ckpt.formats.dcp.onepass``: hashed while read, applied only once every file matched), resharding to any
world size; RNG states come back at the same world size,
otherwise every rank reseeds by the elastic rule (``ckpt.commit.state.reseed``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ckpt.commit import fingerprint as fp
from ckpt.commit import identity
from ckpt.commit.hashing import hash_files
from ckpt.commit.state import MOMENTS, reseed
from ckpt.formats.dcp.direct_io import ExactStoragePlanner, HashingDirectWriter
from ckpt.formats.dcp.onepass import load_verified
from ckpt.memtier import recycle as memtier_recycle
from ckpt.memtier.stage import SnapshotTemplate, StageFiles, write_metadata
from schemas import CheckpointManifest, DtypePolicy, FileEntry, Fingerprint, TensorEntry
from trainer.checkpointer.core import Checkpointer, TrainState, Written, background_pool
from trainer.optim import init_state

log = logging.getLogger("shardkeeper.checkpoint")


def cpu_buffers(sd: dict[str, Any], *, pin_memory: bool) -> dict[str, Any]:
    """Uninitialised CPU tensors shaped like ``sd``'s (DTensors keep their mesh and placements), for ``stage``.

    torch's ``_create_cpu_state_dict`` deep-copies every DTensor already on the CPU (data included) before
    swapping in an empty local tensor: on the CPU that is a full extra copy of the state, paid by the first
    async save of a fresh run (its optimizer state exists only after the first step). ``empty_like`` only
    allocates. Device (pinned) buffers keep torch's function."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict, _iterate_state_dict
    from torch.distributed.tensor import DTensor

    if pin_memory:
        return _create_cpu_state_dict(sd, pin_memory=True)

    def plain(t: torch.Tensor, *_: Any) -> torch.Tensor:
        return torch.tensor(0, dtype=t.dtype) if t.dim() == 0 else torch.empty_like(t, device="cpu")

    def dtensor(t: DTensor, *_: Any) -> DTensor:
        if t.dim() == 0 or t.device.type != "cpu":
            return _create_cpu_state_dict({"t": t})["t"]
        return DTensor.from_local(
            torch.empty_like(t.to_local()),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )

    def sharded(t: Any, *_: Any) -> Any:
        return _create_cpu_state_dict({"t": t})["t"]

    return _iterate_state_dict(
        sd, sharded, dtensor, plain, pg=None, device=None, cpu_offload=False, ranks_only=(), type_check=False
    )


def _local_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a nested state dict, a DTensor as its local shard."""
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _local_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _local_tensors(v)
    elif isinstance(tree, torch.Tensor):
        to_local = getattr(tree, "to_local", None)
        yield to_local() if to_local is not None else tree


def _renamed(sd: dict[str, Any], names: dict[str, str], *, drop_groups: bool) -> dict[str, Any]:
    """``sd`` (``DCPCheckpointer.state_dict``) with its model and optimizer-state names renamed (``names``: live
    -> checkpoint) and, ``drop_groups``, without the optimizer's param groups: what ``restore`` asks the checkpoint
    for. ``sd`` itself when nothing changes."""
    if not names and not drop_groups:
        return sd
    optim = {k: v for k, v in sd["optim"].items() if not (drop_groups and k == "param_groups")}
    optim["state"] = {names.get(k, k): v for k, v in sd["optim"]["state"].items()}
    return {**sd, "model": {names.get(k, k): v for k, v in sd["model"].items()}, "optim": optim}


class DCPCheckpointer(Checkpointer):
    """Checkpoints of an FSDP2 model and its optimizer in PyTorch Distributed Checkpoint format."""

    FORMAT = "dcp"
    BACKEND = "fsdp2"
    SUPPORTS_ASYNC = True
    ONE_PASS = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._staged: dict[str, Any] | None = None
        self._first_step_hook: Any = None  # a fresh run's staging waits for the first optimizer step
        # The memory tier at one copy (ckpt.memtier.stage): after one ordinary snapshot, the next one's files
        # are laid out and mapped ahead of time, and ``stage`` copies the state straight into them.
        self._template: SnapshotTemplate | None = None
        self._stage: StageFiles | None = None
        # what ``stage`` returned last (into the stage's files while there is a stage, else into the buffers)
        self._last_out: dict[str, Any] | None = None
        self._maps: dict[tuple[int, int], tuple[int, Any]] = {}  # file (device, inode) -> (size, its map)
        self._staged_keys: set[tuple[int, int]] = set()  # the files of the last snapshot staged in its files
        self._fp_pool = background_pool("ckpt-fingerprint", self.spec.checkpoint.background_nice)
        self._load_sums: fp.KnownSums = {}  # the last load's sums of what it wrote, for the fingerprint after it
        self._load_held: list[torch.Tensor] = []  # the tensors those sums are of, held until then

    # ----------------------------------------------------------------- state dict
    def state_dict(self, ts: TrainState, *, with_rng: bool = True) -> dict[str, Any]:
        """The nested state DCP saves: model and optimizer shards, counters, this rank's RNG states."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=False))
        sd: dict[str, Any] = {
            "model": msd,
            "optim": osd,
            "trainer": {
                "step": torch.tensor(ts.step, dtype=torch.int64),
                "tokens": torch.tensor(ts.tokens, dtype=torch.int64),
                "samples": torch.tensor(ts.samples, dtype=torch.int64),
            },
        }
        if with_rng:
            rng = {"cpu": torch.get_rng_state()}
            if self.env.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.env.device)
            sd["rng"] = {f"rank{self.env.rank}": rng}
        return sd

    @staticmethod
    def _fingerprint_parts(
        sd: dict[str, Any], method: str = fp.METHOD, rank: int = 0, known: fp.KnownSums | None = None
    ) -> tuple[list[str], torch.Tensor, int, float]:
        """Local part of the fingerprint: names and sums of squares (model first), and the optimizer step.

        A plain tensor (not a DTensor: a replicated module, e.g. under DDP) is the same on every rank, and DCP
        saves it once: only rank 0 counts it, or the sum would grow with the world size. ``known``: sums a load
        computed from the bytes it wrote into a tensor's memory (``fingerprint.local_sum_squares``)."""
        from torch.distributed.tensor import DTensor

        def once(t: Any) -> Any:
            return t if rank == 0 or isinstance(t, DTensor) or not isinstance(t, torch.Tensor) else t.new_empty(0)

        model = [(k, once(v)) for k, v in sorted(sd["model"].items())]
        moments = []
        step = 0.0
        for name, st in sorted(sd["optim"]["state"].items()):
            moments += [(f"{name}.{m}", once(st[m])) for m in MOMENTS if m in st]
            if "step" in st:
                step = float(st["step"])
        names, vec = fp.local_sum_squares(model + moments, method, known)
        return names, vec, len(model), step

    @staticmethod
    def _finish_fingerprint(
        parts: tuple[list[str], torch.Tensor, int, float], group: dist.ProcessGroup | None, method: str = fp.METHOD
    ):
        names, vec, n_model, step = parts
        sq = fp.reduce_sum_squares(names, vec, group)
        model_sq = {k: sq[k] for k in names[:n_model]}
        optim_sq = {k: sq[k] for k in names[n_model:]}
        return fp.make_fingerprint(model_sq, optim_sq, step, method)

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        """The fingerprint of the live state (a collective over ``group``); the first one after a load takes the
        sums that load computed of what it wrote (``restore``), and only that one."""
        known, self._load_sums = self._load_sums, {}
        held, self._load_held = self._load_held, []  # noqa: F841 - alive until the sums are taken
        sd = self.state_dict(TrainState(), with_rng=False)
        return self._finish_fingerprint(self._fingerprint_parts(sd, method, self.env.rank, known), group, method)

    @staticmethod
    def _model_entries(msd: dict[str, Any]) -> list[TensorEntry]:
        return [
            TensorEntry(name=f"model.{k}", shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."))
            for k, v in sorted(msd.items())
            if isinstance(v, torch.Tensor)
        ]

    @classmethod
    def _inventory(cls, sd: dict[str, Any]) -> list[TensorEntry]:
        out = cls._model_entries(sd["model"])
        for name, st in sorted(sd["optim"]["state"].items()):
            for m in MOMENTS:
                if m in st:
                    v = st[m]
                    out.append(
                        TensorEntry(
                            name=f"optim.state.{name}.{m}",
                            shape=list(v.shape),
                            dtype=str(v.dtype).removeprefix("torch."),
                        )
                    )
        return out

    def live_model_inventory(self) -> list[TensorEntry]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # the model's part of ``state_dict`` (the optimizer's would create AdamW state before the first step)
        return self._model_entries(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False)))

    def live_dtype_policy(self) -> DtypePolicy:
        from trainer.precision import module_policy

        return module_policy(self.model)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape)) for n, p in self.model.named_parameters()]  # a DTensor's shape is global

    def named_param_groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        names = {id(p): identity.canonical(n) for n, p in self.model.named_parameters()}
        return [[(names[id(p)], tuple(p.shape)) for p in g["params"]] for g in self.optimizer.param_groups]

    # ----------------------------------------------------------------- save hooks
    def snapshot(self, ts: TrainState) -> dict[str, Any]:
        sd = self.state_dict(ts)
        if self.extra:  # packed copies, taken now: never staged (their size may change between saves)
            from trainer.extras import pack_all

            sd["extra"] = {f"rank{self.env.rank}": pack_all(self.extra)}
        return sd

    def read_extras(self, path: Path, rank: int) -> dict[str, torch.Tensor]:
        from ckpt.formats.dcp.reader import DCPTensorReader

        prefix = f"extra.rank{rank}."
        with DCPTensorReader(path) as reader:
            return {k[len(prefix) :]: reader.read(k) for k in reader.tensor_keys() if k.startswith(prefix)}

    def prepare_staging(self, ts: TrainState) -> None:
        """Allocate the staging buffers of async saves now, before training, not at the first save."""
        # Not before the first optimizer step: get_state_dict would initialise AdamW's state (step=1)
        # with a dummy step, and the run would no longer match an uninterrupted one. A fresh run stages
        # right after its first step instead (a one-shot step hook): else its first save pays the
        # allocation and first touch of a whole copy of the state while training waits.
        if self._staged is None and not self.optimizer.state and self._first_step_hook is None:

            def after_first_step(*_: Any) -> None:
                self._remove_first_step_hook()
                self.prepare_staging(ts)

            self._first_step_hook = self.optimizer.register_step_post_hook(after_first_step)
        if self._staged is None and self.optimizer.state:
            sd = self.state_dict(ts)
            self._staged = cpu_buffers(sd, pin_memory=self.env.device.type == "cuda")
            self.stage(sd)  # touch every page once, so the first save does not pay the page faults

    def _remove_first_step_hook(self) -> None:
        if self._first_step_hook is not None:
            self._first_step_hook.remove()
            self._first_step_hook = None

    def release(self) -> None:
        self._remove_first_step_hook()
        self._fp_pool.shutdown(wait=True)
        self._drop_stage(unlink=True)  # a stage no snapshot took: its files would hold a snapshot's worth of memory
        self._maps, self._staged_keys = {}, set()
        self._staged = None

    # ----------------------------------------------------------------- the memory tier at one copy
    def _stages_in_files(self) -> bool:
        """Snapshots staged straight into their files: the memory tier on one node, a CPU state (a GPU's copy goes
        to pinned buffers, faster than to a file's pages)."""
        return self.memory is not None and not self.node_tier and self.env.device.type == "cpu"

    def staged_ahead(self) -> bool:
        return self._stage is not None

    def tier_gone(self) -> None:
        """The memory tier went off: a stage's files and the maps kept go now (another run may claim the dir)."""
        self._drop_stage(unlink=True)
        self._maps, self._staged_keys, self._template = {}, set(), None

    def after_snapshot(self, step: int) -> None:
        """Every rank, on the background thread, after the snapshot of ``step`` committed: the next snapshot's files
        laid out (the older snapshot's retired into the node's stage dir, its pages reused) and mapped. Anything
        failing here only means the next snapshot is written the ordinary way."""
        if not self._stages_in_files():  # the same on every rank
            return
        mem = self.memory
        assert mem is not None
        every = torch.tensor([0 if self._template is None else 1], dtype=torch.int32)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.env.ckpt_group)  # a template on every rank, or none
        if not int(every):
            return
        if self.is_leader:
            try:
                memtier_recycle.retire_for_stage(mem, step, self.run_dir)
            except Exception as e:  # noqa: BLE001 - never before the barrier below: every rank reaches it
                log.debug("memory tier: no stage for the next snapshot: %s", e)
        dist.barrier(group=self.env.ckpt_group)  # every rank sees the stage dir its leader made
        where = memtier_recycle.stage_dir(mem)
        self._drop_stage()
        if where is None or self._staged is None:
            return
        # Maps kept: the snapshot just committed if it was staged (its files are the stage after next), and the
        # files now in the stage dir. Any other map (of files retention removed) would keep their pages alive.
        keep = self._staged_keys | self._files_in(where)
        self._maps = {k: v for k, v in self._maps.items() if k in keep}
        try:
            self._stage = StageFiles(self._template, where, where, self._staged, self._maps)
        except ValueError as e:  # the state no longer has the template's shapes
            log.debug("memory tier: template dropped: %s", e)
            self._template = None
        except Exception as e:  # noqa: BLE001 - a full memory dir and the like: the next snapshot is written the ordinary way
            log.debug("memory tier: no stage for the next snapshot: %s", e)

    @staticmethod
    def _files_in(where: Path) -> set[tuple[int, int]]:
        try:
            return {(st.st_dev, st.st_ino) for st in (e.stat(follow_symlinks=False) for e in os.scandir(where))}
        except OSError:
            return set()

    def _drop_stage(self, unlink: bool = False) -> None:
        stage, self._stage = self._stage, None
        if stage is None:
            return
        stage.discard()
        if unlink and not stage.moved:
            for name in stage.template.sizes:
                try:
                    os.unlink(stage.dir / name)
                except OSError:
                    pass
            if self.is_leader:  # the others' files too (unlinked under their maps: those stay valid)
                shutil.rmtree(stage.dir, ignore_errors=True)

    def stage(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into CPU buffers that are allocated once and reused by later saves."""
        from torch.distributed._state_dict_utils import _copy_state_dict

        extra = snapshot.get("extra")
        if extra is not None:
            snapshot = {k: v for k, v in snapshot.items() if k != "extra"}
        if self._stage is not None and self.memory is not None:  # the copy is the write
            try:
                placed = self._stage.put_extras(extra) if extra is not None else {}
                if placed is None:  # a tracked object's packed state changed size: a new template after this one
                    raise ValueError("the tracked objects' states are not the sizes staged")
                out = _copy_state_dict(snapshot, self._stage.staged, non_blocking=False)
                self._last_out = out if extra is None else {**out, "extra": placed}
                return self._last_out
            except (ValueError, RuntimeError) as e:  # not the layout staged: the ordinary buffers
                log.debug("memory tier: not staged into the files: %s", e)
                self._drop_stage(unlink=True)  # every rank writes this one the ordinary way (agreed in write)
        if self._staged is None:
            self._staged = cpu_buffers(snapshot, pin_memory=self.env.device.type == "cuda")
        staged = _copy_state_dict(snapshot, self._staged, non_blocking=self.env.device.type == "cuda")
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        self._last_out = staged if extra is None else {**staged, "extra": extra}
        return self._last_out

    def write(self, snapshot: dict[str, Any], ts: TrainState, partial: Path) -> Written:
        group = self.env.ckpt_group
        t = time.perf_counter()
        # The fingerprint's local sums are computed while DCP writes (the write mostly waits on the
        # device); its all-reduce runs after dcp.save, as both use the checkpoint group.
        fp_job = self._fp_pool.submit(self._fingerprint_parts, snapshot, fp.METHOD, self.env.rank)
        in_memory = self.memory is not None and self.memory.checkpoints == partial.parent  # tmpfs: no O_DIRECT
        from_stage = self._last_out is not None and snapshot is self._last_out  # an async save's copy (else: live)
        self._last_out = None
        if in_memory and self._stages_in_files():
            staged = self._write_staged(snapshot if from_stage else None, partial, fp_job, group)
            if staged is not None:
                return Written(
                    staged,
                    self._inventory(snapshot),
                    self._finish_fingerprint(fp_job.result(), group),
                    phases={"write_s": time.perf_counter() - t, "fingerprint_wait_s": 0.0, "staged": 1.0},
                )
        writer = HashingDirectWriter(
            partial,
            sync_files=True,
            thread_count=self.spec.checkpoint.io_threads,
            overwrite=False,
            direct=not in_memory,
            reuse=memtier_recycle.recycle_dir(self.memory, ts.step) if in_memory else None,
        )
        failure: BaseException | None = None
        try:
            dcp.save(snapshot, storage_writer=writer, planner=ExactStoragePlanner(), process_group=group)
        except (Exception, CheckpointException) as e:  # DCP re-raises a rank's write error on every rank; agree anyway
            failure = e
        problem = self.agree(self.save_problem(failure, partial) if failure else None, group)
        if problem is not None:
            fp_job.cancel()
            self.abort_save(partial, problem, group)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        fingerprint = self._finish_fingerprint(fp_job.result(), group)
        fingerprint_wait_s = time.perf_counter() - t
        # Checksums were computed while writing; the metadata was written as .metadata.tmp and renamed.
        entries = self._entries(writer.digests, partial)
        if in_memory:  # the newest snapshot's files are not a staged one's: only the stage's maps are kept
            self._staged_keys = set()
            ahead = self._stage.keys if self._stage is not None else set()
            self._maps = {k: v for k, v in self._maps.items() if k in ahead}
        if in_memory and self._stages_in_files():
            # Every rank keeps its template only if every rank's files came out laid out as its template says (rank
            # 0's holds the global .metadata, which names every rank's offsets: kept from before another rank's
            # layout changed, it would be wrong). Else each makes it again from this write, after an async save
            # (after a blocking one, a segment's last, none is made).
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            same = torch.tensor(
                [
                    1
                    if self._template is not None
                    and self._template.same_layout(writer.results, flatten_state_dict(snapshot)[0])
                    else 0
                ],
                dtype=torch.int32,
            )
            dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
            if not int(same):
                self._template = self._build_template(partial, writer, snapshot) if from_stage else None
        return Written(
            entries,
            self._inventory(snapshot),
            fingerprint,
            phases={"write_s": write_s, "fingerprint_wait_s": fingerprint_wait_s},
        )

    def _entries(self, digests: dict[str, tuple[int, str]], partial: Path) -> list[FileEntry]:
        """This rank's files (rank 0: and ``.metadata``, written as ``.metadata.tmp`` by DCP) for the manifest."""
        entries = [
            FileEntry(
                path=".metadata" if name == ".metadata.tmp" else name, size=size, xxh3_128=digest, rank=self.env.rank
            )
            for name, (size, digest) in sorted(digests.items())
            if name.startswith(f"__{self.env.rank}_") or (self.env.is_rank0 and name in (".metadata.tmp", ".metadata"))
        ]
        if self.env.is_rank0 and not any(e.path == ".metadata" for e in entries):
            size, digest = hash_files([partial / ".metadata"])[partial / ".metadata"]
            entries.append(FileEntry(path=".metadata", size=size, xxh3_128=digest, rank=0))
        return entries

    def _build_template(
        self, partial: Path, writer: HashingDirectWriter, snapshot: dict[str, Any]
    ) -> SnapshotTemplate | None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        try:
            flat, _ = flatten_state_dict(snapshot)
            return SnapshotTemplate.build(
                partial, writer.results, writer.items, flat, writer.metadata if self.env.is_rank0 else None
            )
        except Exception as e:  # noqa: BLE001 - the snapshot was written; only the next ones stay ordinary
            log.debug("memory tier: no template from %s: %s", partial.name, e)
            return None

    def _write_staged(
        self, staged: dict[str, Any] | None, partial: Path, fp_job: Any, group: Any
    ) -> list[FileEntry] | None:
        """``staged``: what ``stage`` returned for this save (None: a blocking save's live state); with a stage, its
        files hold it: they join ``partial``, get their byte items, are hashed; rank 0 writes ``.metadata``. Every
        rank or none (agreed): else None, and the caller writes the snapshot the ordinary way (from the files' maps,
        if staged there), the stage dropped."""
        stage = self._stage if staged is not None else None
        blobs = stage.blob_bytes(staged) if stage is not None else None
        ready = torch.tensor(
            [
                1
                if blobs is not None
                and (self._template is not None and (self._template.metadata is not None or not self.env.is_rank0))
                else 0
            ],
            dtype=torch.int32,
        )
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
        if not int(ready):
            if stage is not None:  # its views stay valid for the ordinary write: the maps go with them
                self._stage = None
                self._maps = {k: v for k, v in self._maps.items() if k not in stage.keys}
                stage.discard()
            return None
        assert stage is not None and blobs is not None and self._template is not None
        self._stage = None
        self._staged_keys = stage.keys
        failure: BaseException | None = None
        digests: dict[str, tuple[int, str]] = {}
        try:
            stage.move_into(partial)
            stage.write_blobs(blobs)
            digests = stage.digests()
            if self.env.is_rank0:
                digests[".metadata"] = write_metadata(partial, self._template.metadata)
        except Exception as e:  # noqa: BLE001 - agreed below; a full memory dir turns the tier off as ever
            failure = e
        finally:
            stage.discard()
        problem = self.agree(self.save_problem(failure, partial) if failure else None, group)
        if problem is not None:
            fp_job.cancel()
            self.abort_save(partial, problem, group)
        return self._entries(digests, partial)

    # ----------------------------------------------------------------- load hooks
    def restore(self, path: Path, manifest: CheckpointManifest) -> tuple[TrainState, bool]:
        same_world = manifest.topology.world_size == self.env.world_size
        init_state(self.optimizer)  # the moments the load fills, without get_state_dict's dummy optimizer step
        live = self.state_dict(TrainState(), with_rng=same_world)
        # Names that differ from the checkpoint's only by a wrapper prefix (ckpt.commit.identity) are loaded under the
        # checkpoint's. Another kind of run's optimizer groups (their number, their settings) are not loaded: this
        # run trains with its own, and the state (moments, step) is matched by parameter name.
        names = identity.renames(
            live["model"],
            [
                e.name[len(identity.MODEL_PREFIX) :]
                for e in manifest.tensors
                if e.name.startswith(identity.MODEL_PREFIX)
            ],
        )
        own_groups = bool(names) or self.other_kind(manifest) is not None
        sd = _renamed(live, names, drop_groups=own_groups)
        # One pass: every byte is hashed as it is read, and the live tensors are written only after every file
        # of every rank matched the manifest (a mismatch raises ChecksumMismatch with the state untouched), or, with
        # eager_load, each chunk right behind the hash (a mismatch still raises; the state was written).
        # With node tiers, a memory snapshot is this node's copy (``trainer.checkpointer.node_tier``).
        node_copy = self.nodes if self.memory is not None and self.memory.root in path.parents else None
        self._load_sums, self._load_held = {}, []
        # The fingerprint after this load takes the sums the reader computed from the bytes it copied whole into a
        # live tensor's memory (read while the disk streamed the rest) instead of reading the state again: only the
        # memory of the state's own tensors, which live through the whole load (never a temporary's address).
        # The tensors the fingerprint covers (weights and moments), held until it ran: no other tensor can take
        # their memory, and so their keys, in between.
        covered = [
            t.detach()
            for t in _local_tensors(
                [sd["model"], [st[m] for st in sd["optim"]["state"].values() for m in MOMENTS if m in st]]
            )
        ]
        live_keys = {k for k in map(fp.memory_key, covered) if k is not None}
        # Eager (a resume that never starts over from the state as it is): each chunk goes into the live state as
        # the hash pass passes it, the copy hidden behind the device; a refusal has then written into the state.
        if self.eager_load:
            self.applied = True
        shared, self.shared_metadata = self.shared_metadata, None  # this load's only
        reader = load_verified(
            sd,
            path,
            {f.path: (f.size, f.xxh3_128) for f in manifest.files},
            process_group=self.env.ckpt_group,
            node_size=self.env.topology.procs_per_node if node_copy is not None else None,  # each node its own copy
            verified=node_copy.verified_in_copy(manifest.step) if node_copy is not None else None,
            sum_method=manifest.fingerprint.method,
            sum_keys=live_keys,
            sum_parts=not same_world,  # compared within the tolerance: parts' sums added are as good
            eager=self.eager_load,
            shared=shared,
        )  # hashed on the way in
        self.applied = True
        self._load_sums, self._load_held = reader.sums, covered
        if sd is not live:  # back to the live names and groups (the tensors were filled in place)
            back = {v: k for k, v in names.items()}
            groups = live["optim"]["param_groups"] if own_groups else sd["optim"]["param_groups"]
            sd = {
                **sd,
                "model": {back.get(k, k): v for k, v in sd["model"].items()},
                "optim": {
                    **sd["optim"],
                    "state": {back.get(k, k): v for k, v in sd["optim"]["state"].items()},
                    "param_groups": groups,
                },
            }
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if same_world:
            rng = sd["rng"][f"rank{self.env.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.env.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.env.device)
        else:
            reseed(self.spec.seed, manifest.step, self.env.rank)
        ts = TrainState(
            step=int(sd["trainer"]["step"]), tokens=int(sd["trainer"]["tokens"]), samples=int(sd["trainer"]["samples"])
        )
        # A converted checkpoint's fingerprint was summed by another code path (ckpt.formats.deepspeed.convert):
        # compare it within the cross-world tolerance even at the same world size.
        return ts, same_world and manifest.reason != "converted"
