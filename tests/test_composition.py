"""Composition: a user's own script continues checkpoints other tools wrote, at another world size, onto the losses of
the run that wrote them (the table recipe of tests/scripts/llama_loop.py, whose losses do not depend on the world size;
the writers are tests/compose.py's). One FSDP2 launch on 2 in-process ranks (tests.harness.spawn) writes the origins;
each case imports one and continues it on 3 ranks."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from shardkeeper.cli import main
from tests.compose import LOOP, ORIGIN_STEP, TINY, WORLD, write_dcp_layouts
from tests.harness import spawn

pytestmark = pytest.mark.slow

END = 6


@pytest.fixture(scope="module")
def dcp_origins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain FSDP2 run of the recipe on 2 ranks: its state at step 3 as a plain DCP save and torchtitan's
    ``step-3/``, and every step's loss to step 6 (``losses.json``)."""
    out = tmp_path_factory.mktemp("origins")
    spawn(write_dcp_layouts, WORLD, str(out), END, timeout=300)
    return out


def _loop(argv: list[str], run_dir: str, until: int) -> dict:
    return runpy.run_path(str(LOOP))["main"](argv, run_dir, until)


@pytest.mark.parametrize("origin", ["plain", "titan"])
def test_own_fsdp2_script_continues_an_imported_dcp_checkpoint_at_another_world_size(
    dcp_origins: Path, tmp_path: Path, origin: str
) -> None:
    """``shardkeeper import`` of another tool's DCP checkpoint of 2 ranks, then the user's own FSDP2 loop on 3 ranks:
    steps 4-6 are the writer's own within 1e-6 (relative), the optimizer as the script made it."""
    run = tmp_path / "run"
    assert main(["import", str(dcp_origins / origin), "--config", TINY, "--run-dir", str(run)]) == 0
    out = spawn(_loop, 3, ["--global-batch", "6"], str(run), END, timeout=300)
    assert [(o["step"], o["groups"], o["weight_decay"]) for o in out] == [(END, 1, 0.0)] * 3
    ref = json.loads((dcp_origins / "losses.json").read_text())
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(ORIGIN_STEP + 1, END + 1)) and {r["world_size"] for r in rows.values()} == {3}
    worst = max(abs(rows[s]["loss"] - ref[s - 1]) / ref[s - 1] for s in rows)
    assert worst <= 1e-6, [(s, ref[s - 1], rows[s]["loss"]) for s in rows]
