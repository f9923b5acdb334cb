"""Goodput: training throughput while checkpointing asynchronously, against the same run without checkpoints.

    flock /tmp/shardkeeper-heavy.lock python bench/goodput_bench.py --backend fsdp2 --backend deepspeed
        # ~11 min on 2 cores; both measured: publishes bench/results/goodput.md
    python bench/goodput_bench.py --backend fsdp2   # one backend (kept in bench/out/goodput/); --publish: table of both
    python bench/goodput_bench.py --backend fsdp2 --layers 2 --target-s 3   # quick smoke run
    python bench/goodput_bench.py --backend fsdp2 --device cuda --nproc 1 --seq 256 --batch 16
        # on a GPU node (NCCL): training on the GPU, the save's background work on host cores;
        # publishes bench/results/goodput-gpu.md

One 2-rank gloo run per backend (a ~250M-parameter Llama, fp32 + AdamW, ZeRO-2 for DeepSpeed) through the
trainer's own Segment and Checkpointer. After warm-up steps (not counted) it measures the step time and
picks K, the steps between saves, so that a save comes every ~``--target-s`` seconds of training. Then
phases of the same number of steps alternate in the same processes: ckpt (an async save every K steps,
at steps K/2, 3K/2, ... so the last write has time to finish inside the phase), plain (no save), ckpt,
plain, ... A ckpt phase's time includes every stall (the copy, the wait for a save still in flight) and
the wait for its last save to commit; the background writes run on the same 2 cores as training. The
stall of a save is barrier-bounded (the slower rank). Finally two sync saves give the reference time.
Checkpoints are written through the page cache (DeepSpeed) or O_DIRECT (DCP) and fsynced; keep_last 1.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out" / "goodput"
GOAL_GOODPUT = 0.95
GOAL_STALL = 0.10


def spec_for(backend: str, layers: int, seq: int, batch: int = 4):
    from schemas import RunSpec

    return RunSpec.model_validate(
        {
            "name": f"goodput-{backend}",
            "global_batch_size": batch,
            "seed": 0,
            "backend": backend,
            "deepspeed": {"zero_stage": 2},
            "model": {
                "model_type": "llama",
                "config": {
                    "vocab_size": 32000,
                    "hidden_size": 1024,
                    "intermediate_size": 2816,
                    "num_hidden_layers": layers,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 8,
                    "max_position_embeddings": 256,
                    "tie_word_embeddings": False,
                },
            },
            "data": {"seq_len": seq, "synthetic_tokens": 1 << 16},
            "checkpoint": {"interval": 1 << 30, "keep_last": 1, "io_threads": 2, "async_save": True},
        }
    )


def worker(run_dir: str, warm: int, target_s: float, saves: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from ckpt.commit.layout import RunDir
    from trainer.checkpointer.core import TrainState
    from trainer.dist import init_distributed
    from trainer.segment import build_segment

    env = init_distributed()
    seg = build_segment(RunDir.at(run_dir), 1 << 30, 0, env)
    group = env.ctrl_group
    seg.start_fresh()
    ts = TrainState()  # step 0 (start_fresh returns nothing since the built-in trainer became an API client)

    def step() -> None:
        nonlocal ts
        seg.train_step(ts.step, None)
        ts = TrainState(
            step=ts.step + 1, tokens=ts.tokens + seg.tokens_per_step, samples=ts.samples + seg.spec.global_batch_size
        )

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    for _ in range(warm):
        step()
    seg.ckpt.warm_up(ts)  # the async buffers, before the first measured save (AdamW has its state now)
    probe = []
    for _ in range(3):
        dist.barrier(group=group)
        t = time.perf_counter()
        step()
        probe.append(time.perf_counter() - t)
    step_s = slowest(statistics.median(probe))
    k = max(2, round(target_s / step_s))
    n = saves * k
    phases = []
    for _ in range(reps):
        for mode in ("ckpt", "plain"):
            stalls = []
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                step()
                if mode == "ckpt" and i % k == k // 2:
                    t = time.perf_counter()
                    seg.ckpt.save(ts, reason="interval")
                    dist.barrier(group=group)
                    stalls.append(slowest(time.perf_counter() - t))
            seg.ckpt.wait()  # the last save's commit belongs to its phase
            dist.barrier(group=group)
            wall = slowest(time.perf_counter() - t0)
            phases.append(
                {
                    "mode": mode,
                    "steps": n,
                    "wall_s": wall,
                    "tokens_s": n * seg.tokens_per_step / wall,
                    "stalls_s": stalls,
                }
            )
    sync = []
    for _ in range(2):
        step()
        dist.barrier(group=group)
        t = time.perf_counter()
        seg.ckpt.save(ts, reason="interval", blocking=True)
        dist.barrier(group=group)
        sync.append(slowest(time.perf_counter() - t))
    seg.ckpt.close()
    ck = seg.ckpt.run_dir.checkpoint(ts.step)
    nbytes = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
    params = sum(math.prod(p.shape) for p in seg.model.parameters())  # a DTensor's shape is the whole tensor's
    device = (
        torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else f"CPU, {env.world_size} gloo ranks"
    )
    return {
        "backend": seg.spec.backend,
        "device": device,
        "world_size": env.world_size,
        "step_s": step_s,
        "k": k,
        "steps_per_phase": n,
        "phases": phases,
        "sync_s": sync,
        "warm_up_steps": warm,
        "tokens_per_step": seg.tokens_per_step,
        "params": params,
        "checkpoint_bytes": nbytes,
    }


def measure(backend: str, args: argparse.Namespace) -> dict:
    import os

    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir
    from tests.harness import spawn

    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run = OUT / backend
    shutil.rmtree(run, ignore_errors=True)
    prepare_run_dir(RunDir.at(run), spec_for(backend, args.layers, args.seq, args.batch))
    try:
        res = spawn(
            worker,
            args.nproc,
            str(run),
            args.warm,
            args.target_s,
            args.saves,
            args.reps,
            timeout=1800,
            device=args.device,
        )[0]
    finally:
        shutil.rmtree(run, ignore_errors=True)
    res.update(layers=args.layers, seq=args.seq, target_s=args.target_s)
    (OUT / f"{backend}{gpu_suffix(args)}.json").write_text(json.dumps(res, indent=2))
    return res


def gpu_suffix(args: argparse.Namespace) -> str:
    """GPU results are kept and published apart from the CPU ones."""
    return "-gpu" if args.device == "cuda" else ""


def table(results: list[dict]) -> str:
    from benchlib import fmt, md_table

    rows = []
    notes = []
    for r in results:
        ck = [p["tokens_s"] for p in r["phases"] if p["mode"] == "ckpt"]
        plain = [p["tokens_s"] for p in r["phases"] if p["mode"] == "plain"]
        stalls = [s for p in r["phases"] for s in p["stalls_s"]]
        ratio = statistics.median(ck) / statistics.median(plain)
        stall, sync = statistics.median(stalls), statistics.median(r["sync_s"])
        g_ok = "met" if ratio >= GOAL_GOODPUT else f"missed by {GOAL_GOODPUT - ratio:.3f}"
        s_ok = "met" if stall <= GOAL_STALL * sync else f"missed by {stall / sync - GOAL_STALL:.1%} of a sync save"
        rows.append(
            [
                "FSDP2 (DCP)" if r["backend"] == "fsdp2" else "DeepSpeed ZeRO-2",
                f"{r['k']} ({r['step_s']:.2f} s/step, a save every ~{r['k'] * r['step_s']:.0f} s)",
                fmt(plain, 1),
                fmt(ck, 1),
                f"**{ratio:.3f}** ({g_ok})",
                f"{fmt(stalls)} s (first {stalls[0]:.2f} s)",
                fmt(r["sync_s"]),
                f"{100 * stall / sync:.1f} % ({s_ok})",
            ]
        )
        notes.append(
            f"{r['backend']} on {r.get('device', 'CPU, 2 gloo ranks')}: {r['params'] / 1e6:.0f}M parameters, "
            f"{r['tokens_per_step']} tokens per step, checkpoint {r['checkpoint_bytes'] / 1e9:.2f} GB, "
            f"{r['steps_per_phase']} steps per phase ({len(stalls) // max(len(ck), 1)} saves in each ckpt phase), "
            f"{len(ck)}+{len(plain)} alternated phases, {r['warm_up_steps']} warm-up steps excluded"
        )
    head = [
        "backend",
        "K (steps per save)",
        "tokens/s, no checkpoints",
        "tokens/s, async save every K",
        "goodput (goal ≥ 0.95)",
        "stall per save (slower rank)",
        "sync save (s)",
        "stall ÷ sync save (goal ≤ 10 %)",
    ]
    return md_table(head, rows, "llrrrrrr") + "\n\n" + "\n".join(f"- {n}" for n in notes)


def plot() -> Path:
    """bench/results/goodput.png: goodput against the checkpoint interval, from the published tables (CPU and, when
    measured, GPU). Each row's cost per save, c = T (1/g - 1) for its goodput g at its interval T (K steps), is
    drawn at other intervals, T / (T + c); the dot is the measured point."""
    from benchlib import RESULTS, numbers, plot_from_table, table_rows

    tables = [
        (name, where)
        for name, where in (("goodput", "CPU, 2 ranks"), ("goodput-gpu", "1 GPU"))
        if (RESULTS / f"{name}.md").is_file()
    ]

    def draw(fig) -> None:
        ax = fig.add_subplot()
        xs = [2 * 1.05**i for i in range(120)]
        for name, where in tables:
            for row in table_rows(name):
                k, step_s = numbers(row["K (steps per save)"])[:2]
                interval, good = k * step_s, numbers(row["goodput (goal ≥ 0.95)"])[0]
                cost = interval * (1 / good - 1)
                style = "-" if name == "goodput" else "--"
                (line,) = ax.plot(xs, [x / (x + cost) for x in xs], style, label=f"{row['backend']}, {where}")
                ax.plot([interval], [good], "o", color=line.get_color())
        ax.axhline(GOAL_GOODPUT, color="grey", lw=1, ls=":")
        ax.annotate(
            f"goal ≥ {GOAL_GOODPUT}",
            (600, GOAL_GOODPUT),
            textcoords="offset points",
            xytext=(-4, -11),
            ha="right",
            color="grey",
        )
        ax.set_xscale("log")
        ax.set_xlim(xs[0], 600)
        ax.set_ylim(0.5, 1.0)
        ax.set_xlabel("seconds of training between async saves (log)")
        ax.set_ylabel("goodput (tokens/s with saves ÷ without)")
        ax.set_title("Goodput vs checkpoint interval (dots: measured; lines: the measured cost per save)")
        ax.legend(loc="lower right")

    return plot_from_table("goodput", draw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["fsdp2", "deepspeed"], action="append")
    ap.add_argument("--publish", action="store_true", help="the table from the backends' saved results")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 -> ~253M parameters)")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (at most 256)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (all ranks)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    ap.add_argument("--nproc", type=int, default=2, help="ranks")
    ap.add_argument("--target-s", type=float, default=30.0, help="seconds of training between saves")
    ap.add_argument("--saves", type=int, default=2, help="saves per ckpt phase")
    ap.add_argument("--reps", type=int, default=2, help="ckpt/plain phase pairs")
    ap.add_argument("--warm", type=int, default=3, help="warm-up steps (not counted)")
    ap.add_argument("--plot-only", action="store_true", help="redraw bench/results/goodput.png from the tables")
    args = ap.parse_args()
    if args.plot_only:
        plot()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    for b in args.backend or []:
        r = measure(b, args)
        print(f"{b}: step {r['step_s']:.2f} s -> K = {r['k']} steps between saves (~{r['k'] * r['step_s']:.0f} s)")
        print(table([r]))
    from benchlib import publish

    if args.device == "cuda":
        publish(
            "goodput" + gpu_suffix(args),
            table([json.loads((OUT / f"{b}{gpu_suffix(args)}.json").read_text()) for b in args.backend or []]),
        )
    elif args.publish or set(args.backend or []) == {"fsdp2", "deepspeed"}:
        have = [b for b in ("fsdp2", "deepspeed") if (OUT / f"{b}.json").is_file()]
        missing = "".join(
            f"\n- {b}: not measured (no {OUT.name}/{b}.json); run --backend {b}"
            for b in ("fsdp2", "deepspeed")
            if b not in have
        )
        publish("goodput", table([json.loads((OUT / f"{b}.json").read_text()) for b in have]) + missing)
    else:
        return
    plot()


if __name__ == "__main__":
    main()
