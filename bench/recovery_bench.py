"""Recovery time: SIGTERM -> emergency checkpoint -> the next segment's first optimizer step, through the real CLI.

    python bench/recovery_bench.py              # ~250M-parameter Llama, 2 repetitions (~10 min on 2 cores, ~6 GB disk)
    python bench/recovery_bench.py --reps 1 && python bench/recovery_bench.py --reps 1 --append   # the same in 2 runs
    python bench/recovery_bench.py --reps 0 --append   # the table again from bench/out/recovery/raw.json
    python bench/recovery_bench.py --layers 2 --reps 1   # quick smoke run on a small model
    python bench/recovery_bench.py --device cuda --reps 1  # on a node with >= 2 GPUs (NCCL): recovery-gpu.md

Each repetition launches ``python -m shardkeeper train`` four times, fresh and resumed alternated:

  F2  fresh run at 2 ranks; SIGTERM to the CLI after 2 steps (a preemption): emergency checkpoint, exit 75
  R22 the same run resumed at 2 ranks (checkpoint files evicted from the page cache first); SIGTERM after 2 steps
  F1  a fresh run at 1 rank; SIGTERM after 2 steps
  R21 R22's emergency checkpoint resumed at 1 rank (cache evicted first); SIGTERM after 2 steps

Phases come from the segments' reports (``SegmentReport.times``: Unix times of the slower rank) and from this
script's own clock (when it sent SIGTERM, started a CLI, saw it exit). Time to first step is counted from the
CLI's start for fresh and resumed segments alike; resume overhead = resumed minus fresh at the same world size.
The disk's read bandwidth is measured on the same checkpoint files in the same run: cold (evicted with
posix_fadvise DONTNEED, which drops exactly these files' clean pages) and warm (read again at once).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import evict, fmt, md_table, publish  # noqa: E402 - bench/ is on the path when run as a script

OUT = ROOT / "bench" / "out" / "recovery"
STEPS_BEFORE_SIGTERM = 2
GRACE_PERIODS_S = (30.0, 120.0)
DEVICE = "cpu"  # --device: what SHARDKEEPER_DEVICE tells every launch


def config_text(layers: int) -> str:
    return f"""name: recovery-bench
backend: fsdp2
seed: 0
global_batch_size: 4
model:
  model_type: llama
  config: {{vocab_size: 32000, hidden_size: 1024, intermediate_size: 2816, num_hidden_layers: {layers},
           num_attention_heads: 16, num_key_value_heads: 8, max_position_embeddings: 256, tie_word_embeddings: false}}
data: {{source: synthetic, seq_len: 16, synthetic_tokens: 65536}}
checkpoint: {{interval: 100000, async_save: false, keep_last: 2, io_threads: 2}}
"""


def params(layers: int) -> int:
    h, i, v, kv = 1024, 2816, 32000, 512
    return 2 * v * h + h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


class Launch:
    """One ``shardkeeper train`` process, with this script's clock around it."""

    def __init__(self, config: Path, run: Path, nproc: int, log: Path):
        self.run = run
        env = {**os.environ, "SHARDKEEPER_DEVICE": DEVICE, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
        self.log = log.open("w")
        self.started = time.time()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardkeeper",
                "train",
                "--config",
                str(config),
                "--run-dir",
                str(run),
                "--nproc",
                str(nproc),
                "--until-step",
                "100000",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )
        self.sigterm_at: float | None = None
        self.exited_at: float | None = None

    def steps(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def preempt_after(self, segment: int, steps: int, timeout: float = 600) -> int:
        """SIGTERM the CLI once ``segment`` trained ``steps`` steps; wait for it; return its exit code."""
        deadline = time.time() + timeout
        while sum(1 for r in self.steps() if r["segment"] == segment) < steps:
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(
                    f"{self.run}: segment {segment} ended or stalled before step {steps} "
                    f"(exit {self.proc.poll()}); see {self.log.name}"
                )
            time.sleep(0.05)
        self.sigterm_at = time.time()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self.exited_at = time.time()
        self.log.close()
        return code


def report(run: Path) -> dict:
    from schemas.seam import REPORT_FILE

    return json.loads((run / REPORT_FILE).read_text())


def ckpt_files(run: Path) -> list[Path]:
    from ckpt.manifest import read_manifest

    ckpt = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step-") and "." not in p.name)[-1]
    return [ckpt / f.path for f in read_manifest(ckpt).files]


def read_all(files: list[Path], threads: int = 2) -> float:
    """Read every byte with ``threads`` parallel streams of 8 MiB reads (what the resume's hashing does); seconds."""

    def one(path: Path) -> int:
        buf = bytearray(8 << 20)
        n = 0
        with open(path, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, sorted(files, key=lambda p: -p.stat().st_size)))
    return time.perf_counter() - t


def segment_phases(launch: Launch, rep: dict) -> dict[str, float]:
    """Start-up phases of a segment, in seconds: controller (CLI start -> launcher), ranks started + imports,
    process group, model build, load + verification, first step; and time to first step from the CLI's start."""
    t = rep["times"]
    o = t["origin_time"]
    assert t["origin"] == "launcher", t
    return {
        "controller": o - launch.started,
        "start_imports": t["imports_s"],
        "process_group": t["process_group_s"] - t["imports_s"],
        "model_build": t["model_built_s"] - t["process_group_s"],
        "load": t["loaded_s"] - t["model_built_s"],
        "first_step": t["first_step_s"] - t["loaded_s"],
        "ttfs": o + t["first_step_s"] - launch.started,
    }


def stop_phases(launch: Launch, rep: dict) -> dict[str, float]:
    """The preempted side: SIGTERM sent -> checkpoint committed -> report written (after the background re-read of
    the checkpoint, when there is one) -> the CLI exited (ranks, torchrun and the controller's bookkeeping)."""
    t = rep["times"]
    committed = t["origin_time"] + t["emergency_saved_s"]
    closed = t["origin_time"] + t["closed_s"]
    assert launch.sigterm_at is not None and launch.exited_at is not None
    return {
        "emergency_save": committed - launch.sigterm_at,
        "close": closed - committed,
        "exit": launch.exited_at - closed,
        "to_exit": launch.exited_at - launch.sigterm_at,
    }


def one_rep(i: int, layers: int, config: Path, out: dict[str, list]) -> None:
    def launch(name: str, run: Path, nproc: int, segment: int) -> tuple[Launch, dict]:
        before = report(run)["end_step"] if segment else 0  # the step the preempted segment committed
        ln = Launch(config, run, nproc, OUT / f"{name}-rep{i}.log")
        code = ln.preempt_after(segment, STEPS_BEFORE_SIGTERM)
        rep = report(run)
        if code != 75 or rep["status"] != "preempted" or rep["segment"] != segment or rep["start_step"] != before:
            raise SystemExit(
                f"{name}: exit {code}, report {rep['status']} from step {rep['start_step']} (expected 75, "
                f"preempted, from step {before}); see {ln.log.name}"
            )
        out[f"stop{nproc}"].append(stop_phases(ln, rep))
        return ln, rep

    run2, run1 = OUT / f"run2-{i}", OUT / f"run1-{i}"
    for r in (run2, run1):
        shutil.rmtree(r, ignore_errors=True)
    ln, rep = launch("F2", run2, 2, 0)
    out["fresh2"].append(segment_phases(ln, rep))
    files = ckpt_files(run2)
    nbytes = sum(f.stat().st_size for f in files)
    evict(files)
    cold = read_all(files)
    warm = read_all(files)
    out["bw"].append({"bytes": nbytes, "cold": nbytes / cold, "warm": nbytes / warm})
    for name, run, nproc, seg, key in (
        ("R22", run2, 2, 1, "resume22"),
        ("F1", run1, 1, 0, "fresh1"),
        ("R21", run2, 1, 2, "resume21"),
    ):
        if name.startswith("R"):
            files = ckpt_files(run)
            evict(files)
            out["resume_cached_pages"].append(cached_fraction(files))
            out[key + "_bytes"].append(sum(f.stat().st_size for f in files))
        ln, rep = launch(name, run, nproc, seg)
        out[key].append(segment_phases(ln, rep))
        if name.startswith("R"):
            prev = out["stop2"][-2 if name == "R22" else -1]  # the preempted segment this one resumes
            out[key][-1]["sigterm_to_first_step"] = prev["to_exit"] + out[key][-1]["ttfs"]
    for r in (run2, run1):
        shutil.rmtree(r, ignore_errors=True)


def cached_fraction(files: list[Path]) -> float:
    """Share of the files' pages in the page cache (fincore), to state the cache state the resume starts in."""
    try:
        res = subprocess.run(
            ["fincore", "-b", "-n", "-o", "RES,SIZE", *map(str, files)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        rows = [list(map(int, line.split())) for line in res.stdout.splitlines() if line.strip()]
        return sum(r[0] for r in rows) / max(1, sum(r[1] for r in rows))
    except (OSError, subprocess.SubprocessError, ValueError):
        return float("nan")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def table(out: dict[str, list], layers: int, reps: int, runs: int = 1) -> tuple[str, bool]:
    bw_cold = [b["cold"] for b in out["bw"]]
    rows = []
    met_all = True
    phase_rows = [
        ("emergency save (SIGTERM sent -> checkpoint committed)", "emergency_save"),
        ("after the commit: close, report", "close"),
        ("exit: ranks, torchrun, controller (report -> CLI exited)", "exit"),
        ("controller start (CLI start -> torchrun started)", "controller"),
        ("ranks' process start + imports", "start_imports"),
        ("process group", "process_group"),
        ("model build (+ FSDP2 sharding, optimizer)", "model_build"),
        ("load + verification", "load"),
        ("first optimizer step", "first_step"),
        ("**time to first step** (CLI start -> first step)", "ttfs"),
    ]
    cols = [
        ("fresh 2", "fresh2", None),
        ("resumed 2 -> 2", "resume22", "stop2"),
        ("fresh 1", "fresh1", None),
        ("resumed 2 -> 1", "resume21", "stop2"),
    ]
    for label, key in phase_rows:
        row = [label]
        for _, seg, stop in cols:
            if key in ("emergency_save", "close", "exit"):
                which = key
                if stop is None:
                    row.append("")
                    continue
                j = 0 if seg == "resume22" else 1  # the preempted segment it resumes: F2 or R22 of its repetition
                vals = [out["stop2"][r * 2 + j][which] for r in range(reps)]
                row.append(fmt(vals, 1))
            else:
                row.append(fmt([p[key] for p in out[seg]], 1))
        rows.append(row)
    total = ["**SIGTERM -> first step of the next segment**", ""]
    total += [
        fmt([p["sigterm_to_first_step"] for p in out["resume22"]], 1),
        "",
        fmt([p["sigterm_to_first_step"] for p in out["resume21"]], 1),
    ]
    rows.append(total)
    body = md_table(["phase (s)", *[c[0] for c in cols]], rows, "lrrrr")
    goal_rows = []
    for label, res, fresh in (("2 -> 2", "resume22", "fresh2"), ("2 -> 1", "resume21", "fresh1")):
        over = [r["ttfs"] - f["ttfs"] for r, f in zip(out[res], out[fresh])]
        nbytes = med(out[res + "_bytes"])
        limit = 1.2 * nbytes / med(bw_cold) + 1.0
        ok = med(over) <= limit
        met_all &= ok
        goal_rows.append(
            [
                label,
                fmt(over, 1),
                f"{nbytes / 1e9:.2f} GB / {med(bw_cold) / 1e6:,.0f} MB/s",
                f"{limit:.1f}",
                "met" if ok else f"missed by {med(over) - limit:.1f} s",
            ]
        )
    body += "\n\n" + md_table(
        [
            "resume",
            "overhead: resumed - fresh time to first step (s)",
            "checkpoint / cold read bandwidth",
            "goal: <= 1.2 x bytes/bw + 1 s",
            "result",
        ],
        goal_rows,
        "lrrrl",
    )
    saves = [("2 ranks", out["stop2"]), ("1 rank", out["stop1"])]
    grace = []
    for label, stops in saves:
        es = [s["emergency_save"] for s in stops]
        te = [s["to_exit"] for s in stops]
        grace.append(
            [label, fmt(es, 1), fmt(te, 1)]
            + [f"{100 * med(te) / g:.0f}% ({'fits' if max(te) < g else 'does not fit'})" for g in GRACE_PERIODS_S]
        )
    body += "\n\n" + md_table(
        [
            "emergency save",
            "SIGTERM -> committed (s)",
            "SIGTERM -> exited (s)",
            "of a 30 s grace period",
            "of a 2 min grace period",
        ],
        grace,
        "lrrll",
    )
    b = out["bw"]
    pages = out["resume_cached_pages"]
    body += (
        f"\n\n{params(layers) / 1e6:.0f}M-parameter Llama (fp32 weights + AdamW: "
        f"{med([x['bytes'] for x in b]) / 1e9:.2f} GB of checkpoint at 2 ranks), gloo on CPU, "
        f"{reps} repetitions of F2, R22, F1, R21 (fresh and resumed alternated{f', in {runs} runs of the script' if runs > 1 else ''}), median (min–max); "
        f"{len(out['stop2'])} emergency saves at 2 ranks, {len(out['stop1'])} at 1. Read bandwidth of the "
        f"checkpoint files, 2 streams: cold {fmt([x['cold'] / 1e6 for x in b], 0)} MB/s, warm "
        f"{fmt([x['warm'] / 1e6 for x in b], 0)} MB/s. Every resume started **cold**: its checkpoint's pages "
        f"evicted (posix_fadvise DONTNEED; {100 * max(pages):.0f}% still cached at most, fincore); the "
        "Python modules were warm (the previous segment had just imported them)."
    )
    return body, met_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16, help="decoder blocks (16: ~254M parameters)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--append",
        action="store_true",
        help="add these repetitions to those of the previous run "
        "(bench/out/recovery/raw.json, same --layers): long benches in several runs",
    )
    ap.add_argument("--no-publish", action="store_true", help="print only (smoke runs)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, needs 2 GPUs")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(
                f"error: --device cuda: the 2-rank segments need 2 GPUs, {torch.cuda.device_count()} visible; "
                "run it on a node with 2 or more",
                file=sys.stderr,
            )
            return 2
    OUT.mkdir(parents=True, exist_ok=True)
    config = OUT / "config.yaml"
    config.write_text(config_text(args.layers))
    raw = OUT / "raw.json"
    out: dict[str, list] = {
        k: []
        for k in (
            "fresh2",
            "resume22",
            "fresh1",
            "resume21",
            "stop2",
            "stop1",
            "bw",
            "resume_cached_pages",
            "resume22_bytes",
            "resume21_bytes",
        )
    }
    if args.append:
        prev = json.loads(raw.read_text())
        if prev.get("layers") != args.layers:
            raise SystemExit(
                f"{raw}: measured with --layers {prev.get('layers')}, not {args.layers}; rerun without --append"
            )
        out = prev["out"]
    runs = (json.loads(raw.read_text()).get("runs", 1) + (args.reps > 0)) if args.append else 1
    done = len(out["fresh2"])
    for i in range(done, done + args.reps):
        one_rep(i, args.layers, config, out)
        raw.write_text(json.dumps({"layers": args.layers, "runs": runs, "out": out}, indent=1))
    body, _ = table(out, args.layers, len(out["fresh2"]), runs)
    if args.no_publish:
        print(body)
    else:
        publish("recovery" + ("-gpu" if DEVICE == "cuda" else ""), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
