"""Overhead of the public API on a user's loop outside saves: step time with ``seg.steps()``/``seg.log`` vs the same
FSDP2 loop bare (bench/api_loop.py), 2 ranks on CPU, both blocks in one process (same ranks, same memory; launches
differ more between themselves than the API costs), in alternating order from launch to launch, no checkpoint
inside the timed steps (checkpoint.interval beyond the run). Goal: <= 1 % per step.

    python bench/api_overhead.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import fmt, md_table, publish  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LOOP = ROOT / "bench" / "api_loop.py"


def run(order: str, steps: int, width: int, work: Path, i: int) -> dict[str, list[float]]:
    import os

    out = work / f"times-{i}.json"
    run_dir = work / f"run-{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--script",
        str(LOOP),
        "--run-dir",
        str(run_dir),
        "--until-step",
        str(steps + 10),
        "--nproc",
        "2",
        "--set",
        f"checkpoint.interval={steps * 10}",
        "--",
        "--order",
        order,
        "--steps",
        str(steps),
        "--width",
        str(width),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=1024)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="api-overhead-"))
    medians: dict[str, list[float]] = {"bare": [], "api": []}
    ratio = []
    for i in range(a.reps):  # the order alternates: whatever drifts within a process falls on both sides
        times = run("bare,api" if i % 2 == 0 else "api,bare", a.steps, a.width, work, i)
        for side in ("bare", "api"):
            medians[side].append(statistics.median(times[side]) * 1e3)
        ratio.append(medians["api"][-1] / medians["bare"][-1])
    rows = [
        ["bare loop (torch.distributed only)", fmt(medians["bare"]), ""],
        ["same loop through sk.Segment (steps + log)", fmt(medians["api"]), fmt(ratio, 4) + "x"],
    ]
    body = md_table(["loop", "median step ms, median (min-max) of launches", "ratio api / bare"], rows, "lrr")
    over = (statistics.median(ratio) - 1) * 100
    body += (
        f"\n\n{a.reps} launches, each timing {a.steps} steps bare and {a.steps} through the API after 10 warm-up "
        f"steps each, in alternating order; 2 ranks, 4 x Linear({a.width}) FSDP2 blocks, batch 32, AdamW, no "
        f"checkpoint in the timed steps. Overhead: {over:+.2f} % (goal <= 1 %: {'met' if over <= 1 else 'missed'})."
    )
    publish("api-overhead", body)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
