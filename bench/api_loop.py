"""The loop bench/api_overhead.py times, run by ``shardkeeper train --script``: the same FSDP2 step bare
(torch.distributed and the loop only) and through the public API (``seg.steps()`` + ``seg.log``), in short blocks
that alternate within one process (``--block`` steps each, the side that goes first alternating from pair to pair),
so that the load of a shared machine, which drifts over seconds, falls on both sides alike. Same model, data,
optimizer and collectives, same ranks and memory. The generator of ``seg.steps()`` is advanced by hand: a bare block
runs while it waits at a yield.

Rank 0 writes, as JSON to --out, every timed step of each side (after --warm steps of each; wall seconds, and CPU
seconds of the rank's process, all its threads: what a step costs whatever else the machine runs), and the profile
of the API's steps: the user's step inside it, ``seg.log``, and the time inside ``steps()`` between two yields
(metrics row, progress line, the agreement collective: the one started at the previous step waited for, the next
one started).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

p = argparse.ArgumentParser()
p.add_argument("--pairs", type=int, default=30, help="pairs of blocks (one bare, one through the API)")
p.add_argument("--block", type=int, default=4, help="steps per block")
p.add_argument("--warm", type=int, default=10, help="untimed steps of each side first")
p.add_argument("--width", type=int, default=1024)
p.add_argument(
    "--agreement",
    default="async",
    choices=["async", "blocking", "none"],
    help="profile only: the per-step agreement as the API runs it (async), waited for at once, or left out",
)
p.add_argument("--out", required=True)
a = p.parse_args()

seg = sk.Segment()
torch.manual_seed(0)
model = torch.nn.Sequential(
    *[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(4)]
)
for block in model:
    fully_shard(block, mesh=seg.mesh)
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def one_step(step: int) -> float:
    x = torch.randn(32, a.width, generator=torch.Generator().manual_seed(step * 100 + seg.rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # what a user logs: the mean loss over ranks
    return float(total) / seg.world_size


seg.track(model=model, optimizer=opt)
steps = seg.steps()
at = next(steps)  # the resume (here: a fresh start) happens before the first yield
if a.agreement != "async":  # a profile of what the agreement costs, never a way to run: stops would go unseen
    watcher = seg._watcher
    watcher.start_agree = (lambda flag: None) if a.agreement == "none" else (lambda flag: watcher.agree(flag) and None)
out: dict[str, list[float]] = {
    "bare": [],
    "api": [],
    "api_user": [],
    "api_log": [],
    "api_steps": [],
    "bare_cpu": [],
    "api_cpu": [],
}
bare_step = 0


def bare(n: int, keep: bool) -> None:
    global bare_step
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        one_step(bare_step)
        if keep:
            out["bare"].append(time.perf_counter() - t)
            out["bare_cpu"].append(time.process_time() - c)
        bare_step += 1


def api(n: int, keep: bool) -> None:
    """One API step: the user's step, ``seg.log``, then ``steps()`` up to its next yield."""
    global at
    for _ in range(n):
        t0, c = time.perf_counter(), time.process_time()
        loss = one_step(at)
        t1 = time.perf_counter()
        seg.log(loss=loss)
        t2 = time.perf_counter()
        at = next(steps)
        t3 = time.perf_counter()
        if keep:
            out["api_cpu"].append(time.process_time() - c)
            for key, v in (("api", t3 - t0), ("api_user", t1 - t0), ("api_log", t2 - t1), ("api_steps", t3 - t2)):
                out[key].append(v)


bare(a.warm, False)
api(a.warm, False)
for i in range(a.pairs):
    for side in (bare, api) if i % 2 == 0 else (api, bare):
        side(a.block, True)
seg.log(loss=one_step(at))  # the last step the bench yielded, then the segment's end (its final save): untimed
for at in steps:
    seg.log(loss=one_step(at))
if seg.rank == 0:
    with open(a.out, "w") as f:
        json.dump({**out, "block": a.block}, f)
