"""Composition: every kind of run continues every origin of checkpoint through every way to continue it.

The generated matrix (tests/compose.py: kind x origin x continuation) runs here as its smallest subset that holds every
level of every factor (``levels_cover``: 5 cells through the real CLI, torchrun and the Prefect flows against the
session's server); the 25-cell covering set and the whole product run in ``bench/composition.py``. Beside it, the
user's own FSDP2 loop in-process on 3 ranks continues torchtitan's layout imported (the optimizer as the script
built it, onto the writer's losses)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from shardkeeper.cli import main
from tests.compose import LOOP, ORIGIN_STEP, TINY, Cell, Matrix, Sources, levels_cover, product
from tests.harness import spawn

pytestmark = pytest.mark.slow

END = 6


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, prefect_server: object) -> Matrix:
    """The matrix's runner: the origins other tools wrote (built once, on first use) and the cells' folders."""
    work = tmp_path_factory.mktemp("composition")
    return Matrix(Sources(work / "sources"), work / "cells")


@pytest.mark.parametrize("cell", levels_cover(product()), ids=lambda c: c.key)
def test_every_kind_continues_every_origin_every_way(matrix: Matrix, cell: Cell) -> None:
    """The cell continues: its losses within 1e-6 of the uninterrupted reference, its final export loads with
    ``from_pretrained`` (every cell of the matrix is one a user may expect to continue: a refusal here, even in one
    line, is a regression)."""
    out = matrix.run(cell)
    assert out.status == "continued", f"{cell.key}: {out.cell_text()} (reference: {out.reference})"
    assert out.max_rel is not None and out.max_rel <= 1e-6 and out.export_loads


def _loop(argv: list[str], run_dir: str, until: int) -> dict:
    return runpy.run_path(str(LOOP))["main"](argv, run_dir, until)


def test_own_fsdp2_script_continues_an_imported_torchtitan_checkpoint_at_another_world_size(
    matrix: Matrix, tmp_path: Path
) -> None:
    """``shardkeeper import`` of another tool's DCP checkpoint of 2 ranks, then the user's own FSDP2 loop on 3 ranks:
    steps 4-6 are the writer's own within 1e-6 (relative), the optimizer as the script made it."""
    run = tmp_path / "run"
    dcp_origins = matrix.sources.dcp()  # the plain FSDP2 run's state at step 3 (plain DCP, torchtitan), its losses
    assert main(["import", str(dcp_origins / "titan"), "--config", TINY, "--run-dir", str(run)]) == 0
    out = spawn(_loop, 3, ["--global-batch", "6"], str(run), END, timeout=300)
    assert [(o["step"], o["groups"], o["weight_decay"]) for o in out] == [(END, 1, 0.0)] * 3
    ref = json.loads((dcp_origins / "losses.json").read_text())
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == list(range(ORIGIN_STEP + 1, END + 1)) and {r["world_size"] for r in rows.values()} == {3}
    worst = max(abs(rows[s]["loss"] - ref[s - 1]) / ref[s - 1] for s in rows)
    assert worst <= 1e-6, [(s, ref[s - 1], rows[s]["loss"]) for s in rows]
