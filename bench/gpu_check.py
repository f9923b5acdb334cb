"""GPU figures from one command (``make gpu-check``): on a machine with one or more CUDA GPUs, in <= 10 minutes.

    make gpu-check                       # installs .venv-gpu (a CUDA torch), then this script
    python bench/gpu_check.py --budget-s 600 [--only tests,goodput,...]

Runs, each with its own time limit inside the budget, stopping to start new parts when the budget is spent:

  tests      the GPU-marked tests (tests/test_gpu.py: bitwise resume on CUDA + NCCL, async save, DeepSpeed, a script)
  goodput    bench/goodput_bench.py --device cuda for FSDP2 and DeepSpeed (async save every ~--goodput-target-s)
  memtier    bench/memtier_bench.py --device cuda: memory snapshot stall, rank crash -> training again from memory
             beside the storage path (when the in-memory tier is part of this checkout)
  recovery   bench/recovery_bench.py --device cuda (SIGTERM -> emergency checkpoint -> next first step; >= 2 GPUs)
  finetune   bench/gpu_finetune.py: a pretrained ~1B fine-tune segment (time to first step, tokens/s, MFU, peak GPU
             memory against preflight's estimate)

Every part publishes its table into bench/results/ (each table's header names the GPU, the date and the command);
then bench/readme_tables.py copies them into the README and the docs' benchmark pages, and this script publishes
bench/results/gpu-check.md: what ran, how long, and what passed. Exit 0 when every part that ran passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

PARTS = ("tests", "goodput", "memtier", "recovery", "finetune")


def commands(a: argparse.Namespace, gpus: int) -> dict[str, tuple[list[str] | None, float, str]]:
    """part -> (argv or None when it cannot run here, its time limit in seconds, why not / what it measures)."""
    py = sys.executable
    have_ds = importlib.util.find_spec("deepspeed") is not None
    backends = ["--backend", "fsdp2"] + (["--backend", "deepspeed"] if have_ds else [])
    memtier = (ROOT / "bench" / "memtier_bench.py").is_file()
    return {
        "tests": (
            [py, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"],
            200,
            "GPU-marked tests",
        ),
        "goodput": (
            [
                py,
                "bench/goodput_bench.py",
                *backends,
                "--device",
                "cuda",
                "--nproc",
                str(gpus),
                "--seq",
                "256",
                "--batch",
                str(16 * gpus),
                "--saves",
                "2",
                "--reps",
                "1",
                "--warm",
                "3",
                "--target-s",
                str(a.goodput_target_s),
            ],
            240,
            "goodput, FSDP2" + (" and DeepSpeed" if have_ds else " (DeepSpeed is not installed)"),
        ),
        "memtier": (
            ([py, "bench/memtier_bench.py", "--device", "cuda", "--reps", "1"] if memtier and gpus >= 2 else None),
            180,
            "in-memory tier: snapshot stall, goodput, crash -> restart"
            if memtier and gpus >= 2
            else f"in-memory tier: needs 2 GPUs for its 2-rank segments ({gpus} here)"
            if memtier
            else "no bench/memtier_bench.py in this checkout",
        ),
        "recovery": (
            (
                [py, "bench/recovery_bench.py", "--device", "cuda", "--reps", "1", "--layers", "16"]
                if gpus >= 2
                else None
            ),
            240,
            "recovery time" if gpus >= 2 else f"needs 2 GPUs for its 2-rank segments ({gpus} here)",
        ),
        "finetune": (
            [py, "bench/gpu_finetune.py", "--size", a.finetune_size, "--steps", "20"],
            300,
            "pretrained fine-tune segment",
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=600.0, help="the whole check (default 10 minutes)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    ap.add_argument("--goodput-target-s", type=float, default=15.0, help="seconds of training between saves")
    ap.add_argument("--finetune-size", default="1b", help="infra.make_tiny_pretrained size for the fine-tune")
    a = ap.parse_args(argv)
    only = [p.strip() for p in a.only.split(",") if p.strip()]
    unknown = [p for p in only if p not in PARTS]
    if unknown:
        print(f"error: --only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print("error: torch is not installed; run `make gpu-check` (it installs .venv-gpu)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            f"error: no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False); run "
            "`make gpu-check` on a GPU node, with a CUDA build of torch (GPU_TORCH_SPEC)",
            file=sys.stderr,
        )
        return 2
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    print(
        f"gpu-check: {gpus} x {name}, torch {torch.__version__} (CUDA {torch.version.cuda}); budget {a.budget_s:.0f} s",
        flush=True,
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    start = time.monotonic()
    rows: list[list[str]] = []
    failed = False
    for part, (cmd, limit, what) in commands(a, gpus).items():
        if part not in only:
            continue
        left = a.budget_s - (time.monotonic() - start)
        if cmd is None:
            rows.append([part, what, "skipped", ""])
            continue
        if left < 30:
            rows.append([part, what, "skipped: the budget is spent", ""])
            continue
        print(f"\n== {part}: {' '.join(cmd[1:])} (limit {min(limit, left):.0f} s)", flush=True)
        t = time.monotonic()
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=min(limit, left)).returncode
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            code, status = 124, f"failed (over its {min(limit, left):.0f} s)"
        failed = failed or code != 0
        rows.append([part, what, status, f"{time.monotonic() - t:.0f} s"])
    subprocess.run([sys.executable, "bench/readme_tables.py"], cwd=ROOT, env=env, check=False)
    from benchlib import md_table, publish

    total = time.monotonic() - start
    body = md_table(["part", "what", "result", "seconds"], rows)
    publish(
        "gpu-check",
        f"{body}\n\n{gpus} x {name}; the whole check took {total:.0f} s (budget {a.budget_s:.0f} s). "
        "The figures are in the tables each part published (goodput-gpu, memtier-gpu, recovery-gpu, gpu-finetune).",
        argv=[sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
