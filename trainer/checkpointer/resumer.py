"""The resume side of the Checkpointer: ``Resumer`` (``load_latest`` and the checks, fallback and quarantine behind it,
what a checkpoint must match to be loaded), and the one line of a failed load (``_load_problem``) with whom it blames
(``checkpoint_at_fault``). The Checkpointer's docstring (``trainer.checkpointer.core``) holds the commit protocol: a
directory without a valid manifest is never loaded.

Load: the newest checkpoint that passes the quick checks and every checksum is loaded (a one-pass backend
checks the checksums while it reads; a storage checkpoint's chunks go into the live state right behind the hash
unless ``restart`` or a memory snapshot asks it to wait until every file of every rank matched; the others hash
every file first); if the load fails
because of what the checkpoint holds (an undecodable record, a fingerprint or counter mismatch) all ranks
agree on it, rank 0 quarantines the checkpoint (ckpt.commit.fsutil.quarantine) and the next older one is tried. A
load that fails because of the live run (a name or shape the live model does not have, a failed collective:
``checkpoint_at_fault``) fails the segment in one line and leaves the checkpoint where it is. A later successful load
overwrites the whole model, optimizer and RNG state, so nothing of the failed attempt survives. If checkpoints exist
and none loads, the segment is refused (never a silent restart from step 0) unless the launch said
restart (``SegmentLaunch.restart``, set by ``shardkeeper train --restart``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckpt.commit import fingerprint as fp
from ckpt.commit import identity, lineage
from ckpt.commit.fsutil import quarantine
from ckpt.commit.hashing import ChecksumMismatch, hash_files, mismatch_message
from ckpt.commit.layout import RunDir, parse_step
from ckpt.gcpause import gc_paused
from ckpt.memtier import tier as memtier
from ckpt.memtier.tier import MEMORY, STORAGE
from schemas import CheckpointManifest, HFModelRecord, RunSpec
from schemas.data import data_change
from schemas.errors import CheckpointError, ModelMismatch
from schemas.seam import SegmentLaunch
from trainer import lifetime
from trainer.checkpointer.common import Progress, ResumerHost, TrainState
from trainer.checkpointer.node_tier import NodeTier
from trainer.dist import DistEnv

log = logging.getLogger("shardkeeper.checkpoint")


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


class Resumer:
    """Every load of a Checkpointer: the newest checkpoint that loads, after its checks.

    Args:
        host: the Checkpointer (``ResumerHost``: the backend's load hooks, what the run tracks, the memory dir).
        env: this rank's place in the run.
        spec: the run's spec.
        run_dir: the run directory (the storage tier).
        segment: this segment's index, recorded in lineage.
        optimizer: the live optimizer (its settings stay this run's when another kind of run wrote the checkpoint).
        hf_model: the live model's Hugging Face record (its tied weights), if any.
        progress: where the segment's checkpoints stand; a load sets it to the checkpoint loaded.
        nodes: the memory tier of a run on several nodes, if on.
    """

    def __init__(
        self,
        host: ResumerHost,
        *,
        env: DistEnv,
        spec: RunSpec,
        run_dir: RunDir,
        segment: int,
        optimizer: torch.optim.Optimizer,
        hf_model: HFModelRecord | None,
        progress: Progress,
        nodes: NodeTier | None,
    ):
        self.host = host
        self.env = env
        self.spec = spec
        self.run_dir = run_dir
        self.segment = segment
        self.optimizer = optimizer
        self.hf_model = hf_model
        self.progress = progress
        self.nodes = nodes

    def load_latest(self, *, restart: bool | None = None) -> TrainState | None:
        """Load the newest checkpoint that passes the quick checks and every checksum, and then loads and
        verifies (fingerprint, counters). One that fails the checksums or the load is quarantined on every
        rank's agreement and the next older one is tried. Returns None when there is nothing to resume;
        raises CheckpointError when checkpoints exist but none could be loaded, unless ``restart`` (default:
        the launch's ``restart``) and no load attempt touched the state."""
        if restart is None:
            launch = SegmentLaunch.from_environ()
            restart = bool(launch and launch.restart)
        # Without ``restart`` a refused checkpoint is followed by an older one (which overwrites the whole state) or
        # by an error, never by training on from the state as it is: a one-pass load may then write each chunk as it
        # is hashed. With it, the state stays untouched until every file matched (a fresh start stays possible).
        try:
            return self._load_newest(restart)
        finally:
            self.host.eager_load = False
            self.host.shared_metadata = None

    def _load_newest(self, restart: bool) -> TrainState | None:
        notes = self.nodes.node_plans() if self.nodes is not None else []  # a collective
        if self.env.is_rank0:
            for note in notes:
                log.warning("%s; resuming from another checkpoint", note)
        candidates = self._candidates() if self.env.is_rank0 else None
        box = [candidates]
        dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
        failed: list[str] = []
        touched = False  # a failed load may have written into the live state
        for cand, tier in box[0] or []:
            with gc_paused():  # per attempt (see ``load``): a refused attempt's objects are freed before the next
                path = Path(cand)
                if tier == MEMORY:
                    if self.nodes is not None:  # each node loads its own copy
                        path = self.nodes.memory.checkpoint(parse_step(path.name) or 0)
                    ts = self._try_memory(path)
                    touched = touched or ts is not False
                    if isinstance(ts, TrainState):
                        return ts
                    continue
                problem = self._quick_check(path, share=True)
                if problem is not None:  # incomplete or mislabelled: skipped (train --restart moves it aside)
                    if self.env.is_rank0:
                        log.warning("not loading %s: %s", path.name, problem)
                    failed.append(f"{path.name} ({problem})")
                    continue
                # One-pass backends hash every byte while loading it (eager_load: writing the live state right behind).
                # Tracked extras are read (check_loadable) before the load.
                one_pass = self.host.ONE_PASS and not self.host.extra
                problem = None if one_pass else self._hash_check(path)
                if problem is None:
                    self.host.check_loadable(path, self._manifest(path))  # another run's checkpoint: refuse, keep it
                    self.host.applied = not one_pass
                    self.host.eager_load = not restart
                    ts, problem, ours = self._try_load(path)
                    touched = touched or self.host.applied
                    if ts is not None:
                        return ts
                    if not ours and one_pass:  # the load may have stopped before every byte was hashed: hash now
                        bad = self._hash_check(path)
                        problem, ours = (bad, True) if bad else (problem, False)
                    if not ours:  # the live run does not fit a checkpoint whose every byte checked out: keep it
                        raise CheckpointError(
                            f"{path}: its files match their checksums, but it does not load into this run ({problem}); "
                            "left in place, not moved aside: resume with the model, backend and world size it fits "
                            "(its manifest.json's run_spec), or convert it with shardkeeper convert"
                        )
                self._set_aside(path, problem)
                failed.append(f"{path.name} ({problem})")
        if failed and not (restart and not touched):
            raise CheckpointError(
                f"{self.run_dir.checkpoints}: no checkpoint could be loaded ({'; '.join(failed)[:600]}); "
                "failed loads were "
                "moved aside as step-*.invalid-*; to start over from step 0 run shardkeeper train again with --restart"
            )
        return None

    def _candidates(self) -> list[tuple[str, str]]:
        """Rank 0: every committed checkpoint of both tiers, newest first; at the same step the memory snapshot
        first (no storage read). Snapshots of another run (its name, or its run id) or world size are left out, each
        said in one line."""
        found = [(parse_step(p.name) or 0, 0, str(p), STORAGE) for p in self.run_dir.committed()]
        memory = self.host.memory
        if memory is not None and self.nodes is not None:  # the plans the nodes agreed on
            found += [(step, 1, str(memory.checkpoint(step)), MEMORY) for step in self.nodes.plans]
        elif memory is not None:
            snaps = memory.committed()
            problem = memtier.owner_problem(memory, self.run_dir) if snaps else None
            if problem:
                log.warning("memory snapshots not used: %s; resuming from storage", problem)
                snaps = []
            for p in snaps:
                try:
                    m = self._manifest(p)
                    why = memtier.written_by_other_run(m, self.run_dir) or (
                        f"saved at world size {m.topology.world_size}, this segment runs {self.env.world_size}"
                        if m.topology.world_size != self.env.world_size
                        else f"written by run {m.run_name!r}, not {self.spec.name!r}"
                        if m.run_name != self.spec.name
                        else None
                    )
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
            if self.host.is_leader:  # each node sets its own copy aside
                # (not in a node dir another run holds: its snapshot at this step is that run's)
                ours = self.nodes is None or memtier.owner_problem(self.nodes.memory, self.run_dir) is None
                if path.exists() and ours:
                    quarantine(path, "failed its checks")
            dist.barrier(group=self.env.ctrl_group)
            return None if attempted else False

        # As for storage: hashed while read; applied once all matched (never eager here).
        one_pass = self.host.ONE_PASS and not self.host.extra
        if self.nodes is not None:  # the peer's files first; then every node checks its copy
            problem = self.nodes.complete_copy(parse_step(path.name) or 0) or self.nodes.check_copy(path, not one_pass)
        else:
            problem = self._quick_check(path, share=True) or (None if one_pass else self._hash_check(path))
        if problem is not None:
            return skip(problem, False)
        try:
            self.host.check_loadable(path, self._manifest(path))
        except CheckpointError as e:
            return skip(str(e), False)
        self.host.applied = not one_pass
        # A refused memory snapshot may be followed by nothing (no storage checkpoint yet: a fresh start), so it
        # never writes the live state before every file matched.
        self.host.eager_load = False
        ts, problem, ours = self._try_load(path, MEMORY)
        if ts is not None:
            return ts
        if not ours and one_pass:  # the load may have stopped before every byte was hashed: hash now
            bad = self._hash_check(path)
            problem, ours = (bad, True) if bad else (problem, False)
        if not ours:
            raise CheckpointError(
                f"{path}: the memory snapshot's files match their checksums, but it does not load "
                f"into this run ({problem}); resume with the model and world size it fits"
            )
        return skip(problem, self.host.applied)

    @staticmethod
    def _manifest(path: Path) -> CheckpointManifest:
        from ckpt.commit.manifest import read_manifest

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
        if (
            self.env.is_rank0 and tier == STORAGE
        ):  # every byte was hashed against the manifest before (or, one-pass, during) this load
            from ckpt.validate.checks import record_verified

            record_verified(self.run_dir, path, how="load", bytes_read=sum(f.size for f in self._manifest(path).files))
        return ts, None, False

    def _set_aside(self, path: Path, problem: str | None) -> None:
        """Rank 0 quarantines a checkpoint that failed its checksums or its load, logs one line and records
        it in lineage; all ranks wait for the rename before looking at the next candidate."""
        if self.env.is_rank0:
            log.error("cannot resume from %s: %s", path.name, problem)
            aside = quarantine(path, "failed to load")
            lineage.record(
                self.run_dir,
                "validate",
                f"quarantine:{path.name}:{aside.name.rsplit('-', 1)[-1]}",
                parent=f"checkpoint:{path.name}",
                step=int(path.name[5:13]),
                uri=aside.as_uri(),
                valid=False,
                action="quarantined",
                errors=[problem or ""],
                segment=self.segment,
            )
        dist.barrier(group=self.env.ctrl_group)

    def _quick_check(self, path: Path, share: bool = False) -> str | None:
        """Quick validation on rank 0, broadcast: None if the checkpoint is complete and consistent.

        Args:
            path: the checkpoint.
            share: a load of it follows. Meanwhile rank 1 parses its DCP ``.metadata`` for that load and, if the
                checkpoint passed, gives it to every rank (the host's ``shared_metadata``): no rank parses it again,
                and rank 0 does not parse it after its validation while the others wait for it (the allow-list
                unpickler is pure Python: ~0.1 s for a 254M-parameter state saved by 4 ranks). For a checkpoint
                the validation refuses, that parse was for nothing, but it ran beside the validation.

        Returns:
            None, or the first problem found, in one line.
        """
        from ckpt.validate.checks import validate

        self.host.shared_metadata = None
        parser = 1 if share and self.env.world_size > 1 and self.host.FORMAT == "dcp" else None
        problem, mine = None, None
        with gc_paused():  # as in ``load``
            if self.env.is_rank0:
                report = validate(path)
                problem = None if report.valid else report.errors[0]
            elif self.env.rank == parser:
                from ckpt.formats.dcp.reader import share_metadata

                mine = share_metadata(path)  # None when it failed: every rank then parses its own
            box = [problem]
            dist.broadcast_object_list(box, src=0, group=self.env.ctrl_group)
            if parser is not None and box[0] is None:
                from ckpt.formats.dcp.reader import shared_from

                sent = [mine[1] if mine is not None else None]
                dist.broadcast_object_list(sent, src=parser, group=self.env.ctrl_group)
                self.host.shared_metadata = mine[0] if mine is not None else shared_from(sent[0])
        return box[0]

    def _hash_check(self, path: Path) -> str | None:
        """Every rank hashes a share of the files; None if all match the manifest."""
        files = self._manifest(path).files[self.env.rank :: self.env.world_size]
        hashed = hash_files([path / f.path for f in files], threads=self.spec.checkpoint.io_threads)
        bad = [mismatch_message(path / f.path) for f in files if hashed[path / f.path] != (f.size, f.xxh3_128)]
        return self.host.agree(bad[0] if bad else None)

    def verify_files(self, path: Path) -> str | None:
        """Quick validation on rank 0, then every rank hashes a share of the files; None if all match."""
        return self._quick_check(path) or self._hash_check(path)

    def load(self, path: Path, tier: str = STORAGE) -> TrainState:
        """Load ``path`` into the live model, optimizer and RNG; verify counters and fingerprint, or raise.

        The cyclic GC is paused meanwhile: a load makes some 10^5 objects that live through it (the parsed
        ``.metadata``, every rank's load plan unpickled on rank 0, the read items), and the collections their number
        triggers rescan all of them and free nothing (~0.25 s of a 3 GB resume at 2 ranks, on its critical path).
        """
        with gc_paused():
            return self._load(path, tier)

    def _load(self, path: Path, tier: str) -> TrainState:
        from ckpt.commit.manifest import read_manifest

        t0 = time.perf_counter()
        manifest = read_manifest(path)
        self.host.check_loadable(path, manifest)
        other = self.other_kind(manifest)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        ts, exact = self.host.restore(path, manifest)
        if other is not None:  # another run's optimizer settings came with the state: this run trains with its own
            for group, settings in zip(self.optimizer.param_groups, groups):
                group.update(settings)
        if self.host.extra:
            from trainer.extras import restore_all

            started = restore_all(
                self.host.extra,
                path,
                manifest,
                self.env.rank,
                self.env.world_size,
                lambda r: self.host.read_extras(path, r),
            )
            if started and self.env.is_rank0:
                log.warning("%s was %s; tracked objects it holds no state of: %s", path.name, other, ", ".join(started))
        self._check_counters(path, manifest, ts)
        now = self.host.fingerprint(self.env.ctrl_group, manifest.fingerprint.method)
        fp.require_match(path, manifest.fingerprint, now, exact=exact)
        # The run's base model stays recorded; its weights are not read again.
        self.host.base_model = manifest.base_model
        self._resumed(path, manifest, ts, t0, tier)
        return ts

    @staticmethod
    def _check_counters(path: Path, manifest: CheckpointManifest, ts: TrainState) -> None:
        """The loaded counters, the manifest and the directory name must tell the same step."""
        for key in ("step", "tokens", "samples"):
            if getattr(ts, key) != getattr(manifest, key):
                raise CheckpointError(
                    f"{path}: loaded trainer.{key} {getattr(ts, key)}, the manifest says "
                    f"{getattr(manifest, key)}; the checkpoint is inconsistent"
                )
        if path.name.startswith("step-") and path.name != f"step-{ts.step:08d}":
            raise CheckpointError(f"{path}: holds step {ts.step}; the directory name and the state disagree")

    def check_loadable(self, path: Path, manifest: CheckpointManifest) -> None:
        """The checks of every backend (the Checkpointer's ``check_loadable``, which a backend may extend, runs
        them). Refuse, in one line each and before anything is loaded: a checkpoint of the other backend's format, of
        another model (``model_problem``: the first tensor that differs), of other data, or lacking a tracked
        object's state when this kind of run wrote it (``trainer.extras.check_restorable``).

        Raises:
            CheckpointError: the checkpoint does not fit this run (ModelMismatch: another model).
        """
        if manifest.format != self.host.FORMAT:
            raise CheckpointError(
                f"{path}: a {manifest.format} checkpoint cannot be loaded by the {self.host.BACKEND} "
                f"backend; convert it first: shardkeeper convert {path} --to {self.host.FORMAT} NEW_RUN_DIR"
            )
        problem = self.model_problem(manifest)
        if problem is not None:
            raise ModelMismatch(
                f"{path}: holds another model than this run's: {problem}; resume with the model that "
                "wrote it (its manifest.json's tensors list it), or start a new --run-dir"
            )
        changed = data_change(manifest.data, self.host.data) if manifest.data and self.host.data else None
        if changed:
            raise CheckpointError(
                f"{path}: trained on other data: {changed}; resume with the data the run started "
                "with, or start a new --run-dir"
            )
        if self.host.extra:
            from trainer.extras import check_restorable

            check_restorable(
                self.host.extra,
                path,
                manifest,
                self.env.world_size,
                lambda r: self.host.read_extras(path, r),
                other_kind=self.other_kind(manifest),
            )

    def other_kind(self, manifest: CheckpointManifest) -> str | None:
        """How the checkpoint was written when another kind of run wrote it (an import or a conversion, the
        built-in trainer, another script: its run_spec and reason say), else None. Such a checkpoint never held this
        run's own tracked objects or optimizer settings."""
        if manifest.reason == "converted":
            imported = manifest.parent is None  # shardkeeper import; shardkeeper convert names its source
            return "imported from another tool's checkpoint" if imported else "converted to another format"
        saved, mine = manifest.run_spec.script, self.spec.script
        if saved is None and mine is not None:
            return "written by the built-in trainer"
        if saved is not None and (mine is None or Path(saved.path).resolve() != Path(mine.path).resolve()):
            return f"written by script {saved.path}"
        return None

    def model_problem(self, manifest: CheckpointManifest) -> str | None:
        """The first model tensor (name, global shape, dtype, tie) in which the checkpoint differs from what a save of
        the live model records (``ckpt.commit.identity``), or None. How the run was described (config, script, adapter)
        does not enter; a checkpoint without a model inventory is left to the load."""
        there = identity.model_tensors(manifest.tensors)
        if not there:
            return None
        here = identity.model_tensors(self.host.model_inventory())
        problem = identity.first_difference(here, there)
        record = self.hf_model
        if problem is None and record is not None and manifest.hf_model is not None:
            problem = identity.tie_difference(record.tied, manifest.hf_model.tied)
        return problem

    def _resumed(
        self, path: Path, manifest: CheckpointManifest, ts: TrainState, t0: float, tier: str = STORAGE
    ) -> None:
        """Bookkeeping after a verified load: parent of the next checkpoint, log line, lineage event (with the
        tier it was loaded from)."""
        self.progress.parent = path.name
        self.progress.last_committed_step = ts.step
        event = memtier.snapshot_event_id(ts.step) if tier == MEMORY else lineage.checkpoint_event_id(ts.step)
        self.progress.parent_event = event
        if tier == MEMORY:
            self.progress.last_memory_step = ts.step  # the first snapshot still claims the dir (its lock)
        if tier == STORAGE or (self.run_dir.checkpoint(ts.step) / "manifest.json").is_file():
            self.progress.last_storage_step = ts.step
        if self.env.is_rank0:
            seconds = time.perf_counter() - t0
            saved = manifest.topology.world_size
            if manifest.reason == "converted":  # a one-process conversion: say where the state was trained
                saved = manifest.source_world_size or saved
                how = (
                    f"converted from a checkpoint saved at world size {manifest.source_world_size}"
                    if manifest.source_world_size
                    else "converted"
                )
            else:
                how = f"saved at world size {saved}"
            log.info(
                "resumed from %s%s at step %d (%s, now %d) in %.2f s",
                path.name,
                " in memory" if tier == MEMORY else "",
                ts.step,
                how,
                self.env.world_size,
                seconds,
            )
            restarts = lifetime.restart_count()  # ranks restarted in place resume again, in the same segment
            lineage.record(
                self.run_dir,
                "resume",
                f"resume:segment-{self.segment}" + (f":restart-{restarts}" if restarts else ""),
                parent=event,
                step=ts.step,
                segment=self.segment,
                tier=tier,
                from_world_size=saved,
                to_world_size=self.env.world_size,
                converted=manifest.reason == "converted",
                load_seconds=round(seconds, 3),
                **({"restart": restarts} if restarts else {}),
            )
