"""The memory tier on several nodes: each node's copy, replication to the peer node, restore after losing a node.

Emulated nodes: the spawn harness gives the ranks local ranks and node names as torchrun's agents on two hosts
would (``nodes=2``); each node keeps its own memory dir (MEMORY_DIR/nodes/<name>). Real gloo groups carry the
replication and the restore transfers. The 2-node run the restore tests start from is one launch for the module,
put back as it ended (same paths) before each of them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt.commit.layout import RunDir
from ckpt.validate.checks import validate
from tests.harness import assert_bitwise, metrics, new_run, spawn, tiny_spec
from tests.reliability.corrupt import flip_byte
from trainer.segment import run_segment

K, END = 2, 6


def _spec(mem: Path):
    return tiny_spec(
        **{
            "checkpoint.memory_interval": K,
            "checkpoint.memory_dir": str(mem),
            "checkpoint.interval": 100,
            "checkpoint.background_nice": 0,
        }
    )


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 node x 2 ranks without a memory tier: the same training as 2 nodes x 1 rank."""
    ref = new_run(tmp_path_factory.mktemp("ref") / "run", tiny_spec())
    assert spawn(run_segment, 2, str(ref), END + 2, 0) == [0, 0]
    return ref


@pytest.fixture(scope="module")
def _two_node_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """One launch for every test below that starts from it: 2 nodes x 1 rank with the memory tier, steps 0 -> END
    (a snapshot every K steps on each node). Kept as it ended, beside the paths the tests work in."""
    base = tmp_path_factory.mktemp("two-node")
    mem = base / "shm"
    run = new_run(base / "run", _spec(mem))
    assert spawn(run_segment, 2, str(run), END, 0, nodes=2) == [0, 0]
    kept = base / "as-trained"
    for path in (run, mem):
        shutil.copytree(path, kept / path.name, symlinks=True)
    return run, mem, kept


@pytest.fixture
def two_node_run(_two_node_template: tuple[Path, Path, Path]) -> tuple[Path, Path]:
    """The run directory and memory dir of that launch, put back as it ended before each test. At the same paths:
    run.yaml names the memory dir, and each node's memory dir names the run that owns it."""
    run, mem, kept = _two_node_template
    for path in (run, mem):
        shutil.rmtree(path, ignore_errors=True)  # a test may have removed it (a left node tier is removed)
        shutil.copytree(kept / path.name, path, symlinks=True)
    return run, mem


def test_each_node_holds_the_whole_snapshot_and_a_lost_node_restores_from_its_peer(
    reference: Path, two_node_run: tuple[Path, Path]
) -> None:
    run, mem = two_node_run
    a, b = mem / "nodes" / "node0", mem / "nodes" / "node1"
    for node in (a, b):  # own files + the peer's: with two nodes, each node's copy is whole and valid
        snap = node / "checkpoints" / f"step-{END:08d}"
        assert validate(snap, deep=True).valid, node
    kept = sorted(p.name for p in (a / "checkpoints").iterdir())
    assert len(kept) == 2 and kept[-1] == f"step-{END:08d}", kept  # memory retention on each node
    # Node 1 is lost (its memory gone); the next segment restores from memory: node 1's files from node 0's RAM.
    shutil.rmtree(b)
    assert spawn(run_segment, 2, str(run), END + 2, 1, nodes=2) == [0, 0]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "memory" and resume["parent"] == f"checkpoint:step-{END:08d}@memory"
    assert validate(b / "checkpoints" / f"step-{END:08d}", deep=True).valid  # node 1's copy rebuilt from the peer
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def test_a_replica_tampered_in_the_peers_memory_is_never_loaded(
    reference: Path, two_node_run: tuple[Path, Path], capfd
) -> None:
    """Node 1 lost, and node 0's copy of node 1's file changed in memory: the bytes received are hashed against
    the manifest before they join node 1's copy; one line, storage's checkpoint of the same step is used."""
    run, mem = two_node_run
    a, b = mem / "nodes" / "node0", mem / "nodes" / "node1"
    shutil.rmtree(b)
    flip_byte(sorted((a / "checkpoints" / f"step-{END:08d}").glob("__1_*.distcp"))[0])
    capfd.readouterr()
    assert spawn(run_segment, 2, str(run), END + 2, 1, nodes=2) == [0, 0]
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "memory snapshot" in ln and "not used" in ln]
    assert len(said) == 1 and "differ" in said[0] and "resuming from storage" in said[0], err[-3000:]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "storage" and resume["parent"] == f"checkpoint:step-{END:08d}"
    assert not (b / "checkpoints" / f"step-{END:08d}").exists()  # nothing of it joined node 1's memory
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def test_plan_takes_each_missing_file_from_the_node_that_holds_it() -> None:
    """Three nodes, one rank each: node n holds its own files and node n-1's. Node 1 lost: its files come from
    node 2 (its peer), the others from whoever holds them; two neighbours lost: a file is in no node's memory."""
    from ckpt.memtier.nodes import Copy, plan

    files = {"__0_0.distcp": 10, "__1_0.distcp": 10, "__2_0.distcp": 10, ".metadata": 5}

    def copy(*held: str) -> Copy:
        return Copy(8, "d", 3, "tiny", files, list(held))

    node0 = copy("__0_0.distcp", ".metadata", "__2_0.distcp")
    node2 = copy("__2_0.distcp", "__1_0.distcp")
    plans, notes = plan([[node0], None, [node2]], 3, "tiny")
    assert notes == [] and len(plans) == 1 and plans[0].manifest_from == {1: 2}
    moves = {(d, name): s for d, s, name in plans[0].transfers}
    assert moves[(1, "__1_0.distcp")] == 2 and moves[(1, "__0_0.distcp")] == 0 and moves[(0, "__1_0.distcp")] == 2
    assert moves[(2, ".metadata")] == 0 and (0, "__0_0.distcp") not in moves
    plans, notes = plan([[node0], None, None], 3, "tiny")
    assert plans == [] and "__1_0.distcp" in notes[0] and "in no node's memory" in notes[0]
    other = Copy(8, "e", 3, "tiny", files, list(files))  # copies that disagree on the manifest: not used
    plans, notes = plan([[node0], [other], [node2]], 3, "tiny")
    assert plans == [] and "different manifests" in notes[0]


def test_each_node_verifies_its_own_copy_whole(reference: Path, two_node_run: tuple[Path, Path], capfd) -> None:
    """No node lost, but node 1's copy of node 0's file changed in its memory: node 1 hashes its whole copy while
    loading it (not only the files its rank reads), so the snapshot is not used and storage's is."""
    run, mem = two_node_run
    shard = sorted((mem / "nodes" / "node1" / "checkpoints" / f"step-{END:08d}").glob("__0_*.distcp"))[0]
    flip_byte(shard, shard.stat().st_size // 3)
    capfd.readouterr()
    assert spawn(run_segment, 2, str(run), END + 2, 1, nodes=2) == [0, 0]
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "memory snapshot" in ln and "not used" in ln]
    assert len(said) == 1 and "checksum" in said[0], err[-3000:]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "storage"
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def _exchange_rank(root: str, reuse: bool = False) -> list:
    """Each of 2 ranks sends its files to the other in many small chunks (the pipelined stream), both at once.
    ``reuse``: the receiver's retired snapshot (a recycle dir) holds files of the peer's names, longer or shorter,
    one of them a symlink to a precious file: the regular ones are overwritten in place (same inodes), the symlink
    is never followed."""
    import os as _os

    import torch.distributed as dist

    import ckpt.memtier.replicate as rep
    from ckpt.commit.hashing import hash_file
    from schemas import FileEntry

    dist.init_process_group("gloo")
    rep.CHUNK = 1000
    rank = dist.get_rank()
    here = Path(root) / f"node{rank}"
    here.mkdir(parents=True)
    mine = []
    for i, size in enumerate((0, 1, 999, 1000, 1001, 7777 + rank)):
        name = f"__{rank}_{i}.distcp"
        (here / name).write_bytes(_os.urandom(size))
        mine.append(FileEntry(path=name, size=size, xxh3_128=hash_file(here / name)[1], rank=rank))
    theirs: list = [None, None]
    dist.all_gather_object(theirs, mine)
    bin_, inodes = Path(root) / f"recycle{rank}", {}
    if reuse:
        bin_.mkdir()
        precious = Path(root) / f"precious{rank}"
        precious.write_bytes(b"precious")
        for k, f in enumerate(theirs[1 - rank]):
            if k == 2:
                (bin_ / f.path).symlink_to(precious)
                continue
            (bin_ / f.path).write_bytes(_os.urandom(f.size + (5000 if k % 2 else -min(f.size, 3))))
            inodes[f.path] = (bin_ / f.path).stat().st_ino
    problem = rep.exchange(here, mine, 1 - rank, theirs[1 - rank], 1 - rank, dist.group.WORLD, bin_ if reuse else None)
    dist.barrier()
    peer = Path(root) / f"node{1 - rank}"
    same = [(here / f.path).read_bytes() == (peer / f.path).read_bytes() for f in theirs[1 - rank]]
    if reuse:
        same.append(all((here / name).stat().st_ino == ino for name, ino in inodes.items()) and len(inodes) == 5)
        same.append(precious.read_bytes() == b"precious" and not (here / theirs[1 - rank][2].path).is_symlink())
    return [problem, same]


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh-files", "over-a-retired-snapshot"])
def test_replication_streams_many_chunks_both_ways_at_once(tmp_path: Path, reuse: bool) -> None:
    got = spawn(_exchange_rank, 2, str(tmp_path), reuse)
    for problem, same in got:
        assert problem is None and len(same) == (8 if reuse else 6) and all(same), got


@pytest.mark.parametrize("damage", ["file-is-a-dir", "copy-is-a-file"])
def test_a_node_copy_with_something_in_the_way_is_rebuilt_from_the_peer_without_a_hang(
    reference: Path, two_node_run: tuple[Path, Path], damage: str, capfd
) -> None:
    """Node 1's copy damaged where the peer's files must land: one of its files replaced by a directory, or the
    whole step dir replaced by a regular file. The files fetched from node 0 replace what is in the way (the
    restore neither raises on one rank while the others wait, nor loads anything unchecked)."""
    run, mem = two_node_run
    snap = mem / "nodes" / "node1" / "checkpoints" / f"step-{END:08d}"
    if damage == "file-is-a-dir":
        victim = sorted(snap.glob("__0_*.distcp"))[0]
        victim.unlink()
        victim.mkdir()
    else:
        shutil.rmtree(snap)
        snap.write_bytes(b"not a snapshot")
    capfd.readouterr()
    assert spawn(run_segment, 2, str(run), END + 2, 1, nodes=2, timeout=90) == [0, 0]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "memory" and resume["parent"] == f"checkpoint:step-{END:08d}@memory"
    assert validate(snap, deep=True).valid
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def _segment_node1_full_at_commit(run: str, until: int, segment: int) -> int:
    """run_segment, but node 1's memory dir is full when its copy's manifest is written (tmpfs ENOSPC), and its
    background thread is slow to turn the memory tier off after that (rank 0's is off first: the next snapshot's
    step comes while rank 1's save is still in flight)."""
    import errno
    import os
    import time

    from trainer.checkpointer import node_tier
    from trainer.checkpointer.core import Checkpointer

    if int(os.environ["RANK"]) == 1:

        def full(partial: Path, manifest: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(partial) / "manifest.json"))

        node_tier.write_manifest = full  # type: ignore[assignment]
        off = Checkpointer._tier_off

        def slow_off(self: Checkpointer, problem: str) -> None:
            time.sleep(1.5)
            off(self, problem)

        Checkpointer._tier_off = slow_off  # type: ignore[method-assign]
    return run_segment(run, until, segment)


def test_one_node_failing_its_commit_commits_no_node_and_does_not_hang(tmp_path: Path, capfd) -> None:
    """Node 1's memory dir is full when its copy is committed: no node commits the snapshot (node 0's copy alone
    would be a snapshot the run said was not committed), the memory tier goes off in one line, training goes on."""
    mem = tmp_path / "shm"
    run = new_run(tmp_path / "run", _spec(mem))
    capfd.readouterr()
    assert spawn(_segment_node1_full_at_commit, 2, str(run), END, 0, nodes=2, timeout=90) == [0, 0]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    said = [ln for ln in err.splitlines() if "memory tier is off" in ln]
    assert len(said) == 1 and "not committed" in said[0], err[-3000:]
    for node in ("node0", "node1"):
        assert RunDir(mem / "nodes" / node).committed() == [], node
    assert not any(e["kind"] == "checkpoint" and e["data"].get("tier") == "memory" for e in _events(run))


def test_a_node_dir_held_by_another_live_run_is_left_untouched(
    two_node_run: tuple[Path, Path], tmp_path: Path, capfd
) -> None:
    """Node 1's memory dir was taken by another run that is still alive (its tier.json, its lock held): the
    restore cannot complete node 1's copy there; one line, storage is used, and nothing of the other run's
    snapshots is moved or removed."""
    import fcntl
    import os

    run, mem = two_node_run
    other = mem / "nodes" / "node1"
    (other / "tier.json").write_text(json.dumps({"run_dir": str(tmp_path / "other-run"), "id": "0" * 32}))
    before = sorted(p.name for p in (other / "checkpoints").iterdir())
    fd = os.open(other / "tier.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capfd.readouterr()
        assert spawn(run_segment, 2, str(run), END + 2, 1, nodes=2, timeout=90) == [0, 0]
        err = capfd.readouterr().err
    finally:
        os.close(fd)
    assert sorted(p.name for p in (other / "checkpoints").iterdir()) == before, err[-3000:]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "storage", err[-3000:]


def test_a_node_copy_of_another_run_is_never_offered_and_a_left_node_tier_is_persisted_then_removed(
    two_node_run: tuple[Path, Path],
) -> None:
    """A node's copy whose manifest carries another run's id is not offered for a restore. With the ranks dead
    before the persist of step END (storage has none), the launcher of a segment with the memory tier off persists
    it from a whole node copy, then removes the node dirs and the memory dir they lay in."""
    from ckpt.commit.manifest import read_manifest
    from ckpt.memtier import nodes as memtier_nodes
    from ckpt.memtier import persist as memtier_persist
    from ckpt.memtier import tier as memtier

    run, mem = two_node_run
    rd = RunDir.at(run)
    a, b = RunDir(mem / "nodes" / "node0"), RunDir(mem / "nodes" / "node1")
    mine = memtier.identity(rd)
    steps = [c.step for c in memtier_nodes.inventory(b, mine)]  # (one due while a save was in flight is skipped)
    assert len(steps) == 2 and steps[-1] == END
    copy = b.checkpoint(END)
    raw = (copy / "manifest.json").read_text()
    (copy / "manifest.json").write_text(raw.replace(f'"run_id": "{mine}"', f'"run_id": "{"e" * 32}"'))
    assert [c.step for c in memtier_nodes.inventory(b, mine)] == steps[:1]
    (copy / "manifest.json").write_text(raw)
    shutil.rmtree(rd.checkpoint(END))
    spec = _spec(mem)
    off = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"memory_interval": None})})
    said = memtier_persist.between_segments(off, rd)
    assert said == [
        f"persisted the memory snapshot step-{END:08d} to storage: {rd.checkpoint(END)}",
        f"removed the memory tier {mem}: no longer this run's checkpoint.memory_dir (the memory tier is "
        "off); storage holds its steps",
    ], said
    assert validate(rd.checkpoint(END), deep=True).valid and read_manifest(rd.checkpoint(END)).run_id == mine
    assert not mem.exists() and not a.root.exists()


def test_plan_says_why_a_snapshot_of_another_world_size_is_not_used() -> None:
    """The node tier's candidates are the plans alone: a snapshot left out for its world size or run name is said
    in one line (as the single-node tier says it), not dropped silently."""
    from ckpt.memtier.nodes import Copy, plan

    files = {"__0_0.distcp": 10, "__1_0.distcp": 10}
    whole = Copy(8, "d", 2, "tiny", files, list(files))
    plans, notes = plan([[whole], [whole]], 4, "tiny")
    assert plans == [] and len(notes) == 1 and "world size 2" in notes[0] and "runs 4" in notes[0], notes
    plans, notes = plan([[whole], [whole]], 2, "other")
    assert plans == [] and len(notes) == 1 and "'tiny'" in notes[0], notes


def test_two_ranks_per_node_restore_from_the_peer_and_continue_as_storage_would(tmp_path: Path) -> None:
    """2 nodes x 2 ranks: node 1 lost, its leader fetches the node's copy from node 0's leader while the other
    ranks wait (only the two leaders hold the manifest's entries); the four ranks then load each node's copy, the
    files hashed on the way in not hashed again. The steps after equal a copy of the run resumed from storage."""
    from ckpt.commit.fsutil import dump_yaml

    mem = tmp_path / "shm"
    run = new_run(tmp_path / "run", _spec(mem))
    assert spawn(run_segment, 4, str(run), END, 0, nodes=2) == [0, 0, 0, 0]
    stored = tmp_path / "stored"
    shutil.copytree(run, stored)
    spec = _spec(tmp_path / "shm-of-the-copy")  # an empty memory dir: the copy resumes from storage
    (stored / "run.yaml").write_text(dump_yaml(spec.model_dump(mode="json")))
    b = mem / "nodes" / "node1"
    assert validate(b / "checkpoints" / f"step-{END:08d}", deep=True).valid
    shutil.rmtree(b)
    for path in (run, stored):
        assert spawn(run_segment, 4, str(path), END + 2, 1, nodes=2) == [0, 0, 0, 0]
    tiers = [[e for e in _events(path) if e["kind"] == "resume"][-1]["data"]["tier"] for path in (run, stored)]
    assert tiers == ["memory", "storage"]
    assert validate(b / "checkpoints" / f"step-{END:08d}", deep=True).valid  # node 1's copy rebuilt from the peer
    assert_bitwise(metrics(stored), metrics(run), range(END + 1, END + 3))


def _watch_the_load(tamper: str | None) -> dict[str, list]:
    """In a rank: note the files (paths) the restore's loads hash themselves (OnePassReader._hash_whole), the
    files the early work checked (NodeTier._ready_early) and the files it hashed itself (node_tier.hash_files).
    ``tamper`` (a file name pattern): once the Checkpointer took the early work over, rank 0 changes a byte of the
    first file of node 0's copy that matches it."""
    import os

    from ckpt.formats.dcp import onepass
    from trainer.checkpointer import core, node_tier

    seen: dict[str, list] = {"hashed_by_the_load": [], "early": [], "hashed_early": []}
    hash_whole, ready_early, take_early, hash_files = (
        onepass.OnePassReader._hash_whole,
        node_tier.NodeTier._ready_early,
        core.take_early,
        node_tier.hash_files,
    )

    def hashing(paths, threads=2):  # type: ignore[no-untyped-def]
        seen["hashed_early"] += [Path(p).name for p in paths]
        return hash_files(paths, threads=threads)

    def hashed(self, fd: int, size: int, progress):  # type: ignore[no-untyped-def]
        seen["hashed_by_the_load"].append(os.readlink(f"/proc/self/fd/{fd}"))
        return hash_whole(self, fd, size, progress)

    def early(self) -> None:  # type: ignore[no-untyped-def]
        ready_early(self)
        seen["early"].append(sorted(self._early_verified.get(END, {})))

    def take(host, memory):  # type: ignore[no-untyped-def]
        tier = take_early(host, memory)
        if tamper and tier is not None and int(os.environ["RANK"]) == 0:
            flip_byte(sorted(tier.memory.checkpoint(END).glob(tamper))[0], 1000)
        return tier

    onepass.OnePassReader._hash_whole = hashed  # type: ignore[method-assign]
    node_tier.NodeTier._ready_early = early  # type: ignore[method-assign]
    core.take_early = take  # type: ignore[assignment]
    node_tier.hash_files = hashing  # type: ignore[assignment]
    return seen


def _segment_watching_the_load(run: str, until: int, segment: int, out: str, tamper: str | None) -> int:
    """run_segment under ``_watch_the_load``; what it saw goes to OUT.RANK.json."""
    import os

    seen = _watch_the_load(tamper)
    try:
        return run_segment(run, until, segment)
    finally:
        Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(seen))


def _script_watching_the_load(run: str, until: int, out: str) -> dict:
    """A user's FSDP2 loop (tests/scripts/llama_loop.py) under ``_watch_the_load``; what it saw goes to
    OUT.RANK.json."""
    import os
    import runpy

    seen = _watch_the_load(None)
    try:
        return runpy.run_path(str(Path(__file__).parent / "scripts" / "llama_loop.py"))["main"]([], run, until)
    finally:
        Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(seen))


def test_the_lost_nodes_files_come_and_every_copy_is_hashed_while_the_model_builds(
    reference: Path, two_node_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """Node 1 lost: before the Checkpointer exists (beside the model build) node 1 receives every file from node 0,
    which hashes each as it sends it (so nothing is left to hash early); the load then hashes no file again, and the
    run goes on bitwise."""
    run, mem = two_node_run
    shutil.rmtree(mem / "nodes" / "node1")
    out = tmp_path / "seen"
    assert spawn(_segment_watching_the_load, 2, str(run), END + 2, 1, str(out), None, nodes=2) == [0, 0]
    seen = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    files = sorted(f.name for f in (mem / "nodes" / "node0" / "checkpoints" / f"step-{END:08d}").iterdir())
    files.remove("manifest.json")
    for r in range(2):  # each node's whole copy checked early (sent or received), none hashed by the load
        assert seen[r]["early"] == [files] and seen[r]["hashed_by_the_load"] == [], (r, seen[r], files)
        assert seen[r]["hashed_early"] == [], seen[r]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "memory" and resume["parent"] == f"checkpoint:step-{END:08d}@memory"
    assert validate(mem / "nodes" / "node1" / "checkpoints" / f"step-{END:08d}", deep=True).valid
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def test_a_file_changed_after_the_early_hash_is_hashed_again_and_refused(
    reference: Path, two_node_run: tuple[Path, Path], tmp_path: Path, capfd
) -> None:
    """Node 1 lost; the early work checked both copies, then a byte of node 0's copy changes before the load: the
    load sees the file is no longer the one hashed, hashes it, and refuses the snapshot (one line; storage's
    checkpoint of the same step is used)."""
    run, mem = two_node_run
    shutil.rmtree(mem / "nodes" / "node1")
    out = tmp_path / "seen"
    capfd.readouterr()
    assert spawn(_segment_watching_the_load, 2, str(run), END + 2, 1, str(out), "__1_*.distcp", nodes=2) == [0, 0]
    err = capfd.readouterr().err
    seen = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    first_of_node1 = sorted(n for n in seen[0]["early"][0] if n.startswith("__1_"))[0]  # the file changed
    from_memory = [[Path(p).name for p in s["hashed_by_the_load"] if p.startswith(str(mem))] for s in seen]
    assert from_memory == [[first_of_node1], []], seen  # then the storage checkpoint's load hashes its own files
    said = [ln for ln in err.splitlines() if "memory snapshot" in ln and "not used" in ln]
    assert len(said) == 1 and "checksum" in said[0] and "resuming from storage" in said[0], err[-3000:]
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "storage" and resume["parent"] == f"checkpoint:step-{END:08d}"
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))


def test_a_users_script_gets_the_early_restore_too(tmp_path: Path) -> None:
    """A user's own FSDP2 loop on 2 nodes x 1 rank with the memory tier: node 1 lost after step END; the next
    segment's sk.Segment() starts the node work while the script builds its model, the load hashes nothing again,
    and the steps after equal a copy of the run resumed from storage."""
    from ckpt.commit.fsutil import dump_yaml
    from schemas import ScriptSpec

    loop = Path(__file__).parent / "scripts" / "llama_loop.py"
    mem = tmp_path / "shm"
    spec = _spec(mem).model_copy(update={"script": ScriptSpec(path=str(loop))})
    run = new_run(tmp_path / "run", spec)
    spawn(_script_watching_the_load, 2, str(run), END, str(tmp_path / "first"), nodes=2)
    stored = tmp_path / "stored"
    shutil.copytree(run, stored)
    other = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"memory_dir": str(tmp_path / "shm-of-the-copy")})}
    )
    (stored / "run.yaml").write_text(dump_yaml(other.model_dump(mode="json")))  # an empty memory dir: storage
    shutil.rmtree(mem / "nodes" / "node1")
    out = tmp_path / "seen"
    spawn(_script_watching_the_load, 2, str(run), END + 2, str(out), nodes=2)
    spawn(_script_watching_the_load, 2, str(stored), END + 2, str(tmp_path / "stored-seen"), nodes=2)
    seen = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    files = sorted(f.name for f in (mem / "nodes" / "node0" / "checkpoints" / f"step-{END:08d}").iterdir())
    files.remove("manifest.json")
    for r in range(2):
        assert seen[r]["early"] == [files] and seen[r]["hashed_by_the_load"] == [], (r, seen[r], files)
    tiers = [[e for e in _events(path) if e["kind"] == "resume"][-1]["data"]["tier"] for path in (run, stored)]
    assert tiers == ["memory", "storage"]
    got, want = metrics(run), metrics(stored)  # the script logs its loss (no gradient norm)
    assert [got[s]["loss"] for s in (END + 1, END + 2)] == [want[s]["loss"] for s in (END + 1, END + 2)]


@pytest.mark.parametrize("tamper", [None, "__0_*.distcp"], ids=["as-kept", "own-file-changed-after-the-early-hash"])
def test_no_node_lost_each_node_hashes_its_copy_while_the_model_builds(
    reference: Path, two_node_run: tuple[Path, Path], tmp_path: Path, tamper: str | None, capfd
) -> None:
    """Both nodes kept their memory: each node hashes its whole copy early (nothing to transfer), and the load
    hashes nothing again; a file of node 0's own changed after that hash (rewritten in place: its mtime and ctime
    move) is hashed again by the load, which refuses the snapshot (one line; storage's checkpoint is used)."""
    run, mem = two_node_run
    out = tmp_path / "seen"
    files = sorted(f.name for f in (mem / "nodes" / "node1" / "checkpoints" / f"step-{END:08d}").iterdir())
    files.remove("manifest.json")
    capfd.readouterr()
    assert spawn(_segment_watching_the_load, 2, str(run), END + 2, 1, str(out), tamper, nodes=2) == [0, 0]
    err = capfd.readouterr().err
    seen = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    from_memory = [[Path(p).name for p in s["hashed_by_the_load"] if p.startswith(str(mem))] for s in seen]
    for r in range(2):  # one rank a node: it hashed every file of its node's copy itself
        assert sorted(seen[r]["hashed_early"]) == files and seen[r]["early"] == [files], (r, seen[r])
    resume = [e for e in _events(run) if e["kind"] == "resume"][-1]
    if tamper is None:
        assert from_memory == [[], []], seen
        assert resume["data"]["tier"] == "memory" and resume["parent"] == f"checkpoint:step-{END:08d}@memory"
    else:
        assert from_memory == [[sorted(n for n in files if n.startswith("__0_"))[0]], []], seen
        said = [ln for ln in err.splitlines() if "memory snapshot" in ln and "not used" in ln]
        assert len(said) == 1 and "checksum" in said[0] and "resuming from storage" in said[0], err[-3000:]
        assert resume["data"]["tier"] == "storage" and resume["parent"] == f"checkpoint:step-{END:08d}"
    assert_bitwise(metrics(reference), metrics(run), range(END + 1, END + 3))
