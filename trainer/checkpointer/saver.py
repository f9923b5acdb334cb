"""The save side of the Checkpointer: ``Saver`` (``save`` for both tiers, the write before the commit, the memory
tier's persist to storage), and the one lines of a full memory dir (``_disk_full``, ``_tier_full``). The commit every
save ends in is the Checkpointer's (``trainer.checkpointer.core``, whose docstring holds the protocol).

Async save: training blocks only for one copy of the state into reusable CPU buffers; fingerprint,
DCP planning and writing, hashing and the commit run on a background thread over a dedicated gloo
group, so they never interleave with the training collectives. At most one save is in flight.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from ckpt.commit.layout import RunDir, step_dir_name
from ckpt.commit.manifest import read_manifest
from ckpt.formats.dcp.direct_io import copy_file
from ckpt.gcpause import gc_paused
from ckpt.memtier import persist as memtier_persist
from ckpt.memtier.tier import MEMORY, STORAGE
from schemas import RunSpec
from schemas.errors import CheckpointError
from trainer.checkpointer.common import Progress, SaverHost, TrainState
from trainer.dist import DistEnv, log0

log = logging.getLogger("shardkeeper.checkpoint")


def _disk_full(problem: str) -> bool:
    return problem.startswith("disk full at")


def _tier_full(step: int, problem: str) -> str:
    return (
        f"memory snapshot at step {step} not committed: {problem.split(';')[0]} (the memory dir is full); the memory "
        "tier is off for the rest of this segment, storage checkpoints are written the normal way"
    )


class Saver:
    """Every save of a Checkpointer, and the save in flight.

    Args:
        host: the Checkpointer (``SaverHost``: the backend's save hooks, the commit, the memory tier).
        env: this rank's place in the run.
        spec: the run's spec (its checkpoint policy).
        run_dir: the run directory (the storage tier).
        progress: where the segment's checkpoints stand; a commit moves it on.
        pool: the background thread async saves run on.
    """

    def __init__(
        self,
        host: SaverHost,
        *,
        env: DistEnv,
        spec: RunSpec,
        run_dir: RunDir,
        progress: Progress,
        pool: ThreadPoolExecutor,
    ):
        self.host = host
        self.env = env
        self.spec = spec
        self.run_dir = run_dir
        self.progress = progress
        self._pool = pool
        self._inflight: Future | None = None
        self._warned_async = False
        self._storage_owed: int | None = None  # a persist from memory failed on the background thread
        self._tier_gone = False  # the memory tier went off, agreed: a memory step needs no collective any more
        self.skipped_snapshots = 0
        self.stats: list[dict[str, float]] = []  # per save: the step, how long training was blocked, async, memory
        self.last_phases: dict[str, float] = {}  # the timings of the newest commit

    def save(self, ts: TrainState, *, reason: str, blocking: bool | None = None, tier: str = STORAGE) -> None:
        """Checkpoint the current state at ``ts.step``. Async unless ``blocking``, the policy says sync or the
        backend saves synchronously only (then said once in the log).

        With the memory tier on, every save is first a memory snapshot (async unless ``blocking``: training waits
        for one copy of the state); a storage save (``tier`` 'storage') is then persisted from that snapshot on
        the same background thread. ``tier`` 'memory': the snapshot only, skipped (on every rank) while an earlier
        save is still in flight, so that training never waits for a write (counted in ``skipped_snapshots``)."""
        # No rank leaves before the collective below on its own view of the tier: a save in flight may turn the
        # tier off (``_tier_off``) on one rank's background thread before another's; a rank that returned here
        # while the other waited in the all-reduce hung both. Once every rank's save in flight is done, each
        # has the same view (the tier goes off on an agreed decision), checked after ``wait``.
        if (
            tier == MEMORY
            and self._storage_owed is None
            and (self._tier_gone or (self.host.memory is None and self._inflight is None))
        ):
            return
        if tier == MEMORY and self._inflight is not None and not blocking:
            busy = torch.tensor([0 if self._inflight.done() else 1], dtype=torch.int32)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.env.ctrl_group)  # all ranks skip, or none
            if int(busy):
                self.skipped_snapshots += 1
                log0(self.env, "memory snapshot at step %d skipped: the previous save is still being written", ts.step)
                return
        self.wait()
        if self._storage_owed is not None:  # set on every rank by the same agreed failure, seen after the wait
            with gc_paused():  # a blocking save: see the note on sync saves below
                self._write_owed(ts, reason)
            return
        if tier == MEMORY and self.host.memory is None:  # the memory tier went off during the save in flight
            self._tier_gone = True  # seen by every rank at this same call: later memory steps return at once
            return
        at = self.progress
        done = (at.last_storage_step,) if tier == STORAGE else (at.last_memory_step, at.last_storage_step)
        if at.last_committed_step == ts.step and (self.host.memory is None or ts.step in done):
            return
        persist = tier == STORAGE and self.host.memory is not None
        use_async = (
            (self.spec.checkpoint.async_save or self.host.memory is not None) if blocking is None else not blocking
        )
        if use_async and not self.host.SUPPORTS_ASYNC:
            if not self._warned_async:
                log0(
                    self.env,
                    "checkpoint.async_save is not supported by the %s backend; saving synchronously",
                    self.host.BACKEND,
                )
                self._warned_async = True
            use_async = False
        t0 = time.perf_counter()
        in_memory = 1.0 if self.host.memory is not None else 0.0
        # A sync save stops training anyway: the cyclic GC is paused through it. DCP's plans (every rank's write
        # items, unpickled on rank 0) and the metadata are some 10^5 objects that live through the save, and the
        # collections their number triggers rescan all of them and free nothing (~0.3 s of a 3 GB save at 2 ranks).
        # Not while an async save runs: the GC is the whole process's, and training goes on meanwhile.
        if persist and at.last_memory_step == ts.step:  # the snapshot of this step is committed: persist it only
            if not use_async:
                with gc_paused():
                    self._persist(ts, reason, t0, False)
            else:
                self._inflight = self._pool.submit(self._persist, ts, reason, t0, True)
            self.stats.append(
                {"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": float(use_async), "memory": in_memory}
            )
            return
        target = self.host.memory if self.host.memory is not None else self.run_dir
        snapshot = self.host.snapshot(ts)
        if not use_async:
            with gc_paused():
                self._write_and_commit(snapshot, ts, reason, t0, False, target, persist)
            self.stats.append(
                {"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 0.0, "memory": in_memory}
            )
            return
        staged = self.host.stage(snapshot)
        self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 1.0, "memory": in_memory})
        self._inflight = self._pool.submit(self._write_and_commit, staged, ts, reason, t0, True, target, persist)

    def warm_up(self, ts: TrainState) -> None:
        """Allocate what async saves need now, before training, not at the first save."""
        if self.host.SUPPORTS_ASYNC and (self.spec.checkpoint.async_save or self.host.memory is not None):
            self.host.prepare_staging(ts)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()

    def _write_and_commit(
        self,
        snapshot: Any,
        ts: TrainState,
        reason: str,
        t0: float,
        async_save: bool,
        target: RunDir | None = None,
        persist: bool = False,
    ) -> None:
        """The whole save after the snapshot (on the background thread when async): ``.partial`` created in
        ``target`` (the run directory, or the memory tier's), the backend writes and hashes its files, then the
        shared commit; ``persist``: then the memory snapshot is persisted to storage."""
        target = target or self.run_dir
        tier = MEMORY if target is self.host.memory else STORAGE
        committed = self.host._prepare_partial(ts.step, self.env.ckpt_group, target)
        if committed:
            try:
                written = self.host.write(snapshot, ts, target.partial(ts.step))
            except CheckpointError as e:  # every rank agreed on it; a full tmpfs turns the memory tier off
                if tier != MEMORY or not _disk_full(str(e)):
                    raise
                self.host._tier_off(_tier_full(ts.step, str(e)))
                committed = False
        if committed:
            t = time.perf_counter()
            committed = self.host._commit(
                ts,
                reason,
                written.entries,
                written.tensors,
                written.fingerprint,
                t0,
                async_save,
                problem=written.problem,
                target=target,
            )
        if not committed:  # the memory tier went off (refused, lost, full): nothing committed there
            if persist:  # the storage checkpoint is written the normal way
                self._write_and_commit(snapshot, ts, reason, t0, async_save, self.run_dir, False)
            return
        self.last_phases = {**written.phases, "commit_s": time.perf_counter() - t, "total_s": time.perf_counter() - t0}
        self.progress.last_committed_step = ts.step
        self.progress.parent = step_dir_name(ts.step)
        if tier == MEMORY:
            self.progress.last_memory_step = ts.step
            if async_save:  # a blocking save ends a segment (preemption, the end): no next snapshot to stage
                self.host.after_snapshot(ts.step)
        else:
            self.progress.last_storage_step = ts.step
        if persist:
            self._persist(ts, reason, t0, async_save)

    def _persist(self, ts: TrainState, reason: str, t0: float, async_save: bool) -> None:
        """A storage checkpoint from the committed memory snapshot of ``ts.step``: every rank copies the files it
        wrote (hashed on the way against the manifest rank 0 committed), then the shared commit in the run
        directory with the checksums, inventory and fingerprint that manifest holds. When the snapshot vanished or
        changed since its commit (agreed: every rank learns any rank's problem), nothing is committed from it and
        the storage checkpoint is written from the live state instead (``_persist_failed``)."""
        assert self.host.memory is not None
        t = time.perf_counter()
        group = self.env.ckpt_group
        src = self.host.memory.checkpoint(ts.step)
        box: list[Any] = [None]
        if self.env.is_rank0:
            like = self.progress.committed_snapshot
            if like is None or like.step != ts.step:  # not committed by this process (never so today): read it
                try:
                    like = read_manifest(src)
                except Exception as e:  # noqa: BLE001 - said and agreed below
                    like = f"{src}: {' '.join(str(e).split())[:300]}"
            box[0] = like
        dist.broadcast_object_list(box, src=0, group=group)
        like = box[0]
        if isinstance(like, str):
            return self._persist_failed(ts, reason, t0, async_save, like)
        self.host._prepare_partial(ts.step, group, self.run_dir)
        partial = self.run_dir.partial(ts.step)
        mine = [f for f in like.files if f.rank == self.env.rank]
        outcome: tuple[str | None, str | None]
        try:
            outcome = (memtier_persist.copy_verified(src, partial, mine, copy_file), None)
        except OSError as e:  # storage could not take it: the save fails as any storage save does
            outcome = (None, self.host.save_problem(e, partial))
        found: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(found, outcome, group=group)
        failed = next((f for _, f in found if f), None)
        if failed is not None:
            self.host.abort_save(partial, failed, group)
        problem = next((g for g, _ in found if g), None)
        if problem is not None:
            if self.env.is_rank0:
                shutil.rmtree(partial, ignore_errors=True)
            return self._persist_failed(ts, reason, t0, async_save, problem)
        self.host._commit(
            ts, reason, mine, like.tensors, like.fingerprint, t0, async_save, target=self.run_dir, like=like
        )
        self.progress.last_storage_step = ts.step
        self.last_phases = {
            **self.last_phases,
            "persist_s": time.perf_counter() - t,
            "total_s": time.perf_counter() - t0,
        }

    def _persist_failed(self, ts: TrainState, reason: str, t0: float, async_save: bool, problem: str) -> None:
        """Every rank, together: the memory snapshot of ``ts.step`` vanished or changed between its commit and its
        persist (deleted, a byte changed; the live state is intact). One line on rank 0; the storage checkpoint is
        written the normal way from the live state: now when this save blocks (training waits: the live state is
        still at ``ts.step``), else at the next save not skipped (``_write_owed``: the next snapshot that finds no
        save in flight, or the segment's end), which writes storage instead of a snapshot. The snapshot is left where it
        is: the checks of a resume or the launcher's persist refuse it if its bytes changed."""
        later = "" if not async_save else " at the next save (blocking)"
        if self.env.is_rank0:
            log.warning(
                "storage checkpoint at step %d not persisted from its memory snapshot: %s; it is written from "
                "the live state%s instead",
                ts.step,
                problem,
                later,
            )
        if async_save:
            self._storage_owed = ts.step
            return
        self._write_and_commit(self.host.snapshot(ts), ts, reason, t0, False, self.run_dir, False)

    def _write_owed(self, ts: TrainState, reason: str) -> None:
        """The storage checkpoint a failed persist owes (``_persist_failed``), from the live state at ``ts.step``:
        blocking (no staged copy in the memory dir is written to storage), in place of the save asked for now."""
        self._storage_owed = None
        t0 = time.perf_counter()
        self._write_and_commit(self.host.snapshot(ts), ts, reason, t0, False, self.run_dir, False)
        self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 0.0, "memory": 0.0})
