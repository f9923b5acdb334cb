"""A user's script for the API tests: a tiny FSDP2 MLP whose behaviour --mode picks.

--mode train       train normally (a StatefulDataLoader over a rank's shard is tracked with --loader)
--mode raise       raise ValueError("boom at step N") in the user's own code at step --at
--mode no-steps    build and track, but never enter seg.steps()
--mode bad-track   track an object without state_dict()
--mode break       leave the loop early at step --at
--mode nan         log a NaN loss at step --at (the user's optimizer already stepped)
--mode nan-then-ok log a NaN loss, then a finite one, at step --at (the NaN must still stop the run)
--mode str-loss    log loss="nan" (a string) at step --at
--mode term-then-nan rank 0 gets SIGTERM at step --at - 1, rank 1 logs a NaN loss at step --at (the stop, agreed a
                   step late, must not commit the NaN step)
--mode after       raise in the user's code after the loop (a final evaluation that fails)
--mode twice       enter seg.steps() a second time after the loop
--mode thread      leave a non-daemon thread running and an atexit handler that never returns (the rank must
                   still end; the handlers registered after it still run)
--atexit-file F    an atexit handler writes F.RANK (a script's handlers run at its rank's exit)
--atexit-noise     an atexit handler prints 80 lines and closes stdout (the rank's code and failure line survive)
--workers N        DataLoader worker processes of --loader
--counter          track a small counter object; with --mode bad-load its load_state_dict raises (a user's bug)
--sleep S          sleep S seconds per step (to be preempted mid-run)
"""

import argparse
import atexit
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train")
p.add_argument("--at", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--loader", action="store_true")
p.add_argument("--workers", type=int, default=0)
p.add_argument("--counter", action="store_true")
p.add_argument("--atexit-file", default=None)
p.add_argument("--atexit-noise", action="store_true")
a = p.parse_args()


def explode(step):
    raise ValueError(f"boom at step {step}")


seg = sk.Segment()
if a.mode == "thread":
    atexit.register(time.sleep, 3600)  # runs after the one below (atexit is last in, first out)
if a.atexit_file:
    atexit.register(Path(f"{a.atexit_file}.{seg.rank}").write_text, "ran")


def noise():
    import sys

    for i in range(80):
        print(f"tracker: run summary line {i}", file=sys.stderr)
    sys.stdout.close()


if a.atexit_noise:
    atexit.register(noise)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = {}
loader = None
if a.loader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(400, dtype=torch.float32).reshape(100, 4) / 400
    mine = data[seg.rank :: seg.world_size]  # this rank's shard: its position is per-rank state
    loader = StatefulDataLoader(
        mine, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seg.rank), num_workers=a.workers
    )
    state["loader"] = loader


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        if a.mode == "bad-load":
            raise KeyError("user bug in load_state_dict")
        self.n = sd["n"]


if a.counter:
    state["counter"] = Counter()
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
    if a.mode in ("nan", "nan-then-ok") and step == a.at:
        seg.log(loss=float("nan"))
    if a.mode == "term-then-nan" and step == a.at - 1 and seg.rank == 0:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
    if a.mode == "term-then-nan" and step == a.at and seg.rank == 1:
        seg.log(loss=float("nan"))
    if a.mode == "str-loss" and step == a.at:
        seg.log(loss="nan")
    if not (a.mode in ("nan", "term-then-nan") and step == a.at):
        seg.log(loss=float(loss), first=float(x[0, 0]))
    if a.sleep:
        time.sleep(a.sleep)
if a.mode == "after":
    explode("after the loop")
if a.mode == "twice":
    for step in seg.steps():  # noqa: B007
        pass
if a.mode == "thread":
    import threading

    threading.Thread(target=time.sleep, args=(3600,)).start()
