"""The Checkpointer: save / load_latest / wait / close over DCP, with the commit protocol.

Commit protocol (a directory without a valid manifest is never loaded):
  1. every rank writes its shards into ``step-XXXXXXXX.partial/`` (DCP, fsync per file);
  2. each rank hashes the files it wrote (xxh3-128), in parallel across ranks;
  3. rank 0 gathers sizes and digests, writes ``manifest.json`` (fsync), renames the directory to
     ``step-XXXXXXXX`` and fsyncs the parent; then every rank learns the commit happened.

A failed save (a write error, a disk full, a file missing or of the wrong size at commit) raises the same
one-line CheckpointError on every rank, removes the ``.partial`` directory and commits nothing: the
previous checkpoint stays the resume point. After a commit rank 0 re-reads the checkpoint in the
background and records it as verified (ckpt.validate.reread_and_record); retention keeps the newest one.

Load: the newest checkpoint that passes the quick checks and every checksum is loaded; if the load fails
(an undecodable record, a fingerprint or counter mismatch) all ranks agree on it, rank 0 quarantines the
checkpoint (ckpt.fsutil.quarantine) and the next older one is tried. A later successful load overwrites
the whole model, optimizer and RNG state, so nothing of the failed attempt survives. If checkpoints exist
and none loads, the segment is refused (never a silent restart from step 0) unless the launch said
restart (``SegmentLaunch.restart``, set by ``shardkeeper train --restart``).

Async save: training blocks only for one copy of the state into reusable CPU buffers; fingerprint,
DCP planning and writing, hashing and the commit run on a background thread over a dedicated gloo
group, so they never interleave with the training collectives. At most one save is in flight.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ckpt.state import MOMENTS, reseed
from ckpt import __version__, fingerprint as fp, lineage
from ckpt.formats.dcp import load_state
from ckpt.formats.direct_io import HashingDirectWriter
from schemas.errors import CheckpointError
from ckpt.fsutil import fsync_dir, mkdir_durable, quarantine
from ckpt.hashing import hash_files
from ckpt.layout import RunDir, step_dir_name
from ckpt.manifest import write_manifest
from ckpt.retention import apply_retention
from schemas.seam import SegmentLaunch
from schemas import CheckpointManifest, DtypePolicy, FileEntry, Fingerprint, HFModelRecord, RunSpec, TensorEntry

from trainer.dist import DistEnv

log = logging.getLogger("shardkeeper.checkpoint")


_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class TrainState:
    """Counters that, with the model/optimizer/RNG state, determine the continuation."""

    step: int = 0
    tokens: int = 0
    samples: int = 0


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


def code_version() -> str:
    sha = os.environ.get("SHARDKEEPER_GIT_SHA")
    return f"shardkeeper {__version__}" + (f" ({sha})" if sha else "")


class Checkpointer:
    """One per training segment. The trainer calls ``load_latest()`` once, ``save()`` at intervals
    and on preemption, and ``close()`` at the end."""

    FORMAT: Literal["dcp", "deepspeed"] = "dcp"  # the manifest format this backend writes and loads
    BACKEND = "fsdp2"

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
        self.last_committed_step: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._fp_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-fingerprint")
        self._reread_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-reread")
        self._reread: Future | None = None
        self._inflight: Future | None = None
        self._staged: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self.stats: list[dict[str, float]] = []
        self.last_phases: dict[str, float] = {}

    # ----------------------------------------------------------------- state dict
    def _state_dict(self, ts: TrainState, *, with_rng: bool = True) -> dict[str, Any]:
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
    def _fingerprint_parts(sd: dict[str, Any]) -> tuple[list[str], torch.Tensor, int, float]:
        """Local part of the fingerprint: names and sums of squares (model first), and the optimizer step."""
        model = sorted(sd["model"].items())
        moments = []
        step = 0.0
        for name, st in sorted(sd["optim"]["state"].items()):
            moments += [(f"{name}.{m}", st[m]) for m in MOMENTS if m in st]
            if "step" in st:
                step = float(st["step"])
        names, vec = fp.local_sum_squares(model + moments)
        return names, vec, len(model), step

    @staticmethod
    def _finish_fingerprint(parts: tuple[list[str], torch.Tensor, int, float], group: dist.ProcessGroup | None):
        names, vec, n_model, step = parts
        sq = fp.reduce_sum_squares(names, vec, group)
        model_sq = {k: sq[k] for k in names[:n_model]}
        optim_sq = {k: sq[k] for k in names[n_model:]}
        return fp.make_fingerprint(model_sq, optim_sq, step)

    def _fingerprint_of(self, sd: dict[str, Any], group: dist.ProcessGroup | None):
        return self._finish_fingerprint(self._fingerprint_parts(sd), group)

    def _inventory(self, sd: dict[str, Any]) -> list[TensorEntry]:
        out = [TensorEntry(name=f"model.{k}", shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."))
               for k, v in sorted(sd["model"].items())]
        for name, st in sorted(sd["optim"]["state"].items()):
            for m in MOMENTS:
                if m in st:
                    v = st[m]
                    out.append(TensorEntry(name=f"optim.state.{name}.{m}", shape=list(v.shape),
                                           dtype=str(v.dtype).removeprefix("torch.")))
        return out

    # ----------------------------------------------------------------- save
    def save(self, ts: TrainState, *, reason: str, blocking: bool | None = None) -> None:
        """Checkpoint the current state at ``ts.step``. Async unless ``blocking`` or the policy says sync."""
        self.wait()
        if self.last_committed_step == ts.step:
            return
        blocking = (not self.spec.checkpoint.async_save) if blocking is None else blocking
        t0 = time.perf_counter()
        sd = self._state_dict(ts)
        if blocking:
            self._write_and_commit(sd, ts, reason, t0, async_save=False)
            self.stats.append({"step": ts.step, "blocked_s": time.perf_counter() - t0, "async": 0.0})
            return
        staged = self._stage(sd)
        blocked = time.perf_counter() - t0
        self.stats.append({"step": ts.step, "blocked_s": blocked, "async": 1.0})
        self._inflight = self._pool.submit(self._write_and_commit, staged, ts, reason, t0, True)

    def _prepare_partial(self, step: int, group: dist.ProcessGroup | None = None) -> None:
        """Rank 0 (re)creates ``step-XXXXXXXX.partial/``; nobody writes before it exists. An async save
        does this on its background thread, over the checkpoint group, so training does not wait on it."""
        partial = self.run_dir.partial(step)
        if self.env.is_rank0:
            if partial.exists():  # an abandoned attempt at the same step
                shutil.rmtree(partial)
            mkdir_durable(partial.parent)
            partial.mkdir()
        dist.barrier(group=group if group is not None else self.env.ctrl_group)

    def warm_up(self, ts: TrainState) -> None:
        """Allocate the staging buffers of async saves now, before training, not at the first save."""
        # Not before the first optimizer step: get_state_dict would initialise AdamW's state (step=1)
        # with a dummy step, and the run would no longer match an uninterrupted one.
        if self.spec.checkpoint.async_save and self._staged is None and self.optimizer.state:
            from torch.distributed._state_dict_utils import _create_cpu_state_dict

            sd = self._state_dict(ts)
            self._staged = _create_cpu_state_dict(sd, pin_memory=self.env.device.type == "cuda")
            self._stage(sd)  # touch every page once, so the first save does not pay the page faults

    def _stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into CPU buffers that are allocated once and reused by later saves."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self._staged is None:
            self._staged = _create_cpu_state_dict(sd, pin_memory=self.env.device.type == "cuda")
        staged = _copy_state_dict(sd, self._staged, non_blocking=self.env.device.type == "cuda")
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        return staged

    def _write_and_commit(self, sd: dict[str, Any], ts: TrainState, reason: str, t0: float, async_save: bool) -> None:
        group = self.env.ckpt_group
        partial = self.run_dir.partial(ts.step)
        phases: dict[str, float] = {}
        t = time.perf_counter()
        self._prepare_partial(ts.step, group)
        # The fingerprint's local sums are computed while DCP writes (the write mostly waits on the
        # device); its all-reduce runs after dcp.save, as both use the checkpoint group.
        fp_job = self._fp_pool.submit(self._fingerprint_parts, sd)
        writer = HashingDirectWriter(partial, sync_files=True, thread_count=self.spec.checkpoint.io_threads,
                                     overwrite=False)
        failure: BaseException | None = None
        try:
            dcp.save(sd, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)
        except (Exception, CheckpointException) as e:  # DCP re-raises a rank's write error on every rank; agree anyway
            failure = e
        problem = self._agree(self._save_problem(failure, partial) if failure else None, group)
        if problem is not None:
            fp_job.cancel()
            self._abort_save(partial, problem, group)
        phases["write_s"] = time.perf_counter() - t
        t = time.perf_counter()
        fingerprint = self._finish_fingerprint(fp_job.result(), group)
        phases["fingerprint_wait_s"] = time.perf_counter() - t
        t = time.perf_counter()
        # Checksums were computed while writing; the metadata was written as .metadata.tmp and renamed.
        entries = [FileEntry(path=".metadata" if name == ".metadata.tmp" else name, size=size, xxh3_128=digest,
                             rank=self.env.rank)
                   for name, (size, digest) in sorted(writer.digests.items())
                   if name.startswith(f"__{self.env.rank}_") or (self.env.is_rank0 and name == ".metadata.tmp")]
        if self.env.is_rank0 and not any(e.path == ".metadata" for e in entries):
            size, digest = hash_files([partial / ".metadata"])[partial / ".metadata"]
            entries.append(FileEntry(path=".metadata", size=size, xxh3_128=digest, rank=0))
        self._commit(ts, reason, entries, self._inventory(sd), fingerprint, t0, async_save)
        phases["commit_s"] = time.perf_counter() - t
        phases["total_s"] = time.perf_counter() - t0
        self.last_phases = phases
        self.last_committed_step = ts.step
        self.parent = step_dir_name(ts.step)

    # ----------------------------------------------------------------- failures, agreement
    def _agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
        """Every rank learns every rank's problem (one all-gather): all move on, or all fail, together."""
        found: list[str | None] = [None] * self.env.world_size
        dist.all_gather_object(found, problem, group=group if group is not None else self.env.ctrl_group)
        return next((p for p in found if p), None)

    def _resume_point(self) -> int:
        return self.last_committed_step or 0

    def _save_problem(self, exc: BaseException, partial: Path) -> str:
        """One line for a failed save: the file, the cause, what happens on rerun."""
        os_err = _find_os_error(exc)
        where = Path(os_err.filename) if os_err is not None and os_err.filename else partial
        if os_err is not None and os_err.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"disk full at {where}; free space and rerun, the run resumes from step {self._resume_point()}")
        cause = (os_err.strerror or str(os_err)) if os_err is not None else f"{type(exc).__name__}: {exc}"
        return (f"checkpoint save failed at {where} ({' '.join(str(cause).split())[:300]}); nothing was committed, "
                f"the run resumes from step {self._resume_point()}")

    def _abort_save(self, partial: Path, problem: str, group: dist.ProcessGroup | None) -> None:
        """Every rank knows the save failed: rank 0 removes the .partial directory (its space is what a disk-full
        rerun needs back), then all raise the same line."""
        if self.env.is_rank0:
            shutil.rmtree(partial, ignore_errors=True)
            log.error("checkpoint not committed: %s", problem)
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
                fingerprint: Fingerprint, t0: float, async_save: bool, problem: str | None = None) -> None:
        """Steps 2-3 of the commit protocol, shared by both backends: gather every rank's (file, size,
        digest) and problems; rank 0 checks that the files on disk are exactly those listed, with the hashed
        sizes and the layout the format references, writes the manifest, renames ``.partial`` away and
        fsyncs the parent. Every rank learns the outcome; on a failure all raise and nothing is committed."""
        group = self.env.ckpt_group
        partial = self.run_dir.partial(ts.step)
        mine = (entries, problem or self._check_written(partial, entries))
        gathered: list[tuple[list[FileEntry], str | None]] | None = (
            [([], None) for _ in range(self.env.world_size)] if self.env.is_rank0 else None)
        dist.gather_object(mine, gathered, dst=0, group=group)
        decision = None
        if self.env.is_rank0:
            try:
                decision = self._commit_rank0(ts, reason, gathered or [], tensors, fingerprint, t0, async_save)
            except Exception as e:  # tell the other ranks instead of leaving them at the broadcast
                decision = self._save_problem(e, partial)
        box = [decision]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is not None:
            self._abort_save(partial, box[0], group)

    def _commit_rank0(self, ts: TrainState, reason: str, gathered: list[tuple[list[FileEntry], str | None]],
                      tensors: list[TensorEntry], fingerprint: Fingerprint, t0: float, async_save: bool) -> str | None:
        from ckpt.validate import check_staged

        partial = self.run_dir.partial(ts.step)
        problems = [p for _, p in gathered if p]
        if problems:
            return problems[0]
        files = sorted((e for part, _ in gathered for e in part), key=lambda e: e.path)
        manifest = CheckpointManifest(
            format=self.FORMAT, run_name=self.spec.name, step=ts.step, tokens=ts.tokens, samples=ts.samples,
            segment=self.segment, reason=reason,  # type: ignore[arg-type]
            created_at=lineage.now_iso(), files=files, tensors=tensors,
            model_signature=self.signature, topology=self.env.topology,
            dtype_policy=DtypePolicy(compute=_DTYPE_NAMES[self.spec.precision.compute],  # type: ignore[arg-type]
                                     reduce=_DTYPE_NAMES[self.spec.precision.reduce]),  # type: ignore[arg-type]
            parent=self.parent, code_version=code_version(), fingerprint=fingerprint, run_spec=self.spec,
            save_seconds=time.perf_counter() - t0, async_save=async_save, hf_model=self.hf_model,
        )
        staged = check_staged(partial, manifest)  # exactly the planned files, each of its hashed size
        if staged:
            return staged[0]
        write_manifest(partial, manifest)
        final = self.run_dir.checkpoint(ts.step)
        if final.exists():  # an invalid checkpoint at this step that resume skipped: keep it as evidence
            quarantine(final, "a new checkpoint is committed at the same step")
        os.rename(partial, final)
        fsync_dir(final.parent)
        try:  # committed: what follows is bookkeeping, and its failure must not fail the save
            self._after_commit(final, manifest, reason, async_save)
        except Exception as e:
            log.warning("committed %s, but its bookkeeping failed: %s", final.name, e)
        return None

    def _after_commit(self, final: Path, manifest: CheckpointManifest, reason: str, async_save: bool) -> None:
        """Rank 0, after the rename: lineage event, log line, retention, background re-read."""
        nbytes = sum(f.size for f in manifest.files)
        lineage.record(self.run_dir, "checkpoint", lineage.checkpoint_event_id(manifest.step),
                       parent=lineage.checkpoint_event_id(int(self.parent[5:])) if self.parent else None,
                       step=manifest.step, uri=final.as_uri(), reason=reason, world_size=self.env.world_size,
                       segment=self.segment, save_seconds=round(manifest.save_seconds, 3),
                       bytes=nbytes, async_save=async_save)
        log.info("committed %s (%s, %.2f s, %.1f MB)", final.name, reason, manifest.save_seconds, nbytes / 1e6)
        self._wait_reread()  # retention must see the previous checkpoint's verification
        pol = self.spec.checkpoint
        apply_retention(self.run_dir, keep_last=pol.keep_last, keep_every=pol.keep_every)
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
        self._fp_pool.shutdown(wait=True)
        self._reread_pool.shutdown(wait=True)
        self._staged = None

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
        candidates = [str(p) for p in reversed(self.run_dir.committed())] if self.env.is_rank0 else None
        box = [candidates]
        dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
        failed: list[str] = []
        touched = False  # a failed load may have written into the live state
        for cand in box[0] or []:
            path = Path(cand)
            problem = self._quick_check(path)
            if problem is not None:  # incomplete or mislabelled: skipped (train --restart moves it aside)
                if self.env.is_rank0:
                    log.warning("not loading %s: %s", path.name, problem)
                failed.append(f"{path.name} ({problem})")
                continue
            problem = self._hash_check(path)
            if problem is None:
                self._check_loadable(path, self._manifest(path))  # another run's checkpoint: refuse, keep it
                touched = True
                ts, problem = self._try_load(path)
                if ts is not None:
                    return ts
            self._set_aside(path, problem)
            failed.append(f"{path.name} ({problem})")
        if failed and not (restart and not touched):
            raise CheckpointError(
                f"{self.run_dir.checkpoints}: no checkpoint could be loaded ({'; '.join(failed)[:600]}); failed loads were "
                "moved aside as step-*.invalid-*; to start over from step 0 run shardkeeper train again with --restart")
        return None

    @staticmethod
    def _manifest(path: Path) -> CheckpointManifest:
        from ckpt.manifest import read_manifest

        return read_manifest(path)

    def _try_load(self, path: Path) -> tuple[TrainState | None, str | None]:
        """Load ``path``; every rank learns whether any rank failed (one all-gather after the attempt)."""
        ts, problem = None, None
        try:
            ts = self.load(path)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            problem = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        problem = self._agree(problem)
        if problem is not None:
            return None, problem
        if self.env.is_rank0:  # every byte was hashed against the manifest before this load
            from ckpt.validate import record_verified

            record_verified(self.run_dir, path, how="load", bytes_read=sum(f.size for f in self._manifest(path).files))
        return ts, None

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
        bad = [f"{path / f.path}: checksum mismatch; the file is corrupted"
               for f in files if hashed[path / f.path] != (f.size, f.xxh3_128)]
        return self._agree(bad[0] if bad else None)

    def _verify_files(self, path: Path) -> str | None:
        """Quick validation on rank 0, then every rank hashes a share of the files; None if all match."""
        return self._quick_check(path) or self._hash_check(path)

    def load(self, path: Path) -> TrainState:
        from ckpt.manifest import read_manifest

        t0 = time.perf_counter()
        manifest = read_manifest(path)
        self._check_loadable(path, manifest)
        same_world = manifest.topology.world_size == self.env.world_size
        ts = TrainState()
        sd = self._state_dict(ts, with_rng=same_world)
        load_state(sd, path, process_group=self.env.ckpt_group)
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if same_world:
            rng = sd["rng"][f"rank{self.env.rank}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and self.env.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.env.device)
        else:
            reseed(self.spec.seed, manifest.step, self.env.rank)
        ts = TrainState(step=int(sd["trainer"]["step"]), tokens=int(sd["trainer"]["tokens"]),
                        samples=int(sd["trainer"]["samples"]))
        self._check_counters(path, manifest, ts)
        # A converted checkpoint's fingerprint was summed by another code path (ckpt.formats.deepspeed_convert):
        # compare it within the cross-world tolerance even at the same world size.
        self._verify(path, manifest, same_world and manifest.reason != "converted")
        self._resumed(path, manifest, ts, t0)
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

    def _check_loadable(self, path: Path, manifest: CheckpointManifest) -> None:
        """Refuse a checkpoint of the other backend's format or of another architecture (one line each)."""
        if manifest.format != self.FORMAT:
            raise CheckpointError(f"{path}: a {manifest.format} checkpoint cannot be loaded by the {self.BACKEND} "
                                  f"backend; convert it first: shardkeeper convert {path} --to {self.FORMAT} NEW_RUN_DIR")
        if manifest.model_signature != self.signature:
            raise CheckpointError(f"{path}: written by another architecture (model signature differs from "
                                  f"{self.spec.model.model_type} {self.spec.model.config}); use a new --run-dir")

    def _resumed(self, path: Path, manifest: CheckpointManifest, ts: TrainState, t0: float) -> None:
        """Bookkeeping after a verified load: parent of the next checkpoint, log line, lineage event."""
        self.parent = path.name
        self.last_committed_step = ts.step
        if self.env.is_rank0:
            seconds = time.perf_counter() - t0
            log.info("resumed from %s at step %d (saved at world size %d, now %d) in %.2f s", path.name, ts.step,
                     manifest.topology.world_size, self.env.world_size, seconds)
            lineage.record(self.run_dir, "resume", f"resume:segment-{self.segment}",
                           parent=lineage.checkpoint_event_id(ts.step), step=ts.step, segment=self.segment,
                           from_world_size=manifest.topology.world_size, to_world_size=self.env.world_size,
                           load_seconds=round(seconds, 3))

    def _verify(self, path: Path, manifest: CheckpointManifest, same_world: bool) -> None:
        """Recompute the fingerprint of the live state and refuse to train on a mismatch."""
        sd = self._state_dict(TrainState(), with_rng=False)
        now = self._fingerprint_of(sd, self.env.ctrl_group)
        fp.require_match(path, manifest.fingerprint, now, exact=same_world)
