"""DeepSpeed checkpoint benchmark: our world-size conversion and export vs DeepSpeed's own tools.

    /work/venv/bin/python bench/deepspeed_bench.py                  # build (or reuse) bench/out/deepspeed, measure, print a table
    /work/venv/bin/python bench/deepspeed_bench.py --rebuild        # rebuild the checkpoint first
    /work/venv/bin/python bench/deepspeed_bench.py --hidden 64 --layers 2 --vocab 256 --intermediate 128   # tiny, CPU smoke

What it builds once under bench/out/deepspeed (git-ignored): a real ZeRO-2 training checkpoint of a
Llama-style model (default hidden 1024, 16 layers, vocab 32000, intermediate 2816: 271M parameters),
trained one step with AdamW on 2 gloo ranks by the deepspeed backend and committed by its Checkpointer.

What it measures, each in a fresh subprocess with the checkpoint in the page cache: wall time of the
subprocess and its peak resident memory summed over the process tree (sampled every 20 ms, so
DeepSpeed's worker pools are counted):

* world-size change: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` vs
  ``ckpt.formats.deepspeed_convert.ensure_universal`` (what the trainer runs by itself at a new world size);
* export: ``python -m deepspeed.utils.zero_to_fp32 --safe_serialization`` vs ours, the export stage
  ``shardkeeper.stages.export_and_record`` on the ZeRO checkpoint (one pass: the fp32 master weights
  are streamed from the ``*_optim_states.pt`` partitions into safetensors, CRC-checked, SHA-256 hashed,
  fsynced, with config.json and README.md; the stage also records the export in the run's lineage);
* for reference, the full DeepSpeed -> DCP conversion (model + AdamW state) used to continue under FSDP2.

Then it checks that our universal tensors equal ds_to_universal's and our export equals zero_to_fp32's
(bitwise), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("shardkeeper.bench")

STEP = 1
BASELINE_UNIVERSAL_S, BASELINE_UNIVERSAL_GB = 45.8, 4.1  # ds_to_universal, measured before on this machine
BASELINE_FP32_S, BASELINE_FP32_GB = 5.5, 2.3  # zero_to_fp32


# ------------------------------------------------------------------------------------ build input
def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": f"dsbench-h{args.hidden}-l{args.layers}", "backend": "deepspeed", "seed": 1234, "global_batch_size": 2,
        "deepspeed": {"zero_stage": 2},
        "model": {"model_type": "llama", "config": {
            "vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": max(1, args.hidden // 64),
            "num_key_value_heads": max(1, args.hidden // 64), "max_position_embeddings": 256,
            "tie_word_embeddings": False}},
        "data": {"source": "synthetic", "seq_len": 32, "synthetic_tokens": 4096},
        "schedule": {"warmup_steps": 1, "total_steps": 10},
        "checkpoint": {"interval": 1000, "async_save": False, "keep_last": 3, "io_threads": 4},
    }


def build(out: Path, args: argparse.Namespace) -> Path:
    import yaml

    from tests.harness import spawn
    from trainer.segment import run_segment

    run_dir = out / "run"
    ckpt = run_dir / "checkpoints" / f"step-{STEP:08d}"
    spec = run_spec(args)
    same = (run_dir / "run.yaml").is_file() and yaml.safe_load((run_dir / "run.yaml").read_text()) == spec
    manifest = ckpt / "manifest.json"  # older checkpoints, without the hf_model record, are rebuilt
    if not args.rebuild and same and manifest.is_file() and json.loads(manifest.read_text()).get("hf_model"):
        log.info("reusing %s", ckpt)
        return ckpt
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(spec))
    t0 = time.perf_counter()
    spawn(run_segment, 2, str(run_dir), STEP, 0, timeout=3600)
    log.info("built the ZeRO-2 checkpoint in %.1f s", time.perf_counter() - t0)
    return ckpt


# ------------------------------------------------------------------------------------ methods
def _ours_universal(ckpt: Path, out: Path) -> None:
    from ckpt.formats.deepspeed_convert import ensure_universal

    shutil.rmtree(ckpt / "universal", ignore_errors=True)
    ensure_universal(ckpt)


def _ours_export(ckpt: Path, out: Path) -> None:
    from shardkeeper.stages import export_and_record

    res = export_and_record(ckpt, out)
    print(f"stage: {res.seconds:.2f} s inside the process (after imports), peak RSS {res.peak_rss_bytes / 1e9:.2f} GB")


def _ours_to_dcp(ckpt: Path, out: Path) -> None:
    from ckpt.formats.deepspeed_convert import to_dcp

    to_dcp(ckpt, out / ckpt.name)


def measure(method: str, src: Path, out: Path) -> None:
    """Child process: run one of our methods; each imports what it uses (counted in the wall time, as
    the DeepSpeed tools' imports are)."""
    {"ours_universal": _ours_universal, "ours_export": _ours_export, "ours_to_dcp": _ours_to_dcp}[method](src, out)


def command(method: str, src: Path, out: Path) -> list[str]:
    py = sys.executable
    if method == "ds_to_universal":
        return [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src), "--output_folder",
                str(out), "--inject_missing_state"]
    if method == "zero_to_fp32":
        return [py, "-m", "deepspeed.utils.zero_to_fp32", str(src.parent), str(out), "--tag", src.name,
                "--safe_serialization"]
    return [py, __file__, "--measure", method, "--src", str(src), "--dest", str(out)]


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _warm(path: Path) -> None:
    """Flush earlier outputs and put the checkpoint in the page cache, so every method starts alike."""
    os.sync()
    for f in sorted(path.iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass


def run_measure(method: str, src: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    _warm(src)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    peak = 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(command(method, src, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{method} failed:\n{output[-4000:]}")
    log.info("%-16s %7.2f s  peak RSS %.2f GB  load %.1f", method, seconds, peak / 1e9, os.getloadavg()[0])
    for line in output.splitlines():
        if line.startswith("stage: "):
            log.info("%-16s %s", method, line)
    return {"method": method, "seconds": seconds, "peak_rss": peak}


# ------------------------------------------------------------------------------------ checks
def compare_universal(ours: Path, theirs: Path) -> str:
    """Every zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt tensor of ours equals ds_to_universal's."""
    import torch

    bad, n = [], 0
    for d in sorted((theirs / "zero").iterdir()):
        if not d.is_dir():
            continue
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            a = torch.load(d / f"{key}.pt", weights_only=False)["param"]  # noqa: S614 - files this bench made
            b = torch.load(ours / "zero" / d.name / f"{key}.pt", weights_only=True)["param"]
            n += 1
            if a.shape != b.shape or not torch.equal(a, b):
                bad.append(f"{d.name}/{key}")
    return f"bitwise equal ({n} tensors)" if not bad else f"{len(bad)} differ, e.g. {bad[0]}"


def compare_export(ours: Path, theirs: Path) -> str:
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        where: dict[str, Path] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                where.update(dict.fromkeys(st.keys(), f))
        return where

    a, b = index(theirs), index(ours)
    if set(a) != set(b):
        return f"different names: {sorted(set(a) ^ set(b))[:3]}"
    bad = []
    for name in sorted(a):
        with safe_open(str(a[name]), framework="pt") as fa, safe_open(str(b[name]), framework="pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                bad.append(name)
    return f"bitwise equal ({len(a)} tensors)" if not bad else f"{len(bad)} differ, e.g. {bad[0]}"


# ------------------------------------------------------------------------------------ report
def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| task | method | time (s) | vs DeepSpeed tool | peak RSS, process tree (GB) | output check |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{r['seconds'] / r['ref_s']:.2f}x" if r.get("ref_s") else "-"
        lines.append(f"| {r['task']} | {r['label']} | {r['seconds']:.2f} | {ratio} | {r['peak_rss'] / 1e9:.2f} | {r['check']} |")
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    import math

    from ckpt.manifest import read_manifest

    ckpt = build(args.out, args)
    res = args.out / "results"
    manifest = read_manifest(ckpt)
    params = sum(math.prod(t.shape) for t in manifest.tensors if t.name.startswith("model."))
    log.info("checkpoint %s: %d parameters, ZeRO-%d at %d ranks, %.2f GB on disk", ckpt, params,
             manifest.run_spec.deepspeed.zero_stage, manifest.topology.world_size, sum(f.size for f in manifest.files) / 1e9)
    # ours_universal of an earlier run left <ckpt>/universal/, whose model-states files ds_to_universal
    # would count as the checkpoint's own (and refuse it): start from the checkpoint as trained
    shutil.rmtree(ckpt / "universal", ignore_errors=True)
    r = {}
    r["ds_to_universal"] = run_measure("ds_to_universal", ckpt, res / "ds_universal" / "out")
    r["ours_universal"] = run_measure("ours_universal", ckpt, res / "ours_universal")
    r["zero_to_fp32"] = run_measure("zero_to_fp32", ckpt, res / "zero_to_fp32")
    r["ours_export"] = run_measure("ours_export", ckpt, res / "ours_export")
    r["ours_to_dcp"] = run_measure("ours_to_dcp", ckpt, res / "ours_to_dcp")
    uni, fp32 = r["ds_to_universal"]["seconds"], r["zero_to_fp32"]["seconds"]
    rows = [
        {"task": "world-size change", "label": "deepspeed ds_to_universal --inject_missing_state", **r["ds_to_universal"],
         "ref_s": uni, "check": "reference"},
        {"task": "world-size change", "label": "shardkeeper ensure_universal (trainer does it by itself)",
         **r["ours_universal"], "ref_s": uni,
         "check": compare_universal(ckpt / "universal", res / "ds_universal" / "out")},
        {"task": "export", "label": "deepspeed zero_to_fp32 --safe_serialization", **r["zero_to_fp32"], "ref_s": fp32,
         "check": "reference"},
        {"task": "export", "label": "shardkeeper export stage (one pass from the ZeRO files)", **r["ours_export"],
         "ref_s": fp32, "check": compare_export(res / "ours_export", res / "zero_to_fp32")},
        {"task": "to FSDP2", "label": "shardkeeper to_dcp (model + AdamW state + counters)", **r["ours_to_dcp"],
         "check": "fingerprint verified"},
    ]
    print(f"\n{params / 1e6:.0f}M-parameter ZeRO-{manifest.run_spec.deepspeed.zero_stage} checkpoint at "
          f"{manifest.topology.world_size} ranks, {sum(f.size for f in manifest.files) / 1e9:.2f} GB; "
          f"{os.cpu_count()} CPUs. Earlier measurements of the DeepSpeed tools here: ds_to_universal "
          f"{BASELINE_UNIVERSAL_S} s / {BASELINE_UNIVERSAL_GB} GB, zero_to_fp32 {BASELINE_FP32_S} s / {BASELINE_FP32_GB} GB.\n")
    print(table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "deepspeed")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dest", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # the export stage records file:// URIs of its output in the run's lineage
    if args.measure:
        measure(args.measure, args.src, args.dest)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
