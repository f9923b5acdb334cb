"""Overhead of the public API on a user's loop outside saves: step time with ``seg.steps()``/``seg.log`` vs the same
FSDP2 loop bare (bench/api_loop.py), 2 ranks on CPU. Both sides run in the same processes (same ranks, same memory;
launches differ more between themselves than the API costs), in short blocks that alternate (``--block`` steps
each, the side first alternating from pair to pair), no checkpoint inside the timed steps (checkpoint.interval beyond
the run). Each pair of blocks gives one ratio (median API step / median bare step); the figure is the median over
every pair of every launch. Goal: <= 1 % per step.

The profile beside it splits an API step: the user's step inside it (against the bare step: what the API changes
in the step itself, e.g. its collective in flight), ``seg.log``, and the time inside ``steps()`` between two yields.

    python bench/api_overhead.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
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
WARM = 10


def run(pairs: int, block: int, width: int, work: Path, i: int, agreement: str = "async") -> dict:
    out = work / f"times-{i}.json"
    run_dir = work / f"run-{i}"
    shutil.rmtree(run_dir, ignore_errors=True)
    until = WARM + pairs * block + 1  # the API side's steps, then one untimed last step
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
        str(until),
        "--nproc",
        "2",
        "--set",
        f"checkpoint.interval={until * 10}",
        "--",
        "--pairs",
        str(pairs),
        "--block",
        str(block),
        "--warm",
        str(WARM),
        "--width",
        str(width),
        "--out",
        str(out),
        "--agreement",
        agreement,
    ]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    return json.loads(out.read_text())


def blocks(xs: list[float], k: int) -> list[list[float]]:
    return [xs[i : i + k] for i in range(0, len(xs), k)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3, help="launches")
    ap.add_argument("--pairs", type=int, default=30, help="alternated pairs of blocks per launch")
    ap.add_argument("--block", type=int, default=4, help="steps per block")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument(
        "--agreement",
        default="async",
        choices=["async", "blocking", "none"],
        help="profile only (implies --no-publish): the agreement waited for at once, or left out",
    )
    ap.add_argument("--no-publish", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="api-overhead-"))
    pair_ratio: list[float] = []
    launch_ratio: list[float] = []
    med: dict[str, list[float]] = {
        k: [] for k in ("bare", "api", "api_user", "api_log", "api_steps", "bare_cpu", "api_cpu")
    }
    cpu_ratio: list[float] = []
    load0 = os.getloadavg()[0]
    try:
        for i in range(a.reps):
            t = run(a.pairs, a.block, a.width, work, i, a.agreement)
            for b, x in zip(blocks(t["bare"], a.block), blocks(t["api"], a.block)):
                pair_ratio.append(statistics.median(x) / statistics.median(b))
            for b, x in zip(blocks(t["bare_cpu"], a.block), blocks(t["api_cpu"], a.block)):
                cpu_ratio.append(statistics.median(x) / statistics.median(b))
            launch_ratio.append(statistics.median(t["api"]) / statistics.median(t["bare"]))
            for k, got in med.items():
                got.append(statistics.median(t[k]) * 1e3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    over = (statistics.median(pair_ratio) - 1) * 100
    bare_ms = statistics.median(med["bare"])
    rows = [
        ["bare loop (torch.distributed only)", fmt(med["bare"]), "", ""],
        [
            "same loop through sk.Segment (steps + log)",
            fmt(med["api"]),
            fmt(pair_ratio, 4) + "x",
            fmt(launch_ratio, 4) + "x",
        ],
        [
            "CPU seconds of rank 0's process per step (all its threads), through sk.Segment vs bare",
            f"{fmt(med['bare_cpu'])} bare, {fmt(med['api_cpu'])} API",
            fmt(cpu_ratio, 4) + "x",
            "",
        ],
    ]
    body = md_table(
        [
            "loop",
            "median step ms, median (min-max) of launches",
            "api / bare, every pair of blocks",
            "api / bare, each launch",
        ],
        rows,
        "lrrr",
    )
    profile = [
        [
            "the user's step inside an API step",
            fmt(med["api_user"]),
            f"{(statistics.median(med['api_user']) / bare_ms - 1) * 100:+.2f} % of the bare step",
        ],
        ["seg.log", fmt(med["api_log"], 3), f"{statistics.median(med['api_log']) / bare_ms * 100:.3f} %"],
        [
            "inside steps() between two yields (metrics row, progress, the agreement waited for and started)",
            fmt(med["api_steps"], 3),
            f"{statistics.median(med['api_steps']) / bare_ms * 100:.3f} %",
        ],
    ]
    body += "\n\nWhere an API step's time goes (median ms per step; share of the bare step):\n\n" + md_table(
        ["part", "ms, median (min-max) of launches", "of a bare step"], profile, "lrr"
    )
    body += (
        f"\n\n{a.reps} launches, each {a.pairs} pairs of {a.block}-step blocks (bare, API) alternated after "
        f"{WARM} warm-up steps of each side; 2 ranks, 4 x Linear({a.width}) FSDP2 blocks, batch 32, AdamW, no "
        f"checkpoint in the timed steps; load average {load0:.1f} at the start, {load1:.1f} at the end. "
        f"Overhead: {over:+.2f} % (goal <= 1 %: {'met' if over <= 1 else 'missed'})."
    )
    if a.no_publish or a.agreement != "async":
        print(body)
        return
    publish("api-overhead", body)


if __name__ == "__main__":
    main()
