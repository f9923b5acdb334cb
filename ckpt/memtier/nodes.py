"""The memory tier across nodes: each node's own memory dir, replication to a peer node, and the plan that
completes every node's copy of a snapshot before a restore.

With more than one node, each node keeps its snapshots in ``MEMORY_DIR/nodes/<node name>/`` (a memory tier of its
own: tier.json, tier.lock, checkpoints/), in its own host memory. Rank ``r`` writes its files there, and sends them
in the background to rank ``r + procs_per_node`` (the same local rank on the next node, cyclically), which writes
them into *its* node's copy, hashing them on receipt. So node ``n`` holds its own ranks' files and those of node
``n - 1``: with two nodes every node holds the whole snapshot, and losing one node loses no byte of it. Each node
commits its copy with the same manifest (the run's rank 0 builds it) after checking the files it holds.

Before a restore, the node leaders tell what they hold (``inventory``); ``plan`` picks the newest snapshot whose
copies agree (one manifest) and together hold every file, and lists the transfers that complete each node's copy
(a node that was lost and replaced holds nothing: its files come from the peer's memory). The transfers themselves
(``ckpt.memtier.replicate``) hash every byte on receipt; then every node loads its own complete copy, verified as usual.

No torch here: node naming, what a node holds, and the plan.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.commit.layout import RunDir, parse_step
from schemas import MANIFEST_NAME, CheckpointManifest, FileEntry
from schemas.seam import NODE_ENV

NODES_DIR = "nodes"

log = logging.getLogger(__name__)


def node_name() -> str:
    """This node's name: $SHARDKEEPER_NODE_NAME, Slurm's $SLURMD_NODENAME, else the host name (file-name safe)."""
    raw = os.environ.get(NODE_ENV) or os.environ.get("SLURMD_NODENAME") or socket.gethostname() or "node"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)[:64].lstrip(".") or "node"


def node_root(root: Path, name: str) -> Path:
    return root / NODES_DIR / name


def node_dirs(root: Path) -> list[Path]:
    """The node memory dirs under a memory tier's root visible on this host (one on a real cluster)."""
    try:
        return sorted(p for p in (root / NODES_DIR).iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def holds(node: int, nodes: int) -> set[int]:
    """The nodes whose ranks' files node ``node`` keeps: its own, and those of the node replicating to it."""
    return {node, (node - 1) % nodes}


def node_of(entry: FileEntry, procs_per_node: int) -> int:
    return (entry.rank or 0) // max(1, procs_per_node)


def expected(manifest: CheckpointManifest, node: int, nodes: int, procs_per_node: int) -> list[FileEntry]:
    """The files node ``node``'s copy of a snapshot holds when committed."""
    mine = holds(node, nodes)
    return [f for f in manifest.files if node_of(f, procs_per_node) in mine]


def check_node_copy(partial: Path, files: list[FileEntry]) -> str | None:
    """Before a node commits its copy: exactly ``files``, each a regular file of its hashed size (one line)."""
    want = {f.path: f.size for f in files}
    for path, size in want.items():
        try:
            st = os.lstat(partial / path)
        except OSError:
            return f"{partial / path}: missing from this node's copy at commit; nothing was committed"
        if not os.path.isfile(partial / path) or os.path.islink(partial / path) or st.st_size != size:
            return f"{partial / path}: {st.st_size} bytes in this node's copy, {size} hashed; nothing was committed"
    extra = sorted(
        str(p.relative_to(partial))
        for p in partial.rglob("*")
        if p.is_file() and str(p.relative_to(partial)) not in want
    )
    if extra:
        return f"{partial}: holds {extra[0]}, which is not in the snapshot; nothing was committed"
    return None


# ------------------------------------------------------------------------------------------------ restore
@dataclass
class Copy:
    """One node's committed copy of a snapshot, as its node leader saw it."""

    step: int
    digest: str  # sha256 of manifest.json's bytes: copies of one snapshot carry the same manifest
    world_size: int
    run_name: str
    files: dict[str, int]  # every file of the manifest -> size
    held: list[str] = field(default_factory=list)  # those present here with their size


def inventory(mem: RunDir, run_id: str | None = None) -> list[Copy]:
    """A node leader: every committed copy in its node dir (the caller checked the dir is this run's) written by
    the run whose id is ``run_id`` (a copy without a run id, from before snapshots carried one, counts as the
    dir's: this run's)."""
    from ckpt.commit.manifest import read_manifest

    out = []
    for path in mem.committed():
        try:
            raw = (path / MANIFEST_NAME).read_bytes()
            m = read_manifest(path)
        except Exception:  # noqa: BLE001 - an unreadable copy is simply not offered
            continue
        if m.run_id is not None and m.run_id != run_id:  # another run's snapshot copied here: never offered
            log.warning(
                "memory snapshot %s not used: written by another run (run id %s; this run's is %s)",
                path,
                m.run_id,
                run_id,
            )
            continue
        held = []
        for f in m.files:
            try:
                if os.lstat(path / f.path).st_size == f.size and not os.path.islink(path / f.path):
                    held.append(f.path)
            except OSError:
                pass
        out.append(
            Copy(
                m.step,
                hashlib.sha256(raw).hexdigest(),
                m.topology.world_size,
                m.run_name,
                {f.path: f.size for f in m.files},
                held,
            )
        )
    return out


@dataclass
class Plan:
    """How to restore snapshot ``step``: the node whose manifest every node uses (``source``), and the transfers
    (destination node, source node, file) that complete each node's copy, in the order every rank runs them."""

    step: int
    digest: str
    transfers: list[tuple[int, int, str]]
    manifest_from: dict[int, int]  # node without a copy -> node sending it the manifest


def plan(found: list[list[Copy] | None], world_size: int, run_name: str) -> tuple[list[Plan], list[str]]:
    """From every node's inventory (index = node; None for a node that offered none): the restorable snapshots,
    newest first, and one line for each newest-first snapshot that cannot be (copies disagree, files lost)."""
    nodes = len(found)
    steps = sorted({c.step for copies in found for c in copies or []}, reverse=True)
    plans, notes = [], []
    for step in steps:
        at = {n: c for n, copies in enumerate(found) for c in copies or [] if c.step == step}
        digests = {c.digest for c in at.values()}
        any_copy = next(iter(at.values()))
        if len(digests) > 1:
            notes.append(f"memory snapshot step-{step:08d}: the nodes' copies carry different manifests; not used")
            continue
        if any_copy.world_size != world_size or any_copy.run_name != run_name:
            notes.append(
                f"memory snapshot step-{step:08d}: "
                + (
                    f"saved at world size {any_copy.world_size}, this segment runs {world_size}"
                    if any_copy.world_size != world_size
                    else f"written by run {any_copy.run_name!r}, not {run_name!r}"
                )
                + "; not used"
            )
            continue
        everything = set(any_copy.files)
        held = {n: set(c.held) for n, c in at.items()}
        union = set().union(*held.values())
        if union != everything:
            lost = sorted(everything - union)
            notes.append(
                f"memory snapshot step-{step:08d}: {len(lost)} file(s) ({lost[0]}...) are in no node's "
                "memory (more nodes lost than replicated); not used"
            )
            continue
        transfers, manifest_from = [], {}
        for dst in range(nodes):
            have = held.get(dst, set())
            if dst not in at:
                manifest_from[dst] = next(s for s in _around(dst, nodes) if s in at)
            for name in sorted(everything - have):
                src = next(s for s in _around(dst, nodes) if name in held.get(s, set()))
                transfers.append((dst, src, name))
        plans.append(Plan(step, next(iter(digests)), transfers, manifest_from))
    return plans, notes


def _around(node: int, nodes: int) -> list[int]:
    """The other nodes, nearest first after ``node`` (its peer holds its files)."""
    return [(node + k) % nodes for k in range(1, nodes)]


def fetch_dir(mem: RunDir, step: int) -> Path:
    """Where a node gathers the files it lacks for a restore before they join its copy."""
    return mem.checkpoints / f"step-{step:08d}.fetch"


def is_fetch(path: Path) -> bool:
    return path.name.endswith(".fetch") and parse_step(path.name.split(".", 1)[0]) is not None
