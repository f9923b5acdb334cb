"""The memory tier of a run on several nodes (``ckpt.memtier.nodes`` holds the layout and the restore plan):
``NodeTier``, which the Checkpointer holds as ``nodes`` when the memory tier is on and the run has more than one node.

Save: each node leader (local rank 0) claims and prepares its node's memory dir; after the ranks wrote their files,
each rank replicates them to the same local rank of the next node (``ckpt.memtier.replicate.exchange``, hashed on
receipt); rank 0 builds the manifest from every rank's files, and each node leader commits its node's copy with it
(the files it must hold, each of its hashed size; owner still this run; the launcher still alive).

Restore: the node leaders tell what their node holds; every rank computes the same plan (``memtier_nodes.plan``);
the files a node lacks (all of them on a node that replaced a lost one) come from the peer node's memory, hashed on
receipt (and by the sender as it reads them); then each node checks its own complete copy (quick checks; every
checksum, shared by its local ranks, unless the load is one-pass) before the usual verified load reads it. The
one-pass load does not hash again a file its node hashed whole on the way in and that is still that file (same
inode, size, mtime and ctime): a restore from the peer reads and hashes each byte once on each side.

Early: a segment's ranks start that restore work while their model builds (``start_early``, on a thread of its own
over the checkpoint group, which nothing else uses before the Checkpointer exists): the plans, the peer's files for the
newest plan, and this node's copy hashed by its ranks. The Checkpointer takes the NodeTier over (``take_early``, which
waits for that thread); the restore then runs as above, and its load does not hash again a file the early work
hashed whole and that is still that file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from itertools import groupby
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckpt.commit.fsutil import file_identity, fsync_dir, mkdir_durable, quarantine
from ckpt.commit.hashing import hash_files, mismatch_message
from ckpt.commit.layout import PARTIAL_SUFFIX, RunDir, parse_step
from ckpt.commit.manifest import write_manifest
from ckpt.memtier import nodes as memtier_nodes
from ckpt.memtier import recycle as memtier_recycle
from ckpt.memtier import replicate
from ckpt.memtier import tier as memtier
from schemas import MANIFEST_NAME, CheckpointManifest, RunSpec
from trainer import lifetime
from trainer.checkpointer.common import NodeTierHost, agree_in
from trainer.dist import DistEnv

log = logging.getLogger("shardkeeper.checkpoint")

TIER_OFF = "memory-tier-off"  # a commit decision: the memory tier goes off on every rank (trainer.checkpointer.core)


class NodeTier:
    """This node's memory dir and the steps that keep a copy of every snapshot on each node: the claim, the
    replication and the commit of the copies (save), the plans and the transfers that complete a node's copy (restore).

    Args:
        host: the Checkpointer (its agreement and its one line for a failed save).
        env: this rank's place in the run.
        spec: the run's spec.
        run_dir: the run directory (whose identity the memory dirs carry).
        memory: this node's memory dir.
        tier_lock: the lock that holds it for this run.
    """

    def __init__(
        self,
        host: NodeTierHost,
        *,
        env: DistEnv,
        spec: RunSpec,
        run_dir: RunDir,
        memory: RunDir,
        tier_lock: memtier.TierLock,
    ):
        self.host = host
        self.env = env
        self.spec = spec
        self.run_dir = run_dir
        self.memory = memory
        self._tier_lock = tier_lock
        self.plans: dict[int, memtier_nodes.Plan] = {}  # the restore plans the nodes agreed on, by step
        self._verified: dict[int, replicate.Verified] = {}  # the files a restore hashed on the way, by step
        self._early_verified: dict[int, replicate.Verified] = {}  # this node's files the early work hashed, by step
        self._early: threading.Thread | None = None
        self._early_failure: BaseException | None = None
        # The group the restore's collectives and transfers run on: the control group, but the checkpoint group
        # for the early work (nothing uses that one before the Checkpointer exists; a user's script may use the
        # control group meanwhile: seg.track's agreement)
        self._restore_group: dist.ProcessGroup = env.ctrl_group

    # ----------------------------------------------------------------- who does what
    @property
    def node(self) -> int:
        return self.env.rank // max(1, self.env.topology.procs_per_node)

    @property
    def is_leader(self) -> bool:
        """The rank that handles this rank's copy of a memory snapshot: its node's leader (local rank 0)."""
        return self.env.local_rank == 0

    @property
    def tier_lock(self) -> memtier.TierLock:
        """The lock that holds this node's memory dir for the run (the Checkpointer's once it takes this over)."""
        return self._tier_lock

    def _leader_rank(self, node: int) -> int:
        return node * self.env.topology.procs_per_node

    # ----------------------------------------------------------------- save
    def claim_nodes(self, group: dist.ProcessGroup) -> str | None:
        """Every node leader claims its node's memory dir (rank 0 first makes the run's identity, so that all
        claims carry the same one); one line when a node's claim is refused or two nodes share a name."""
        if self.env.is_rank0:
            memtier.identity(self.run_dir, create=True)
        dist.barrier(group=group)
        mine: str | None = None
        if self.is_leader:
            try:
                mine = memtier.claim(self.memory, self.run_dir, self._tier_lock)
            except OSError as e:
                mine = f"checkpoint.memory_dir {self.memory.root}: could not be claimed ({e}); the memory tier is off"
        found: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(found, (memtier_nodes.node_name() if self.is_leader else None, mine), group=group)
        names = [n for n, _ in found if n is not None]
        if len(set(names)) != len(names):
            return (
                f"checkpoint.memory_dir: the nodes are not told apart (node names {sorted(names)}), so their memory "
                f"dirs would be one; set {memtier_nodes.NODE_ENV} to a distinct name on each node; the memory tier "
                "is off"
            )
        return next((p for _, p in found if p), None)

    def replicate_files(self, partial: Path, entries: list, group: dist.ProcessGroup) -> str | None:
        """Send this rank's files to the same local rank of the next node; receive the previous node's."""
        everyone: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(everyone, entries, group=group)
        per, world = self.env.topology.procs_per_node, self.env.world_size
        dst, src = (self.env.rank + per) % world, (self.env.rank - per) % world
        step = parse_step(partial.name.removesuffix(PARTIAL_SUFFIX))
        reuse = memtier_recycle.recycle_dir(self.memory, step) if step is not None else None
        return replicate.exchange(partial, list(entries), dst, list(everyone[src] or []), src, group, reuse)

    def commit_copy(self, step: int, manifest: CheckpointManifest, target: RunDir) -> Any:
        """A node leader readies its node's copy for the commit: the files it must hold, each of its hashed size,
        the owner still this run, the manifest written into the ``.partial``. Returns None, one line, or (TIER_OFF,
        line); every node is ready (agreed) before any renames (``rename_copy``), so that a node failing here
        leaves no node with a snapshot the run says was not committed."""
        from ckpt.validate.checks import check_staged

        if not self.is_leader:
            return None
        partial = target.partial(step)
        topo = self.env.topology
        files = memtier_nodes.expected(manifest, self.node, topo.nodes, topo.procs_per_node)
        whole = len(files) == len(manifest.files)
        try:
            problem = (
                (check_staged(partial, manifest) or [None])[0]
                if whole
                else memtier_nodes.check_node_copy(partial, files)
            )
            if problem:
                return problem
            lost = memtier.still_owner(target, self.run_dir)
            if lost:
                return (TIER_OFF, lost)
            write_manifest(partial, manifest)
        except Exception as e:  # noqa: BLE001 - one line, agreed: no node commits
            return self.host.save_problem(e, partial)
        return None

    def rename_copy(self, step: int, target: RunDir) -> str | None:
        """A node leader commits its readied copy (the rename); one line when it cannot."""
        if not self.is_leader:
            return None
        partial, final = target.partial(step), target.checkpoint(step)
        gone = lifetime.orphaned()
        if gone:
            lifetime.die_orphaned(f"{gone}; {partial.name} is not committed")
        try:
            if final.exists():
                quarantine(final, "a new snapshot is committed at the same step")
            os.rename(partial, final)
            fsync_dir(final.parent)
        except Exception as e:  # noqa: BLE001
            return self.host.save_problem(e, partial)
        return None

    def commit_copies(self, step: int, manifest: CheckpointManifest, target: RunDir, group: dist.ProcessGroup) -> Any:
        """Every rank: every node leader readies its copy, then (all ready) commits it; agreed. A node whose rename
        failed while others' succeeded: theirs go back to ``.partial`` (removed with the failed save)."""
        problem = self.host.agree(self.commit_copy(step, manifest, target), group)
        if problem is not None:
            return problem
        problem = self.host.agree(self.rename_copy(step, target), group)
        if self.is_leader and problem is not None and target.checkpoint(step).is_dir():
            try:
                os.rename(target.checkpoint(step), target.partial(step))
            except OSError:
                quarantine(target.checkpoint(step), "its save failed on another node")
        elif self.is_leader and problem is None and not self.env.is_rank0:
            memtier.retain(target)  # rank 0's retention runs in _after_commit
        return problem

    # ----------------------------------------------------------------- restore
    def node_plans(self) -> list[str]:
        """Every rank (a collective): what each node holds, and the same restore plans on every rank. Returns the
        lines rank 0 says about snapshots that cannot be restored."""
        offer = None
        if self.is_leader and self.memory.checkpoints.is_dir():
            problem = memtier.owner_problem(self.memory, self.run_dir)
            try:
                mine = memtier.identity(self.run_dir)
                offer = memtier_nodes.inventory(self.memory, mine) if problem is None else None
            except OSError as e:  # an unreadable node dir offers nothing (before the collective: no rank left waiting)
                log.warning("%s: not readable (%s); this node offers no memory snapshot", self.memory.root, e)
        found: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(found, offer, group=self._restore_group)
        per = self.env.topology.procs_per_node
        by_node = [found[n * per] for n in range(self.env.topology.nodes)]
        plans, notes = memtier_nodes.plan(by_node, self.env.world_size, self.spec.name)
        self.plans = {p.step: p for p in plans}
        return notes

    def complete_copy(self, step: int) -> str | None:
        """Every rank: run the plan's transfers so that every node holds the whole snapshot ``step``; agreed."""
        plan = self.plans[step]
        self._verified = {}  # nothing from an earlier attempt is taken as verified
        mem = self.memory
        ctrl = self._restore_group
        problem: str | None = None
        fetch = memtier_nodes.fetch_dir(mem, step)
        copy = mem.checkpoint(step)
        receiving = any(d == self.node for d, _, _ in plan.transfers) or self.node in plan.manifest_from
        if self.is_leader and receiving:
            try:
                problem = memtier.claim(mem, self.run_dir, self._tier_lock)
                if problem is None:  # a dir that is not this run's is left as it is
                    if fetch.exists():
                        shutil.rmtree(fetch)
                    mkdir_durable(fetch)
            except OSError as e:
                problem = f"{mem.root}: cannot take the snapshot from the peer node ({e.strerror or e})"
        problem = self.host.agree(problem, ctrl)
        if problem:
            return problem
        got = self._manifest_for(step, plan, copy, fetch)
        problem = self.host.agree(got if isinstance(got, str) else None, ctrl)
        if problem:
            if self.is_leader and receiving:
                shutil.rmtree(fetch, ignore_errors=True)
            return problem
        entries = {f.path: f for f in got.files} if isinstance(got, CheckpointManifest) else {}
        mine: str | None = None
        verified: replicate.Verified = {}  # the files this node hashed on the way, sent or received
        received: set[str] = set()
        for (dst, src), group in groupby(plan.transfers, key=lambda t: (t[0], t[1])):
            if not (self.is_leader and self.node in (src, dst)):  # only the two leaders hold the manifest's entries
                continue
            files = [entries[name] for _, _, name in group]
            if self.is_leader and self.node == src:
                mine = replicate.send(copy, files, self._leader_rank(dst), ctrl, verified) or mine
            elif self.is_leader and self.node == dst:
                mine = replicate.receive(fetch, files, self._leader_rank(src), ctrl, verified) or mine
                received |= {f.path for f in files}
        problem = self.host.agree(mine, ctrl)
        joined: str | None = None
        if self.is_leader and receiving:
            if problem is None:
                try:
                    self._join(fetch, copy, got, self.node in plan.manifest_from)  # type: ignore[arg-type]
                    verified = replicate.rebase(verified, received, copy)  # the join's renames moved their ctime
                except OSError as e:  # said and agreed below: every rank leaves together
                    joined = f"{copy}: the files from the peer node cannot join this node's copy ({e.strerror or e})"
            shutil.rmtree(fetch, ignore_errors=True)
        problem = problem or self.host.agree(joined, ctrl)
        if problem is None and plan.transfers:  # every rank of a node learns what its leader verified
            told: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(told, verified if self.is_leader else None, group=ctrl)
            self._verified = {step: told[self._leader_rank(self.node)] or {}}
        if problem is None and step in self._early_verified:  # what the early work hashed, this restore's first
            self._verified[step] = {**self._early_verified.pop(step), **self._verified.get(step, {})}
        return problem

    # ----------------------------------------------------------------- early (while the model builds)
    def _ready_early(self) -> None:
        """Every rank, on the early thread: the plans, the newest plan's transfers, then this node's copy of that
        snapshot hashed by its ranks (each a share); what matched its manifest entry, and is still the file that was
        hashed, is kept for the restore's load (``_early_verified``). A copy that fails here is left to the restore,
        which runs its checks again and says why."""
        self.node_plans()
        if not self.plans:
            return
        step = max(self.plans)
        if self.complete_copy(step) is not None:
            return
        verified = dict(self._verified.pop(step, {}))
        copy = self.memory.checkpoint(step)
        mine: replicate.Verified = {}
        try:
            from ckpt.commit.manifest import read_manifest

            files = [f for f in read_manifest(copy).files if f.path not in verified]
        except Exception:  # noqa: BLE001 - an unreadable copy: the restore's checks say so
            files = []
        per, local = self.env.topology.procs_per_node, self.env.local_rank
        share = files[local::per]
        try:
            before = {f.path: file_identity(os.stat(copy / f.path, follow_symlinks=False)) for f in share}
            hashed = hash_files([copy / f.path for f in share], threads=self.spec.checkpoint.io_threads)
            for f in share:
                now = file_identity(os.stat(copy / f.path, follow_symlinks=False))
                if now == before[f.path] and hashed[copy / f.path] == (f.size, f.xxh3_128) and now[2] == f.size:
                    mine[f.path] = (f.size, f.xxh3_128, now)
        except Exception:  # noqa: BLE001 - gone, unreadable, not a regular file: the restore's checks say so
            mine = {}  # (every rank reaches the all-gather below whatever this rank found)
        told: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(told, mine, group=self._restore_group)
        first = self.node * per
        for share_of in told[first : first + per]:
            verified.update(share_of or {})
        self._early_verified = {step: verified}

    def _run_early(self) -> None:
        self._restore_group = self.env.ckpt_group
        try:
            self._ready_early()
        except BaseException as e:  # noqa: BLE001 - raised again on the rank's main thread (take_early)
            self._early_failure = e
        finally:
            self._restore_group = self.env.ctrl_group

    def verified_in_copy(self, step: int) -> replicate.Verified:
        """The files of this node's copy of ``step`` hashed whole against the manifest in this restore (by its
        leader while it sent or received them, or by its ranks early, while the model built), each with its identity
        then: the verified load reads them without hashing them again while each is still that file. Given out
        once."""
        return self._verified.pop(step, {})

    def _manifest_for(
        self, step: int, plan: memtier_nodes.Plan, copy: Path, fetch: Path
    ) -> CheckpointManifest | str | None:
        """The snapshot's manifest on every rank: a node without a copy gets its bytes from a node that has one
        (checked against the digest every node agreed on)."""
        from ckpt.commit.manifest import read_manifest

        ctrl = self._restore_group
        for dst, src in sorted(plan.manifest_from.items()):
            if self.is_leader and self.node == src:
                try:
                    raw = (copy / MANIFEST_NAME).read_bytes()
                except OSError:  # gone since the inventory: the receiver's digest check refuses the empty bytes
                    raw = b""
                dist.send_object_list([raw], dst=self._leader_rank(dst), group=ctrl)
            elif self.is_leader and self.node == dst:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=self._leader_rank(src), group=ctrl)
                raw = box[0] if isinstance(box[0], bytes) else b""
                if hashlib.sha256(raw).hexdigest() != plan.digest:
                    return f"{fetch}: the manifest received from node {src} differs from the one every node agreed on"
                (fetch / MANIFEST_NAME).write_bytes(raw)
        if not self.is_leader:
            return None
        try:  # a node that offered no copy of this step uses the manifest it received, whatever lies at ``copy``
            return read_manifest(fetch if self.node in plan.manifest_from else copy)
        except Exception as e:  # noqa: BLE001 - one line, agreed: the snapshot is not used
            return f"{copy}: manifest unreadable ({e})"

    @staticmethod
    def _join(fetch: Path, copy: Path, manifest: CheckpointManifest, whole: bool) -> None:
        """The received files join the node's copy. ``whole``: the node offered no copy of this step, so the
        fetched dir (manifest included) becomes it, and whatever lay at ``copy`` (torn, not a dir) is set aside.
        Else a file whose place holds something else (a directory, a symlink) replaces it. Raises OSError."""
        if whole:
            if os.path.lexists(copy):
                quarantine(copy, "replaced by the copy fetched from the peer node")
            os.rename(fetch, copy)  # the rename commits it, as a snapshot's own commit does
            fsync_dir(copy.parent)
            return
        for f in manifest.files:
            src, dst = fetch / f.path, copy / f.path
            if src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                if os.path.isdir(dst) and not os.path.islink(dst):
                    shutil.rmtree(dst)
                os.rename(src, dst)
        fsync_dir(copy)

    def check_copy(self, path: Path, hashes: bool) -> str | None:
        """Every node checks its own copy: the quick checks on its leader; ``hashes``: then every checksum, shared
        by its ranks (not needed before a one-pass load, which hashes every node's copy whole as it reads it)."""
        from ckpt.commit.manifest import read_manifest
        from ckpt.validate.checks import validate

        problem = None
        if self.is_leader:
            report = validate(path)
            problem = None if report.valid else report.errors[0]
        problem = self.host.agree(problem, self._restore_group)
        if problem or not hashes:
            return problem
        per, local = self.env.topology.procs_per_node, self.env.local_rank
        files = read_manifest(path).files[local::per]
        hashed = hash_files([path / f.path for f in files], threads=self.spec.checkpoint.io_threads)
        bad = [mismatch_message(path / f.path) for f in files if hashed[path / f.path] != (f.size, f.xxh3_128)]
        return self.host.agree(bad[0] if bad else None, self._restore_group)


class _EarlyHost:
    """The agreement a NodeTier needs before its Checkpointer exists (the Checkpointer's own, ``agree``)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env

    def agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None:
        return agree_in(group if group is not None else self.env.ctrl_group, self.env.world_size, problem)

    def save_problem(self, exc: BaseException, partial: Path) -> str:  # no save runs before the Checkpointer
        return f"{partial}: {exc}"


_EARLY: list[NodeTier] = []  # the NodeTier whose early work runs, until its Checkpointer takes it over
_STARTED: list[bool] = []  # early work starts once per process (a second sk.Segment() starts none)


def start_early(env: DistEnv, spec: RunSpec, run_dir: RunDir) -> NodeTier | None:
    """Every rank of a segment whose run keeps memory snapshots on several nodes (DCP), before its model builds:
    start the restore's node work on a thread (module docstring), once per process. Returns the NodeTier, or None
    where there is none (or it started before: a second ``sk.Segment()`` in the process)."""
    if spec.checkpoint.memory_interval is None or env.topology.nodes <= 1 or spec.backend == "deepspeed":
        return None
    if _STARTED:  # the same on every rank: each makes its Segments in the same order
        return None
    _STARTED.append(True)
    memory = memtier.memory_run_dir(spec, run_dir, node=memtier_nodes.node_name())
    if memory is None:
        return None
    tier = NodeTier(
        _EarlyHost(env), env=env, spec=spec, run_dir=run_dir, memory=memory, tier_lock=memtier.TierLock(memory)
    )
    tier._early = threading.Thread(target=tier._run_early, name="ckpt-node-early", daemon=True)
    tier._early.start()
    _EARLY.append(tier)
    return tier


def take_early(host: NodeTierHost, memory: RunDir | None) -> NodeTier | None:
    """The Checkpointer of the segment: the NodeTier ``start_early`` made for ``memory``, its early work done (waited
    for here: the checkpoint group is free again), now this host's; None when there is none. Raises what the early
    work raised (a failed collective: a peer rank died)."""
    if not _EARLY:
        return None
    tier = _EARLY.pop()
    if tier._early is not None:
        tier._early.join()
        tier._early = None
    if tier._early_failure is not None:
        failure, tier._early_failure = tier._early_failure, None
        raise failure
    if memory is None or tier.memory.root != memory.root:  # not this Checkpointer's: its lock goes, nothing else
        tier._tier_lock.release()
        return None
    tier.host = host
    return tier
