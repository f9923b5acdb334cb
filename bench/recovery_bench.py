"""Recovery time, through the real CLI: a preemption (SIGTERM -> emergency checkpoint -> the next segment's first
optimizer step), and a rank SIGKILLed (``--kill``: restarted in place against a new segment).

    python bench/recovery_bench.py --kill --reps 4   # SIGKILL of one rank: in place vs a new segment (~10 min on 2
                                                     # cores); publishes bench/results/recovery-in-place.md
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
script's own clock (when it sent SIGTERM, started a CLI, saw it exit).

``--kill`` (``kill_bench``): the issue's model (a 37.9M-parameter Llama: vocabulary 32000, hidden 512, 2 layers,
fp32 + AdamW, FSDP2 on 2 gloo CPU ranks), a memory snapshot every 2 steps; once the snapshot of step ``--kill-after``
is committed, rank 1 is SIGKILLed, and the segment recovers two ways, alternated rep by rep: **in place**
(``checkpoint.restarts: 3``: the same ``shardkeeper train`` restarts its ranks, forked from the node's fork server,
which resume from the snapshot) and **a new segment** (``checkpoint.restarts: 0``: the launcher ends the segment and
this script starts the next ``shardkeeper train`` at once, which resumes from the same snapshot). Measured from the
kill: the new ranks started (their processes exist), the state loaded, the first optimizer step done again; then
the new ranks' own phases, and the steps lost. Every run's losses and gradient norms are compared with an
uninterrupted run of the same steps (bitwise). The imports of a rank started fresh (what the fork server spares a
restarted one) are timed in fresh interpreters. Time to first step is counted from the
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
    from ckpt.commit.manifest import read_manifest

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
        f"{reps} repetitions of F2, R22, F1, R21 (fresh and resumed alternated"
        f"{f', in {runs} runs of the script' if runs > 1 else ''}), median (min–max); "
        f"{len(out['stop2'])} emergency saves at 2 ranks, {len(out['stop1'])} at 1. Read bandwidth of the "
        f"checkpoint files, 2 streams: cold {fmt([x['cold'] / 1e6 for x in b], 0)} MB/s, warm "
        f"{fmt([x['warm'] / 1e6 for x in b], 0)} MB/s. Every resume started **cold**: its checkpoint's pages "
        f"evicted (posix_fadvise DONTNEED; {100 * max(pages):.0f}% still cached at most, fincore); the "
        "Python modules were warm (the previous segment had just imported them)."
    )
    return body, met_all


# --------------------------------------------------------------------------------------------- --kill
KILL_MEMORY_INTERVAL = 2


def kill_config(restarts: int, memory_dir: Path) -> str:
    return f"""name: recovery-kill-bench
backend: fsdp2
seed: 0
global_batch_size: 4
model:
  model_type: llama
  config: {{vocab_size: 32000, hidden_size: 512, intermediate_size: 1152, num_hidden_layers: 2,
           num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 256, tie_word_embeddings: false}}
data: {{source: synthetic, seq_len: 32, synthetic_tokens: 65536}}
checkpoint: {{interval: 100000, keep_last: 2, memory_interval: {KILL_MEMORY_INTERVAL}, memory_dir: {memory_dir},
             restarts: {restarts}}}
"""


def rank_pid(run: Path, rank: int) -> int | None:
    """The process that torchrun started as rank ``rank`` of the segment training ``run`` (it leads its session)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(run) not in cmd or "trainer.segment" not in cmd or "torch.distributed.run" in cmd:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env and os.getsid(int(d.name)) == int(d.name):
                return int(d.name)
        except (OSError, ProcessLookupError):
            continue
    return None


def _cli(config: Path, run: Path, until: int, log: Path, sets: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {
        **os.environ,
        "SHARDKEEPER_DEVICE": DEVICE,
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "SHARDKEEPER_PROGRESS_S": "0",
    }
    args = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--config",
        str(config),
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        str(until),
        *[a for x in sets for a in ("--set", x)],
    ]
    return subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _kill_when_snapshot(proc: subprocess.Popen, run: Path, memory_dir: Path, step: int, log: Path) -> float:
    """SIGKILL rank 1 as soon as the memory snapshot of ``step`` is committed; the kill's Unix time."""
    done = memory_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json"
    deadline = time.time() + 900
    while not done.is_file():
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{run}: no snapshot of step {step} (exit {proc.poll()}); see {log}")
        time.sleep(0.005)
    pid = rank_pid(run, 1)
    if pid is None:
        raise SystemExit(f"{run}: rank 1 not found; see {log}")
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return at


def _recovered(run: Path, killed_at: float) -> dict[str, float]:
    """From the kill: the new ranks started, loaded, first step; and the new ranks' own phases (the report of the
    segment that finished the run)."""
    rep = report(run)
    t = rep["times"]
    o = t["origin_time"]
    at = {k: o + t[f"{k}_s"] for k in ("ranks_started", "imports", "process_group", "loaded", "first_step")}
    built = t.get("model_built_s")
    phases = {
        "imports": at["imports"] - at["ranks_started"],
        "process_group": at["process_group"] - at["imports"],
        "model_build": (o + built - at["process_group"]) if built is not None else float("nan"),
        "load": at["loaded"] - (o + built if built is not None else at["process_group"]),
        "first_step": at["first_step"] - at["loaded"],
    }
    resumed = [
        e for e in (json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()) if e["kind"] == "resume"
    ][-1]
    return {
        "started": at["ranks_started"] - killed_at,
        "loaded": at["loaded"] - killed_at,
        "first_step": at["first_step"] - killed_at,
        "resumed_step": resumed["step"],
        "tier": resumed["data"].get("tier"),
        **{f"phase_{k}": v for k, v in phases.items()},
    }


def kill_once(path: str, i: int, base: Path, shm: Path, args: argparse.Namespace) -> dict:
    """One SIGKILL of rank 1 and the recovery: ``path`` 'in place' or 'new segment'."""
    run, mem = base / f"{path.replace(' ', '-')}-{i}", shm / f"{path.replace(' ', '-')}-{i}"
    for d in (run, mem):
        shutil.rmtree(d, ignore_errors=True)
    config = base / f"{run.name}.yaml"
    config.write_text(kill_config(3 if path == "in place" else 0, mem))
    until = args.kill_after + 6
    log = base / f"{run.name}.log"
    proc = _cli(config, run, until, log)
    killed_at = _kill_when_snapshot(proc, run, mem, args.kill_after, log)
    trained = max(json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines())
    out: dict = {}
    if path == "new segment":
        if proc.wait(timeout=900) == 0:
            raise SystemExit(f"{run}: the segment did not end after its rank was killed; see {log}")
        out["launcher_exited"] = time.time() - killed_at
        proc = _cli(config, run, until, base / f"{run.name}-next.log")  # whoever runs it starts the next at once
        log = base / f"{run.name}-next.log"
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{run}: exit {proc.returncode}; see {log}")
    out.update(_recovered(run, killed_at))
    out["lost"] = trained - out["resumed_step"]
    out["metrics"] = {
        r["step"]: (r["loss"], r["grad_norm"])
        for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    }
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    return out


def fresh_imports(reps: int) -> dict[str, list[float]]:
    """Seconds a rank started fresh spends importing, step by step in its order, each in a fresh interpreter."""
    code = """
import json, sys, time
t = [time.perf_counter()]
import trainer.lifetime; t.append(time.perf_counter())
import torch; t.append(time.perf_counter())
import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor; t.append(time.perf_counter())
import trainer.api.segment, trainer.checkpointer.dcp_backend; t.append(time.perf_counter())
import transformers, transformers.models.llama.modeling_llama, trainer.builtin.loop; t.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(t, t[1:])]))
"""
    keys = ("lifetime", "torch", "torch_distributed", "shardkeeper", "transformers")
    out: dict[str, list[float]] = {k: [] for k in (*keys, "interpreter")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
        out["interpreter"].append(time.perf_counter() - t0)
        res = subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env, cwd=ROOT
        )
        for k, v in zip(keys, json.loads(res.stdout.strip().splitlines()[-1])):
            out[k].append(v)
    return out


def kill_bench(args: argparse.Namespace) -> dict:
    base = OUT / "kill"
    base.mkdir(parents=True, exist_ok=True)
    shm = Path(args.memory_dir)
    loads = [os.getloadavg()[0]]
    res: dict = {"in place": [], "new segment": [], "kill_after": args.kill_after, "loads": loads}
    ref_cfg = base / "reference.yaml"
    ref_cfg.write_text(kill_config(0, shm / "reference"))
    ref_run = base / "reference"
    shutil.rmtree(ref_run, ignore_errors=True)
    if _cli(ref_cfg, ref_run, args.kill_after + 6, base / "reference.log").wait(timeout=900) != 0:
        raise SystemExit(f"the uninterrupted reference run failed; see {base / 'reference.log'}")
    reference = {
        r["step"]: (r["loss"], r["grad_norm"])
        for r in (json.loads(x) for x in (ref_run / "metrics.jsonl").read_text().splitlines())
    }
    try:
        for i in range(args.reps):
            for path in ("in place", "new segment") if i % 2 == 0 else ("new segment", "in place"):
                r = kill_once(path, i, base, shm, args)
                r["bitwise"] = r.pop("metrics") == reference
                res[path].append(r)
                loads.append(os.getloadavg()[0])
                print(
                    f"rep {i} {path}: kill -> first step {r['first_step']:.2f} s (started {r['started']:.2f}, "
                    f"loaded {r['loaded']:.2f}); lost {r['lost']}; bitwise {r['bitwise']}",
                    flush=True,
                )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    res["imports"] = fresh_imports(max(3, args.reps))
    return res


def kill_table(res: dict) -> str:
    cols = ("in place", "new segment")
    rows = [
        ["kill → new ranks started"] + [fmt([r["started"] for r in res[c]]) for c in cols],
        ["kill → state loaded"] + [fmt([r["loaded"] for r in res[c]]) for c in cols],
        ["**kill → first step done again**"] + [f"**{fmt([r['first_step'] for r in res[c]])}**" for c in cols],
        ["of which: the launcher exited (new segment)", "", fmt([r["launcher_exited"] for r in res["new segment"]])],
    ]
    ratio = med([r["first_step"] for r in res["in place"]]) / med([r["first_step"] for r in res["new segment"]])
    body = md_table(["SIGKILL of rank 1 (s)", *cols], rows, "lrr")
    phases = [
        ("process start + imports (fresh), or the fork (in place)", "phase_imports"),
        ("process group", "phase_process_group"),
        ("model build (+ FSDP2 sharding, optimizer)", "phase_model_build"),
        ("load (from the memory snapshot, verified)", "phase_load"),
        ("first optimizer step", "phase_first_step"),
    ]
    prow = [[label] + [fmt([r[key] for r in res[c]]) for c in cols] for label, key in phases]
    body += "\n\n" + md_table(["the new ranks' own phases (s)", *cols], prow, "lrr")
    imp = res["imports"]
    irow = [
        [label, fmt(imp[key])]
        for label, key in (
            ("python interpreter start (`python -c pass`)", "interpreter"),
            ("shardkeeper's rank guard (stdlib: `trainer.lifetime`)", "lifetime"),
            ("`torch`", "torch"),
            ("`torch.distributed` checkpoint, FSDP2, tensor", "torch_distributed"),
            ("shardkeeper's rank modules (`trainer.api.segment`, pydantic schemas, DCP backend)", "shardkeeper"),
            ("`transformers` + Llama modeling (during model build)", "transformers"),
        )
    ]
    total = [
        sum(v)
        for v in zip(*(imp[k] for k in ("lifetime", "torch", "torch_distributed", "shardkeeper", "transformers")))
    ]
    irow.append(["**a fresh rank's imports** (what the fork server spares a restarted rank)", f"**{fmt(total)}**"])
    body += "\n\n" + md_table(
        ["a rank started fresh: imports, in its order, fresh interpreters (s)", "median (min–max)"], irow, "lr"
    )
    lost = [r["lost"] for c in cols for r in res[c]]
    bitwise = all(r["bitwise"] for c in cols for r in res[c])
    tiers = sorted({str(r["tier"]) for c in cols for r in res[c]})
    loads = res["loads"]
    body += (
        f"\n\nIn place / new segment, kill → first step done again: **{ratio:.2f}x**. A 37.9M-parameter Llama "
        f"(vocabulary 32000, hidden 512, 2 layers; fp32 + AdamW: 0.46 GB of state), FSDP2 on 2 gloo CPU ranks, a "
        f"memory snapshot every {KILL_MEMORY_INTERVAL} steps; rank 1 SIGKILLed as soon as the snapshot of step "
        f"{res['kill_after']} was committed; {len(res['in place'])}+{len(res['new segment'])} recoveries "
        f"alternated, median (min–max). Steps lost {max(lost)} at most (memory_interval {KILL_MEMORY_INTERVAL}); "
        f"resumed from tier {', '.join(tiers)}; every run's losses and gradient norms "
        f"{'bitwise equal to' if bitwise else 'NOT equal to'} an uninterrupted run's. In place: the launcher "
        "keeps running (and the run lock); the node's agent restarts both ranks, forked from its fork server "
        "(torch, transformers and shardkeeper's rank modules imported once, after the first step). New segment: "
        "the launcher persists the snapshot and exits, and the next `shardkeeper train` starts at once (what a "
        f"retry loop or a scheduler's requeue would do, minus their own delay). Load average (1 min) "
        f"{min(loads):.1f}–{max(loads):.1f} during the runs (a shared machine)."
    )
    return body


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
    ap.add_argument(
        "--kill",
        action="store_true",
        help="SIGKILL of one rank: in place vs a new segment (bench/results/recovery-in-place.md)",
    )
    ap.add_argument("--kill-after", type=int, default=8, help="--kill: the snapshot step after which rank 1 is killed")
    ap.add_argument("--memory-dir", default=f"/dev/shm/shardkeeper-bench-recovery-{os.getpid()}")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.kill:
        OUT.mkdir(parents=True, exist_ok=True)
        res = kill_bench(args)
        (OUT / "kill.json").write_text(json.dumps(res, indent=1))
        body = kill_table(res)
        if args.no_publish:
            print(body)
        else:
            publish("recovery-in-place" + ("-gpu" if DEVICE == "cuda" else ""), body)
        return 0
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
