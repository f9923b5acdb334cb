# Stays whole (over 500 lines): save, commit, agreement, fallback, quarantine and resume are one class whose guards must be read together.
"""The Checkpointer: save / load_latest / wait / close, with the commit protocol, for every backend.

Commit protocol (a directory without a valid manifest is never loaded):
  1. every rank writes its files into ``step-XXXXXXXX.partial/`` (the backend's format, fsync per file);
  2. each rank hashes the files it wrote (xxh3-128), in parallel across ranks;
  3. rank 0 gathers sizes and digests, writes ``manifest.json`` (fsync), renames the directory to
     ``step-XXXXXXXX`` and fsyncs the parent; then every rank learns the commit happened.

A failed save (a write error, a disk full, a file missing or of the wrong size at commit) raises the same
one-line CheckpointError on every rank, removes the ``.partial`` directory and commits nothing: the
previous checkpoint stays the resume point. After a commit rank 0 re-reads the checkpoint in the
background and records it as verified (ckpt.validate.reread_and_record); retention keeps the newest one.
Not after a preemption's checkpoint: the ranks must exit within the grace period, and the next load hashes
every byte anyway (and records it verified then).

Load: the newest checkpoint that passes the quick checks and every checksum is loaded (a one-pass backend
checks the checksums while it reads, and writes the live state only once every file of every rank matched;
the others hash every file first); if the load fails
because of what the checkpoint holds (an undecodable record, a fingerprint or counter mismatch) all ranks
agree on it, rank 0 quarantines the checkpoint (ckpt.fsutil.quarantine) and the next older one is tried. A
load that fails because of the live run (a name or shape the live model does not have, a failed collective:
``checkpoint_at_fault``) fails the segment in one line and leaves the checkpoint where it is. A later successful load overwrites
the whole model, optimizer and RNG state, so nothing of the failed attempt survives. If checkpoints exist
and none loads, the segment is refused (never a silent restart from step 0) unless the launch said
restart (``SegmentLaunch.restart``, set by ``shardkeeper train --restart``).

Backends (``trainer.dcp_backend``, ``trainer.ds_backend``) implement hooks only; this module is longer than
the house's ~400 lines because the whole protocol — save, commit, agreement, fallback, quarantine, resume —
is one class whose guards must be read together; splitting it would spread one invariant over files.

Async save: training blocks only for one copy of the state into reusable CPU buffers; fingerprint,
DCP planning and writing, hashing and the commit run on a background thread over a dedicated gloo
group, so they never interleave with the training collectives. At most one save is in flight.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckpt import __version__, fingerprint as fp, lineage, memtier
from ckpt.memtier import MEMORY, STORAGE
from schemas.errors import CheckpointError
from ckpt.fsutil import fsync_dir, mkdir_durable, quarantine
from ckpt.hashing import ChecksumMismatch, hash_files, mismatch_message
from ckpt.layout import RunDir, parse_step, step_dir_name
from ckpt.manifest import write_manifest
from ckpt.retention import apply_retention
from schemas.seam import SegmentLaunch
from schemas import (BaseModelRecord, CheckpointManifest, DataRecord, DtypePolicy, FileEntry, Fingerprint, HFModelRecord,
                     ModelSpec, RunSpec, TensorEntry)
from schemas.data import data_change

from trainer.dist import DistEnv, log0

log = logging.getLogger("shardkeeper.checkpoint")


def _lower_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts, which inherit it) ``nice`` steps nicer. Linux
    only: there a thread id names one thread; elsewhere PRIO_PROCESS would renice the whole process."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # a sandbox refusing it costs speed, never the save
        log.debug("could not lower the background thread's priority: %s", e)


def background_pool(name: str, nice: int) -> ThreadPoolExecutor:
    """One background thread for checkpoint work, at a lower CPU priority than training (see
    CheckpointPolicy.background_nice)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))


_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class TrainState:
    """Counters that, with the model/optimizer/RNG state, determine the continuation."""

    step: int = 0
    tokens: int = 0
    samples: int = 0


_TIER_OFF = "memory-tier-off"


def _disk_full(problem: str) -> bool:
    return problem.startswith("disk full at")


def _tier_full(step: int, problem: str) -> str:
    return (f"memory snapshot at step {step} not committed: {problem.split(';')[0]} (the memory dir is full); the memory "
            "tier is off for the rest of this segment, storage checkpoints are written the normal way")


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


def _load_problem(exc: BaseException) -> str:
    """One line for a failed load. DCP's CheckpointException prints every failing rank's traceback: name each
    rank's own exception instead (the first line of its message)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = sorted(exc.failures.items())[0][1][0]
    if isinstance(exc, ChecksumMismatch):  # the same line as the separate hash check's
        return str(exc)
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"


def checkpoint_at_fault(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether a failed load is the checkpoint's doing: our readers and checks raise CheckpointError for what the
    bytes say (an undecodable record, a fingerprint or counter mismatch, a file missing), also inside DCP's
    CheckpointException (every failing rank's exception). Anything else (DCP's planner missing a key the live
    model has, a shape mismatch, a failed collective, DeepSpeed refusing the live engine's layout) is the live
    run's: the checkpoint, whose every byte matched its manifest, is not to blame."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, CheckpointError):
        return True
    if isinstance(exc, CheckpointException):
        return any(checkpoint_at_fault(inner, depth + 1) for inner, _tb in exc.failures.values())
    return checkpoint_at_fault(exc.__cause__, depth + 1)


def code_version() -> str:
    sha = os.environ.get("SHARDKEEPER_GIT_SHA")
    return f"shardkeeper {__version__}" + (f" ({sha})" if sha else "")


@dataclass
class Written:
    """What a backend's ``write`` hands the commit."""

    entries: list[FileEntry]  # this rank's files: path, size, digest
    tensors: list[TensorEntry]  # the tensor inventory of the checkpoint (the same on every rank)
    fingerprint: Fingerprint
    problem: str | None = None  # one line: this rank's save failed; nothing is committed
    phases: dict[str, float] = field(default_factory=dict)  # timings for the save's stats


class Checkpointer:
    """One per training segment. The trainer calls ``load_latest()`` once, ``save()`` at intervals
    and on preemption, and ``close()`` at the end.

    The public methods and every guard live here; a backend (``trainer.dcp_backend.DCPCheckpointer``,
    ``trainer.ds_checkpointer.DeepSpeedCheckpointer``) implements the hooks at the end of the class: snapshot /
    stage / write on the save side, restore / fingerprint on the load side, and may extend check_loadable.
    The services it may call: agree, save_problem, abort_save, verify_files."""

    FORMAT: Literal["dcp", "deepspeed"]  # the manifest format this backend writes and loads
    BACKEND: str  # the RunSpec backend it serves
    SUPPORTS_ASYNC = False  # can save on a background thread from a staged copy
    ONE_PASS = False  # ``restore`` verifies every file while it reads, before it writes the live state (sets applied)
    applied = True  # whether the last load attempt may have written into the live state
    data: DataRecord | None = None  # the prepared dataset (data.source 'dataset'): recorded, and checked on load

    def __init__(self, run_dir: RunDir, spec: RunSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 env: DistEnv, *, segment: int, signature: str, hf_model: HFModelRecord | None = None):
        self.run_dir = run_dir
        self.spec = spec
        self.model = model
        self.optimizer = optimizer
        self.env = env
        self.segment = segment
        self.signature = signature
        self.hf_model = hf_model  # recorded in every manifest: the export then needs no transformers
        self.parent: str | None = None
        self._parent_event: str | None = None  # lineage id of the checkpoint (either tier) the next one follows
        self.last_committed_step: int | None = None
        # The memory tier (checkpoint.memory_interval): snapshots in host shared memory under the same protocol;
        # storage checkpoints are then persisted from the snapshot of their step (ckpt.memtier).
        self.memory: RunDir | None = memtier.memory_run_dir(spec, run_dir) if self.FORMAT == "dcp" else None
        self.last_memory_step: int | None = None
        self.last_storage_step: int | None = None
        self._claimed = False
        self._tier_lock = memtier.TierLock(self.memory) if self.memory is not None else None
        self.skipped_snapshots = 0
        self._pool = background_pool("ckpt-commit", spec.checkpoint.background_nice)
        self._reread_pool = background_pool("ckpt-reread", spec.checkpoint.background_nice)
        self._reread: Future | None = None
        self._inflight: Future | None = None
        self._warned_async = False
        self._lock = threading.Lock()
        self.stats: list[dict[str, float]] = []
        self.last_phases: dict[str, float] = {}
        # The base model of a pretrained run: hashed by rank 0 in the background at the run's start, or taken
        # from the checkpoint a segment resumed from; every manifest carries it.
        self.base_model: BaseModelRecord | Future | None = None
        # What a user's script tracks besides model and optimizer (trainer.tracked): name -> object with
        # state_dict/load_state_dict, saved as one packed tensor per rank and name.
        self.extra: dict[str, Any] = {}

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

    # ----------------------------------------------------------------- save
    def save(self, ts: TrainState, *, reason: str, blocking: bool | None = None, tier: str = STORAGE) -> None:
        """Checkpoint the current state at ``ts.step``. Async unless ``blocking``, the policy says sync or the
        backend saves synchronously only (then said once in the log).

        With the memory tier on, every save is first a memory snapshot (async unless ``blocking``: training waits
        for one copy of the state); a storage save (``tier`` 'storage') is then persisted from that snapshot on
        the same background thread. ``tier`` 'memory': the snapshot only, skipped (on every rank) while an earlier
        save is still in flight, so that training never waits for a write (counted in ``skipped_snapshots``)."""
        if tier == MEMORY and self.memory is None:
            return
        if tier == MEMORY and self._inflight is not None and not blocking:
            busy = torch.tensor([0 if self._inflight.done() else 1], dtype=torch.int32)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.env.ctrl_group)  # all ranks skip, or none
            if int(busy):
                self.skipped_snapshots += 1
                log0(self.env, "memory snapshot at step %d skipped: the previous save is still being written", ts.step)
                return
        self.wait()
        if tier == MEMORY and self.memory is None:  # the memory tier went off during the save in flight
            return
        done = (self.last_storage_step,) if tier == STORAGE else (self.last_memory_step, self.last_storage_step)
        if self.last_committed_step == ts.step and (self.memory is None or ts.step in done):
            return
        persist = tier == STORAGE and self.memory is not None
        use_async = ((self.spec.checkpoint.async_save or self.memory is not None) if blocking is None
                     else not blocking)
        if use_async and not self.SUPPORTS_ASYNC:
            if not self._warned_async:
                log0(self.env, "checkpoint.async_save is not supported by the %s backend; saving synchronously",
                     self.BACKEND)
                self._warned_async = True
            use_async = False
        t0 = time.perf_counter()
        in_memory = 1.0 if self.memory is not None else 0.0
        if persist and self.last_memory_step == ts.step:  # the snapshot of this step is committed: persist it only
            if not use_async:
                self._persist(ts, reason, t0, False)
            else:
                self._inflight = self._pool.submit(self._persist, ts, reason, t0, True)
            self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": float(use_async),
                               "memory": in_memory})
            return
        target = self.memory if self.memory is not None else self.run_dir
        snapshot = self.snapshot(ts)
        if not use_async:
            self._write_and_commit(snapshot, ts, reason, t0, False, target, persist)
            self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 0.0, "memory": in_memory})
            return
        staged = self.stage(snapshot)
        self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 1.0, "memory": in_memory})
        self._inflight = self._pool.submit(self._write_and_commit, staged, ts, reason, t0, True, target, persist)

    def warm_up(self, ts: TrainState) -> None:
        """Allocate what async saves need now, before training, not at the first save."""
        if self.SUPPORTS_ASYNC and (self.spec.checkpoint.async_save or self.memory is not None):
            self.prepare_staging(ts)

    def _write_and_commit(self, snapshot: Any, ts: TrainState, reason: str, t0: float, async_save: bool,
                          target: RunDir | None = None, persist: bool = False) -> None:
        """The whole save after the snapshot (on the background thread when async): ``.partial`` created in
        ``target`` (the run directory, or the memory tier's), the backend writes and hashes its files, then the
        shared commit; ``persist``: then the memory snapshot is persisted to storage."""
        target = target or self.run_dir
        tier = MEMORY if target is self.memory else STORAGE
        committed = self._prepare_partial(ts.step, self.env.ckpt_group, target)
        if committed:
            try:
                written = self.write(snapshot, ts, target.partial(ts.step))
            except CheckpointError as e:  # every rank agreed on it; a full tmpfs turns the memory tier off
                if tier != MEMORY or not _disk_full(str(e)):
                    raise
                self._tier_off(_tier_full(ts.step, str(e)))
                committed = False
        if committed:
            t = time.perf_counter()
            committed = self._commit(ts, reason, written.entries, written.tensors, written.fingerprint, t0, async_save,
                                     problem=written.problem, target=target)
        if not committed:  # the memory tier went off (refused, lost, full): nothing committed there
            if persist:  # the storage checkpoint is written the normal way
                self._write_and_commit(snapshot, ts, reason, t0, async_save, self.run_dir, False)
            return
        self.last_phases = {**written.phases, "commit_s": time.perf_counter() - t, "total_s": time.perf_counter() - t0}
        self.last_committed_step = ts.step
        self.parent = step_dir_name(ts.step)
        if tier == MEMORY:
            self.last_memory_step = ts.step
        else:
            self.last_storage_step = ts.step
        if persist:
            self._persist(ts, reason, t0, async_save)

    def _tier_off(self, problem: str) -> None:
        """Every rank, together: the memory tier is off for the rest of the segment (one line on rank 0);
        storage checkpoints go the normal way."""
        if self.env.is_rank0:
            log.warning("%s", problem)
        self.memory = None
        if self._tier_lock is not None:
            self._tier_lock.release()

    def _persist(self, ts: TrainState, reason: str, t0: float, async_save: bool) -> None:
        """A storage checkpoint from the committed memory snapshot of ``ts.step``: every rank copies the files it
        wrote (hashed on the way against the snapshot's manifest), then the shared commit in the run directory
        with the checksums, inventory and fingerprint the snapshot's manifest already holds."""
        assert self.memory is not None
        t = time.perf_counter()
        src = self.memory.checkpoint(ts.step)
        like = self._manifest(src)
        self._prepare_partial(ts.step, self.env.ckpt_group, self.run_dir)
        mine = [f for f in like.files if f.rank == self.env.rank]
        problem = memtier.copy_verified(src, self.run_dir.partial(ts.step), mine)
        self._commit(ts, reason, mine, like.tensors, like.fingerprint, t0, async_save, problem=problem,
                     target=self.run_dir, like=like)
        self.last_storage_step = ts.step
        self.last_phases = {**self.last_phases, "persist_s": time.perf_counter() - t, "total_s": time.perf_counter() - t0}

    def _prepare_partial(self, step: int, group: dist.ProcessGroup | None = None, target: RunDir | None = None) -> bool:
        """Rank 0 (re)creates ``step-XXXXXXXX.partial/``; nobody writes before it exists. An async save
        does this on its background thread, over the checkpoint group, so training does not wait on it. The
        first snapshot claims the memory dir; when the claim is refused, the memory tier goes off on every rank
        (False: nothing to write there)."""
        target = target or self.run_dir
        partial = target.partial(step)
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
        if self.env.is_rank0:
            if partial.exists():  # an abandoned attempt at the same step
                shutil.rmtree(partial)
            mkdir_durable(partial.parent)
            partial.mkdir()
        dist.barrier(group=group if group is not None else self.env.ctrl_group)
        return True

    # ----------------------------------------------------------------- failures, agreement
    def agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
        """Every rank learns every rank's problem (one all-gather): all move on, or all fail, together."""
        found: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(found, problem, group=group if group is not None else self.env.ctrl_group)
        return next((p for p in found if p), None)

    def _resume_point(self) -> int:
        return self.last_committed_step or 0

    def save_problem(self, exc: BaseException, partial: Path) -> str:
        """One line for a failed save: the file, the cause, what happens on rerun."""
        os_err = _find_os_error(exc)
        where = Path(os_err.filename) if os_err is not None and os_err.filename else partial
        if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"disk full at {where}; free space and rerun, the run resumes from step {self._resume_point()}")
        cause = (os_err.strerror or str(os_err)) if os_err is not None else f"{type(exc).__name__}: {exc}"
        return (f"checkpoint save failed at {where} ({' '.join(str(cause).split())[:300]}); nothing was committed, "
                f"the run resumes from step {self._resume_point()}")

    def abort_save(self, partial: Path, problem: str, group: dist.ProcessGroup | None) -> None:
        """Every rank knows the save failed: rank 0 removes the .partial directory (its space is what a disk-full
        rerun needs back), then all raise the same line."""
        if self.env.is_rank0:
            shutil.rmtree(partial, ignore_errors=True)
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
                return (f"{partial / e.path}: {size} bytes on disk, {e.size} hashed while writing; "
                        "nothing was committed")
        return None

    def _commit(self, ts: TrainState, reason: str, entries: list[FileEntry], tensors: list[TensorEntry],
                fingerprint: Fingerprint, t0: float, async_save: bool, problem: str | None = None,
                target: RunDir | None = None, like: CheckpointManifest | None = None) -> bool:
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
        gathered: list[tuple[list[FileEntry], str | None]] | None = (
            [([], None) for _ in range(self.env.world_size)] if self.env.is_rank0 else None)
        dist.gather_object(mine, gathered, dst=0, group=group)
        decision = None
        if self.env.is_rank0:
            try:
                decision = self._commit_rank0(ts, reason, gathered or [], tensors, fingerprint, t0, async_save,
                                              target, like)
            except Exception as e:  # tell the other ranks instead of leaving them at the broadcast
                decision = self.save_problem(e, partial)
            if target is self.memory and isinstance(decision, str) and _disk_full(decision):
                decision = (_TIER_OFF, _tier_full(ts.step, decision))
        box: list[Any] = [decision]
        dist.broadcast_object_list(box, src=0, group=group)
        if isinstance(box[0], tuple) and box[0][0] == _TIER_OFF:
            if self.env.is_rank0:
                shutil.rmtree(partial, ignore_errors=True)
            self._tier_off(box[0][1])
            return False
        if box[0] is not None:
            self.abort_save(partial, box[0], group)
        return True

    def _commit_rank0(self, ts: TrainState, reason: str, gathered: list[tuple[list[FileEntry], str | None]],
                      tensors: list[TensorEntry], fingerprint: Fingerprint, t0: float, async_save: bool,
                      target: RunDir, like: CheckpointManifest | None) -> str | tuple[str, str] | None:
        """``like``: the memory snapshot this storage checkpoint is persisted from (its parent, base model and data
        records are the snapshot's)."""
        from ckpt.validate import check_staged

        partial = target.partial(ts.step)
        problems = [p for _, p in gathered if p]
        if problems:
            return problems[0]
        bad = fp.first_nonfinite(fingerprint)
        if bad is not None:  # a NaN/Inf in the state: its manifest could not even be read back
            return (f"non-finite state at step {ts.step}: the norm of {bad} is NaN/Inf (NaN/Inf weights or optimizer "
                    f"state, e.g. in the pretrained weights or from an overflowing update); nothing was committed, the "
                    f"run resumes from step {self._resume_point()}")
        files = sorted((e for part, _ in gathered for e in part), key=lambda e: e.path)
        manifest = CheckpointManifest(
            format=self.FORMAT, run_name=self.spec.name, step=ts.step, tokens=ts.tokens, samples=ts.samples,
            segment=self.segment, reason=reason,  # type: ignore[arg-type]
            created_at=lineage.now_iso(), files=files, tensors=tensors,
            model_signature=self.signature, topology=self.env.topology,
            dtype_policy=DtypePolicy(compute=_DTYPE_NAMES[self.spec.precision.compute],  # type: ignore[arg-type]
                                     reduce=_DTYPE_NAMES[self.spec.precision.reduce]),  # type: ignore[arg-type]
            parent=like.parent if like else self.parent, code_version=code_version(), fingerprint=fingerprint,
            run_spec=self.spec, save_seconds=time.perf_counter() - t0, async_save=async_save, hf_model=self.hf_model,
            data=like.data if like else self.data, base_model=like.base_model if like else self._base_model_record(),
        )
        staged = check_staged(partial, manifest)  # exactly the planned files, each of its hashed size
        if staged:
            return staged[0]
        if target is self.memory:  # another run may have claimed the memory dir since our claim
            lost = memtier.still_owner(target, self.run_dir)
            if lost:
                return (_TIER_OFF, lost)
        write_manifest(partial, manifest)
        final = target.checkpoint(ts.step)
        if final.exists():  # an invalid checkpoint at this step that resume skipped: keep it as evidence
            quarantine(final, "a new checkpoint is committed at the same step")
        os.rename(partial, final)
        fsync_dir(final.parent)
        try:  # committed: what follows is bookkeeping, and its failure must not fail the save
            self._after_commit(final, manifest, reason, async_save, MEMORY if target is self.memory else STORAGE,
                               persisted=like is not None)
        except Exception as e:
            log.warning("committed %s, but its bookkeeping failed: %s", final.name, e)
        return None

    def _after_commit(self, final: Path, manifest: CheckpointManifest, reason: str, async_save: bool,
                      tier: str = STORAGE, persisted: bool = False) -> None:
        """Rank 0, after the rename: lineage event (with the tier), log line, retention, background re-read."""
        nbytes = sum(f.size for f in manifest.files)
        if tier == MEMORY:
            event, parent = memtier.snapshot_event_id(manifest.step), self._parent_event
        else:
            event = lineage.checkpoint_event_id(manifest.step)
            parent = memtier.snapshot_event_id(manifest.step) if persisted else self._parent_event
        lineage.record(self.run_dir, "checkpoint", event, parent=parent,
                       step=manifest.step, uri=final.as_uri(), reason=reason, world_size=self.env.world_size,
                       segment=self.segment, save_seconds=round(manifest.save_seconds, 3),
                       bytes=nbytes, async_save=async_save, tier=tier,
                       **({"persisted_from": MEMORY} if persisted else {}))
        if not persisted:
            self._parent_event = event
        log.info("committed %s%s (%s, %.2f s, %.1f MB)", final.name, " to memory" if tier == MEMORY else
                 (" (persisted from memory)" if persisted else ""), reason, manifest.save_seconds, nbytes / 1e6)
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
        from ckpt.validate import reread_and_record

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

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()

    def close(self) -> None:
        self.wait()
        self._wait_reread()
        self._pool.shutdown(wait=True)
        self._reread_pool.shutdown(wait=True)
        self.release()
        if self._tier_lock is not None:
            self._tier_lock.release()

    # ----------------------------------------------------------------- load
    def load_latest(self, *, restart: bool | None = None) -> TrainState | None:
        """Load the newest checkpoint that passes the quick checks and every checksum, and then loads and
        verifies (fingerprint, counters). One that fails the checksums or the load is quarantined on every
        rank's agreement and the next older one is tried. Returns None when there is nothing to resume;
        raises CheckpointError when checkpoints exist but none could be loaded, unless ``restart`` (default:
        the launch's ``restart``) and no load attempt touched the state."""
        if restart is None:
            launch = SegmentLaunch.from_environ()
            restart = bool(launch and launch.restart)
        candidates = self._candidates() if self.env.is_rank0 else None
        box = [candidates]
        dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
        failed: list[str] = []
        touched = False  # a failed load may have written into the live state
        for cand, tier in box[0] or []:
            path = Path(cand)
            if tier == MEMORY:
                ts = self._try_memory(path)
                touched = touched or ts is not False
                if isinstance(ts, TrainState):
                    return ts
                continue
            problem = self._quick_check(path)
            if problem is not None:  # incomplete or mislabelled: skipped (train --restart moves it aside)
                if self.env.is_rank0:
                    log.warning("not loading %s: %s", path.name, problem)
                failed.append(f"{path.name} ({problem})")
                continue
            # One-pass backends hash every byte while loading it, and write the live state only once all matched.
            one_pass = self.ONE_PASS and not self.extra  # tracked extras are read (check_loadable) before the load
            problem = None if one_pass else self._hash_check(path)
            if problem is None:
                self.check_loadable(path, self._manifest(path))  # another run's checkpoint: refuse, keep it
                self.applied = not one_pass
                ts, problem, ours = self._try_load(path)
                touched = touched or self.applied
                if ts is not None:
                    return ts
                if not ours and one_pass:  # the load may have stopped before every byte was hashed: hash now
                    bad = self._hash_check(path)
                    problem, ours = (bad, True) if bad else (problem, False)
                if not ours:  # the live run does not fit a checkpoint whose every byte checked out: keep it
                    raise CheckpointError(
                        f"{path}: its files match their checksums, but it does not load into this run ({problem}); "
                        "left in place, not moved aside: resume with the model, backend and world size it fits "
                        "(its manifest.json's run_spec), or convert it with shardkeeper convert")
            self._set_aside(path, problem)
            failed.append(f"{path.name} ({problem})")
        if failed and not (restart and not touched):
            raise CheckpointError(
                f"{self.run_dir.checkpoints}: no checkpoint could be loaded ({'; '.join(failed)[:600]}); failed loads were "
                "moved aside as step-*.invalid-*; to start over from step 0 run shardkeeper train again with --restart")
        return None

    def _candidates(self) -> list[tuple[str, str]]:
        """Rank 0: every committed checkpoint of both tiers, newest first; at the same step the memory snapshot
        first (no storage read). Snapshots of another run or world size are left out, each said in one line."""
        found = [(parse_step(p.name) or 0, 0, str(p), STORAGE) for p in self.run_dir.committed()]
        if self.memory is not None:
            snaps = self.memory.committed()
            problem = memtier.owner_problem(self.memory, self.run_dir) if snaps else None
            if problem:
                log.warning("memory snapshots not used: %s; resuming from storage", problem)
                snaps = []
            for p in snaps:
                try:
                    m = self._manifest(p)
                    why = (f"saved at world size {m.topology.world_size}, this segment runs {self.env.world_size}"
                           if m.topology.world_size != self.env.world_size else
                           f"written by run {m.run_name!r}, not {self.spec.name!r}" if m.run_name != self.spec.name
                           else None)
                except Exception as e:  # an unreadable manifest: the snapshot is not used
                    why = _load_problem(e)
                if why:
                    log.warning("memory snapshot %s not used (%s); resuming from storage", p, why)
                else:
                    found.append((parse_step(p.name) or 0, 1, str(p), MEMORY))
        return [(path, tier) for _step, _mem, path, tier in sorted(found, reverse=True)]

    def _try_memory(self, path: Path) -> TrainState | None | bool:
        """Load a memory snapshot after the same checks as a storage checkpoint. One that fails them (torn,
        tampered, another model) is never loaded: rank 0 moves it aside in the memory dir, logs one line, and the
        next candidate (storage) is tried. Returns the state, None after a failed load attempt, False when
        nothing was loaded into the live state."""
        def skip(problem: str | None, attempted: bool) -> None | bool:
            if self.env.is_rank0:
                log.error("memory snapshot %s not used: %s; resuming from storage", path, problem)
                if path.exists():
                    quarantine(path, "failed its checks")
            dist.barrier(group=self.env.ctrl_group)
            return None if attempted else False

        one_pass = self.ONE_PASS and not self.extra  # as for storage: hashed while read, applied once all matched
        problem = self._quick_check(path) or (None if one_pass else self._hash_check(path))
        if problem is not None:
            return skip(problem, False)
        try:
            self.check_loadable(path, self._manifest(path))
        except CheckpointError as e:
            return skip(str(e), False)
        self.applied = not one_pass
        ts, problem, ours = self._try_load(path, MEMORY)
        if ts is not None:
            return ts
        if not ours and one_pass:  # the load may have stopped before every byte was hashed: hash now
            bad = self._hash_check(path)
            problem, ours = (bad, True) if bad else (problem, False)
        if not ours:
            raise CheckpointError(f"{path}: the memory snapshot's files match their checksums, but it does not load "
                                  f"into this run ({problem}); resume with the model and world size it fits")
        return skip(problem, self.applied)

    @staticmethod
    def _manifest(path: Path) -> CheckpointManifest:
        from ckpt.manifest import read_manifest

        return read_manifest(path)

    def _try_load(self, path: Path, tier: str = STORAGE) -> tuple[TrainState | None, str | None, bool]:
        """Load ``path``; every rank learns whether any rank failed (one all-gather after the attempt), and
        whether any rank blames the checkpoint's bytes (``checkpoint_at_fault``) rather than the live run."""
        ts, mine = None, None
        try:
            ts = self.load(path, tier)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            mine = (_load_problem(e), checkpoint_at_fault(e))
        found: list[tuple[str, bool] | None] = [None] * self.env.world_size
        dist.all_gather_object(found, mine, group=self.env.ctrl_group)
        failures = [f for f in found if f]
        if failures:
            blamed = [p for p, ours in failures if ours]
            return None, (blamed or [failures[0][0]])[0], bool(blamed)
        if self.env.is_rank0 and tier == STORAGE:  # every byte was hashed against the manifest before (or, one-pass, during) this load
            from ckpt.validate import record_verified

            record_verified(self.run_dir, path, how="load", bytes_read=sum(f.size for f in self._manifest(path).files))
        return ts, None, False

    def _set_aside(self, path: Path, problem: str | None) -> None:
        """Rank 0 quarantines a checkpoint that failed its checksums or its load, logs one line and records
        it in lineage; all ranks wait for the rename before looking at the next candidate."""
        if self.env.is_rank0:
            log.error("cannot resume from %s: %s", path.name, problem)
            aside = quarantine(path, "failed to load")
            lineage.record(self.run_dir, "validate", f"quarantine:{path.name}:{aside.name.rsplit('-', 1)[-1]}",
                           parent=f"checkpoint:{path.name}", step=int(path.name[5:13]), uri=aside.as_uri(),
                           valid=False, action="quarantined", errors=[problem or ""], segment=self.segment)
        dist.barrier(group=self.env.ctrl_group)

    def _quick_check(self, path: Path) -> str | None:
        """Quick validation on rank 0, broadcast: None if the checkpoint is complete and consistent."""
        from ckpt.validate import validate

        problem = None
        if self.env.is_rank0:
            report = validate(path)
            problem = None if report.valid else report.errors[0]
        box = [problem]
        dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
        return box[0]

    def _hash_check(self, path: Path) -> str | None:
        """Every rank hashes a share of the files; None if all match the manifest."""
        files = self._manifest(path).files[self.env.rank :: self.env.world_size]
        hashed = hash_files([path / f.path for f in files], threads=self.spec.checkpoint.io_threads)
        bad = [mismatch_message(path / f.path) for f in files if hashed[path / f.path] != (f.size, f.xxh3_128)]
        return self.agree(bad[0] if bad else None)

    def verify_files(self, path: Path) -> str | None:
        """Quick validation on rank 0, then every rank hashes a share of the files; None if all match."""
        return self._quick_check(path) or self._hash_check(path)

    def load(self, path: Path, tier: str = STORAGE) -> TrainState:
        """Load ``path`` into the live model, optimizer and RNG; verify counters and fingerprint, or raise."""
        from ckpt.manifest import read_manifest

        t0 = time.perf_counter()
        manifest = read_manifest(path)
        self.check_loadable(path, manifest)
        ts, exact = self.restore(path, manifest)
        if self.extra:
            from trainer.extras import restore_all

            restore_all(self.extra, path, manifest, self.env.rank, self.env.world_size,
                        lambda r: self.read_extras(path, r))
        self._check_counters(path, manifest, ts)
        now = self.fingerprint(self.env.ctrl_group, manifest.fingerprint.method)
        fp.require_match(path, manifest.fingerprint, now, exact=exact)
        self.base_model = manifest.base_model  # the run's base model stays recorded; its weights are not read again
        self._resumed(path, manifest, ts, t0, tier)
        return ts

    @staticmethod
    def _check_counters(path: Path, manifest: CheckpointManifest, ts: TrainState) -> None:
        """The loaded counters, the manifest and the directory name must tell the same step."""
        for key in ("step", "tokens", "samples"):
            if getattr(ts, key) != getattr(manifest, key):
                raise CheckpointError(f"{path}: loaded trainer.{key} {getattr(ts, key)}, the manifest says "
                                      f"{getattr(manifest, key)}; the checkpoint is inconsistent")
        if path.name.startswith("step-") and path.name != f"step-{ts.step:08d}":
            raise CheckpointError(f"{path}: holds step {ts.step}; the directory name and the state disagree")

    def check_loadable(self, path: Path, manifest: CheckpointManifest) -> None:
        """Refuse a checkpoint of the other backend's format or of another architecture (one line each)."""
        if manifest.format != self.FORMAT:
            raise CheckpointError(f"{path}: a {manifest.format} checkpoint cannot be loaded by the {self.BACKEND} "
                                  f"backend; convert it first: shardkeeper convert {path} --to {self.FORMAT} NEW_RUN_DIR")
        if manifest.model_signature != self.signature:
            if self.spec.script is not None:
                raise CheckpointError(f"{path}: written by another model (its parameter names or shapes differ from "
                                      "those of the model the script tracks now); track the run's own model, or start a "
                                      "new --run-dir")
            raise CheckpointError(f"{path}: written by another architecture (model signature differs from "
                                  f"{self.spec.model.model_type} {self.spec.model.config}); use a new --run-dir")
        changed = data_change(manifest.data, self.data) if manifest.data and self.data else None
        if changed:
            raise CheckpointError(f"{path}: trained on other data: {changed}; resume with the data the run started "
                                  "with, or start a new --run-dir")
        if self.extra:
            from trainer.extras import check_restorable

            check_restorable(self.extra, path, manifest, self.env.world_size, lambda r: self.read_extras(path, r))

    def _resumed(self, path: Path, manifest: CheckpointManifest, ts: TrainState, t0: float,
                 tier: str = STORAGE) -> None:
        """Bookkeeping after a verified load: parent of the next checkpoint, log line, lineage event (with the
        tier it was loaded from)."""
        self.parent = path.name
        self.last_committed_step = ts.step
        event = memtier.snapshot_event_id(ts.step) if tier == MEMORY else lineage.checkpoint_event_id(ts.step)
        self._parent_event = event
        if tier == MEMORY:
            self.last_memory_step = ts.step  # the first snapshot still claims the dir (its lock)
        if tier == STORAGE or (self.run_dir.checkpoint(ts.step) / "manifest.json").is_file():
            self.last_storage_step = ts.step
        if self.env.is_rank0:
            seconds = time.perf_counter() - t0
            saved = manifest.topology.world_size
            if manifest.reason == "converted":  # a one-process conversion: say where the state was trained
                saved = manifest.source_world_size or saved
                how = (f"converted from a checkpoint saved at world size {manifest.source_world_size}"
                       if manifest.source_world_size else "converted")
            else:
                how = f"saved at world size {saved}"
            log.info("resumed from %s%s at step %d (%s, now %d) in %.2f s", path.name,
                     " in memory" if tier == MEMORY else "", ts.step, how, self.env.world_size, seconds)
            lineage.record(self.run_dir, "resume", f"resume:segment-{self.segment}",
                           parent=event, step=ts.step, segment=self.segment, tier=tier,
                           from_world_size=saved, to_world_size=self.env.world_size,
                           converted=manifest.reason == "converted", load_seconds=round(seconds, 3))


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

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = fp.METHOD) -> Fingerprint:
        """Per-tensor norms of the live fp32 masters and AdamW moments (a collective over ``group``), computed
        by ``method`` (a load passes its checkpoint's)."""
        raise NotImplementedError
