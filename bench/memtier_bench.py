"""The memory tier (checkpoint.memory_interval): snapshot stall, goodput, and recovery after a rank crash.

    nice -n 5 python bench/memtier_bench.py                 # ~10 min on 2 cores; publishes bench/results/memtier.md
    python bench/memtier_bench.py --layers 1 --target-s 2 --no-publish   # quick smoke run
    python bench/memtier_bench.py --device cuda --reps 1    # on a GPU node (make gpu-check): memtier-gpu.md

The ~250M-parameter Llama of bench/goodput_bench.py (``--layers`` decoder layers; 4 -> ~112M parameters), fp32 +
AdamW, FSDP2 on 2 gloo ranks, snapshots in ``/dev/shm`` (``--memory-dir``), storage under bench/out/memtier.

1. Stall: in the same processes, alternating order, ``--reps`` times each: one host->host copy of the rank's whole
   state (model + AdamW + counters + RNG) into preallocated buffers, against the training loop's stall of a memory
   snapshot (``Checkpointer.save(tier='memory')``; its write, hashing and commit run in the background and are
   waited for outside the timed region). Both barrier-bounded: the slower rank's time.
2. Goodput: ``--rounds`` rounds of three phases side by side, in rotated order, each phase one snapshot period
   (~``--target-s`` s of training, ``--saves`` snapshots; one by default): a 'memory' phase takes a memory snapshot,
   a 'storage' phase a storage checkpoint (persisted from its snapshot in the background), a 'plain' phase none.
   Each phase ends when its checkpoint is committed. Each round gives plain / memory (the snapshot goodput) and
   storage - memory (what one storage checkpoint adds): phases seconds apart, so the machine's slow drifts cancel.
   Goodput with a storage checkpoint every 5 min = 1 / (1 / snapshot goodput + added seconds / 300 s), from the
   medians over rounds, with a 95 % bootstrap interval over rounds: the goal is met or missed only when the whole
   interval is on one side of it.
3. Recovery: a segment (``trainer.segment.run_segment``) with a memory snapshot every 2 steps and a storage
   checkpoint every 10 (``--crash-*``) is SIGKILLed on rank 1 after the snapshot of step 14 (storage holds step
   10). Then, from
   copies of that state, alternating: the next segment from memory, the next segment from storage only (its memory
   dir empty; the storage files evicted from the page cache first), and a fresh run's first segment (no
   checkpoint: a fresh process start). Time to first step is from the ranks' process start (the segment's
   timeline: imports, process group, model build, load, first step).
4. Node loss: two emulated nodes x 1 rank (``node_loss``): the restore from the peer node's memory against the
   restore from the same node's memory, alternated.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cpu"  # --device: the spawned ranks' device (cuda: one GPU per rank, NCCL; the copy is device->host)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

OUT = ROOT / "bench" / "out" / "memtier"
GOAL_STALL = 1.05
GOAL_GOODPUT = 0.98
GOAL_RECOVERY_S = 2.0
GOAL_PEER = 1.2
MIN_ROUNDS = 10  # fewer complete goodput rounds: no verdict
STORAGE_EVERY_S = 300.0  # the storage interval the goodput goal names


def spec_for(layers: int, seq: int, memory_dir: Path, memory_interval: int, interval: int):
    from goodput_bench import spec_for as goodput_spec

    spec = goodput_spec("fsdp2", layers, seq)
    ck = spec.checkpoint.model_copy(
        update={"memory_interval": memory_interval, "memory_dir": str(memory_dir), "interval": interval, "keep_last": 2}
    )
    return spec.model_copy(update={"name": "memtier-bench", "checkpoint": ck})


# --------------------------------------------------------------------------------------------- 1 + 2, in process
def worker(run_dir: str, warm: int, target_s: float, saves: int, reps: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict

    from ckpt.commit.layout import RunDir
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import cpu_buffers
    from trainer.dist import init_distributed
    from trainer.segment import build_segment

    env = init_distributed()
    seg = build_segment(RunDir.at(run_dir), 1 << 30, 0, env)
    group, ck = env.ctrl_group, seg.ckpt
    seg.start_fresh()
    ts = TrainState()

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

    def timed(fn) -> float:
        dist.barrier(group=group)
        t = time.perf_counter()
        fn()
        dist.barrier(group=group)
        return slowest(time.perf_counter() - t)

    for _ in range(warm):
        step()
    ck.warm_up(ts)
    bufs = cpu_buffers(ck.state_dict(ts), pin_memory=env.device.type == "cuda")  # the snapshot's own kind of buffers
    _copy_state_dict(ck.state_dict(ts), bufs)  # first touch of the reference's pages, as warm_up does for staging
    copies, stalls = [], []
    for r in range(reps):
        for what in ("copy", "snapshot") if r % 2 == 0 else ("snapshot", "copy"):
            if what == "copy":
                copies.append(timed(lambda: _copy_state_dict(ck.state_dict(ts), bufs)))
            else:
                step()  # a new step for each snapshot
                stalls.append(timed(lambda: ck.save(ts, reason="interval", tier="memory")))
                ck.wait()
    bufs = {}  # the reference copy's buffers are freed before the goodput phases
    probe = []
    for _ in range(3):
        probe.append(timed(step))
    step_s = statistics.median(probe)
    k = max(1, round(target_s / step_s))
    n = saves * k
    phases = []
    orders = [("memory", "plain", "storage"), ("plain", "storage", "memory"), ("storage", "memory", "plain")]
    for r in range(rounds):
        for mode in orders[r % 3] if r % 2 == 0 else orders[r % 3][::-1]:
            phase_stalls = []
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                step()
                if mode != "plain" and i % k == k // 2:  # once per period of k steps ((i - 1) // k: its index)
                    tier = "storage" if mode == "storage" and (i - 1) // k == saves // 2 else "memory"
                    t = time.perf_counter()
                    ck.save(ts, reason="interval", tier=tier)
                    phase_stalls.append((tier, time.perf_counter() - t))
            ck.wait()  # the last snapshot's (or persist's) commit belongs to its phase
            ck._wait_reread()  # and rank 0's re-read of a storage checkpoint it committed (else the next phase's)
            assert mode != "storage" or any(t == "storage" for t, _ in phase_stalls), (k, saves)
            dist.barrier(group=group)
            wall = slowest(time.perf_counter() - t0)
            phases.append({"round": r, "mode": mode, "steps": n, "wall_s": wall, "stalls": phase_stalls})
    ck.close()
    snap = ck.memory.committed()[-1]
    nbytes = sum(f.stat().st_size for f in snap.rglob("*") if f.is_file())
    return {
        "copy_s": copies,
        "stall_s": stalls,
        "step_s": step_s,
        "k": k,
        "steps_per_phase": n,
        "phases": phases,
        "snapshot_bytes": nbytes,
        "params": sum(p.numel() for p in seg.model.parameters()),
    }


# --------------------------------------------------------------------------------------------- 3, segments
def _kill_after(mem: Path, step: int, killed: list[int]):
    """SIGKILL rank 1 once a snapshot of ``step`` or later is committed (one due while a save is in flight is
    skipped, and retention retires old ones: waiting for exactly ``step`` could wait forever)."""

    def on_start(procs: list) -> None:
        deadline = time.time() + 1200
        while time.time() < deadline:
            done = [p.name for p in (mem / "checkpoints").glob("step-*") if (p / "manifest.json").is_file()]
            late = sorted(int(n[5:13]) for n in done if n[5:13].isdigit() and int(n[5:13]) >= step)
            if late:
                killed.append(late[0])
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[0].join(timeout=30)
                if procs[0].is_alive():
                    os.kill(procs[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)
        raise RuntimeError(f"no snapshot of step {step} in time")

    return on_start


# The restore's parts timed inside the ranks (the profile of the node-loss rows): (owner, attribute, label). Each is
# wrapped with a perf_counter pair around the real call; nothing else changes.
RESTORE_PARTS = (
    (
        "trainer.checkpointer.node_tier:NodeTier",
        "_ready_early",
        "early, on its own thread while the model builds (plan, copy from the peer, hash this node's copy)",
    ),
    ("trainer.checkpointer.node_tier:NodeTier", "node_plans", "inventory + plan (collective; early and at the load)"),
    ("trainer.checkpointer.node_tier:NodeTier", "complete_copy", "complete the copy (early and at the load)"),
    ("trainer.checkpointer.node_tier:NodeTier", "_manifest_for", "manifest from the peer"),
    ("ckpt.memtier.replicate", "send", "send files (read + hash + send)"),
    ("ckpt.memtier.replicate", "receive", "receive files (receive + hash + write)"),
    ("trainer.checkpointer.node_tier:NodeTier", "_join", "join the fetched files"),
    ("trainer.checkpointer.node_tier:NodeTier", "check_copy", "quick checks of the copy"),
    ("trainer.checkpointer.resumer:Resumer", "load", "load (all of it)"),
    ("ckpt.formats.dcp.onepass:OnePassReader", "read_data", "load: read_data (hash, plan records)"),
    ("ckpt.formats.dcp.onepass:OnePassReader", "apply", "load: apply (chunks into the live state)"),
    ("trainer.checkpointer.dcp_backend", "set_state_dict", "load: set_state_dict"),
    ("trainer.checkpointer.dcp_backend:DCPCheckpointer", "fingerprint", "load: fingerprint"),
    ("trainer.checkpointer.resumer:Resumer", "_resumed", "load: lineage, log"),
)


def profiled_segment(run_dir: str, until: int, index: int, out: str) -> int:
    """``trainer.segment.run_segment`` with the restore's parts (RESTORE_PARTS) timed; each rank writes its times
    (label -> seconds of every call) to OUT.RANK.json."""
    import importlib

    from trainer.segment import run_segment

    times: dict[str, list[float]] = {}

    def wrap(owner: object, name: str, label: str) -> None:
        import inspect

        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times.setdefault(label, []).append(time.perf_counter() - t)

        static = inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)

    for where, name, label in RESTORE_PARTS:
        mod, _, cls = where.partition(":")
        owner = importlib.import_module(mod)
        wrap(getattr(owner, cls) if cls else owner, name, label)
    try:
        return run_segment(run_dir, until, index)
    finally:
        Path(f"{out}.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(times))


def _segment(run: Path, until: int, index: int, nodes: int = 1, profile: bool = False) -> dict:
    from tests.harness import spawn
    from trainer.segment import run_segment

    if profile:
        where = run / "restore-profile"
        assert spawn(
            profiled_segment, 2, str(run), until, index, str(where), timeout=1200, device=DEVICE, nodes=nodes
        ) == [0, 0]
        parts = [json.loads(Path(f"{where}.{r}.json").read_text()) for r in range(2)]
    else:
        assert spawn(run_segment, 2, str(run), until, index, timeout=1200, device=DEVICE, nodes=nodes) == [0, 0]
        parts = None
    status = json.loads((run / ".segment-status.json").read_text())
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e["kind"] == "resume" and e["data"].get("segment") == index]
    t = status["times"]
    return {
        "first_step_s": t["first_step_s"] - (t.get("ranks_started_s") or 0.0),
        "load_s": (t["loaded_s"] - t["model_built_s"]) if t.get("loaded_s") and t.get("model_built_s") else None,
        # process group up -> state loaded: the model build, the restore's node work beside it, the load
        "restore_s": (t["loaded_s"] - t["process_group_s"]) if t.get("loaded_s") and t.get("process_group_s") else None,
        "start_step": status["start_step"],
        "tier": resumes[-1]["data"].get("tier") if resumes else None,
        **({"parts": parts} if parts else {}),
    }


def recovery(args: argparse.Namespace) -> dict:
    import queue

    from benchlib import drop_caches

    from ckpt.commit.fsutil import dump_yaml
    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir
    from tests.harness import metrics, spawn
    from trainer.segment import run_segment

    base = OUT / "recovery"
    mem = Path(args.memory_dir) / "recovery"
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    crash_at, mem_k, store_k = args.crash_at, args.crash_memory_interval, args.crash_interval
    spec = spec_for(args.layers, args.seq, mem, mem_k, store_k)
    run = base / "crashed"
    prepare_run_dir(RunDir.at(run), spec)
    killed: list[int] = []
    try:
        spawn(
            run_segment, 2, str(run), 1 << 20, 0, timeout=20, on_start=_kill_after(mem, crash_at, killed), device=DEVICE
        )
    except queue.Empty:
        pass
    trained = max(metrics(run))
    pristine_mem = base / "mem-pristine"
    shutil.copytree(mem, pristine_mem)
    out: dict = {
        "trained_before_crash": trained,
        "crash_at": killed[0] if killed else crash_at,
        "memory_interval": mem_k,
        "interval": store_k,
        "memory": [],
        "storage": [],
        "fresh": [],
    }
    for r in range(args.reps):
        order = ("memory", "storage", "fresh") if r % 2 == 0 else ("fresh", "storage", "memory")
        for path in order:
            work = base / f"{path}-{r}"
            shutil.rmtree(work, ignore_errors=True)
            wmem = Path(args.memory_dir) / f"{path}-{r}"
            shutil.rmtree(wmem, ignore_errors=True)
            ck = spec.checkpoint.model_copy(update={"memory_dir": str(wmem)})
            wspec = spec.model_copy(update={"checkpoint": ck})
            if path == "fresh":
                prepare_run_dir(RunDir.at(work), wspec)
                out[path].append(_segment(work, 1, 0))
                shutil.rmtree(wmem, ignore_errors=True)
                continue
            shutil.copytree(run, work)
            if path == "memory":  # the snapshots of the crashed segment, as the node kept them
                shutil.copytree(pristine_mem, wmem)
                owner = json.loads((wmem / "tier.json").read_text())
                owner["run_dir"] = str(RunDir.at(work).root)
                (wmem / "tier.json").write_text(json.dumps(owner))
            (work / "run.yaml").write_text(dump_yaml(wspec.model_dump(mode="json")))
            out["cache"] = drop_caches([p for p in (work / "checkpoints").rglob("*") if p.is_file()])
            res = _segment(work, trained + 1, 1)
            res["lost"] = trained - res["start_step"]
            out[path].append(res)
            shutil.rmtree(wmem, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    return out


def node_loss(args: argparse.Namespace) -> dict:
    """Two emulated nodes x 1 rank (each its own memory dir, replicated to the other): a segment to ``--crash-at``
    steps with snapshots every ``--crash-memory-interval``; then, from copies of that state, alternating, the next
    segment restores from memory with both nodes' memory kept ('same node') or with node 1's memory gone ('peer':
    its files come from node 0's memory). Time: the segment's load phase (model built -> state loaded)."""
    from ckpt.commit.fsutil import dump_yaml
    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir

    base, mem = OUT / "nodes", Path(args.memory_dir) / "nodes"
    shutil.rmtree(base, ignore_errors=True)
    spec = spec_for(args.layers, args.seq, mem, args.crash_memory_interval, 1 << 20)
    run = base / "run"
    prepare_run_dir(RunDir.at(run), spec)
    _segment(run, args.crash_at, 0, nodes=2)
    out: dict = {"same": [], "peer": [], "step": args.crash_at}
    for r in range(args.reps):
        for path in ("same", "peer") if r % 2 == 0 else ("peer", "same"):
            work, wmem = base / f"{path}-{r}", Path(args.memory_dir) / f"nodes-{path}-{r}"
            shutil.copytree(run, work)
            shutil.copytree(mem, wmem)
            for owner_file in wmem.glob("nodes/*/tier.json"):
                owner = json.loads(owner_file.read_text())
                owner["run_dir"] = str(RunDir.at(work).root)
                owner_file.write_text(json.dumps(owner))
            if path == "peer":
                shutil.rmtree(wmem / "nodes" / "node1")
            wspec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"memory_dir": str(wmem)})})
            (work / "run.yaml").write_text(dump_yaml(wspec.model_dump(mode="json")))
            out[path].append(_segment(work, args.crash_at + 1, 1, nodes=2, profile=True))
            shutil.rmtree(wmem, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    out["bytes"] = sum(
        f.stat().st_size for f in (mem / "nodes" / "node0" / "checkpoints" / f"step-{args.crash_at:08d}").iterdir()
    )
    shutil.rmtree(mem, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------- table
def rounds_of(phases: list[dict]) -> list[dict[str, float]]:
    """The complete rounds (each mode's wall, its three phases side by side). A run recorded before phases carried
    their round holds its rounds as consecutive triples. Raises ValueError for a wall that is not a positive number."""
    by_round: dict[int, dict[str, float]] = {}
    for i, p in enumerate(phases):
        wall = p["wall_s"]
        if not (isinstance(wall, (int, float)) and math.isfinite(wall) and wall > 0):
            raise ValueError(f"goodput phase {i} ({p['mode']}): wall {wall!r} s is not a positive number of seconds")
        by_round.setdefault(p.get("round", i // 3), {})[p["mode"]] = wall
    return [r for _, r in sorted(by_round.items()) if {"plain", "memory", "storage"} <= set(r)]


def pairs_of(rounds: list[dict[str, float]]) -> list[tuple[float, float]]:
    """Per complete round (``rounds_of``): (plain / memory, storage - memory)."""
    return [(r["plain"] / r["memory"], r["storage"] - r["memory"]) for r in rounds]


def round_pairs(phases: list[dict]) -> list[tuple[float, float]]:
    """``pairs_of`` the complete rounds of ``phases``."""
    return pairs_of(rounds_of(phases))


def goodput_of(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(snapshot goodput, seconds one storage checkpoint adds, goodput with storage every STORAGE_EVERY_S): medians
    over rounds."""
    mem = statistics.median(p for p, _ in pairs)
    persist = max(0.0, statistics.median(d for _, d in pairs))
    return mem, persist, 1 / (1 / mem + persist / STORAGE_EVERY_S)


def bootstrap(pairs: list[tuple[float, float]], draws: int = 4000) -> tuple[float, float]:
    """The 95 % interval of the goodput with storage (``goodput_of``), rounds drawn with replacement (seeded: the
    same rounds give the same interval)."""
    import random

    rng = random.Random(0)
    got = sorted(goodput_of([rng.choice(pairs) for _ in pairs])[2] for _ in range(draws))
    return got[int(0.025 * draws)], got[int(0.975 * draws) - 1]


def table(res: dict, rec: dict | None, args: argparse.Namespace, lost: dict | None = None) -> str:
    from benchlib import fmt, md_table

    copy, stall = statistics.median(res["copy_s"]), statistics.median(res["stall_s"])
    ratio = stall / copy
    ok = lambda good, miss: "met" if good else f"missed: {miss}"  # noqa: E731
    rounds = rounds_of(res["phases"])
    ck, plain, store = ([r[m] for r in rounds] for m in ("memory", "plain", "storage"))
    pairs = pairs_of(rounds)
    period = res["k"] * res["step_s"]
    if pairs:
        mem_goodput, persist, goodput = goodput_of(pairs)
        low, high = bootstrap(pairs)
    else:
        mem_goodput = persist = goodput = low = high = math.nan
    above_one = round(mem_goodput, 3) > 1  # snapshots cannot speed training: the noise is larger than their cost
    interval = f"95 % interval {low:.3f}–{high:.3f}"
    # decided on the figures as printed; a bootstrap of a median from a handful of rounds says little
    verdict = (
        f"not resolved: {len(pairs)} complete round(s), at least {MIN_ROUNDS} needed"
        if len(pairs) < MIN_ROUNDS
        else f"met, {interval}"
        if round(low, 3) >= GOAL_GOODPUT
        else f"missed: {GOAL_GOODPUT - goodput:.3f} short, {interval}"
        if round(high, 3) < GOAL_GOODPUT
        else f"not resolved: {interval} spans the goal"
    )
    rows = [
        [
            "memory snapshot stall vs one host->host copy of the state",
            f"copy {fmt(res['copy_s'], 3)} s; snapshot stall {fmt(res['stall_s'], 3)} s",
            f"**{ratio:.2f}x** (goal ≤ {GOAL_STALL}x: {ok(ratio <= GOAL_STALL, f'{ratio:.2f}x')})",
        ],
        [
            f"goodput, a memory snapshot every {res['k']} steps (~{period:.0f} s)",
            f"phase wall ({res['steps_per_phase']} steps), no checkpoints {fmt(plain, 2)} s; "
            f"with snapshots {fmt(ck, 2)} s; plain / snapshots over {len(pairs)} rounds "
            f"{fmt([p for p, _ in pairs], 3)}",
            f"{mem_goodput:.3f}",
        ],
        [
            f"goodput, a memory snapshot every ~{period:.0f} s and a storage checkpoint every "
            f"{STORAGE_EVERY_S / 60:.0f} min "
            "(persisted from its snapshot)",
            f"phases with one storage checkpoint {fmt(store, 2)} s: one storage checkpoint adds "
            f"{persist:.2f} s (median over rounds of storage - snapshots), spread over {STORAGE_EVERY_S:.0f} s of "
            "training",
            f"**{goodput:.3f}** (goal ≥ {GOAL_GOODPUT}: {verdict})",
        ],
    ]
    notes = [
        f"{res['params'] / 1e6:.0f}M parameters, a snapshot of {res['snapshot_bytes'] / 1e9:.2f} GB (both ranks), "
        f"{res['step_s']:.2f} s per step, {len(res['copy_s'])} copies and {len(res['stall_s'])} snapshots alternated, "
        f"{len(pairs)} goodput rounds of three phases side by side in rotated order (snapshots / none / storage), "
        f"each phase {res['steps_per_phase'] // max(1, res['k'])} snapshot period(s) and ended by its commit; "
        "goodput with storage every "
        f"{STORAGE_EVERY_S / 60:.0f} min = 1 / (1 / snapshot goodput + added "
        f"storage seconds / {STORAGE_EVERY_S:.0f}); memory dir {args.memory_dir}"
        + (
            f"; stall and goodput figures taken from an earlier run of this bench ({res['reused_from']}, "
            f"measured {res.get('measured', 'earlier')})"
            if res.get("reused_from")
            else ""
        )
    ]
    if above_one:  # said, not hidden: the phases' noise is larger than what they compare
        notes.append(
            f"snapshot goodput above 1 ({mem_goodput:.3f}): in the median round the phase with a snapshot ran faster "
            "than the one without, so the machine's noise is larger than what a snapshot costs; the interval says "
            "what the rounds can resolve"
        )
    if rec:
        fresh = [r["first_step_s"] for r in rec["fresh"]]
        memf = [r["first_step_s"] for r in rec["memory"]]
        stof = [r["first_step_s"] for r in rec["storage"]]
        over = statistics.median(memf) - statistics.median(fresh)
        lost_m = max(r["lost"] for r in rec["memory"])
        lost_s = max(r["lost"] for r in rec["storage"])
        rows += [
            [
                "rank crash -> training again, from memory (time to first step from process start)",
                f"{fmt(memf)} s (load {fmt([r['load_s'] for r in rec['memory']])} s); steps lost {lost_m} "
                f"(memory_interval {rec['memory_interval']}); tier {rec['memory'][0]['tier']}",
                f"**fresh start + {over:.2f} s** (goal ≤ + {GOAL_RECOVERY_S} s: "
                f"{ok(over <= GOAL_RECOVERY_S, f'+{over:.2f} s')}); "
                f"steps lost {ok(lost_m <= rec['memory_interval'], str(lost_m))}",
            ],
            [
                "rank crash -> training again, from storage",
                f"{fmt(stof)} s (load {fmt([r['load_s'] for r in rec['storage']])} s); steps lost {lost_s} "
                f"(interval {rec['interval']}); "
                f"tier {rec['storage'][0]['tier']}",
                f"fresh start + {statistics.median(stof) - statistics.median(fresh):.2f} s",
            ],
            ["a fresh process start (new run, no checkpoint: the reference)", f"{fmt(fresh)} s", ""],
        ]
        notes.append(
            f"recovery: rank 1 SIGKILLed after the snapshot of step {rec['crash_at']} (storage every "
            f"{rec['interval']} steps; "
            f"{rec['trained_before_crash']} steps trained by then); {len(fresh)} runs of each path, alternated; "
            f"{rec.get('cache', '')}; launched with the spawn harness (no torchrun: its start-up is the same "
            "for every path)"
            + (
                f"; recovery figures taken from an earlier run of this bench ({rec['reused_from']})"
                if rec.get("reused_from")
                else ""
            )
        )
    if lost:
        # The goal is on the restore window (process group up -> state loaded), which holds the restore's node work
        # wherever it runs (beside the model build); the load phase alone (model built -> loaded) would leave it out.
        window = "restore_s" if all(r.get("restore_s") for r in lost["same"] + lost["peer"]) else "load_s"
        same, peer = [r[window] for r in lost["same"]], [r[window] for r in lost["peer"]]
        ratio = statistics.median(peer) / statistics.median(same)
        tiers = {r["tier"] for r in lost["same"] + lost["peer"]}
        what = "process group up -> state loaded" if window == "restore_s" else "load phase"
        rows.append(
            [
                "node lost -> restore from the peer node's memory vs from the same node's memory (2 nodes x 1 rank)",
                f"same node {fmt(same)} s; peer {fmt(peer)} s ({what}); tier {', '.join(sorted(map(str, tiers)))}",
                f"**{ratio:.2f}x** (goal ≤ {GOAL_PEER}x: {ok(ratio <= GOAL_PEER, f'{ratio:.2f}x')})",
            ]
        )
        for key, label in (
            ("load_s", "the load phase alone (model built -> state loaded)"),
            ("first_step_s", "the ranks' start -> first step done"),
        ):
            a = [r[key] for r in lost["same"] if r.get(key) is not None]
            b = [r[key] for r in lost["peer"] if r.get(key) is not None]
            if a and b and key != window:
                rows.append(
                    [
                        f"node lost, same segments: {label}",
                        f"same node {fmt(a)} s; peer {fmt(b)} s",
                        f"{statistics.median(b) / statistics.median(a):.2f}x",
                    ]
                )
        profile = restore_profile(lost)
        if profile:
            notes.append(
                "node loss, where the restore's time goes (seconds, median over the segments; rank 0 / rank 1; "
                "timed inside the ranks; the early part runs beside the model build, before the load phase, and "
                "the parts it calls are counted in their rows too): " + profile
            )
        notes.append(
            f"node loss: a snapshot of {lost['bytes'] / 1e9:.2f} GB (every file, as each node's copy holds it) "
            f"at step {lost['step']}; node 1's memory dir removed for 'peer'; {len(same)}+{len(peer)} "
            "segments alternated; the transfer runs over gloo on loopback (one host emulates both nodes)"
            + (
                f"; node-loss figures taken from an earlier run of this bench ({lost['reused_from']})"
                if lost.get("reused_from")
                else ""
            )
        )
    return (
        md_table(["what", "measured (median [min–max])", "result"], rows, "lll")
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes)
    )


def restore_profile(lost: dict) -> str:
    """The node-loss restore's parts (RESTORE_PARTS), same node vs peer, one clause per part timed in either."""

    def per(path: str, label: str, rank: int) -> str:
        got = [sum(r["parts"][rank].get(label, [])) for r in lost[path] if r.get("parts")]
        return f"{statistics.median(got):.2f}" if got and any(got) else "-"

    clauses = []
    for _where, _name, label in RESTORE_PARTS:
        cells = {p: f"{per(p, label, 0)} / {per(p, label, 1)}" for p in ("same", "peer")}
        if any(c != "- / -" for c in cells.values()):
            clauses.append(f"{label}: same {cells['same']}, peer {cells['peer']}")
    return "; ".join(clauses)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (4 -> ~112M parameters)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--target-s", type=float, default=5.0, help="seconds of training between memory snapshots")
    ap.add_argument(
        "--saves", type=int, default=1, help="snapshots per goodput phase (in a storage phase, one is stored)"
    )
    ap.add_argument("--reps", type=int, default=3, help="alternated repetitions of the stall and recovery measurements")
    ap.add_argument("--rounds", type=int, default=24, help="goodput: rounds of three phases side by side")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--memory-dir", default=f"/dev/shm/shardkeeper-bench-{os.getpid()}")
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument(
        "--recovery-json",
        help="take part 3 from this earlier run's bench/out/memtier/recovery.json "
        "(said in the table) instead of measuring it again",
    )
    ap.add_argument("--crash-at", type=int, default=14, help="recovery: the snapshot step after which rank 1 is killed")
    ap.add_argument("--crash-memory-interval", type=int, default=2, help="recovery: checkpoint.memory_interval")
    ap.add_argument("--crash-interval", type=int, default=10, help="recovery: checkpoint.interval")
    ap.add_argument(
        "--inproc-json",
        help="take parts 1-2 (stall, goodput) from this earlier run's "
        "bench/out/memtier/inproc.json (said in the table) instead of measuring them again",
    )
    ap.add_argument("--no-nodes", action="store_true", help="skip the node-loss restore (two emulated nodes)")
    ap.add_argument(
        "--nodes-json",
        help="take part 4 from this earlier run's bench/out/memtier/nodes.json (said in the table) instead of "
        "measuring it again",
    )
    ap.add_argument(
        "--nodes-only",
        action="store_true",
        help="only the node-loss restore and its profile, printed (nothing published)",
    )
    ap.add_argument("--no-publish", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: 2 GPUs (one per rank), NCCL")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(
                f"error: --device cuda: the 2-rank segments need 2 GPUs, {torch.cuda.device_count()} visible",
                file=sys.stderr,
            )
            sys.exit(2)
    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir
    from tests.harness import spawn

    OUT.mkdir(parents=True, exist_ok=True)
    if args.nodes_only:
        try:
            lost = node_loss(args)
        finally:
            shutil.rmtree(args.memory_dir, ignore_errors=True)
        (OUT / "nodes.json").write_text(json.dumps(lost, indent=2))
        same, peer = [r["restore_s"] for r in lost["same"]], [r["restore_s"] for r in lost["peer"]]
        print(
            f"node loss (process group up -> loaded): same {same}, peer {peer}: "
            f"{statistics.median(peer) / statistics.median(same):.2f}x\n"
            + "load phase: "
            + ", ".join(f"{p} {[r['load_s'] for r in lost[p]]}" for p in ("same", "peer"))
            + "\nfirst step: "
            + ", ".join(f"{p} {[r['first_step_s'] for r in lost[p]]}" for p in ("same", "peer"))
            + "\n"
            + restore_profile(lost).replace("; ", "\n")
        )
        return
    run, mem = OUT / "inproc", Path(args.memory_dir) / "inproc"
    shutil.rmtree(run, ignore_errors=True)
    try:
        if args.inproc_json:
            res = json.loads(Path(args.inproc_json).read_text())
            res["reused_from"] = Path(args.inproc_json).name  # a name, not a path of this machine
            res.setdefault(
                "measured", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(Path(args.inproc_json).stat().st_mtime))
            )
        else:
            prepare_run_dir(RunDir.at(run), spec_for(args.layers, args.seq, mem, 1 << 20, 1 << 30))
            res = spawn(
                worker,
                2,
                str(run),
                args.warm,
                args.target_s,
                args.saves,
                args.reps,
                args.rounds,
                timeout=3600,
                device=DEVICE,
            )[0]
            (OUT / "inproc.json").write_text(json.dumps(res, indent=2))
        if args.recovery_json:
            rec = json.loads(Path(args.recovery_json).read_text())
            rec["reused_from"] = Path(args.recovery_json).name
        else:
            rec = None if args.no_recovery else recovery(args)
            if rec:
                (OUT / "recovery.json").write_text(json.dumps(rec, indent=2))
        if args.nodes_json:
            lost = json.loads(Path(args.nodes_json).read_text())
            lost["reused_from"] = Path(args.nodes_json).name
        else:
            lost = None if args.no_nodes else node_loss(args)
        if lost and not args.nodes_json:
            (OUT / "nodes.json").write_text(json.dumps(lost, indent=2))
    finally:
        shutil.rmtree(args.memory_dir, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
    body = table(res, rec, args, lost)
    if args.no_publish:
        print(body)
        return
    from benchlib import publish

    publish("memtier" + ("-gpu" if DEVICE == "cuda" else ""), body)


if __name__ == "__main__":
    main()
