"""A user's script for the API tests: a tiny FSDP2 MLP whose behaviour --mode picks.

--mode train       train normally (a StatefulDataLoader over a rank's shard is tracked with --loader)
--mode raise       raise ValueError("boom at step N") in the user's own code at step --at
--mode no-steps    build and track, but never enter seg.steps()
--mode bad-track   track an object without state_dict()
--mode break       leave the loop early at step --at
--mode nan         log a NaN loss at step --at (the user's optimizer already stepped)
--sleep S          sleep S seconds per step (to be preempted mid-run)
"""

import argparse
import time

import torch
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train")
p.add_argument("--at", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--loader", action="store_true")
a = p.parse_args()


def explode(step):
    raise ValueError(f"boom at step {step}")


seg = sk.Segment()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = {}
loader = None
if a.loader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(400, dtype=torch.float32).reshape(100, 4) / 400
    mine = data[seg.rank::seg.world_size]  # this rank's shard: its position is per-rank state
    loader = StatefulDataLoader(mine, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seg.rank))
    state["loader"] = loader
if a.mode == "bad-track":
    state["counter"] = object()
seg.track(model=model, optimizer=opt, **state)
if a.mode == "no-steps":
    raise SystemExit(0)
batches = None  # iterators are made inside the loop: after the resume has restored the loader's position
for step in seg.steps():
    if a.mode == "raise" and step == a.at:
        explode(step)
    if a.mode == "break" and step == a.at:
        break
    if loader is not None:
        batches = batches or iter(loader)
        try:
            x = next(batches)
        except StopIteration:
            batches = iter(loader)
            x = next(batches)
    else:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + seg.rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    seg.log(loss=float("nan") if a.mode == "nan" and step == a.at else float(loss), first=float(x[0, 0]))
    if a.sleep:
        time.sleep(a.sleep)
