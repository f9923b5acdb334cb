"""Scaling: save, resume (load_latest) and export time and peak memory at three Llama-shaped model sizes.

    python bench/scaling_bench.py                       # ~60M, ~250M, ~1B; ~10 min, ~16 GB of disk at the peak
    python bench/scaling_bench.py --sizes 60M 250M      # a subset (results of every size are kept)
    python bench/scaling_bench.py --small               # smoke run on tiny models; publishes nothing
    python bench/scaling_bench.py --plot-only           # redraw bench/results/scaling.png from the published table

What is measured is the real path: ``Checkpointer.save`` (sync: O_DIRECT, fsync, xxh3, manifest, commit),
``Checkpointer.load_latest`` (quick validation, every checksum, dcp.load, fingerprint) and ``shardkeeper
export`` (``ckpt.export.export_checkpoint``, in its own process). Only the state is built differently, so
that a 1B model fits 2 ranks on this machine: the model is built on the meta device, sharded (FSDP2), its
shards materialised with random values, and AdamW's moments made by one optimizer step on random gradients
(no forward/backward, whose activations and full-size gradients would not fit at 1B). The checkpoint is
then exactly what training would write (fp32 weights + AdamW moments + counters + RNG).

Per size, ``--reps`` rounds of save -> load_latest -> export, page cache dropped before each stage;
medians (min–max). Memory: each rank's peak RSS during the stage (sampled every 10 ms) and its growth over
the RSS before the stage (what the stage itself needs beyond the training state it holds); export: the
process's peak RSS (one process, so RSS = what it holds; no children).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import command_line, drop_caches, fmt, md_table, publish  # noqa: E402

OUT = ROOT / "bench" / "out" / "scaling"
# name: (hidden, intermediate, layers, heads, kv heads); vocab 32000, untied embeddings
SIZES = {"60M": (512, 1408, 8, 8, 4), "250M": (1024, 2816, 16, 16, 8), "1B": (2048, 5632, 18, 16, 8)}
SMALL = {"60M": (128, 352, 2, 4, 2), "250M": (256, 704, 2, 4, 2), "1B": (256, 704, 8, 4, 2)}


def spec_for(shape: tuple[int, ...]):
    from schemas import RunSpec

    hidden, inter, layers, heads, kv = shape
    return RunSpec.model_validate(
        {
            "name": "bench-scaling",
            "global_batch_size": 2,
            "seed": 0,
            "model": {
                "model_type": "llama",
                "config": {
                    "vocab_size": 32000,
                    "hidden_size": hidden,
                    "intermediate_size": inter,
                    "num_hidden_layers": layers,
                    "num_attention_heads": heads,
                    "num_key_value_heads": kv,
                    "max_position_embeddings": 256,
                    "tie_word_embeddings": False,
                },
            },
            "data": {"seq_len": 16, "synthetic_tokens": 4096},
            "checkpoint": {"interval": 1000, "keep_last": 1000, "io_threads": 2, "async_save": False},
        }
    )


class PeakRSS:
    """Peak RSS of this process while the block runs (a 10 ms sampler thread), and the RSS before it."""

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = self._rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def build_state(shape: tuple[int, ...], run_dir: str):
    """Sharded model with random weights and AdamW moments, without a training step (see the docstring)."""
    import torch

    from ckpt.commit.layout import RunDir
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, hf_model_record, materialize, params_on_meta, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = spec_for(shape)
    with params_on_meta():
        model = build_model(spec)
    hf = hf_model_record(model, spec.model)  # as the trainer records it: the export then needs no transformers
    shard_model(model, env.mesh, spec)
    materialize(model, env.device)
    torch.manual_seed(env.rank)
    opt = build_optimizer(model, spec)
    with torch.no_grad():
        for p in model.parameters():  # local shards filled in place (no DTensor random ops needed)
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0, 0.02)
            p.grad = torch.zeros_like(p)
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).normal_(0, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ck = DCPCheckpointer(RunDir.at(run_dir), spec, model, opt, env, segment=0, hf_model=hf)
    return env, model, ck


def worker(shape: tuple[int, ...], run_dir: str, reps: int) -> dict:
    import torch.distributed as dist

    from ckpt.validate.checks import forget_known
    from trainer.checkpointer.core import TrainState

    env, model, ck = build_state(shape, run_dir)
    g, rd = env.ctrl_group, Path(run_dir)
    res: dict = {
        k: []
        for k in ("save_s", "load_s", "export_s", "save_rss", "load_rss", "save_extra", "load_extra", "export_rss")
    }
    cache = ""

    def ckpt_files(step: int) -> list[Path]:
        return sorted((rd / "checkpoints" / f"step-{step:08d}").rglob("*"))

    def stage(fn, files: list[Path]) -> tuple[float, PeakRSS]:
        nonlocal cache
        dist.barrier(group=g)
        if env.is_rank0:
            cache = drop_caches(files)
        dist.barrier(group=g)
        with PeakRSS() as m:
            t = time.perf_counter()
            fn()
            dist.barrier(group=g)
            dt = time.perf_counter() - t
        return dt, m

    def load() -> None:
        forget_known()  # as in a new segment's process
        ts = ck.load_latest(restart=False)
        if ts is None or ts.step != step:
            raise SystemExit(f"load_latest returned {ts}, expected step {step}")

    nbytes = 0
    for i in range(reps + 1):  # round 0 is a warm-up, not counted
        step = i + 1
        dt_s, m_s = stage(lambda: ck.save(TrainState(step=step), reason="interval", blocking=True), [])  # noqa: B023
        ck._wait_reread()  # the post-commit re-read (rank 0, background) is I/O of its own; untimed
        dt_l, m_l = stage(load, ckpt_files(step))
        path = rd / "checkpoints" / f"step-{step:08d}"
        nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        exp = {"seconds": 0.0, "peak_rss": 0}
        if env.is_rank0:
            drop_caches(ckpt_files(step))
            exp = export(path, rd / "export")
        dist.barrier(group=g)
        if i:
            res["save_s"].append(dt_s)
            res["load_s"].append(dt_l)
            res["save_rss"].append(m_s.peak)
            res["load_rss"].append(m_l.peak)
            res["save_extra"].append(m_s.peak - m_s.before)
            res["load_extra"].append(m_l.peak - m_l.before)
            res["export_s"].append(exp["seconds"])
            res["export_rss"].append(exp["peak_rss"])
        if env.is_rank0:  # keep one checkpoint on disk at a time; outside the timers
            for old in (rd / "checkpoints").glob("step-*"):
                if old != path:
                    shutil.rmtree(old)
        dist.barrier(group=g)
    params = sum(p.numel() for p in model.parameters())
    ck.close()
    dist.destroy_process_group()
    return {**res, "bytes": nbytes, "params": params, "cache": cache}


EXPORT = """
import json, sys
sys.path.insert(0, {root!r})
from ckpt.export import export_checkpoint
res = export_checkpoint({src!r}, {dst!r}, overwrite=True, tokenizer_from=False)
print(json.dumps({{"seconds": res.seconds, "shards": res.num_shards, "peak_rss": res.peak_rss_bytes}}))
"""


def export(src: Path, dst: Path) -> dict:
    """``export_checkpoint`` in its own process (libraries imported before its clock starts); its peak RSS."""
    proc = subprocess.run(
        [sys.executable, "-c", EXPORT.format(root=str(ROOT), src=str(src), dst=str(dst))],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    if proc.returncode:
        raise SystemExit(f"export of {src} failed: {proc.stderr.strip()[-2000:]}")
    shutil.rmtree(dst, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(found: dict[str, dict]) -> str:
    med = statistics.median
    names = [n for n in SIZES if n in found]
    rows = []
    for n in names:
        r = found[n]
        gb = r["bytes"] / 1e9
        rss = lambda k: fmt([x / 1e9 for x in r[k]])  # noqa: B023, E731
        rows.append(
            [
                f"{n} ({r['params'] / 1e6:.0f}M)",
                f"{gb:.2f}",
                f"{fmt(r['save_s'])} ({gb / med(r['save_s']):.2f} GB/s)",
                f"{fmt(r['load_s'])} ({gb / med(r['load_s']):.2f} GB/s)",
                f"{fmt(r['export_s'])}",
                f"{rss('save_rss')} (+{med(r['save_extra']) / 1e9:.2f})",
                f"{rss('load_rss')} (+{med(r['load_extra']) / 1e9:.2f})",
                rss("export_rss"),
            ]
        )
    body = md_table(
        [
            "model",
            "checkpoint GB",
            "save s (GB/s)",
            "load_latest s (GB/s)",
            "export s",
            "save peak RSS/rank GB (+ over state)",
            "load peak RSS/rank GB (+ over state)",
            "export peak RSS GB",
        ],
        rows,
    )
    # slope: least squares of median seconds on checkpoint GB (export: on model GB = a third of it)
    lines = []
    for key, label in (("save_s", "save"), ("load_s", "load_latest"), ("export_s", "export")):
        xs = [found[n]["bytes"] / 1e9 for n in names]
        ys = [med(found[n][key]) for n in names]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        per = [y / x for x, y in zip(xs, ys)]
        lines.append(
            f"{label}: slope {slope:.2f} s per checkpoint GB, intercept {my - slope * mx:+.2f} s; s/GB by size "
            + " / ".join(f"{p:.2f}" for p in per)
            + f" (largest ÷ smallest {per[-1] / per[0]:.2f})"
        )
    exp_peak = max(max(found[n]["export_rss"]) for n in names) / 1e9
    lines.append(
        f"export peak RSS {exp_peak:.2f} GB at most (goal ≤ one 5 GB output shard + 0.5 GB: "
        f"{'met' if exp_peak <= 5.5 else 'missed'})"
    )
    reps = found[names[0]]["reps"]
    cache = "; ".join(sorted({found[n].get("cache", "page cache state not recorded") for n in names}))
    return (
        body
        + "\n\n"
        + "\n".join(f"- {x}" for x in lines)
        + (
            f"\n\n{reps} rounds of save -> load_latest -> export per size after a warm-up round, 2 ranks × 2 writer "
            f"threads, {cache}; medians (min–max)."
        )
    )


def plot() -> Path:
    """bench/results/scaling.png: save, resume and export seconds against the checkpoint's size, from the published
    table."""
    from benchlib import plot_from_table, spread, table_rows

    rows = table_rows("scaling")
    gb = [float(r["checkpoint GB"]) for r in rows]
    stages = (
        ("save s (GB/s)", "save (sync)"),
        ("load_latest s (GB/s)", "resume (load_latest)"),
        ("export s", "export (safetensors)"),
    )

    def draw(fig) -> None:
        ax = fig.add_subplot()
        for column, label in stages:
            vals = [spread(r[column]) for r in rows]
            ax.errorbar(
                gb,
                [v[0] for v in vals],
                yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]],
                marker="o",
                capsize=3,
                label=label,
            )
        for g, r in zip(gb, rows):
            ax.annotate(
                r["model"].split(" ")[0],
                (g, 0),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="grey",
            )
        ax.set_xlabel("checkpoint size, GB (fp32 weights + AdamW moments)")
        ax.set_ylabel("seconds (median, min–max)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set_title("Time grows linearly with the checkpoint's bytes (2 ranks, page cache dropped)")
        ax.legend(loc="upper left")

    return plot_from_table("scaling", draw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny models, publishes nothing")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from the published table")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot()
        return 0
    from tests.harness import spawn

    out = OUT / ("small" if args.small else "full")
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free / 1e9
    print(f"free disk under {out}: {free:.0f} GB", flush=True)
    for n in args.sizes:
        shape = (SMALL if args.small else SIZES)[n]
        run = out / f"run-{n}"
        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            r = spawn(worker, 2, shape, str(run), args.reps, timeout=900)[0]
        finally:
            shutil.rmtree(run, ignore_errors=True)
        r["reps"], r["argv"] = args.reps, sys.argv
        (out / f"{n}.json").write_text(json.dumps(r, indent=1))
        print(f"{n}: {time.perf_counter() - t0:.0f} s", flush=True)
    found = {n: json.loads((out / f"{n}.json").read_text()) for n in SIZES if (out / f"{n}.json").is_file()}
    if len(found) < 2:
        return 0
    body = table(found)
    if args.small:
        print(body)
        return 0
    cmds = sorted({command_line(["bench/scaling_bench.py", *r["argv"][1:]]) for r in found.values()})
    publish("scaling", body + "\n\nSizes measured by: " + "; ".join(f"`{c}`" for c in cmds) + ".")
    plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
