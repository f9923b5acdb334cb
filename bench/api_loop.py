"""The loop bench/api_overhead.py times, run by ``shardkeeper train --script``: the same FSDP2 step timed in two blocks
of one process, bare (torch.distributed and the loop only) and through the public API (``seg.steps()`` +
``seg.log``), in the order ``--order`` gives. Same model, data, optimizer and collectives, same ranks and memory;
rank 0 writes each block's steady-state step times (after --warm steps) as JSON to --out."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

p = argparse.ArgumentParser()
p.add_argument("--order", default="bare,api", choices=["bare,api", "api,bare"])
p.add_argument("--steps", type=int, default=60, help="steps per block")
p.add_argument("--warm", type=int, default=10)
p.add_argument("--width", type=int, default=1024)
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


def bare() -> list[float]:
    times = []
    for step in range(a.warm + a.steps):
        t = time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t)
    return times[a.warm :]


def api() -> list[float]:
    """From one yield to the next: the user's step plus everything steps() does between two steps."""
    times, t = [], None
    for step in seg.steps():
        if t is not None:
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        seg.log(loss=one_step(step))
    return times[a.warm - 1 :]


seg.track(model=model, optimizer=opt)
result: dict[str, list[float]] = {}
for side in a.order.split(","):
    result[side] = bare() if side == "bare" else api()
if seg.rank == 0:
    with open(a.out, "w") as f:
        json.dump(result, f)
