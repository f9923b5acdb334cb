"""The fuzzer's long run: many Hypothesis-drawn mutations per target, random seeds, every outcome counted.

    nice -n 5 python bench/fuzz.py                      # 300 inputs per target, ~1 h on 2 idle cores
    python bench/fuzz.py --examples 20 --no-publish     # a quick look
    python bench/fuzz.py --only memory,metadata --seed 7

Targets and entry points are those of ``tests/reliability/fuzz_lib.py`` (the short run is
``tests/reliability/test_fuzz.py``): mutations of a DCP ``.metadata`` (through DCP's own classes, and raw bytes), of
``manifest.json``, of DeepSpeed's model/optim state files, of ``latest``, of an HF Trainer/DeepSpeed
``checkpoint-N/`` layout and of a committed memory snapshot (with its run's identity files), each input through
``shardkeeper import``, ``validate --deep``, a resume on one in-process rank (the trainer's Checkpointer, into the
live FSDP2 model) and the launcher's persist of a memory snapshot, as its target has them. Every entry point of every
input runs in its own process forked from a warm worker, under a deadline (``--deadline``) and a memory bound.

The table (bench/results/fuzz.md) counts per target and entry point: inputs tried; outcomes -- refused (one line,
nothing committed), correct (the state that came out is the seed's, or exactly what the mutated files say) and other
(anything else: must be 0); the peak resident memory of an input's process, and what it added over the worker it
was forked from; the median and largest time an input took. Inputs whose outcome was "other" are listed under it
with the reason, to be fixed where the reader lives and kept as a regression case.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchlib import md_table, publish
from tests.reliability.fuzz_lib import OUTCOMES, RSS_BOUND, TARGETS, Fuzzer

OUT = ROOT / "bench" / "out" / "fuzz"


def fuzz_target(fuzzer: Fuzzer, name: str, examples: int, seed: int) -> list[dict[str, Any]]:
    """``examples`` inputs drawn for one target (Hypothesis, seeded, no shrinking: every input counted once)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    results: list[dict[str, Any]] = []

    @with_seed(seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(program=TARGETS[name].strategy)
    def one(program: dict) -> None:
        results.extend(fuzzer.run(name, program))

    one()
    return results


def _public(why: str) -> str:
    """A reason as the table shows it: the input's scratch folder as WORK, Python's own files by name only."""
    why = re.sub(r"/dev/shm/fuzz-worker-[^/\s'\"]*/in-[^/\s'\"]*", "WORK", why)
    return re.sub(r"/\S*/lib/python3\.\d+/", "", why)


def table(results: list[dict[str, Any]], worker_rss: float) -> tuple[str, list[str]]:
    rows, others = [], []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["target"], r["entry"])].append(r)
    for name, target in TARGETS.items():
        for entry in target.entries:
            rs = groups.get((name, entry), [])
            if not rs:
                continue
            count = {o: sum(r["outcome"] == o for r in rs) for o in OUTCOMES}
            secs = [r["seconds"] for r in rs]
            rows.append(
                [
                    target.title,
                    entry,
                    len(rs),
                    count["refused"],
                    count["correct"],
                    f"**{count['other']}**",
                    f"{max(r['rss_mib'] for r in rs):.0f}",
                    f"{max(r['rss_added_mib'] for r in rs):.0f}",
                    f"{statistics.median(secs):.2f}",
                    f"{max(secs):.2f}",
                ]
            )
            others += [
                f"{name}/{entry}: {_public(r['why'])} -- input {json.dumps(r['program'])}"
                for r in rs
                if r["outcome"] == "other"
            ]
    head = [
        "target",
        "entry point",
        "inputs",
        "refused",
        "correct",
        "other",
        "max RSS MiB",
        "max RSS added MiB",
        "median s",
        "max s",
    ]
    body = md_table(head, rows, "llrrrrrrrr")
    body += (
        f"\n\nPeak RSS is that of the input's own process, forked from a worker holding {worker_rss:.0f} MiB "
        "(torch, transformers, the product); 'added' is what the input made resident beyond what the fork left "
        f"it. Bound per input: the worker's RSS + {RSS_BOUND >> 20} MiB, an address-space limit of the worker's + "
        "4 GiB, and the deadline."
    )
    return body, others


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300, help="inputs per target")
    ap.add_argument("--only", default=",".join(TARGETS), help="comma-separated targets: " + ", ".join(TARGETS))
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, printed)")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds an input's entry point may take")
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown target {unknown[0]}; choose from {', '.join(TARGETS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with Fuzzer(deadline_s=args.deadline, log=OUT / "worker.log") as fuzzer:
        for name in names:
            t = time.monotonic()
            got = fuzz_target(fuzzer, name, args.examples, seed)
            results += got
            bad = sum(r["outcome"] == "other" for r in got)
            print(f"{name}: {len(got)} runs in {time.monotonic() - t:.0f} s, other {bad}", flush=True)
        worker_rss = fuzzer.worker_rss_mib
    (OUT / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    body, others = table(results, worker_rss)
    inputs = sum(sum(r["target"] == n for r in results) // len(TARGETS[n].entries) for n in names)
    body += (
        f"\n\n{inputs} inputs (up to {args.examples} per target, Hypothesis seed {seed}, "
        f"{len(results)} entry-point runs) in {(time.monotonic() - t0) / 60:.0f} min; load average "
        f"{load_before:.1f} at the start. Outcomes other than refused or correct: {len(others)}."
    )
    if others:
        body += "\n\n" + "\n".join(f"- {o}" for o in others[:50])
    if args.no_publish:
        print(body)
    else:
        publish("fuzz", body)
    return 1 if others else 0


if __name__ == "__main__":
    sys.exit(main())
