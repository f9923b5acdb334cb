"""Starting from pretrained weights at 2 ranks: peak host RSS per rank and time to the first step.

    python bench/pretrained_bench.py --size 500m                         # a 0.4B Llama made here with save_pretrained
    python bench/pretrained_bench.py --size 1b --load-only --no-scratch  # 1.24B: load the shards only (no step)

Each kind is launched ``--reps`` times (default 2), alternated (scratch, pretrained, scratch, ...), each from a
cold page cache; times are medians (min–max), RSS per rank the highest over the reps. The table is published
with ``bench/benchlib.py``'s ``publish`` as bench/results/pretrained_SIZE[_load].md (README markers).

Makes the model with ``infra.make_tiny_pretrained`` (fp32 safetensors), measures the disk's read bandwidth on
those files (page cache evicted with posix_fadvise before every measurement and launch, so the ranks read
from the disk), then runs ``shardkeeper train --nproc 2 --until-step 1`` twice through the real CLI: the same
architecture from random weights (model.config) and from the pretrained folder (model.pretrained). Time to first
step = launch to rank 0's metrics line of step 1. Peak RSS per rank = VmHWM of each ``trainer.segment`` process,
sampled every 0.1 s (at the first step, and over the whole segment, which adds the final checkpoint's save).
``--load-only`` launches ``trainer.segment RUN_DIR 0`` instead: build, shard and read the weights, no step.

Goals: peak RSS per rank <= its shard of the weights + AdamW moments + 1.5 GB; time to first step <=
1.3 x (weight bytes / measured read bandwidth + the from-scratch start).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchlib import evict  # noqa: E402 - bench/ is on the path when run as a script

GB = 1e9


def read_bandwidth(paths: list[Path]) -> float:
    """Bytes/s reading the files once, cold (16 MiB reads), as a rank's preadv would."""
    evict(paths)
    total, t0 = 0, time.perf_counter()
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    bw = total / (time.perf_counter() - t0)
    evict(paths)
    return bw


def rank_pids(run_dir: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        agent = any(b"nproc" in c or c.endswith(b"torchrun") for c in cmd)  # the torchrun agent, not a rank
        if b"trainer.segment" in cmd and str(run_dir).encode() in cmd and not agent:
            out.append(int(d.name))
    return out


def vm_hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def launch(argv: list[str], run_dir: Path, watch_metrics: bool) -> dict:
    """Run the command; sample every rank's VmHWM; note when rank 0 writes step 1's metrics."""
    peaks: dict[int, int] = {}
    at_first: dict[int, int] = {}
    first_step: list[float] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        for pid in rank_pids(run_dir):
            hwm = vm_hwm(pid)
            if hwm:
                peaks[pid] = max(peaks.get(pid, 0), hwm)
        if watch_metrics and not first_step and metrics.exists() and metrics.stat().st_size > 0:
            first_step.append(time.perf_counter() - t0)
            at_first.update(peaks)
        time.sleep(0.1)
    reader.join(timeout=10)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{''.join(out[-40:])}")
    load_s = next((float(ln.split(" in ")[-1].split(" s")[0]) for ln in out if "loaded this rank's shards" in ln), None)
    return {
        "seconds": time.perf_counter() - t0,
        "first_step_s": first_step[0] if first_step else None,
        "peaks": sorted(peaks.values()),
        "peaks_at_first": sorted(at_first.values()),
        "load_s": load_s,
    }


def config(base: Path, params_cfg: dict, pretrained: bool, work: Path) -> Path:
    import yaml

    spec = {
        "name": f"bench-{'pretrained' if pretrained else 'scratch'}",
        "global_batch_size": 2,
        "model": ({"pretrained": str(base)} if pretrained else {"model_type": "llama", "config": params_cfg}),
        "data": {"source": "synthetic", "seq_len": 32, "synthetic_tokens": 4096},
        "optim": {"lr": 1e-5, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 0, "total_steps": 10},
        "checkpoint": {"interval": 1000, "keep_last": 1},
    }
    path = work / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="500m", help="infra.make_tiny_pretrained size: 100m, 500m, 1b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pretrained-bench"))
    ap.add_argument("--load-only", action="store_true", help="build, shard and load only (no optimizer step)")
    ap.add_argument("--reps", type=int, default=2, help="launches per kind, alternated (scratch, pretrained, ...)")
    ap.add_argument("--keep", action="store_true", help="keep the model folder and runs (default: deleted)")
    ap.add_argument(
        "--no-scratch",
        action="store_true",
        help="skip the from-random-weights comparison (--load-only: "
        "every rank would build the whole fp32 model, which may not fit 2 ranks here)",
    )
    a = ap.parse_args(argv)
    from benchlib import publish  # bench/ is on the path when run as a script

    from infra.make_tiny_pretrained import SIZES, make

    a.work.mkdir(parents=True, exist_ok=True)
    base = a.work / f"llama-{a.size}"
    try:
        if not (base / "config.json").exists():
            free = shutil.disk_usage(a.work).free
            t = time.perf_counter()
            make(base, a.size, tied=a.size == "1b")
            print(f"made {base} in {time.perf_counter() - t:.0f} s ({free / GB:.0f} GB were free)", file=sys.stderr)
        cfg = json.loads((base / "config.json").read_text())
        params = json.loads((base / "MADE_BY.json").read_text())["params"]
        files = sorted(base.glob("*.safetensors"))
        nbytes = sum(p.stat().st_size for p in files)
        bws = [read_bandwidth(files) for _ in range(2)]
        bw = max(bws)
        arch = {k: cfg[k] for k in SIZES[a.size]} | {
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "rms_norm_eps": cfg["rms_norm_eps"],
        }
        kinds = ("pretrained",) if a.no_scratch else ("scratch", "pretrained")
        results: dict[str, list[dict]] = {k: [] for k in kinds}
        for rep in range(a.reps):
            for kind in kinds:  # alternated, each launch from a cold page cache
                run = a.work / f"run-{kind}"
                shutil.rmtree(run, ignore_errors=True)
                conf = config(base, arch, kind == "pretrained", a.work)
                evict(files)
                if a.load_only:
                    from ckpt.commit.layout import RunDir
                    from shardkeeper.config import load_run_spec
                    from shardkeeper.stages import prepare_run_dir

                    prepare_run_dir(RunDir.at(run), load_run_spec(conf))
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        "2",
                        "-m",
                        "trainer.segment",
                        str(run),
                        "0",
                    ]
                else:
                    cmd = [
                        sys.executable,
                        "-m",
                        "shardkeeper",
                        "train",
                        "--config",
                        str(conf),
                        "--run-dir",
                        str(run),
                        "--nproc",
                        "2",
                        "--until-step",
                        "1",
                        "--device",
                        "cpu",
                    ]
                print(f"rep {rep + 1}/{a.reps}: {kind}", file=sys.stderr)
                results[kind].append(launch(cmd, run, not a.load_only))
                shutil.rmtree(run, ignore_errors=True)
        name = f"pretrained_{a.size}" + ("_load" if a.load_only else "")
        publish(
            name,
            table(a, params, nbytes, bws, bw, results),
            argv=[sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
        )
    finally:
        if not a.keep:
            shutil.rmtree(a.work, ignore_errors=True)
    return 0


def table(a: argparse.Namespace, params: int, nbytes: int, bws: list[float], bw: float, r: dict) -> str:
    """The markdown table: times as median (min–max) over the reps, RSS per rank as the highest over the reps."""
    from benchlib import fmt

    shard = params * 4 / 2
    adamw = params * 8 / 2
    grads = params * 4 / 2
    budget = shard + adamw + 1.5 * GB
    sc, pt = r.get("scratch"), r["pretrained"]
    gb = lambda v: f"{v / GB:.2f} GB"  # noqa: E731

    def peaks(runs: list[dict], key: str) -> list[float]:  # per rank (sorted), the highest over the reps
        rows = [run[key] or run["peaks"] for run in runs]
        return [max(col) for col in zip(*rows)]

    def col(runs: list[dict], key: str) -> list[float]:
        return [run[key] for run in runs if run[key] is not None]

    lines = [
        "| measure | value | goal / reference |",
        "|---|---:|---|",
        f"| parameters | {params / 1e9:.3f} B | safetensors {nbytes / GB:.2f} GB (fp32) |",
        f"| disk read bandwidth (cold, 16 MiB reads) | {bw / GB:.2f} GB/s | runs: "
        f"{', '.join(f'{b / GB:.2f}' for b in bws)} |",
    ]
    if a.load_only:
        worst = max(peaks(pt, "peaks"))
        ok_m = "met" if worst <= shard + 1.5 * GB else f"NOT met by {gb(worst - shard - 1.5 * GB)}"
        lines += [
            "| peak RSS per rank, build + shard + read (pretrained) | "
            f"{', '.join(gb(v) for v in peaks(pt, 'peaks'))} | "
            f"<= its shard of the weights {gb(shard)} + 1.5 GB: {ok_m}; the whole model is {gb(params * 4)} |"
        ]
        if sc:
            lines += [
                f"| peak RSS per rank, the same from random weights | "
                f"{', '.join(gb(v) for v in peaks(sc, 'peaks'))} | builds the whole fp32 model "
                f"{gb(params * 4)} on every rank |"
            ]
        lines += [
            f"| segment wall time (launch to exit), pretrained | {fmt(col(pt, 'seconds'), 1)} s | "
            + (f"from random weights {fmt(col(sc, 'seconds'), 1)} s |" if sc else "|"),
            f"| reading this rank's shards (rank 0's log) | {fmt(col(pt, 'load_s'))} s | {nbytes / bw:.2f} s: "
            "all the bytes at the disk's bandwidth (both ranks read at once from one disk) |",
        ]
        return "\n".join(lines)
    first_sc, first_pt = col(sc, "first_step_s"), col(pt, "first_step_s")
    med = lambda v: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1 : len(v) // 2 + 1]) / 2  # noqa: E731
    goal_t = 1.3 * (nbytes / bw + med(first_sc))
    ok_t = "met" if med(first_pt) <= goal_t else f"NOT met by {med(first_pt) - goal_t:.1f} s"
    at_first = peaks(pt, "peaks_at_first")
    ok_m = "met" if max(at_first) <= budget else f"NOT met by {gb(max(at_first) - budget)}"
    lines += [
        f"| time to first step, from random weights | {fmt(first_sc, 1)} s | (launch, imports, build + init, shard, "
        "step 1) |",
        f"| time to first step, from pretrained | {fmt(first_pt, 1)} s | <= 1.3 x ({nbytes / bw:.1f} s read + "
        f"{med(first_sc):.1f} s) = {goal_t:.1f} s (medians): {ok_t} |",
        f"| reading this rank's shards (rank 0's log) | {fmt(col(pt, 'load_s'))} s | |",
        f"| peak RSS per rank at step 1, pretrained | {', '.join(gb(v) for v in at_first)} | <= shard "
        f"{gb(shard)} + AdamW {gb(adamw)} + 1.5 GB = {gb(budget)}: {ok_m} (the fp32 grads alone are {gb(grads)}) |",
        "| peak RSS per rank over the segment (+ final save), pretrained | "
        f"{', '.join(gb(v) for v in peaks(pt, 'peaks'))} | |",
        "| peak RSS per rank at step 1, from random weights | "
        f"{', '.join(gb(v) for v in peaks(sc, 'peaks_at_first'))} | "
        f"builds the whole fp32 model ({gb(params * 4)}) on every rank first |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
