"""The loop bench/api_overhead.py times, in two forms: ``--bare`` (torch.distributed and the loop only) and through
the public API (sk.Segment: track, steps, log). Same model, data, optimizer and collectives; rank 0 writes the
steady-state step times (after --warm steps) as JSON to --out."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--bare", action="store_true")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warm", type=int, default=10)
p.add_argument("--width", type=int, default=1024)
p.add_argument("--out", required=True)
a = p.parse_args()

if a.bare:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh, rank, world = init_device_mesh("cpu", (dist.get_world_size(),)), dist.get_rank(), dist.get_world_size()
else:
    import shardkeeper as sk

    seg = sk.Segment()
    mesh, rank, world = seg.mesh, seg.rank, seg.world_size
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.GELU()) for _ in range(4)])
for block in model:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def one_step(step: int) -> float:
    x = torch.randn(32, a.width, generator=torch.Generator().manual_seed(step * 100 + rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)  # what a user logs: the mean loss over ranks
    return float(total) / world


times: list[float] = []
if a.bare:
    for step in range(a.steps):
        t = time.perf_counter()
        one_step(step)
        times.append(time.perf_counter() - t)
else:
    seg.track(model=model, optimizer=opt)
    t = None
    for step in seg.steps():
        if t is not None:  # from one yield to the next: the user's step plus everything steps() does between
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        seg.log(loss=one_step(step))
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(times[a.warm:], f)
if a.bare:
    dist.destroy_process_group()
