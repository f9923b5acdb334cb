"""Overhead of the public API on a user's loop outside saves: step time with ``seg.steps()``/``seg.log`` vs the same
FSDP2 loop bare (bench/api_loop.py), 2 ranks on CPU, launched the same way (torchrun through ``shardkeeper train
--script`` for the API, torchrun directly for the bare loop), alternated, no checkpoint inside the timed steps
(checkpoint.interval beyond the run). Goal: <= 1 % per step.

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


def run(bare: bool, steps: int, width: int, work: Path, i: int) -> list[float]:
    out = work / f"{'bare' if bare else 'api'}-{i}.json"
    args = ["--steps", str(steps), "--width", str(width), "--out", str(out)]
    env = {"OMP_NUM_THREADS": "1"}
    if bare:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(LOOP), "--bare", *args]
    else:
        run_dir = work / f"run-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "shardkeeper", "train", "--script", str(LOOP), "--run-dir", str(run_dir),
               "--until-step", str(steps), "--nproc", "2", "--set", f"checkpoint.interval={steps * 10}", "--", *args]
    import os

    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env}, cwd=ROOT)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--width", type=int, default=1024)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="api-overhead-"))
    medians: dict[str, list[float]] = {"bare": [], "api": []}
    for i in range(a.reps):  # alternated: the machine's drift falls on both sides
        for side in ("bare", "api"):
            medians[side].append(statistics.median(run(side == "bare", a.steps, a.width, work, i)) * 1e3)
    ratio = [api / bare for api, bare in zip(medians["api"], medians["bare"])]
    rows = [["bare loop (torch.distributed only)", fmt(medians["bare"]), ""],
            ["same loop through sk.Segment (steps + log)", fmt(medians["api"]), fmt(ratio, 4) + "x"]]
    body = md_table(["loop", "median step ms, median (min-max) of reps", "ratio"], rows, "lrr")
    over = (statistics.median(ratio) - 1) * 100
    body += (f"\n\n{a.reps} alternated launches per side, {a.steps} steps each ({a.steps - 10} timed after 10 warm-up "
             f"steps), 2 ranks, 4 x Linear({a.width}) FSDP2 blocks, batch 32, AdamW, no checkpoint in the timed steps. "
             f"Overhead: {over:+.2f} % (goal <= 1 %: {'met' if over <= 1 else 'missed'}).")
    publish("api-overhead", body)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
