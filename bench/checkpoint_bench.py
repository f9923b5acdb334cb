"""Checkpoint I/O, side by side with plain DCP, on a >= 250M-parameter Llama-style model (2 gloo ranks, CPU).

    python bench/checkpoint_bench.py --part save   # ~3 min: device yardstick, sync saves, checksum cost
    python bench/checkpoint_bench.py --part stall  # ~4 min: async stall inside a training loop
    python bench/checkpoint_bench.py --part load   # ~4 min: load_latest vs dcp.load, 2 -> 2 and 4 -> 2
    python bench/checkpoint_bench.py --small --part all   # smoke run on a tiny model (~1 min)
    python bench/checkpoint_bench.py --plot-only   # redraw bench/results/checkpoint*.png from the published tables

Each part writes bench/out/checkpoint/PART.json; once all three exist the table is published
(bench/results/checkpoint.md, copied into the README by bench/readme_tables.py). Fairness: both sides
run warm (one save each first, not counted), alternated A B A B, ``--reps`` times each, with the same
writer threads (``checkpoint.io_threads`` per rank; DCP's FileSystemWriter gets ``thread_count`` equal to
it) and the same cache state; medians (min–max); timings are barrier-bounded (the slower rank).

* save: parallel ``dd oflag=direct conv=fsync`` with ranks × threads streams (the device yardstick at our
  writers' parallelism) and single-stream dd, in the same rep loop as the saves; ``dcp.save`` vs ours
  (fsync, xxh3, manifest, commit) vs ours with torch's CRC-32 of every record on (as before it was turned off)
  vs ours with one buffer per file and synchronous writes vs ours with hashing off (the checksum cost).
* stall: a real training loop (FSDP2, AdamW) with the real Checkpointer: steps with and without a save,
  (a) the first save of a fresh run, (b) a save while the previous one is still in flight, (c) steady
  state; the same for ``dcp.async_save``; and one in-memory copy of the state measured the same way.
* load: ``Checkpointer.load_latest`` (resume: quick validation, every checksum checked as the files come off the
  disk before the live state is written, fingerprint) vs ``dcp.load`` + ``set_state_dict`` of the same checkpoint,
  page cache dropped before each, at the same world size and from a checkpoint written at 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from benchlib import command_line, drop_caches, fmt, md_table, publish  # noqa: E402

OUT, PARTS = ROOT / "bench" / "out" / "checkpoint", ("save", "stall", "load")
REST_S = 3.0  # idle seconds before each timed write of the save part (the same for every side and the yardstick)


def spec_for(small: bool):
    from schemas import RunSpec

    hidden, inter, layers = (256, 704, 2) if small else (1024, 2816, 16)
    return RunSpec.model_validate(
        {
            "name": "bench-ckpt",
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "seed": 0,
            "model": {
                "model_type": "llama",
                "config": {
                    "vocab_size": 32000,
                    "hidden_size": hidden,
                    "intermediate_size": inter,
                    "num_hidden_layers": layers,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 8,
                    "max_position_embeddings": 256,
                    "tie_word_embeddings": False,
                },
            },
            "data": {"seq_len": 64, "synthetic_tokens": 4096},
            "checkpoint": {"interval": 1000, "keep_last": 1000, "io_threads": 2, "async_save": True},
        }
    )


def setup(small: bool, run_dir: str, *, first_step: bool = True):
    """Model, AdamW and the real DCPCheckpointer on this rank (``first_step``: AdamW state exists)."""
    from ckpt.commit.layout import RunDir
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = spec_for(small)
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    if first_step:
        train_step(model, opt)
    ck = DCPCheckpointer(RunDir.at(run_dir), spec, model, opt, env, segment=0)
    return env, spec, model, opt, ck


def train_step(model, opt) -> None:
    """One real optimizer step on random tokens (forward, backward, clip, AdamW)."""
    import torch
    import torch.nn.functional as F

    x = torch.randint(0, 32000, (2, 64))
    logits = model(input_ids=x).logits
    F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, group) -> float:
    """Seconds of ``fn`` bounded by barriers: the slower rank's time (every rank returns the same)."""
    import torch.distributed as dist

    dist.barrier(group=group)
    t = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t


def plain_sd(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dd_streams(folder: Path, total_bytes: int, streams: int) -> float:
    """GB/s of ``streams`` parallel ``dd oflag=direct conv=fsync`` writing ``total_bytes`` in all."""
    count = max(1, round(total_bytes / streams / 2**26))
    paths = [folder / f"dd-{i}.bin" for i in range(streams)]
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["dd", "if=/dev/zero", f"of={p}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in paths
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("dd failed")
    dt = time.perf_counter() - t
    for p in paths:
        p.unlink()
    return streams * count * 2**26 / dt / 1e9


def ckpt_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# ------------------------------------------------------------------------------------------------- save
def save_worker(small: bool, run_dir: str, reps: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt.formats.dcp.direct_io import HashingDirectFileSystem, _HashingDirectStream
    from trainer.checkpointer.core import TrainState

    env, spec, model, opt, ck = setup(small, run_dir)
    g, threads, rd = env.ctrl_group, spec.checkpoint.io_threads, Path(run_dir)
    res: dict = {k: [] for k in ("dcp", "ours", "crc", "before", "nohash", "dd_before", "dd_after", "dd_one")}
    step = iter(range(1, 10_000))

    def clean() -> None:
        if env.is_rank0:
            for p in list(rd.glob("plain-*")) + list((rd / "checkpoints").glob("step-*")):
                shutil.rmtree(p)
        dist.barrier(group=g)

    def plain() -> None:
        dcp.save(
            plain_sd(model, opt), storage_writer=FileSystemWriter(rd / f"plain-{next(step)}", thread_count=threads)
        )

    def ours(hashing: bool, pipelined: bool = True, crc: bool = False):
        def go() -> None:
            _HashingDirectStream.hashing, _HashingDirectStream.pipelined = hashing, pipelined
            HashingDirectFileSystem.torch_crc32 = crc
            ck.save(TrainState(step=next(step)), reason="interval", blocking=True)
            _HashingDirectStream.hashing, _HashingDirectStream.pipelined = True, True
            HashingDirectFileSystem.torch_crc32 = False

        return go

    # With hashing off the manifest's digests are not the bytes', so that save's post-commit re-read logs a
    # mismatch: expected here, and that checkpoint is deleted right after.
    def settle() -> None:  # the background re-read after a commit is I/O of its own: let it finish, untimed
        ck._wait_reread()
        dist.barrier(group=g)

    def rest() -> None:  # every timed write (each side, each yardstick) starts after the same idle pause
        # what earlier writes and deletes left (dirty pages, the journal's commit and, on a file system mounted with
        # `discard`, the TRIMs of the files just removed) goes out before the pause, not inside the next timed write
        os.sync()
        time.sleep(REST_S)
        dist.barrier(group=g)

    def dd_par() -> float:  # rank 0 runs the yardstick while the other ranks wait
        rest()
        rate = dd_streams(rd, nbytes, env.world_size * threads) if env.is_rank0 and nbytes else 0.0
        dist.barrier(group=g)
        return rate

    # The disk's speed drifts by tens of percent between runs here: the yardstick is measured right before and
    # right after each of our saves, every timed write after the same sync and pause; the goal is judged against
    # the dd right before (the table shows the one after too).
    nbytes = 0
    sides = [
        ("dcp", plain),
        ("ours", ours(True)),
        ("crc", ours(True, crc=True)),
        ("before", ours(True, False)),
        ("nohash", ours(False)),
    ]
    for i in range(reps + 1):  # rep 0 is the warm-up of each side, not counted
        # each round starts one side later: no side always follows the same one (or the dd of ours)
        for name, fn in sides[i % len(sides) :] + sides[: i % len(sides)]:
            dd_before = dd_par() if name == "ours" and i else 0.0
            rest()
            dt = timed(fn, g)
            settle()  # before the yardstick after it: the re-read reads the whole checkpoint back
            dd_after = dd_par() if name == "ours" and i else 0.0
            if name == "ours":
                nbytes = sum(ckpt_bytes(p) for p in (rd / "checkpoints").glob("step-*"))
                phases = dict(ck.last_phases)
                if i and env.is_rank0:
                    res["dd_before"].append(dd_before)
                    res["dd_after"].append(dd_after)
            if i:
                res[name].append(dt)
            clean()
        rest()
        if env.is_rank0 and i:
            res["dd_one"].append(dd_streams(rd, nbytes, 1))
        dist.barrier(group=g)
    ck.close()
    params = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {
        **res,
        "bytes": nbytes,
        "params": params,
        "phases": phases,
        "threads": threads,
        "rest_s": REST_S,
        "world": env.world_size,
    }


# ------------------------------------------------------------------------------------------------ stall
def stall_worker(small: bool, run_dir: str, reps: int, between: int) -> dict:
    """A training loop on a fresh run: plain steps, then saves of each kind at chosen steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer.checkpointer.core import TrainState

    env, spec, model, opt, ck = setup(small, run_dir, first_step=False)
    g, threads, rd = env.ctrl_group, spec.checkpoint.io_threads, Path(run_dir)
    ck.warm_up(TrainState(step=0))  # what the loop does for a fresh run: nothing can be staged yet
    state = {"step": 0, "fut": None}
    out: dict = {"plain_step": [], "inflight_step": {"ours": [], "dcp": []}}

    def step() -> float:
        state["step"] += 1
        return timed(lambda: train_step(model, opt), g)

    def save_ours() -> None:
        ck.save(TrainState(step=state["step"]), reason="interval", blocking=False)

    def save_dcp() -> None:
        if state["fut"] is not None:  # the previous save must finish first (as with ours)
            state["fut"].result()
        state["fut"] = dcp.async_save(
            plain_sd(model, opt),
            process_group=env.ckpt_group,
            storage_writer=FileSystemWriter(rd / f"plain-{state['step']}", thread_count=threads),
        )

    def finish(kind: str) -> float:
        if kind == "ours":
            return timed(ck.wait, g)
        return timed(lambda: state["fut"].result() if state["fut"] is not None else None, g)

    def clean() -> None:
        ck._wait_reread()
        dist.barrier(group=g)
        if env.is_rank0:
            for p in list(rd.glob("plain-*")) + list((rd / "checkpoints").glob("step-*")):
                shutil.rmtree(p)
        dist.barrier(group=g)

    def saving_step(kind: str) -> dict:
        """A step then a save (the loop's order); the save's barrier-bounded time is the stall."""
        t = step()
        return {"step_s": t, "stall_s": timed(save_ours if kind == "ours" else save_dcp, g)}

    for _ in range(3):  # first step allocates AdamW's state; two more to settle
        step()
    for _ in range(reps):
        out["plain_step"].append(step())
    # (a) first save of the run, then (b) a save requested at once, while (a) still writes: it waits for (a)'s
    # commit (with a training step between them, (a) finishes during the step on this machine)
    out["b_no_step"] = True
    for kind in ("ours", "dcp"):
        first = saving_step(kind)
        state["step"] += 1
        second = {"stall_s": timed(save_ours if kind == "ours" else save_dcp, g)}
        out[f"{kind}_first"], out[f"{kind}_inflight"] = first, second
        out[f"{kind}_first_total_s"] = finish(kind)
        clean()
    # (c) steady state, alternated: save, ``between`` steps while it writes, the residual wait (untimed by
    # training in a real loop, whose next save is far away); one in-memory copy measured the same way
    staged = _create_cpu_state_dict(ck.state_dict(TrainState()))
    _copy_state_dict(ck.state_dict(TrainState()), staged)  # touched once, as ours' buffers are by then
    for kind in ("ours", "dcp", "copy") * reps:
        if kind == "copy":
            step()
            out.setdefault("copy", []).append(timed(lambda: _copy_state_dict(ck.state_dict(TrainState()), staged), g))
            continue
        out.setdefault(f"{kind}_steady", []).append(saving_step(kind)["stall_s"])
        out["inflight_step"][kind] += [step() for _ in range(between)]
        out.setdefault(f"{kind}_residual", []).append(finish(kind))
        clean()
    out["sync"] = []
    for _ in range(max(2, reps // 2)):  # our sync save in this loop, for the stall's yardstick
        step()
        out["sync"].append(timed(lambda: ck.save(TrainState(step=state["step"]), reason="interval", blocking=True), g))
        clean()
    ck.close()
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------------------------------------- load
def save_at(small: bool, run_dir: str, step: int) -> None:
    import torch.distributed as dist

    from trainer.checkpointer.core import TrainState

    _, _, _, _, ck = setup(small, run_dir)
    ck.save(TrainState(step=step), reason="interval", blocking=True)
    ck.close()
    dist.destroy_process_group()


def load_worker(small: bool, runs: dict, reps: int) -> dict:
    """load_latest (ours) and dcp.load (plain) of the same checkpoints, alternated, caches dropped before each."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ckpt.commit.layout import RunDir
    from ckpt.validate.checks import forget_known
    from trainer.checkpointer.dcp_backend import DCPCheckpointer

    env, spec, model, opt, ck0 = setup(small, runs["same"])
    g = env.ctrl_group
    cks = {k: DCPCheckpointer(RunDir.at(d), spec, model, opt, env, segment=1) for k, d in runs.items()}
    two = {k: DCPCheckpointer(RunDir.at(d), spec, model, opt, env, segment=1) for k, d in runs.items()}
    for ck in two.values():  # as before the one-pass load: every file hashed first, then the load reads it again
        ck.ONE_PASS = False
    out: dict = {}
    phases: dict = {}
    state = {"which": ""}
    for ck in cks.values():  # time load_latest's parts too (its resumer's), without changing what it does
        for name in ("_quick_check", "_hash_check", "load"):  # _hash_check: only a backend without one-pass loads

            def wrapped(*a, _f=getattr(ck.resumer, name), _n=name, **kw):
                t = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    phases.setdefault(f"{_n}_{state['which']}", []).append(time.perf_counter() - t)

            setattr(ck.resumer, name, wrapped)

    # and the load's own parts: the one-pass reader's hash pass and its copy into the live state, DCP's
    # set_state_dict and the fingerprint of the live state (module attributes, patched in this process only)
    import ckpt.formats.dcp.onepass as onepass
    import trainer.checkpointer.dcp_backend as backend

    def timing(owner, name: str, key: str) -> None:
        f = getattr(owner, name)

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                phases.setdefault(f"{key}_{state['which']}", []).append(time.perf_counter() - t)

        setattr(owner, name, wrapped)

    timing(onepass.OnePassReader, "read_data", "read_data")
    timing(onepass.OnePassReader, "apply", "apply")
    timing(backend, "set_state_dict", "set_state_dict")
    timing(backend.fp, "local_sum_squares", "fingerprint_sums")
    timing(backend, "load_verified", "load_verified")
    timing(backend.DCPCheckpointer, "restore", "restore")
    timing(onepass.OnePassReader, "prepare_global_plan", "global_plan")
    timing(onepass.OnePassReader, "read_metadata", "read_metadata")
    timing(onepass.SafeLoadPlanner, "create_local_plan", "local_plan")
    for ck in cks.values():
        timing(ck, "fingerprint", "fingerprint")

    def ours(which: str, pick: dict | None = None):
        def go() -> None:
            state["which"] = which if pick is None else f"twopass_{which}"
            forget_known()  # as in a new segment's process: nothing validated before
            ts = (pick or cks)[which].load_latest(restart=False)
            assert ts is not None and ts.step == {"same": 2, "other": 3}[which], ts

        return go

    def plain(which: str):
        path = sorted((Path(runs[which]) / "checkpoints").glob("step-*"))[-1]

        def go() -> None:
            sd = plain_sd(model, opt)
            dcp.load(sd, checkpoint_id=path, process_group=env.ckpt_group)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        return go

    cache = "page cache state: unknown"
    files = [f for d in runs.values() for f in sorted((Path(d) / "checkpoints").glob("step-*"))[-1].iterdir()]
    for i in range(reps + 1):  # round 0 warms both sides, not counted
        for which in ("same", "other"):
            for side, fn in (("ours", ours(which)), ("dcp", plain(which)), ("twopass", ours(which, two))):
                if env.is_rank0:
                    cache = drop_caches(files)
                dist.barrier(group=g)
                dt = timed(fn, g)
                if i:
                    out.setdefault(f"{side}_{which}", []).append(dt)
    for k in phases:  # drop the warm-up round's load_latest call
        phases[k] = phases[k][1:]
    dist.destroy_process_group()
    return {**out, "phases": phases, "cache": cache}


# ------------------------------------------------------------------------------------------------ table
def med(xs) -> float:
    return statistics.median(xs)


def goal(ok: bool, text: str) -> str:
    return ("met: " if ok else "**missed**: ") + text


def table(s: dict, st: dict, ld: dict, reps: dict) -> str:
    gb = s["bytes"] / 1e9
    rate = [gb / t for t in s["ours"]]
    ours_rate = med(rate)
    w, th = s["world"], s["threads"]
    hash_pct = [100 * (a / b - 1) for a, b in zip(s["ours"], s["nohash"])]
    sync = med(s["ours"])
    before, after = s.get("dd_before"), s.get("dd_after")
    if before:  # each save against the yardstick right before it (the same preceding write and pause), and after it
        vs_before = [gb / t / d for t, d in zip(s["ours"], before)]
        vs_after = [gb / t / d for t, d in zip(s["ours"], after)]
        vs_mean = [gb / t / ((a + b) / 2) for t, a, b in zip(s["ours"], before, after)]
        paired = med(vs_before)
    else:  # older results: one dd per round, after every side
        paired = ours_rate / med(s["dd_par"])
    rows = [
        [
            f"device: parallel dd oflag=direct conv=fsync ({w * th} streams)"
            + (", right before each of our saves" if before else ""),
            f"{fmt(before or s['dd_par'])} GB/s",
            "the yardstick: our writers' parallelism, fsync'd"
            + (
                f"; also measured right after each of our saves: {fmt(after)} GB/s; our save / the one before: "
                f"{fmt(vs_before)}x, / the one after: {fmt(vs_after)}x, / the mean of the two: {fmt(vs_mean)}x"
                if before
                else ""
            ),
            "",
        ],
        ["device: single-stream dd oflag=direct conv=fsync", f"{fmt(s['dd_one'])} GB/s", "second line", ""],
        [
            f"plain dcp.save (sync, FileSystemWriter thread_count={th}, fsync)",
            f"{fmt([gb / t for t in s['dcp']])} GB/s",
            f"{fmt(s['dcp'])} s",
            "",
        ],
        [
            "shardkeeper save (sync: O_DIRECT, fsync, xxh3, manifest, commit; no torch CRC-32)",
            f"{fmt(rate)} GB/s",
            f"{fmt(s['ours'])} s; {med(s['dcp']) / sync:.2f}x faster than dcp.save; last phases "
            + ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items()),
            goal(paired >= 0.8, f"{paired:.2f}x the parallel dd right before it (goal ≥ 0.8x)"),
        ],
    ]
    if s.get("crc"):
        rows.append(
            [
                "shardkeeper save with torch's CRC-32 of every record (as before; the manifest's xxh3 covers "
                "every byte)",
                f"{fmt([gb / t for t in s['crc']])} GB/s",
                f"{fmt(s['crc'])} s; without/with paired {fmt([b / a for a, b in zip(s['ours'], s['crc'])])}x "
                f"faster; "
                + (
                    f"{fmt([gb / t / d for t, d in zip(s['crc'], before)])}x the parallel dd "
                    "before our save of the same round"
                    if before
                    else f"{gb / med(s['crc']) / med(s['dd_par']):.2f}x parallel dd"
                ),
                "",
            ]
        )
    if s.get("before"):
        rows.append(
            [
                "shardkeeper save, before: one buffer per file, xxh3 of the source, synchronous writes",
                f"{fmt([gb / t for t in s['before']])} GB/s",
                f"{fmt(s['before'])} s; now/before paired {fmt([b / a for a, b in zip(s['ours'], s['before'])])}x "
                "faster",
                "",
            ]
        )
    rows += [
        [
            "checksum cost (ours with vs without xxh3, paired reps)",
            f"{fmt(hash_pct, 1)} %",
            f"with {fmt(s['ours'])} s, without {fmt(s['nohash'])} s",
            goal(med(hash_pct) <= 10, f"{med(hash_pct):+.1f} % (goal ≤ 10 %)"),
        ],
    ]
    sync_loop = med(st["sync"]) if st else 0.0
    plain_step = med(st["plain_step"]) if st else 0.0
    for kind, label in (("ours", "shardkeeper async"), ("dcp", "plain dcp.async_save")) if st else ():
        first, infl = st[f"{kind}_first"]["stall_s"], st[f"{kind}_inflight"]["stall_s"]
        steady = st[f"{kind}_steady"]
        rows += [
            [
                f"{label}: stall, first save of a fresh run (a)",
                f"{first:.2f} s",
                f"{100 * first / sync_loop:.0f} % of a sync save",
                "" if kind == "dcp" else goal(first <= 0.1 * sync_loop, "≤ 10 % of a sync save"),
            ],
            [
                f"{label}: stall, "
                + ("previous save still in flight (b)" if st.get("b_no_step") else "save on the step after (a) (b)"),
                f"{infl:.2f} s",
                (
                    "waits for the previous commit"
                    if st.get("b_no_step")
                    else f"(a) had finished during the {st[f'{kind}_first']['step_s']:.0f} s step between: "
                    "no wait measured"
                )
                + f"; {100 * infl / sync_loop:.0f} % of a sync save",
                "" if kind == "dcp" else goal(infl <= 0.1 * sync_loop, "≤ 10 % of a sync save"),
            ],
            [
                f"{label}: stall, steady state (c)",
                f"{fmt(steady)} s",
                f"{100 * med(steady) / sync_loop:.1f} % of a sync save; {med(steady) / med(st['copy']):.2f}x one copy; "
                f"steps while it writes {fmt(st['inflight_step'][kind])} s vs {plain_step:.2f} s",
                "" if kind == "dcp" else goal(med(steady) <= 0.1 * sync_loop, "≤ 10 % of a sync save"),
            ],
        ]
    rows += (
        [
            [
                "one in-memory copy of the state (the floor of any async stall)",
                f"{fmt(st['copy'])} s",
                f"sync save in the same loop {fmt(st['sync'])} s; plain step {fmt(st['plain_step'])} s",
                "",
            ]
        ]
        if st
        else []
    )
    ph = ld["phases"]
    for which, label in (("same", "2 -> 2"), ("other", "4 -> 2")):
        ours, plain = ld[f"ours_{which}"], ld[f"dcp_{which}"]
        rows.append(
            [
                f"resume ({label}): Checkpointer.load_latest",
                f"{fmt(ours)} s",
                f"{med(ours) / med(plain):.2f}x dcp.load (paired rounds: {fmt([a / b for a, b in zip(ours, plain)])}x)",
                goal(med(ours) <= 1.15 * med(plain), f"{med(ours) / med(plain):.2f}x (goal ≤ 1.15x)"),
            ]
        )
        rows.append([f"resume ({label}): plain dcp.load + set_state_dict", f"{fmt(plain)} s", "no checks", ""])
        if ld.get(f"twopass_{which}"):
            two = ld[f"twopass_{which}"]
            rows.append(
                [
                    f"resume ({label}): load_latest before one-pass (hash every file, then load)",
                    f"{fmt(two)} s",
                    f"{med(two) / med(plain):.2f}x dcp.load; one-pass/two-pass paired "
                    f"{fmt([a / b for a, b in zip(ours, two)])}x",
                    "",
                ]
            )
    ratio = med(ld["ours_other"]) / med(ld["ours_same"])
    rows.append(
        ["load_latest, other size vs same size", f"{ratio:.2f}x", "", goal(ratio <= 1.2, f"{ratio:.2f}x (goal ≤ 1.2x)")]
    )
    body = md_table(["measure", "value (median (min–max))", "notes", "goal"], rows)
    body += (
        f"\n\nModel {s['params'] / 1e6:.0f}M parameters, checkpoint {gb:.2f} GB (fp32 weights + AdamW moments), "
        f"{w} ranks × {th} writer threads. Repetitions: save part {reps['save']} rounds after one "
        f"warm-up round, the order of the sides rotated by one each round"
        + (f", each timed write after a sync and {s['rest_s']:g} s idle; " if s.get("rest_s") else "; ")
        + (f"stall part {reps['stall']} steady rounds (a and b are single events of a fresh run); " if st else "")
        + f"load part {reps['load']} alternated rounds after a warm-up round, {ld['cache']}. load_latest's parts "
        "(median s, 2 -> 2 / 4 -> 2): quick validation (manifest, layout, every file's size; first sight) "
        + " / ".join(f"{med(ph['_quick_check_' + w]):.2f}" for w in ("same", "other"))
        + (
            (
                ", xxh3 of every file against the manifest (ranks share the files) "
                + " / ".join(f"{med(ph['_hash_check_' + w]):.2f}" for w in ("same", "other"))
            )
            if all(ph.get("_hash_check_" + w) for w in ("same", "other"))
            else ""
        )
        + ", verified load (dcp.load hashing every file as it comes off the disk, each chunk read from the page "
        "cache straight into the live state right behind the hash) + set_state_dict + counters + fingerprint "
        + " / ".join(f"{med(ph['load_' + w]):.2f}" for w in ("same", "other"))
        + (
            (
                "; of which the hash pass (read_data: every file read and hashed, and the fingerprint's sums of the "
                "chunks computed behind it from the page cache) "
                + " / ".join(f"{med(ph['read_data_' + w]):.2f}" for w in ("same", "other"))
                + ", the copy left after the hash pass (apply; 0 when it is made behind the hash) "
                + " / ".join(f"{med(ph['apply_' + w]):.2f}" for w in ("same", "other"))
                + ", the fingerprint after the load (taking those sums) "
                + " / ".join(f"{med(ph['fingerprint_' + w]):.3f}" for w in ("same", "other"))
            )
            if all(ph.get(k + w) for k in ("read_data_", "apply_", "fingerprint_") for w in ("same", "other"))
            else ""
        )
        + "."
    )
    return body


def run_part(part: str, args: argparse.Namespace) -> None:
    from tests.harness import spawn

    d = OUT / part
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t0 = time.perf_counter()
    if part == "save":
        res = spawn(save_worker, 2, args.small, str(d), args.reps, timeout=1200)[0]
    elif part == "stall":
        res = spawn(stall_worker, 2, args.small, str(d), args.reps, args.between, timeout=1200)[0]
    else:
        runs = {"same": str(d / "same"), "other": str(d / "other")}
        spawn(save_at, 2, args.small, runs["same"], 2, timeout=1200)
        spawn(save_at, 4, args.small, runs["other"], 3, timeout=1200)
        res, other = spawn(load_worker, 2, args.small, runs, args.reps, timeout=1200)
        res["phases_rank1"] = other["phases"]  # a rank that waits on the other shows it only in the other's parts
    res["reps"], res["small"], res["argv"] = args.reps, args.small, sys.argv
    shutil.rmtree(d, ignore_errors=True)
    (OUT / f"{part}.json").write_text(json.dumps(res, indent=1))
    print(f"{part}: {time.perf_counter() - t0:.0f} s", flush=True)


def plot(name: str) -> Path:
    """bench/results/NAME.png from the published table NAME (checkpoint or checkpoint-storage): sync save throughput
    against the device yardstick (parallel and single-stream ``dd``), and resume against a bare ``dcp.load``."""
    from benchlib import plot_from_table, spread, table_rows

    rows = table_rows(name)
    saves = [r for r in rows if r["value (median (min–max))"].endswith("GB/s")]
    loads = [r for r in rows if r["measure"].startswith("resume (")]

    def short(measure: str) -> str:
        """A bar's label: the row's measure without its explanations (labels must differ: equal ones share a bar)."""
        sizes = measure[len("resume (") :].split(")")[0] if measure.startswith("resume (") else ""
        for key, label in (
            ("parallel dd", "dd, parallel"),
            ("single-stream dd", "dd, one stream"),
            ("dcp.save", "dcp.save"),
            ("with torch's CRC-32", "ours + torch CRC-32"),
            ("save, before", "ours, before"),
            ("shardkeeper save", "ours"),
            ("before one-pass", "load_latest two-pass"),
            ("load_latest", "load_latest"),
            ("dcp.load", "dcp.load"),
        ):
            if key in measure:
                return f"{label} {sizes}".strip()
        return measure[:28]

    def baseline(measure: str) -> bool:
        return "dd" in measure.split("(")[0] or "dcp." in measure

    def bars(ax, picked: list[dict[str, str]], unit: str) -> None:
        vals = [spread(r["value (median (min–max))"]) for r in picked]
        ax.barh(
            [short(r["measure"]) for r in picked],
            [v[0] for v in vals],
            color=["#9e9e9e" if baseline(r["measure"]) else "#3f51b5" for r in picked],
            xerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]],
            capsize=2,
            ecolor="#424242",
        )
        for i, v in enumerate(vals):
            ax.annotate(f"{v[0]:.2f}", (v[2], i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_xlim(0, max(v[2] for v in vals) * 1.2)

    def draw(fig) -> None:
        top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [len(saves), len(loads)]})
        bars(top, saves, "sync save, GB/s (grey: the device yardstick dd, and plain DCP)")
        top.set_title("Sync save vs the device, resume vs a bare dcp.load")
        bars(bottom, loads, "resume, seconds, page cache dropped (grey: dcp.load, no checks)")

    return plot_from_table(name, draw, size=(7.5, 1.2 + 0.36 * (len(saves) + len(loads))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=(*PARTS, "all", "table"), default="all")
    ap.add_argument("--reps", type=int, default=5, help="counted repetitions of each side (after a warm-up)")
    ap.add_argument("--between", type=int, default=2, help="training steps while a steady-state save writes")
    ap.add_argument("--small", action="store_true", help="smoke run on a tiny model; publishes nothing")
    ap.add_argument(
        "--storage",
        action="store_true",
        help="publish the save and load parts alone (bench/results/checkpoint-storage.md)",
    )
    ap.add_argument("--plot-only", action="store_true", help="redraw the plots from the published tables")
    args = ap.parse_args(argv)
    if args.plot_only:
        from benchlib import RESULTS

        for name in ("checkpoint", "checkpoint-storage"):
            if (RESULTS / f"{name}.md").is_file():
                plot(name)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for part in PARTS if args.part == "all" else (() if args.part == "table" else (args.part,)):
        run_part(part, args)
    found = {p: json.loads((OUT / f"{p}.json").read_text()) for p in PARTS if (OUT / f"{p}.json").is_file()}
    # The storage path alone (save and load, no stall part): published as checkpoint-storage
    parts = PARTS if len(found) == len(PARTS) else ("save", "load") if args.storage else PARTS
    if any(p not in found for p in parts) or len({found[p]["small"] for p in parts}) != 1:
        print("table: run every part (at the same size) first, or --storage after save and load", file=sys.stderr)
        return 0 if args.part != "table" else 1
    body = table(
        found["save"],
        found.get("stall") if "stall" in parts else None,
        found["load"],
        {p: found[p]["reps"] for p in parts},
    )
    cmds = "; ".join(command_line(["bench/checkpoint_bench.py", *found[p]["argv"][1:]]) for p in parts)
    if args.small:
        print(body)
        return 0
    name = "checkpoint" if "stall" in parts else "checkpoint-storage"
    publish(name, body + f"\n\nParts measured by: `{cmds}`.")
    plot(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
