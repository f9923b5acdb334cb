"""The memory tier on several nodes: each node's copy, replication to the peer node, restore after losing a node.

Emulated nodes: the spawn harness gives the ranks local ranks and node names as torchrun's agents on two hosts
would (``nodes=2``); each node keeps its own memory dir (MEMORY_DIR/nodes/<name>). Real gloo groups carry the
replication and the restore transfers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpt.layout import RunDir
from ckpt.validate import validate
from tests.harness import assert_bitwise, metrics, new_run, spawn, tiny_spec
from trainer.segment import run_segment

K, END = 2, 6


def _spec(mem: Path):
    return tiny_spec(**{"checkpoint.memory_interval": K, "checkpoint.memory_dir": str(mem), "checkpoint.interval": 100,
                        "checkpoint.background_nice": 0})


def _events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1 node x 2 ranks without a memory tier: the same training as 2 nodes x 1 rank."""
    ref = new_run(tmp_path_factory.mktemp("ref") / "run", tiny_spec())
    assert spawn(run_segment, 2, str(ref), END + 2, 0) == [0, 0]
    return ref


def _two_node_run(tmp_path: Path) -> tuple[Path, Path]:
    mem = tmp_path / "shm"
    run = new_run(tmp_path / "run", _spec(mem))
    assert spawn(run_segment, 2, str(run), END, 0, nodes=2) == [0, 0]
    return run, mem


def test_each_node_holds_the_whole_snapshot_and_a_lost_node_restores_from_its_peer(reference: Path,
                                                                                    tmp_path: Path) -> None:
    run, mem = _two_node_run(tmp_path)
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
