"""Import benchmark: ``shardkeeper import`` of a DeepSpeed ZeRO-2 checkpoint into FSDP2 vs DeepSpeed's own extraction.

    python bench/import_bench.py                   # build (or reuse) bench/out/import, measure, print + publish a table
    python bench/import_bench.py --rebuild --repeat 3
    python bench/import_bench.py --hidden 64 --layers 2 --vocab 256 --intermediate 128 --name import-tiny   # CPU smoke

What it builds once under bench/out/import (git-ignored): the checkpoint another tool would hand over, written by a
plain DeepSpeed user (not shardkeeper's trainer): a Llama-style model (default hidden 1024, 16 layers, vocab 32000,
intermediate 2816: 271M parameters), torch AdamW as the client optimizer, ZeRO-2 on 2 gloo ranks, one step, then
``engine.save_checkpoint`` (``latest`` + ``global_step1/``, no ``universal_checkpoint_info``).

What it measures, each in a fresh subprocess (imports included) with the checkpoint in the page cache (every input
file read once just before, earlier outputs synced; the same for both sides), alternated rounds (A B A B ...),
median (min-max): wall time and the peak PSS of the process tree (``deepspeed_bench``'s sampler):

* ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``: DeepSpeed's own extraction of every
  parameter's fp32 weight and AdamW moments (what any move of a ZeRO checkpoint to another layout starts from);
* ``shardkeeper import global_step1/.. --config <fsdp2 config> --run-dir ...``: the whole stage, into a committed,
  checksummed DCP checkpoint that FSDP2 loads at any world size (CRC pass over the partitions, model built on the
  meta device, streamed writes, fsyncs, manifest, lineage).

Then it checks every weight and both moments of every parameter of our checkpoint against ds_to_universal's files,
bit for bit, and the checkpoint with ``validate --deep``; a difference fails the script (exit 1). Goal: <= 0.5x
ds_to_universal's time at <= 1 GB. Published as bench/results/import.md (``benchlib.publish``).
"""

from __future__ import annotations

import argparse
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
METHODS = ("ds_to_universal", "shardkeeper_import")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    heads = max(1, args.hidden // 64)
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }


def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": f"import-h{args.hidden}-l{args.layers}",
        "backend": "fsdp2",
        "seed": 1234,
        "global_batch_size": 2,
        "model": {"model_type": "llama", "config": model_config(args)},
        "data": {"source": "synthetic", "seq_len": 32, "synthetic_tokens": 4096},
        "schedule": {"warmup_steps": 1, "total_steps": 10},
        "checkpoint": {"interval": 1000, "async_save": False, "keep_last": 3, "io_threads": 4},
    }


# ------------------------------------------------------------------------------------ build input
def _write_zero2(out: str, config: dict[str, Any]) -> None:
    """Rank side: a plain DeepSpeed ZeRO-2 user, one step, engine.save_checkpoint."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    x = torch.randint(0, config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(out)
    dist.destroy_process_group()


def build(out: Path, args: argparse.Namespace) -> Path:
    import json

    from tests.harness import spawn

    src = out / "deepspeed"
    stamp = out / "built.json"
    want = model_config(args)
    if not args.rebuild and stamp.is_file() and json.loads(stamp.read_text()) == want and (src / "latest").is_file():
        log.info("reusing %s", src)
        return src
    shutil.rmtree(out, ignore_errors=True)
    src.mkdir(parents=True)
    t0 = time.perf_counter()
    spawn(_write_zero2, 2, str(src), want, timeout=3600)
    stamp.write_text(json.dumps(want))
    log.info("built the ZeRO-2 checkpoint in %.1f s", time.perf_counter() - t0)
    return src


# ------------------------------------------------------------------------------------ measure
def command(method: str, src: Path, out: Path, config: Path) -> list[str]:
    py = sys.executable
    if method == "ds_to_universal":
        return [
            py,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(src / "global_step1"),
            "--output_folder",
            str(out),
            "--inject_missing_state",
        ]
    return [py, "-m", "shardkeeper", "import", str(src), "--config", str(config), "--run-dir", str(out)]


def run_measure(method: str, src: Path, out: Path, config: Path) -> dict[str, Any]:
    from deepspeed_bench import _tree_pss, _warm

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    _warm(src / "global_step1")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    peak = 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        command(method, src, out, config),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_pss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{method} failed:\n{output[-4000:]}")
    log.info("%-18s %7.2f s  peak PSS %.2f GB  load %.1f", method, seconds, peak / 1e9, os.getloadavg()[0])
    return {"method": method, "seconds": seconds, "peak_pss": peak}


def compare(run: Path, universal: Path) -> tuple[bool, str]:
    """Every weight and both moments of every parameter against ds_to_universal's files, bit for bit."""
    import torch

    from ckpt.formats.dcp.reader import DCPTensorReader
    from ckpt.validate.checks import validate

    ckpt = next((run / "checkpoints").iterdir())
    report = validate(ckpt, deep=True)
    if not report.valid:
        return False, report.errors[0]
    params = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    bad = []
    with DCPTensorReader(ckpt) as reader:
        for name in params:
            for key, ours in (
                ("fp32", f"model.{name}"),
                ("exp_avg", f"optim.state.{name}.exp_avg"),
                ("exp_avg_sq", f"optim.state.{name}.exp_avg_sq"),
            ):
                ref = torch.load(universal / "zero" / name / f"{key}.pt", weights_only=True)["param"]
                if not torch.equal(reader.read(ours), ref):
                    bad.append(f"{name}/{key}")
    if bad:
        return False, f"{len(bad)} differ, e.g. {bad[0]}"
    return True, f"bitwise equal: weight and both moments of {len(params)} parameters; validate --deep passes"


def run_all(args: argparse.Namespace) -> int:
    import math
    from statistics import median as med

    import yaml
    from benchlib import fmt, md_table, publish

    from ckpt.formats.deepspeed.zero import ZeroShards

    src = build(args.out, args)
    config = args.out / "run.yaml"
    config.write_text(yaml.safe_dump(run_spec(args)))
    with ZeroShards(src / "global_step1") as shards:
        params = sum(math.prod(s.shape) for s in shards.slots)
    size = sum(f.stat().st_size for f in (src / "global_step1").iterdir())
    log.info("checkpoint %s: %d parameters, ZeRO-2 at 2 ranks, %.2f GB", src, params, size / 1e9)
    res = args.out / "results"
    outs = {"ds_to_universal": res / "ds_universal", "shardkeeper_import": res / "run"}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for i in range(args.repeat):  # alternated: a drifting disk or a busy neighbour hits both alike
        for m in METHODS:
            runs[m].append(run_measure(m, src, outs[m], config))
        log.info("round %d of %d done", i + 1, args.repeat)
    ok, check = compare(outs["shardkeeper_import"], outs["ds_to_universal"])

    def sec(m: str) -> list[float]:
        return [r["seconds"] for r in runs[m]]

    def gb(m: str) -> list[float]:
        return [r["peak_pss"] / 1e9 for r in runs[m]]

    ours, ref, mem = med(sec("shardkeeper_import")), med(sec("ds_to_universal")), max(gb("shardkeeper_import"))
    rows = [
        [
            "deepspeed `ds_to_universal --inject_missing_state`",
            fmt(sec("ds_to_universal")),
            "1.00x",
            fmt(gb("ds_to_universal")),
            "reference",
        ],
        [
            "`shardkeeper import` into FSDP2 (committed DCP checkpoint)",
            fmt(sec("shardkeeper_import")),
            f"{ours / ref:.2f}x",
            fmt(gb("shardkeeper_import")),
            check,
        ],
    ]
    met = ours <= 0.5 * ref and mem <= 1.0
    goal = (
        f"- <= 0.5x `ds_to_universal` at <= 1 GB: {ours:.2f} s = {ours / ref:.2f}x, peak {mem:.2f} GB (highest of "
        f"the runs): {'met' if met else f'**missed** ({ours / ref:.2f}x, {mem:.2f} GB)'}"
    )
    body = "\n".join(
        [
            f"{params / 1e6:.0f}M-parameter ZeRO-2 checkpoint at 2 ranks ({size / 1e9:.2f} GB), written by a plain "
            f"`engine.save_checkpoint`. Each method a fresh process (imports included), checkpoint in the page cache, "
            f"{args.repeat} alternated rounds; median (min–max); memory: peak PSS of the process tree.",
            "",
            md_table(
                ["method", "time (s)", "vs ds_to_universal", "peak PSS, process tree (GB)", "output check"],
                rows,
                "lrrrl",
            ),
            "",
            goal,
        ]
    )
    publish(args.name, body)
    plot(args.name)
    if not ok:
        print(f"output check FAILED: {check}", file=sys.stderr)
        return 1
    return 0


def plot(name: str = "import") -> Path:
    """bench/results/NAME.png: time and peak memory of ``shardkeeper import`` against DeepSpeed's ``ds_to_universal``,
    from the published table."""
    from benchlib import hbars, plot_from_table, table_rows

    rows = table_rows(name)
    labels = ["ds_to_universal" if "ds_to_universal" in r["method"] else "shardkeeper import" for r in rows]
    grey = {i for i, r in enumerate(rows) if r["output check"] == "reference"}

    def draw(fig) -> None:
        left, right = fig.subplots(1, 2)
        hbars(left, labels, [r["time (s)"] for r in rows], "seconds (median, min–max)", grey=grey)
        hbars(
            right, labels, [r["peak PSS, process tree (GB)"] for r in rows], "peak memory, GB (process tree)", grey=grey
        )
        right.set_yticklabels([])
        fig.suptitle("Adopting a DeepSpeed ZeRO-2 checkpoint: shardkeeper import vs ds_to_universal", fontsize=10)

    return plot_from_table(name, draw, size=(7.5, 2.2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "import")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="alternated rounds of both methods (median reported)")
    p.add_argument("--name", default="import", help="the table's name in bench/results/ (tiny runs: another)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--plot-only", action="store_true", help="redraw bench/results/NAME.png from the published table")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(args.name)
        return 0
    args.out = args.out.resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
