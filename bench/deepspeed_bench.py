"""DeepSpeed checkpoint benchmark: our world-size conversion and export vs DeepSpeed's own tools.

    python bench/deepspeed_bench.py                  # build (or reuse) bench/out/deepspeed, measure, print a table
    python bench/deepspeed_bench.py --rebuild        # rebuild the checkpoint first
    python bench/deepspeed_bench.py --hidden 64 --layers 2 --vocab 256 --intermediate 128   # tiny, CPU smoke

What it builds once under bench/out/deepspeed (git-ignored): a real ZeRO-2 training checkpoint of a
Llama-style model (default hidden 1024, 16 layers, vocab 32000, intermediate 2816: 271M parameters),
trained one step with AdamW on 2 gloo ranks by the deepspeed backend and committed by its Checkpointer.

What it measures, each in a fresh subprocess with the checkpoint in the page cache (every input file
read once just before, earlier outputs synced; no warm-up run on either side): wall time of the
subprocess (imports included) and the peak of its process tree's proportional set size (PSS: every
process of the tree, ``/proc/PID/smaps_rollup``, sampled every 50 ms and summed; pages shared
between the processes, such as ``ds_to_universal``'s forked workers, count once, which an RSS sum
would count in every process). The methods run in rounds, one of each per round in the same order
(A B C D E A B C D E ...), ``--repeat`` rounds (3 by default); the table gives median (min-max):

* world-size change: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` vs
  ``ckpt.formats.deepspeed.convert.ensure_universal`` (what the trainer runs by itself at a new world size);
* export: ``python -m deepspeed.utils.zero_to_fp32 --safe_serialization`` vs ours, the export stage
  ``shardkeeper.stages.export_and_record`` on the ZeRO checkpoint (one pass: the fp32 master weights
  are streamed from the ``*_optim_states.pt`` partitions into safetensors, CRC-checked, SHA-256 hashed,
  fsynced, with config.json and README.md; the stage also records the export in the run's lineage);
* for reference, the full DeepSpeed -> DCP conversion (model + AdamW state) used to continue under FSDP2.

Then it checks every tensor and scalar of our universal layout against ds_to_universal's (the
per-parameter files whole; of ``optimizer_state.pt`` what DeepSpeed's ``load_universal`` reads) and
every tensor of our export against zero_to_fp32's (names, dtypes, shapes, bits); a difference fails
the script (exit 1). It publishes the table as bench/results/deepspeed.md (``benchlib.publish``).
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
METHODS = ("ds_to_universal", "ours_universal", "zero_to_fp32", "ours_export", "ours_to_dcp")


# ------------------------------------------------------------------------------------ build input
def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": f"dsbench-h{args.hidden}-l{args.layers}",
        "backend": "deepspeed",
        "seed": 1234,
        "global_batch_size": 2,
        "deepspeed": {"zero_stage": 2},
        "model": {
            "model_type": "llama",
            "config": {
                "vocab_size": args.vocab,
                "hidden_size": args.hidden,
                "intermediate_size": args.intermediate,
                "num_hidden_layers": args.layers,
                "num_attention_heads": max(1, args.hidden // 64),
                "num_key_value_heads": max(1, args.hidden // 64),
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
            },
        },
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
    from ckpt.formats.deepspeed.convert import ensure_universal

    shutil.rmtree(ckpt / "universal", ignore_errors=True)
    ensure_universal(ckpt)


def _ours_export(ckpt: Path, out: Path) -> None:
    from shardkeeper.stages import export_and_record

    res = export_and_record(ckpt, out)
    print(f"stage: {res.seconds:.2f} s inside the process (after imports), peak RSS {res.peak_rss_bytes / 1e9:.2f} GB")


def _ours_to_dcp(ckpt: Path, out: Path) -> None:
    from ckpt.formats.deepspeed.convert import to_dcp

    to_dcp(ckpt, out / ckpt.name)


def measure(method: str, src: Path, out: Path) -> None:
    """Child process: run one of our methods; each imports what it uses (counted in the wall time, as
    the DeepSpeed tools' imports are)."""
    {"ours_universal": _ours_universal, "ours_export": _ours_export, "ours_to_dcp": _ours_to_dcp}[method](src, out)


def command(method: str, src: Path, out: Path) -> list[str]:
    py = sys.executable
    if method == "ds_to_universal":
        return [
            py,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(src),
            "--output_folder",
            str(out),
            "--inject_missing_state",
        ]
    if method == "zero_to_fp32":
        return [
            py,
            "-m",
            "deepspeed.utils.zero_to_fp32",
            str(src.parent),
            str(out),
            "--tag",
            src.name,
            "--safe_serialization",
        ]
    return [py, __file__, "--measure", method, "--src", str(src), "--dest", str(out)]


def _pss(pid: int) -> int:
    """Proportional set size of one process in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _tree_pss(pid: int) -> int:
    """PSS summed over a process and all its descendants: shared pages count once in the sum."""
    import psutil

    try:
        proc = psutil.Process(pid)
        pids = [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return 0
    return sum(_pss(p) for p in pids)


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
    proc = subprocess.Popen(
        command(method, src, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
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
    log.info("%-16s %7.2f s  peak PSS %.2f GB  load %.1f", method, seconds, peak / 1e9, os.getloadavg()[0])
    for line in output.splitlines():
        if line.startswith("stage: "):
            log.info("%-16s %s", method, line)
    return {"method": method, "seconds": seconds, "peak_pss": peak}


# ------------------------------------------------------------------------------------ checks
def _diff(a: Any, b: Any, where: str) -> list[str]:
    """Every place where two loaded objects differ: tensors by dtype, shape and bits, the rest by value."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} vs {b!r}"]


# what DeepSpeed's load_universal reads from zero/optimizer_state.pt (base_optimizer._load_global_state and
# the param_groups loop of load_hp_checkpoint_state_from_checkpoint_dir); the rest of DeepSpeed's file
# (loss_scaler object, paddings, partition counts, flat-group "params" indices) is not read when loading
GLOBAL_READ = ("dynamic_loss_scale", "overflow", "clip_grad", "ds_version")


def compare_universal(ours: Path, theirs: Path) -> tuple[bool, str]:
    """Every tensor and scalar of every zero/<param>/*.pt file, and what load_universal reads of
    zero/optimizer_state.pt, of ours against ds_to_universal's."""
    import torch

    def load(path: Path) -> Any:
        return torch.load(path, weights_only=False, map_location="cpu")  # noqa: S614 - files this bench made

    bad: list[str] = []
    params_t = {d.name for d in (theirs / "zero").iterdir() if d.is_dir()}
    params_o = {d.name for d in (ours / "zero").iterdir() if d.is_dir()}
    if params_t != params_o:
        return False, f"different parameters: {sorted(params_t ^ params_o)[:3]}"
    files = 0
    for name in sorted(params_t):
        ft = sorted(f.name for f in (theirs / "zero" / name).iterdir())
        fo = sorted(f.name for f in (ours / "zero" / name).iterdir())
        if ft != fo:
            bad.append(f"{name}: files {ft} vs {fo}")
            continue
        for f in ft:
            files += 1
            bad += _diff(load(theirs / "zero" / name / f), load(ours / "zero" / name / f), f"{name}/{f}")
    ot, oo = load(theirs / "zero" / "optimizer_state.pt"), load(ours / "zero" / "optimizer_state.pt")
    for k in GLOBAL_READ:
        bad += _diff(ot.get(k), oo.get(k), f"optimizer_state.{k}")
    if int(ot["zero_stage"]) != int(oo["zero_stage"]):
        bad.append(f"optimizer_state.zero_stage {int(ot['zero_stage'])} vs {int(oo['zero_stage'])}")
    strip = [[{k: v for k, v in g.items() if k != "params"} for g in o["param_groups"]] for o in (ot, oo)]
    bad += _diff(strip[0], strip[1], "optimizer_state.param_groups")
    if bad:
        return False, f"{len(bad)} differ, e.g. {bad[0]}"
    return True, (
        f"equal: {files} files of {len(params_t)} parameters (every tensor bitwise, every scalar), "
        "optimizer_state as load_universal reads it"
    )


def compare_export(ours: Path, theirs: Path) -> tuple[bool, str]:
    """Every tensor of our export against zero_to_fp32's: names, dtypes, shapes and bits."""
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        where: dict[str, Path] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                where.update(dict.fromkeys(st.keys(), f))
        return where

    a, b = index(theirs), index(ours)
    if set(a) != set(b):
        return False, f"different names: {sorted(set(a) ^ set(b))[:3]}"
    bad = []
    for name in sorted(a):
        with safe_open(str(a[name]), framework="pt") as fa, safe_open(str(b[name]), framework="pt") as fb:
            bad += _diff(fa.get_tensor(name), fb.get_tensor(name), name)
    return (not bad), (f"bitwise equal ({len(a)} tensors)" if not bad else f"{len(bad)} differ, e.g. {bad[0]}")


# ------------------------------------------------------------------------------------ report
def run_all(args: argparse.Namespace) -> int:
    import math
    from statistics import median as med

    from benchlib import fmt, md_table, publish

    from ckpt.commit.manifest import read_manifest
    from ckpt.validate.checks import validate

    ckpt = build(args.out, args)
    res = args.out / "results"
    manifest = read_manifest(ckpt)
    params = sum(math.prod(t.shape) for t in manifest.tensors if t.name.startswith("model."))
    size = sum(f.size for f in manifest.files)
    log.info(
        "checkpoint %s: %d parameters, ZeRO-%d at %d ranks, %.2f GB on disk",
        ckpt,
        params,
        manifest.run_spec.deepspeed.zero_stage,
        manifest.topology.world_size,
        size / 1e9,
    )
    outs = {
        "ds_to_universal": res / "ds_universal" / "out",
        "ours_universal": res / "ours_universal",
        "zero_to_fp32": res / "zero_to_fp32",
        "ours_export": res / "ours_export",
        "ours_to_dcp": res / "ours_to_dcp",
    }
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for i in range(args.repeat):  # alternated: a drifting disk or a busy neighbour hits every method alike
        for m in METHODS:
            # ours_universal of an earlier run left <ckpt>/universal/, whose model-states files ds_to_universal
            # would count as the checkpoint's own (and refuse it): every method starts from the checkpoint as trained
            shutil.rmtree(ckpt / "universal", ignore_errors=True)
            runs[m].append(run_measure(m, ckpt, outs[m]))
            if m == "ours_universal":  # keep the last one for the check, outside the checkpoint
                shutil.rmtree(res / "ours_universal_kept", ignore_errors=True)
                os.rename(ckpt / "universal", res / "ours_universal_kept")
        log.info("round %d of %d done", i + 1, args.repeat)
    ok_u, check_u = compare_universal(res / "ours_universal_kept", outs["ds_to_universal"])
    ok_e, check_e = compare_export(outs["ours_export"], outs["zero_to_fp32"])
    dcp = outs["ours_to_dcp"] / ckpt.name
    report = validate(dcp, deep=True)
    ok_d, check_d = (
        report.valid,
        ("fingerprint and checksums verified (validate --deep)" if report.valid else report.errors[0]),
    )

    def sec(m: str) -> list[float]:
        return [r["seconds"] for r in runs[m]]

    def gb(m: str) -> list[float]:
        return [r["peak_pss"] / 1e9 for r in runs[m]]

    def ratio(m: str, ref: str) -> str:
        return f"{med(sec(m)) / med(sec(ref)):.2f}x"

    rows = [
        [
            "world-size change",
            "deepspeed `ds_to_universal --inject_missing_state`",
            fmt(sec("ds_to_universal")),
            "1.00x",
            fmt(gb("ds_to_universal")),
            "reference",
        ],
        [
            "world-size change",
            "shardkeeper `ensure_universal` (the trainer converts by itself, once, cached)",
            fmt(sec("ours_universal")),
            ratio("ours_universal", "ds_to_universal"),
            fmt(gb("ours_universal")),
            check_u,
        ],
        [
            "export",
            "deepspeed `zero_to_fp32 --safe_serialization`",
            fmt(sec("zero_to_fp32")),
            "1.00x",
            fmt(gb("zero_to_fp32")),
            "reference",
        ],
        [
            "export",
            "shardkeeper export stage (one pass from the ZeRO partitions)",
            fmt(sec("ours_export")),
            ratio("ours_export", "zero_to_fp32"),
            fmt(gb("ours_export")),
            check_e,
        ],
        [
            "to FSDP2",
            "shardkeeper `convert --to dcp` (model + AdamW state + counters)",
            fmt(sec("ours_to_dcp")),
            "-",
            fmt(gb("ours_to_dcp")),
            check_d,
        ],
    ]
    u, uref, umem = med(sec("ours_universal")), med(sec("ds_to_universal")), max(gb("ours_universal"))
    e, eref, emem = med(sec("ours_export")), med(sec("zero_to_fp32")), max(gb("ours_export"))
    dmem = max(gb("ours_to_dcp"))
    bound = params * 4 / 1e9 + 0.5

    def verdict(ok: bool, miss: str) -> str:
        return "met" if ok else f"**missed** ({miss})"

    goals = [
        f"- world-size change <= 0.5x `ds_to_universal` at <= 1 GB: {u:.2f} s = {u / uref:.2f}x, peak {umem:.2f} GB "
        f"(highest of the runs): {verdict(u <= 0.5 * uref and umem <= 1.0, f'{u / uref:.2f}x, {umem:.2f} GB')}",
        "- export no slower than `zero_to_fp32`, within the export's memory bound "
        f"(one shard + 0.5 GB = {bound:.2f} GB): "
        f"{e:.2f} s vs {eref:.2f} s, peak {emem:.2f} GB: "
        f"{verdict(e <= eref and emem <= bound, f'{e / eref:.2f}x its time, {emem:.2f} GB')}",
        f"- `convert --to dcp` peak <= 1 GB: {dmem:.2f} GB (highest of the runs): "
        f"{verdict(dmem <= 1.0, f'{dmem:.2f} GB')}",
    ]
    body = "\n".join(
        [
            f"{params / 1e6:.0f}M-parameter ZeRO-{manifest.run_spec.deepspeed.zero_stage} checkpoint at "
            f"{manifest.topology.world_size} ranks, {size / 1e9:.2f} GB. "
            "Each method a fresh process (imports included), "
            f"checkpoint in the page cache, {args.repeat} alternated rounds; median (min–max); memory: peak PSS of the "
            "process tree (shared pages counted once).",
            "",
            md_table(
                ["task", "method", "time (s)", "vs DeepSpeed tool", "peak PSS, process tree (GB)", "output check"],
                rows,
                "llrrrl",
            ),
            "",
            *goals,
        ]
    )
    publish(args.name, body)
    plot(args.name)
    if not (ok_u and ok_e and ok_d):
        print(
            "output check FAILED: "
            + "; ".join(c for ok, c in ((ok_u, check_u), (ok_e, check_e), (ok_d, check_d)) if not ok),
            file=sys.stderr,
        )
        return 1
    return 0


def plot(name: str = "deepspeed") -> Path:
    """bench/results/NAME.png: time and peak memory of each task, DeepSpeed's own tool against shardkeeper's, from
    the published table."""
    import re

    from benchlib import hbars, plot_from_table, table_rows

    rows = table_rows(name)

    def label(r: dict[str, str]) -> str:
        tool = re.search(r"`([^` ]+(?: --to \w+)?)", r["method"])
        who = "DeepSpeed" if r["method"].startswith("deepspeed") else "ours"
        return f"{r['task']}: {who} {tool.group(1) if tool else 'export'}"

    labels = [label(r) for r in rows]
    grey = {i for i, r in enumerate(rows) if r["output check"] == "reference"}

    def draw(fig) -> None:
        left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.3, 1]})
        hbars(left, labels, [r["time (s)"] for r in rows], "seconds (median, min–max)", grey=grey)
        hbars(right, labels, [r["peak PSS, process tree (GB)"] for r in rows], "peak memory, GB", grey=grey)
        right.set_yticklabels([])
        fig.suptitle("DeepSpeed ZeRO-2 checkpoint tools (grey: DeepSpeed's own)", fontsize=10)

    return plot_from_table(name, draw, size=(7.5, 3.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "deepspeed")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="alternated rounds of every method (median reported)")
    p.add_argument("--name", default="deepspeed", help="the table's name in bench/results/ (tiny runs: another)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--dest", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--plot-only", action="store_true", help="redraw bench/results/NAME.png from the published table")
    args = p.parse_args(argv)
    if args.plot_only:
        plot(args.name)
        return 0
    args.out = args.out.resolve()  # the export stage records file:// URIs of its output in the run's lineage
    if args.measure:
        measure(args.measure, args.src, args.dest)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
