"""The README's benchmark tables are the benches' own output: every marked block equals bench/results/NAME.md,
and every published table says when, where, with what and by which command it was measured."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

benchlib = importlib.import_module("benchlib")
readme_tables = importlib.import_module("readme_tables")

HEADER = re.compile(
    r"^_Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC on \d+ CPU cores, [\d.]+ GiB memory, .+; "
    r"(load average [\d./]+ \(1/5/15 min\) when the table was printed; )?python [\d.]+, "
    r"torch [^,]+, [^`]*command: `python bench/[a-z0-9_]+\.py[^`]*`_$"
)


def test_readme_blocks_equal_the_published_tables() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rendered, problems = readme_tables.render(text)
    assert problems == []
    assert rendered == text, "a README bench table was edited by hand or not refreshed: python bench/readme_tables.py"
    assert readme_tables.main(["--check"]) == 0


def test_every_published_table_carries_its_provenance() -> None:
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert results, "no bench results published"
    for path in results:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert HEADER.match(first), f"{path.name}: header line is {first!r}"


def test_a_hand_edit_is_caught(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    (tmp_path / "demo.md").write_text("_Measured ..._\n\n| a |\n|---|\n| 1 |\n")
    readme = "intro\n<!-- bench:demo -->\n| a |\n|---|\n| 2 |\n<!-- /bench:demo -->\nrest\n"
    out, problems = readme_tables.render(readme)
    assert problems == [] and "| 1 |" in out and "| 2 |" not in out and out.endswith("rest\n")
    (tmp_path / "orphan.md").write_text("x\n")
    assert any("orphan" in p for p in readme_tables.render(readme)[1])


def test_publish_writes_header_and_table(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    path = benchlib.publish(
        "demo", benchlib.md_table(["x", "y"], [[1, 2]], "lr"), ["bench/demo_bench.py", "--reps", "3"]
    )
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("_Measured ") and "command: `python bench/demo_bench.py --reps 3`" in lines[0]
    assert lines[2:] == ["| x | y |", "|---|---:|", "| 1 | 2 |"]


def test_the_published_command_names_no_machine_path() -> None:
    argv = [
        str(ROOT / "bench/torture.py"),
        "--kills",
        "200",
        "--work",
        "/scratch/torture",
        "--out=/tmp/x.json",
        "--table-from",
        "/a/one.json",
        "/b/two.json",
        "--config",
        str(ROOT / "configs/tiny.yaml"),
        "--note",
        "a b",
    ]
    assert benchlib.command_line(argv) == (
        "python bench/torture.py --kills 200 --work WORK --out=OUT --table-from "
        "TABLE_FROM TABLE_FROM --config configs/tiny.yaml --note 'a b'"
    )
    assert benchlib.command_line(["/opt/venv/bin/../../elsewhere/x.py"]) == "python x.py"
    assert "/scratch" not in benchlib.header([str(ROOT / "bench/demo.py"), "--work", "/scratch/w"])


def test_a_plot_is_drawn_from_the_published_rows(tmp_path) -> None:
    (tmp_path / "demo.md").write_text(
        "_Measured ..._\n\nintro\n\n| size | seconds |\n|---:|---:|\n"
        "| 1,000 | 1.50 (1.20–1.90) |\n| 4,096 | **2.25** (met) |\n\n"
        "| other |\n|---|\n| x |\n"
    )
    rows = benchlib.table_rows("demo", results=tmp_path)
    assert rows == [{"size": "1,000", "seconds": "1.50 (1.20–1.90)"}, {"size": "4,096", "seconds": "**2.25** (met)"}]
    assert benchlib.table_rows("demo", 1, results=tmp_path) == [{"other": "x"}]
    assert benchlib.spread(rows[0]["seconds"]) == (1.5, 1.2, 1.9) and benchlib.spread(rows[1]["seconds"])[0] == 2.25
    assert benchlib.numbers(rows[1]["size"]) == [4096.0]

    def draw(fig) -> None:
        benchlib.hbars(fig.add_subplot(), [r["size"] for r in rows], [r["seconds"] for r in rows], "s", grey={0})

    first = benchlib.plot_from_table("demo", draw, results=tmp_path).read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert benchlib.plot_from_table("demo", draw, results=tmp_path).read_bytes() == first  # same rows, same bytes


def _peers_run(
    system: str, rnd: int, snapshot_s: float, copy_s: float, kill_to_ranks_s: float, loss: str = "2.5"
) -> dict:
    """The events one run of bench/peers_memtier.py collects (2 ranks, rank 1 the slower one at twice rank 0's
    times), for the schedule: a snapshot every 2 steps, storage every 4 (twice a snapshot's stall), steps 5-8
    counted, rank 1 killed at t=100 after the snapshot of step 10; the new ranks load 3 s after they start and
    finish their first step 1 s later (process group joined after 1 s, model built after 2 s)."""
    ev: list[dict] = [{"ev": "start", "rank": r, "pid": 10 + r, "t": 0.1, "created": 0.0} for r in (0, 1)]
    ev.append({"ev": "built", "rank": 0, "pid": 10, "t": 1.0, "params": 38_000_000})
    for s in range(1, 11):
        kind = "storage" if s % 4 == 0 else "memory" if s % 2 == 0 else None
        extra = {None: 0.0, "memory": snapshot_s, "storage": 2 * snapshot_s}[kind]
        for r, f in ((0, 0.5), (1, 1.0)):
            ev.append(
                {
                    "ev": "boundary",
                    "rank": r,
                    "pid": 10 + r,
                    "t": float(s),
                    "s": s,
                    "kind": kind,
                    "dt": 0.01 + extra * f,
                }
            )
            if kind is None:
                ev.append({"ev": "copy", "rank": r, "pid": 10 + r, "t": float(s), "s": s, "dt": copy_s * f})
            if kind == "storage":
                ev.append({"ev": "durable", "rank": r, "pid": 10 + r, "t": float(s), "s": s, "dt": 0.4 * f})
        ev.append({"ev": "step", "rank": 0, "pid": 10, "t": float(s), "s": s, "loss": loss})
    up = 100.0 + kill_to_ranks_s
    ev += [{"ev": "start", "rank": r, "pid": 20 + r, "t": up + 0.1, "created": up} for r in (0, 1)]
    ev += [{"ev": what, "rank": 0, "pid": 20, "t": up + at} for what, at in (("joined", 1.0), ("built", 2.0))]
    ev.append({"ev": "loaded", "rank": 0, "pid": 20, "t": up + 3.0, "step": 10, "source": "memory"})
    ev.append({"ev": "step", "rank": 0, "pid": 20, "t": up + 4.0, "s": 11, "loss": loss})
    return {
        "system": system,
        "round": rnd,
        "events": ev,
        "kill_t": 100.0,
        "launches": [0.0],
        "shm_gb": 0.5,
        "tmpfs_gb": 0.6,
        "tier": None,
    }


def test_the_peers_table_is_built_from_each_runs_events(tmp_path) -> None:
    peers = importlib.import_module("peers_memtier")
    sch = {"memory_interval": 2, "interval": 4, "measure_from": 4, "measure_to": 8, "kill_at": 10, "until": 12}
    one = peers.figures(_peers_run("torch", 0, 0.2, 0.1, 0.5), sch)
    # the slower rank's boundary minus a boundary without a save; the slower rank's copy and durable wait
    assert abs(one["snapshot_stall_s"] - 0.2) < 1e-9 and abs(one["copy_s"] - 0.1) < 1e-9
    assert abs(one["stall_ratio"] - 2.0) < 1e-9 and abs(one["storage_stall_s"] - 0.4) < 1e-9
    assert one["durable_s"] == 0.4 and (one["snapshots"], one["storage_saves"]) == (1, 1)
    assert (one["kill_to_ranks_s"], one["ranks_to_loaded_s"], one["recovery_s"]) == (0.5, 3.0, 4.5)
    assert (one["restored_step"], one["redone"], one["source"]) == (10, 0, "memory")
    assert one["restart_phases_s"] == {"joined": 1.0, "built": 2.0}

    runs = [
        _peers_run("shardkeeper", 0, 0.1, 0.1, 9.0),
        _peers_run("torch", 0, 0.2, 0.1, 0.5),
        _peers_run("torch", 1, 0.3, 0.1, 0.5),
        _peers_run("shardkeeper", 1, 0.1, 0.1, 9.0),
    ]
    for r in runs:
        r["figures"] = peers.figures(r, sch)
    meta = {
        "schedule": sch,
        "args": vars(peers.parse([])),
        "sk_restarts": False,
        "orders": [["shardkeeper", "torch"], ["torch", "shardkeeper"]],
    }
    body = peers.table(runs, meta)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in body.splitlines() if line.startswith("| ")}
    assert rows["snapshot stall / one host copy of the state"].endswith(
        "| **1.00×** [1.00–1.00] | 2.50× [2.00–3.00] |"
    )  # the lower median in bold, [min–max] over rounds
    assert rows["SIGKILL of one rank → first step done again"].endswith("| 13.0 s [13.0–13.0] | **4.5 s** [4.5–4.5] |")
    assert "identical in all 4 runs: yes" in body and "ends the segment" in body
    runs[2]["figures"]["losses"]["11"] = "2.6"  # one run trained one step differently
    assert "identical in all 4 runs: NO" in peers.table(runs, meta)

    (tmp_path / "peers-memtier.md").write_text("_Measured ..._\n\n" + body + "\n", encoding="utf-8")
    assert peers.plot(results=tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # every cell parses for the plot


def test_the_goodput_is_met_or_missed_only_when_its_whole_interval_is_on_one_side_of_the_goal() -> None:
    """Rounds of three phases side by side: the goodput is plain / snapshots and storage - snapshots per round, medians
    over rounds; a verdict only when the rounds' 95 % interval is on one side of the goal, and a median above 1 (the
    noise larger than what a snapshot costs) is said."""
    import argparse

    memtier = importlib.import_module("memtier_bench")
    args = argparse.Namespace(memory_dir="/dev/shm/x")

    def res(rounds: list[tuple[float, float, float]]) -> dict:
        phases = [
            {"round": r, "mode": mode, "wall_s": w}
            for r, walls in enumerate(rounds)
            for mode, w in zip(("plain", "memory", "storage"), walls)
        ]
        common = {"copy_s": [0.06, 0.07], "stall_s": [0.06, 0.07], "k": 2, "step_s": 2.0, "steps_per_phase": 2}
        return {**common, "phases": phases, "snapshot_bytes": 9e8, "params": 7.7e7}

    # the machine drifts from 4.0 to 6.0 s per phase: side by side, every round says 4 % of a phase is the snapshot's
    drift = [(w, w * 1.04, w * 1.04 + 0.5) for w in (4.0 + 0.1 * r for r in range(20))]
    assert memtier.round_pairs(res(drift)["phases"])[0] == pytest.approx((1 / 1.04, 0.5))
    missed = memtier.table(res(drift), None, args)
    assert "**0.960** (goal ≥ 0.98: missed: 0.020 short, 95 % interval 0.960–0.960)" in missed

    clear = memtier.table(res([(4.0, 4.06, 4.1)] * 12), None, args)  # 4.0 / 4.06 = 0.985; + 0.04 s / 300 s
    assert "(goal ≥ 0.98: met, 95 % interval 0.985–0.985)" in clear and "goodput above 1" not in clear

    # rounds scattered around 1 (snapshots as often faster as slower): the interval spans the goal
    noisy = [(4.0, 4.0 * f, 4.0 * f + 0.05) for f in (0.94, 1.05, 0.97, 1.03, 0.92, 1.06, 0.99, 1.01, 0.95, 1.04)]
    verdict = memtier.table(res(noisy), None, args)
    assert "(goal ≥ 0.98: not resolved: 95 % interval " in verdict and " spans the goal)" in verdict
    low, high = memtier.bootstrap(memtier.round_pairs(res(noisy)["phases"]))
    assert low < 0.98 < high

    faster = [(4.0, 4.0 * f, 4.0 * f) for f in (0.97, 0.98, 0.99, 0.96, 1.01)]
    said = memtier.table(res(faster), None, args)
    assert "snapshot goodput above 1 (1.020)" in said and "in the median round the phase with a snapshot ran" in said
    # five rounds are too few for any verdict, however tight they look
    assert "(goal ≥ 0.98: not resolved: 5 complete round(s), at least 10 needed)" in said
    few = memtier.table(res([(4.0, 4.06, 4.1)] * 9), None, args)
    assert "(goal ≥ 0.98: not resolved: 9 complete round(s), at least 10 needed)" in few
    # a wall that is not a positive number is refused, not averaged; no complete round is no verdict
    for bad in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="is not a positive number of seconds"):
            memtier.table(res([(4.0, 4.06, bad)] + [(4.0, 4.06, 4.1)] * 11), None, args)
    lonely = {**res([]), "phases": [{"round": r, "mode": "plain", "wall_s": 4.0} for r in range(12)]}
    assert "not resolved: 0 complete round(s)" in memtier.table(lonely, None, args)

    # node loss: the goal is on process group up -> loaded (the early node work beside the model build counts);
    # the load phase alone and the start -> first step are rows of their own
    def seg(load: float, restore: float, first: float) -> dict:
        return {"load_s": load, "restore_s": restore, "first_step_s": first, "tier": "memory"}

    lost = {
        "same": [seg(0.8, 3.0, 10.0), seg(0.9, 3.2, 10.4)],
        "peer": [seg(0.8, 3.9, 10.6), seg(0.9, 4.1, 11.0)],
        "step": 14,
        "bytes": 1.35e9,
    }
    rows = memtier.table(res([(4.0, 4.06, 4.1)] * 12), None, args, lost)
    assert "same node 3.10 (3.00–3.20) s; peer 4.00 (3.90–4.10) s (process group up -> state loaded)" in rows
    assert "**1.29x** (goal ≤ 1.2x: missed: 1.29x)" in rows
    assert "the load phase alone (model built -> state loaded) | same node 0.85" in rows and "| 1.00x |" in rows
    assert "the ranks' start -> first step done | same node 10.20" in rows and "| 1.06x |" in rows
    before = {p: [{k: v for k, v in r.items() if k != "restore_s"} for r in lost[p]] for p in ("same", "peer")}
    old = memtier.table(res([(4.0, 4.06, 4.1)] * 12), None, args, {**lost, **before})  # an earlier run's nodes.json
    assert "(load phase)" in old and "**1.00x** (goal ≤ 1.2x: met)" in old

    # a run recorded before phases carried their round: consecutive triples are its rounds
    old = [{k: v for k, v in p.items() if k != "round"} for p in res(drift)["phases"]]
    assert memtier.round_pairs(old) == memtier.round_pairs(res(drift)["phases"])
