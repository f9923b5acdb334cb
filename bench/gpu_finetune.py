"""A pretrained ~1B fine-tune segment on the GPUs here: time to first step, tokens/s, MFU and peak GPU memory
against preflight's estimate.

    python bench/gpu_finetune.py                       # 1.24B Llama (Llama-3.2-1B's shape), all GPUs, bf16
    python bench/gpu_finetune.py --size 100m --steps 8 # a quick smoke run

Makes the model with ``infra.make_tiny_pretrained`` (fp32 safetensors, tied embeddings), then runs one segment
through the real CLI (``shardkeeper train --device cuda --nproc N``, FSDP2, bf16 compute with fp32 master weights,
AdamW) from that folder. Time to first step = launch to rank 0's metrics line of step 1 (process start, imports,
preflight, building on the meta device, reading this rank's shards, the first step). Tokens/s = the steps after
``--warm`` (metrics' step_seconds, median). MFU = 6 x parameters x tokens/s (+ attention: 12 x layers x hidden x
seq per token) / (GPUs x the GPU's dense bf16 peak). Peak GPU memory = the highest ``torch.cuda.max_memory_allocated``
rank 0 logs for its first steps ([FSDPDiagnostics]), beside ``shardkeeper.preflight.estimate_memory`` (a documented
lower bound). Publishes bench/results/gpu-finetune.md. Needs CUDA.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# dense bf16 peak (TFLOP/s, without sparsity) of the GPUs this is run on; others: --peak-tflops
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
}


def peak_tflops(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def config(base: Path, work: Path, nproc: int, seq: int, per_rank_batch: int, steps: int) -> Path:
    import yaml

    spec = {
        "name": "gpu-finetune",
        "global_batch_size": per_rank_batch * nproc,
        "seed": 0,
        "model": {"pretrained": str(base)},
        "precision": {"compute": "bf16"},
        "data": {
            "source": "synthetic",
            "seq_len": seq,
            "synthetic_tokens": max(1 << 20, 4 * seq * per_rank_batch * nproc),
        },
        "optim": {"lr": 1e-5, "weight_decay": 0.0},
        "schedule": {"warmup_steps": 0, "total_steps": steps},
        "checkpoint": {"interval": 1 << 20, "keep_last": 1},
    }
    path = work / "gpu-finetune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", help="infra.make_tiny_pretrained size: 100m, 500m, 1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=5, help="steps not counted in tokens/s")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU here)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak, if not in the table")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-finetune"))
    ap.add_argument("--no-publish", action="store_true")
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a smoke run of this script only (2 gloo ranks, nothing published)",
    )
    a = ap.parse_args(argv)
    import torch

    if a.device == "cpu":
        a.no_publish, a.nproc = True, a.nproc or 2
    elif not torch.cuda.is_available():
        print("error: bench/gpu_finetune.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from infra.make_tiny_pretrained import make
    from shardkeeper.config import load_run_spec
    from shardkeeper.preflight import estimate_memory

    nproc = a.nproc or torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU (smoke run)"
    a.work.mkdir(parents=True, exist_ok=True)
    base = a.work / f"llama-{a.size}"
    t = time.perf_counter()
    if not (base / "config.json").exists():
        make(base, a.size, tied=True)
    made_s = time.perf_counter() - t
    params = json.loads((base / "MADE_BY.json").read_text())["params"]
    cfg_json = json.loads((base / "config.json").read_text())
    conf = config(base, a.work, nproc, a.seq, a.batch, a.steps)
    run = a.work / "run"
    shutil.rmtree(run, ignore_errors=True)
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
        str(nproc),
        "--until-step",
        str(a.steps),
        "--device",
        a.device,
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first_step = None
    out: list[str] = []
    metrics = run / "metrics.jsonl"
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        while proc.poll() is None:
            if first_step is None and metrics.exists() and metrics.stat().st_size > 0:
                first_step = time.perf_counter() - t0
            time.sleep(0.05)
    finally:  # interrupted (Ctrl-C, gpu_check's time limit): the segment ends with this script
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    reader.join(timeout=10)
    text = "".join(out)
    if proc.returncode != 0:
        print(text[-4000:], file=sys.stderr)
        print(f"error: the fine-tune segment failed with exit {proc.returncode}", file=sys.stderr)
        return 1
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    steady = [r["step_seconds"] for r in rows if r["step"] > a.warm] or [r["step_seconds"] for r in rows]
    tokens_per_step = a.seq * a.batch * nproc
    tok_s = [tokens_per_step / s for s in steady]
    hidden, layers = cfg_json["hidden_size"], cfg_json["num_hidden_layers"]
    flops_per_token = 6 * params + 12 * layers * hidden * a.seq
    peak = a.peak_tflops or (peak_tflops(gpu) if a.device == "cuda" else None)
    mfu = [flops_per_token * x / (nproc * peak * 1e12) for x in tok_s] if peak else []
    phases = [ast.literal_eval(m) for m in re.findall(r"peak MiB per phase: (\{[^}]*\})", text)]
    peak_mib = max((v for p in phases for v in p.values() if v is not None), default=None)

    class Cfg:  # what estimate_memory reads from a transformers config
        pass

    cfg = Cfg()
    for k, v in cfg_json.items():
        setattr(cfg, k, v)
    est = estimate_memory(load_run_spec(conf), nproc, params, cfg)
    from benchlib import fmt

    gib = 2**30
    table = "\n".join(
        [
            "| model | GPUs | time to first step | tokens/s (median, min–max) | MFU | peak GPU memory (rank 0) | "
            "preflight estimate (lower bound) |",
            "|---|---|---:|---:|---:|---:|---:|",
            f"| {params / 1e9:.2f}B Llama, pretrained folder, bf16 compute + fp32 master, AdamW, seq {a.seq}, "
            f"{a.batch} seq/rank | {nproc} x {gpu} | {first_step:.1f} s | {fmt(tok_s, 0)} | "
            f"{fmt([m * 100 for m in mfu], 1) + ' %' if mfu else 'n/a (unknown peak: --peak-tflops)'} | "
            f"{f'{peak_mib / 1024:.1f} GiB' if peak_mib else 'n/a'} | {est.train_bytes / gib:.1f} GiB |",
            "",
            f"{a.steps} steps through `shardkeeper train --device {a.device} --nproc {nproc}`; tokens/s over steps "
            f"{a.warm + 1}–{a.steps}; MFU against {peak or '?'} TFLOP/s dense bf16 per GPU; the folder was made in "
            f"{made_s:.0f} s (not counted).",
        ]
    )
    print(table)
    if not a.no_publish:
        from benchlib import publish

        publish("gpu-finetune", table, argv=[sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
