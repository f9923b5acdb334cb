"""The Checkpointer, for every backend: its state, the commit protocol, close and the backend hooks. It holds the
save side (``trainer.checkpointer.saver.Saver``: save, async, the memory tier's persist), the resume side
(``trainer.checkpointer.resumer.Resumer``: load_latest, its checks, fallback and quarantine) and, on several nodes,
the memory tier's node copies (``trainer.checkpointer.node_tier.NodeTier``); its public methods delegate to them.

Commit protocol (a directory without a valid manifest is never loaded):
  1. every rank writes its files into ``step-XXXXXXXX.partial/`` (the backend's format, fsync per file);
  2. each rank hashes the files it wrote (xxh3-128), in parallel across ranks;
  3. rank 0 gathers sizes and digests, writes ``manifest.json`` (fsync), renames the directory to
     ``step-XXXXXXXX`` and fsyncs the parent; then every rank learns the commit happened.

A failed save (a write error, a disk full, a file missing or of the wrong size at commit) raises the same
one-line CheckpointError on every rank, removes the ``.partial`` directory and commits nothing: the
previous checkpoint stays the resume point. After a commit rank 0 re-reads the checkpoint in the
background and records it as verified (ckpt.validate.checks.reread_and_record); retention keeps the newest one.
Not after a preemption's checkpoint: the ranks must exit within the grace period, and the next load hashes
every byte anyway (and records it verified then).

Backends (``trainer.checkpointer.dcp_backend``, ``trainer.deepspeed.backend``) implement hooks only.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.commit import fingerprint as fp
from ckpt.commit import identity, lineage
from ckpt.commit.fsutil import fsync_dir, mkdir_durable, quarantine
from ckpt.commit.layout import RunDir
from ckpt.commit.manifest import write_manifest
from ckpt.memtier import nodes as memtier_nodes
from ckpt.memtier import recycle as memtier_recycle
from ckpt.memtier import tier as memtier
from ckpt.memtier.tier import MEMORY, STORAGE
from ckpt.validate.retention import apply_retention
from schemas import (
    BaseModelRecord,
    CheckpointManifest,
    DataRecord,
    DtypePolicy,
    FileEntry,
    Fingerprint,
    HFModelRecord,
    ModelSpec,
    RunSpec,
    TensorEntry,
)
from schemas.errors import CheckpointError
from trainer import lifetime
from trainer.checkpointer.common import Progress, TrainState, Written, agree_in, background_pool, code_version
from trainer.checkpointer.node_tier import TIER_OFF as _TIER_OFF
from trainer.checkpointer.node_tier import NodeTier, take_early
from trainer.checkpointer.resumer import Resumer, _load_problem, checkpoint_at_fault
from trainer.checkpointer.saver import Saver, _disk_full, _tier_full
from trainer.dist import DistEnv

# Names other modules, tests and benches import from here.
__all__ = [
    "Checkpointer",
    "TrainState",
    "Written",
    "background_pool",
    "checkpoint_at_fault",
    "code_version",
    "_load_problem",
]

log = logging.getLogger("shardkeeper.checkpoint")


_NODE_COPIES = "node-copies"  # rank 0's decision: the manifest each node leader commits its copy with


def _find_os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind a failure: itself, its cause/context, or one rank's failure inside DCP's
    CheckpointException (which carries every failing rank's exception)."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, CheckpointException):
        for _rank, (inner, _tb) in sorted(exc.failures.items()):
            found = _find_os_error(inner, depth + 1)
            if found is not None:
                return found
    return _find_os_error(exc.__cause__ or exc.__context__, depth + 1)


class Checkpointer:
    """One per training segment. The trainer calls ``load_latest()`` once, ``save()`` at intervals
    and on preemption, and ``close()`` at the end.

    It owns the segment's state (run dir, spec, dist env, the memory dir, where the checkpoints stand: ``progress``,
    the background threads) and the commit. ``save`` / ``warm_up`` / ``wait`` go to its ``saver``
    (``trainer.checkpointer.saver.Saver``), ``load_latest`` / ``load`` / ``verify_files`` to its ``resumer``
    (``trainer.checkpointer.resumer.Resumer``); with the memory tier on several nodes, the node copies are its
    ``nodes`` (``trainer.checkpointer.node_tier.NodeTier``).

    A backend (``trainer.checkpointer.dcp_backend.DCPCheckpointer``,
    ``trainer.deepspeed.checkpointer.DeepSpeedCheckpointer``) implements the hooks at the end of the class: snapshot /
    stage / write on the save side, restore / fingerprint on the load side, and may extend check_loadable.
    The services it may call: agree, save_problem, abort_save, verify_files."""

    FORMAT: Literal["dcp", "deepspeed"]  # the manifest format this backend writes and loads
    BACKEND: str  # the RunSpec backend it serves
    SUPPORTS_ASYNC = False  # can save on a background thread from a staged copy
    ONE_PASS = False  # ``restore`` verifies every file while it reads, before it writes the live state (sets applied)
    data: DataRecord | None = None  # the prepared dataset (data.source 'dataset'): recorded, and checked on load

    def __init__(
        self,
        run_dir: RunDir,
        spec: RunSpec,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        env: DistEnv,
        *,
        segment: int,
        hf_model: HFModelRecord | None = None,
    ):
        self.run_dir = run_dir
        self.spec = spec
        self.model = model
        self.optimizer = optimizer
        self.env = env
        self.segment = segment
        self.hf_model = hf_model  # recorded in every manifest: the export then needs no transformers
        self.progress = Progress()  # the parent of the next checkpoint, the newest step of each tier
        # The memory tier (checkpoint.memory_interval): snapshots in host shared memory under the same protocol;
        # storage checkpoints are then persisted from the snapshot of their step (ckpt.memtier.tier).
        # With several nodes each node keeps its own copy, replicated to a peer node (trainer.checkpointer.node_tier).
        on_nodes = self.FORMAT == "dcp" and spec.checkpoint.memory_interval is not None and env.topology.nodes > 1
        self.memory: RunDir | None = (
            memtier.memory_run_dir(spec, run_dir, node=memtier_nodes.node_name() if on_nodes else None)
            if self.FORMAT == "dcp"
            else None
        )
        self._claimed = False
        self._tier_lock = memtier.TierLock(self.memory) if self.memory is not None else None
        # The segment may have started this node's restore work while the model built (node_tier.start_early):
        # waited for here, and its NodeTier (with the lock it may hold) becomes this Checkpointer's.
        self.nodes: NodeTier | None = take_early(self, self.memory if on_nodes else None)
        if self.nodes is not None:
            self._tier_lock = self.nodes.tier_lock
        elif on_nodes:
            assert self.memory is not None and self._tier_lock is not None
            self.nodes = NodeTier(
                self, env=env, spec=spec, run_dir=run_dir, memory=self.memory, tier_lock=self._tier_lock
            )
        self.applied = True  # whether the last load attempt may have written into the live state
        # A one-pass restore may write each chunk into the live state as soon as it is hashed (set by the resumer
        # when a refused checkpoint is followed by an older one or a stop, never by a start from the state as is).
        self.eager_load = False
        # The next load's ``.metadata`` as another rank parsed it (the resumer's quick check; DCP only): each rank
        # takes it for the same bytes instead of parsing them again.
        self.shared_metadata: Any = None
        self._pool = background_pool("ckpt-commit", spec.checkpoint.background_nice)
        self._reread_pool = background_pool("ckpt-reread", spec.checkpoint.background_nice)
        self._reread: Future | None = None
        self.saver = Saver(self, env=env, spec=spec, run_dir=run_dir, progress=self.progress, pool=self._pool)
        self.resumer = Resumer(
            self,
            env=env,
            spec=spec,
            run_dir=run_dir,
            segment=segment,
            optimizer=optimizer,
            hf_model=hf_model,
            progress=self.progress,
            nodes=self.nodes,
        )
        # The base model of a pretrained run: hashed by rank 0 in the background at the run's start, or taken
        # from the checkpoint a segment resumed from; every manifest carries it.
        self.base_model: BaseModelRecord | Future | None = None
        # What a user's script tracks besides model and optimizer (trainer.api._tracked): name -> object with
        # state_dict/load_state_dict, saved as one packed tensor per rank and name.
        self.extra: dict[str, Any] = {}
        self._model_inventory: list[TensorEntry] | None = None
        self._dtype_policy: DtypePolicy | None = None

    # ----------------------------------------------------------------- the public methods (saver, resumer)
    def save(self, ts: TrainState, *, reason: str, blocking: bool | None = None, tier: str = STORAGE) -> None:
        """Checkpoint the current state at ``ts.step`` (``Saver.save``: async unless ``blocking`` or the policy or
        backend says sync; ``tier`` 'memory': a memory snapshot only, skipped while a save is in flight).

        Raises:
            CheckpointError: the save failed on some rank; nothing was committed (the same line on every rank).
        """
        self.saver.save(ts, reason=reason, blocking=blocking, tier=tier)

    def warm_up(self, ts: TrainState) -> None:
        """Allocate what async saves need now, before training, not at the first save."""
        self.saver.warm_up(ts)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        self.saver.wait()

    def load_latest(self, *, restart: bool | None = None) -> TrainState | None:
        """Load the newest checkpoint that passes its checks and loads (``Resumer.load_latest``).

        Returns:
            The loaded counters, or None when there is nothing to resume.

        Raises:
            CheckpointError: checkpoints exist but none could be loaded (unless ``restart`` and no load attempt
                touched the state), or a valid one does not fit the live run.
        """
        return self.resumer.load_latest(restart=restart)

    def load(self, path: Path, tier: str = STORAGE) -> TrainState:
        """Load ``path`` into the live model, optimizer and RNG; verify counters and fingerprint, or raise."""
        return self.resumer.load(path, tier)

    def verify_files(self, path: Path) -> str | None:
        """Quick validation on rank 0, then every rank hashes a share of the files; None if all match."""
        return self.resumer.verify_files(path)

    def other_kind(self, manifest: CheckpointManifest) -> str | None:
        """How the checkpoint was written when another kind of run wrote it, else None (``Resumer.other_kind``)."""
        return self.resumer.other_kind(manifest)

    @property
    def node_tier(self) -> bool:
        """Whether each node keeps its own copy of the memory snapshots (memory tier on, several nodes)."""
        return self.nodes is not None

    @property
    def is_leader(self) -> bool:
        """The rank that handles this rank's copy of a memory snapshot: the node leader with node tiers."""
        return self.nodes.is_leader if self.nodes is not None else self.env.is_rank0

    @property
    def last_committed_step(self) -> int | None:
        """The newest step this segment committed or resumed from (either tier)."""
        return self.progress.last_committed_step

    @property
    def last_phases(self) -> dict[str, float]:
        """The timings of the newest commit (its backend's phases, commit_s, total_s, persist_s)."""
        return self.saver.last_phases

    @property
    def stats(self) -> list[dict[str, float]]:
        """Per save: the step, how long training was blocked, whether async, whether to memory."""
        return self.saver.stats

    @property
    def skipped_snapshots(self) -> int:
        """Memory snapshots skipped because the previous save was still being written."""
        return self.saver.skipped_snapshots

    # ----------------------------------------------------------------- the live model, as a save records it
    def model_inventory(self) -> list[TensorEntry]:
        """The ``model.*`` entries a save of the live model records (names, global shapes, dtypes), taken once:
        what a checkpoint must hold to be loaded (``ckpt.commit.identity``)."""
        if self._model_inventory is None:
            self._model_inventory = self.live_model_inventory()
        return self._model_inventory

    def dtype_policy(self) -> DtypePolicy:
        """The dtypes the live model trains in (``trainer.precision``), taken once; every manifest records it."""
        if self._dtype_policy is None:
            self._dtype_policy = self.live_dtype_policy()
        return self._dtype_policy

    # ----------------------------------------------------------------- base model
    def record_base_model(self, spec: ModelSpec) -> None:
        """Rank 0 starts hashing the pretrained weight files now (a background thread; the first commit waits)."""
        if self.env.is_rank0:
            from ckpt.pretrained import base_model_record, resolve

            def record() -> BaseModelRecord:
                folder, revision = resolve(spec, local_files_only=True)
                return base_model_record(spec, folder, revision)

            self.base_model = self._reread_pool.submit(record)

    def _base_model_record(self) -> BaseModelRecord | None:
        if isinstance(self.base_model, Future):
            self.base_model = self.base_model.result()
        return self.base_model

    # ----------------------------------------------------------------- commit
    def _prepare_partial(self, step: int, group: dist.ProcessGroup | None = None, target: RunDir | None = None) -> bool:
        """Rank 0 (re)creates ``step-XXXXXXXX.partial/``; nobody writes before it exists. An async save
        does this on its background thread, over the checkpoint group, so training does not wait on it. The
        first snapshot claims the memory dir; when the claim is refused, the memory tier goes off on every rank
        (False: nothing to write there)."""
        target = target or self.run_dir
        partial = target.partial(step)
        if target is self.memory and not self._claimed and self.nodes is not None:
            problem = self.nodes.claim_nodes(group if group is not None else self.env.ctrl_group)
            if problem is not None:
                self._tier_off(problem)
                return False
            self._claimed = True
        if target is self.memory and not self._claimed:
            box: list[str | None] = [None]
            if self.env.is_rank0:
                assert self._tier_lock is not None
                try:
                    box[0] = memtier.claim(target, self.run_dir, self._tier_lock)
                except OSError as e:
                    box[0] = f"checkpoint.memory_dir {target.root}: could not be claimed ({e}); the memory tier is off"
            dist.broadcast_object_list(box, src=0, group=group if group is not None else self.env.ctrl_group)
            if box[0] is not None:
                self._tier_off(box[0])
                return False
            self._claimed = True
        if self.is_leader if target is self.memory else self.env.is_rank0:
            if partial.exists():  # an abandoned attempt at the same step
                shutil.rmtree(partial)
            mkdir_durable(partial.parent)
            partial.mkdir()
            if target is self.memory:  # the snapshot retention retires next: its pages are overwritten, not freed
                memtier_recycle.recycle(target, step, self.run_dir, staged=self.staged_ahead())
        dist.barrier(group=group if group is not None else self.env.ctrl_group)
        return True

    def _tier_off(self, problem: str) -> None:
        """Every rank, together: the memory tier is off for the rest of the segment (one line on rank 0);
        storage checkpoints go the normal way."""
        if self.env.is_rank0:
            log.warning("%s", problem)
        self.memory = None
        self.tier_gone()
        if self._tier_lock is not None:
            self._tier_lock.release()

    # ----------------------------------------------------------------- failures, agreement
    def agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
        """Every rank learns every rank's problem (one all-gather): all move on, or all fail, together."""
        return agree_in(group if group is not None else self.env.ctrl_group, self.env.world_size, problem)

    def _resume_point(self) -> int:
        return self.progress.last_committed_step or 0

    def save_problem(self, exc: BaseException, partial: Path) -> str:
        """One line for a failed save: the file, the cause, what happens on rerun."""
        os_err = _find_os_error(exc)
        where = Path(os_err.filename) if os_err is not None and os_err.filename else partial
        if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"disk full at {where}; free space and rerun, the run resumes from step {self._resume_point()}"
        cause = (os_err.strerror or str(os_err)) if os_err is not None else f"{type(exc).__name__}: {exc}"
        return (
            f"checkpoint save failed at {where} ({' '.join(str(cause).split())[:300]}); nothing was committed, "
            f"the run resumes from step {self._resume_point()}"
        )

    def abort_save(self, partial: Path, problem: str, group: dist.ProcessGroup | None) -> None:
        """Every rank knows the save failed: rank 0 removes the .partial directory (its space is what a disk-full
        rerun needs back), then all raise the same line."""
        if (
            self.is_leader
            if self.memory is not None and partial.parent == self.memory.checkpoints
            else self.env.is_rank0
        ):
            shutil.rmtree(partial, ignore_errors=True)
        if self.env.is_rank0:
            if not (self.memory is not None and partial.parent == self.memory.checkpoints and _disk_full(problem)):
                log.error("checkpoint not committed: %s", problem)  # a full memory tier says its own line
        raise CheckpointError(problem)

    @staticmethod
    def _check_written(partial: Path, entries: list[FileEntry]) -> str | None:
        """This rank's files exist with the size whose every byte was hashed."""
        for e in entries:
            try:
                size = os.lstat(partial / e.path).st_size
            except OSError:
                return f"{partial / e.path}: written and hashed but missing at commit; nothing was committed"
            if size != e.size:
                return f"{partial / e.path}: {size} bytes on disk, {e.size} hashed while writing; nothing was committed"
        return None

    def _commit(
        self,
        ts: TrainState,
        reason: str,
        entries: list[FileEntry],
        tensors: list[TensorEntry],
        fingerprint: Fingerprint,
        t0: float,
        async_save: bool,
        problem: str | None = None,
        target: RunDir | None = None,
        like: CheckpointManifest | None = None,
    ) -> bool:
        """Steps 2-3 of the commit protocol, shared by both backends: gather every rank's (file, size,
        digest) and problems; rank 0 checks that the files on disk are exactly those listed, with the hashed
        sizes and the layout the format references, writes the manifest, renames ``.partial`` away and
        fsyncs the parent. Every rank learns the outcome; on a failure all raise and nothing is committed.
        A memory snapshot whose dir another run took, or that does not fit the tmpfs, is not committed and the
        memory tier goes off on every rank (False)."""
        group = self.env.ckpt_group
        target = target or self.run_dir
        partial = target.partial(ts.step)
        mine = (entries, problem or self._check_written(partial, entries))
        if target is self.memory and self.nodes is not None:  # every rank, whatever its own outcome (a collective)
            sent = self.nodes.replicate_files(partial, entries, group)
            mine = (entries, mine[1] or sent)
        gathered: list[tuple[list[FileEntry], str | None]] | None = (
            [([], None) for _ in range(self.env.world_size)] if self.env.is_rank0 else None
        )
        dist.gather_object(mine, gathered, dst=0, group=group)
        decision = None
        if self.env.is_rank0:
            try:
                decision = self._commit_rank0(
                    ts, reason, gathered or [], tensors, fingerprint, t0, async_save, target, like
                )
            except Exception as e:  # tell the other ranks instead of leaving them at the broadcast
                decision = self.save_problem(e, partial)
            if target is self.memory and isinstance(decision, str) and _disk_full(decision):
                decision = (_TIER_OFF, _tier_full(ts.step, decision))
        box: list[Any] = [decision]
        dist.broadcast_object_list(box, src=0, group=group)
        if isinstance(box[0], tuple) and box[0][0] == _NODE_COPIES:  # every node leader commits its node's copy
            manifest = box[0][1]
            assert self.nodes is not None  # only node copies are committed so
            box[0] = self.nodes.commit_copies(ts.step, manifest, target, group)
            if isinstance(box[0], str) and _disk_full(box[0]):
                box[0] = (_TIER_OFF, _tier_full(ts.step, box[0]))
            if box[0] is None and self.env.is_rank0:
                try:
                    self._after_commit(target.checkpoint(ts.step), manifest, reason, async_save, MEMORY)
                except Exception as e:
                    log.warning("committed %s, but its bookkeeping failed: %s", target.checkpoint(ts.step).name, e)
        if isinstance(box[0], tuple) and box[0][0] == _TIER_OFF:
            if self.is_leader:
                shutil.rmtree(partial, ignore_errors=True)
            self._tier_off(box[0][1])
            return False
        if box[0] is not None:
            self.abort_save(partial, box[0], group)
        return True

    def _commit_rank0(
        self,
        ts: TrainState,
        reason: str,
        gathered: list[tuple[list[FileEntry], str | None]],
        tensors: list[TensorEntry],
        fingerprint: Fingerprint,
        t0: float,
        async_save: bool,
        target: RunDir,
        like: CheckpointManifest | None,
    ) -> str | tuple[str, Any] | None:
        """``like``: the memory snapshot this storage checkpoint is persisted from (its parent, base model and data
        records are the snapshot's)."""
        from ckpt.validate.checks import check_staged

        partial = target.partial(ts.step)
        problems = [p for _, p in gathered if p]
        if problems:
            return problems[0]
        bad = fp.first_nonfinite(fingerprint)
        if bad is not None:  # a NaN/Inf in the state: its manifest could not even be read back
            return (
                f"non-finite state at step {ts.step}: the norm of {bad} is NaN/Inf (NaN/Inf weights or optimizer "
                f"state, e.g. in the pretrained weights or from an overflowing update); nothing was committed, the "
                f"run resumes from step {self._resume_point()}"
            )
        files = sorted((e for part, _ in gathered for e in part), key=lambda e: e.path)
        manifest = CheckpointManifest(
            format=self.FORMAT,
            run_name=self.spec.name,
            step=ts.step,
            tokens=ts.tokens,
            samples=ts.samples,
            segment=self.segment,
            reason=reason,  # type: ignore[arg-type]
            created_at=lineage.now_iso(),
            files=files,
            tensors=tensors,
            model_signature=identity.signature(tensors, self.hf_model.tied if self.hf_model else None),
            topology=self.env.topology,
            dtype_policy=self.dtype_policy(),
            parent=like.parent if like else self.progress.parent,
            code_version=code_version(),
            fingerprint=fingerprint,
            run_spec=self.spec,
            save_seconds=time.perf_counter() - t0,
            async_save=async_save,
            hf_model=self.hf_model,
            data=like.data if like else self.data,
            base_model=like.base_model if like else self._base_model_record(),
            run_id=memtier.identity(self.run_dir, create=True),  # a memory snapshot is used only by this run
        )
        if target is self.memory and self.nodes is not None:
            return (_NODE_COPIES, manifest)
        staged = check_staged(partial, manifest)  # exactly the planned files, each of its hashed size
        if staged:
            return staged[0]
        if target is self.memory:  # another run may have claimed the memory dir since our claim
            lost = memtier.still_owner(target, self.run_dir)
            if lost:
                return (_TIER_OFF, lost)
        write_manifest(partial, manifest)
        gone = lifetime.orphaned()
        if gone:  # the launcher was killed: its ranks die now; a commit after it is gone would outlive the lock
            lifetime.die_orphaned(f"{gone}; {partial.name} is not committed")
        final = target.checkpoint(ts.step)
        if final.exists():  # an invalid checkpoint at this step that resume skipped: keep it as evidence
            quarantine(final, "a new checkpoint is committed at the same step")
        os.rename(partial, final)
        fsync_dir(final.parent)
        try:  # committed: what follows is bookkeeping, and its failure must not fail the save
            self._after_commit(
                final,
                manifest,
                reason,
                async_save,
                MEMORY if target is self.memory else STORAGE,
                persisted=like is not None,
            )
        except Exception as e:
            log.warning("committed %s, but its bookkeeping failed: %s", final.name, e)
        return None

    def _after_commit(
        self,
        final: Path,
        manifest: CheckpointManifest,
        reason: str,
        async_save: bool,
        tier: str = STORAGE,
        persisted: bool = False,
    ) -> None:
        """Rank 0, after the rename: lineage event (with the tier), log line, retention, background re-read."""
        nbytes = sum(f.size for f in manifest.files)
        if tier == MEMORY:
            # What its persist copies, whatever happens to the files meanwhile.
            self.progress.committed_snapshot = manifest
            event, parent = memtier.snapshot_event_id(manifest.step), self.progress.parent_event
        else:
            event = lineage.checkpoint_event_id(manifest.step)
            parent = memtier.snapshot_event_id(manifest.step) if persisted else self.progress.parent_event
        lineage.record(
            self.run_dir,
            "checkpoint",
            event,
            parent=parent,
            step=manifest.step,
            uri=final.as_uri(),
            reason=reason,
            world_size=self.env.world_size,
            segment=self.segment,
            save_seconds=round(manifest.save_seconds, 3),
            bytes=nbytes,
            async_save=async_save,
            tier=tier,
            **({"persisted_from": MEMORY} if persisted else {}),
        )
        if not persisted:
            self.progress.parent_event = event
        log.info(
            "committed %s%s (%s, %.2f s, %.1f MB)",
            final.name,
            " to memory" if tier == MEMORY else (" (persisted from memory)" if persisted else ""),
            reason,
            manifest.save_seconds,
            nbytes / 1e6,
        )
        if tier == MEMORY:  # hashed while written, like every save; no re-read of memory
            assert self.memory is not None
            memtier.retain(self.memory)
            return
        self._wait_reread()  # retention must see the previous checkpoint's verification
        pol = self.spec.checkpoint
        apply_retention(self.run_dir, keep_last=pol.keep_last, keep_every=pol.keep_every)
        if reason == "preempted":
            # Inside the scheduler's grace period the ranks must exit, not re-read gigabytes: the checkpoint stays
            # unverified until the next segment's load hashes every byte of it (as every load does) and records it
            # verified; until then retention keeps the newest verified checkpoint as always.
            log.info("%s: not re-read now (preempted); the next load verifies every byte", final.name)
            return
        self._reread = self._reread_pool.submit(self._reread_committed, final)

    def _reread_committed(self, final: Path) -> None:
        """Background, rank 0: re-read the committed bytes; on a match record the checkpoint as verified."""
        from ckpt.validate.checks import reread_and_record

        problem = reread_and_record(self.run_dir, final, threads=self.spec.checkpoint.io_threads)
        if problem is not None:
            log.error("re-reading %s after its commit failed: %s", final.name, problem)

    def _wait_reread(self) -> None:
        if self._reread is not None:
            fut, self._reread = self._reread, None
            try:
                fut.result()
            except Exception as e:  # a re-read is advisory: the checkpoint simply stays unverified
                log.warning("re-read after commit did not finish: %s", e)

    def close(self) -> None:
        """Wait for the save in flight (its failure re-raised), then free the pools, buffers and the tier lock
        whatever happened."""
        try:
            self.wait()
            self._wait_reread()
        finally:
            self._pool.shutdown(wait=True)
            self._reread_pool.shutdown(wait=True)
            self.release()
            if self._tier_lock is not None:
                self._tier_lock.release()

    # ----------------------------------------------------------------- backend hooks
    def snapshot(self, ts: TrainState) -> Any:
        """What ``write`` will write, taken while training waits (e.g. a state dict of views)."""
        raise NotImplementedError

    def stage(self, snapshot: Any) -> Any:
        """An async save's copy of ``snapshot`` that training may then overwrite (only if SUPPORTS_ASYNC)."""
        raise NotImplementedError

    def prepare_staging(self, ts: TrainState) -> None:
        """Allocate the buffers ``stage`` copies into (only if SUPPORTS_ASYNC)."""

    def release(self) -> None:
        """At close: drop the backend's buffers and stop its threads."""

    def staged_ahead(self) -> bool:
        """Whether the next memory snapshot's files are laid out in the stage dir (``after_snapshot``)."""
        return False

    def tier_gone(self) -> None:
        """Every rank, when the memory tier goes off (agreed): a backend drops what it holds in the memory dir."""

    def after_snapshot(self, step: int) -> None:
        """Every rank, on the background thread, once the memory snapshot of ``step`` is committed (a backend may
        get the next one ready; collectives over the checkpoint group allowed)."""

    def write(self, snapshot: Any, ts: TrainState, partial: Path) -> Written:
        """Write this rank's files into ``partial`` (it exists on every rank), hashing them as they are
        written; return them with the tensor inventory and the fingerprint of the saved state. A failure
        every rank already agreed on may raise (``abort_save``); else return it as ``problem``."""
        raise NotImplementedError

    def restore(self, path: Path, manifest: CheckpointManifest) -> tuple[TrainState, bool]:
        """Load the checkpoint's state into the live objects (RNG included, or reseeded by the elastic rule);
        return the stored counters and whether the fingerprint must match exactly (same world size)."""
        raise NotImplementedError

    def read_extras(self, path: Path, rank: int) -> dict[str, torch.Tensor]:
        """The packed states of the tracked objects (``self.extra``) that saving rank ``rank`` wrote into ``path``."""
        raise NotImplementedError

    def check_loadable(self, path: Path, manifest: CheckpointManifest) -> None:
        """Refuse, in one line and before anything is loaded, a checkpoint that does not fit this run: the checks of
        every backend (``Resumer.check_loadable``: format, model, data, tracked objects); a backend may add its own.

        Raises:
            CheckpointError: the checkpoint does not fit this run (ModelMismatch: another model).
        """
        self.resumer.check_loadable(path, manifest)

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        """Per-tensor norms of the live fp32 masters and AdamW moments (a collective over ``group``), computed
        by ``method`` (a load passes its checkpoint's)."""
        raise NotImplementedError

    def live_model_inventory(self) -> list[TensorEntry]:
        """The ``model.*`` inventory entries ``write`` records for the live model (no collective, nothing copied)."""
        raise NotImplementedError

    def live_dtype_policy(self) -> DtypePolicy:
        """What the live model computes and reduces in, and the dtype of the weights a save writes."""
        raise NotImplementedError

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The live model's parameters (name, global shape) in ``parameters()`` order."""
        raise NotImplementedError

    def named_param_groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The live optimizer's param groups as canonical parameter names (``ckpt.commit.identity``) and global
        shapes."""
        raise NotImplementedError
