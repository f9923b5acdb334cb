"""The loop bench/memtier_edges.py trains through ``shardkeeper train --script``, with one fault injected into the
memory tier at one moment (``EDGE_*`` environment variables; none: a plain run).

A small FSDP2 MLP (every tensor at least 2 rows, so no rank's shard is empty); the batch of each step derives from
the step alone, so the state at any step is the same whatever the history: a resumed run is bitwise the run
without a fault, or it is a wrong state.

    EDGE_EVENT   kill | launcher | tamper | vanish | foreign
    EDGE_MOMENT  commit (right after the commit of the first snapshot at or after EDGE_STEP: one due while a save
                 is in flight is skipped) | persist (while the ranks copy the snapshot of EDGE_STEP to storage)
    EDGE_STEP    the step of that snapshot
    EDGE_MARK    launcher: rank 0 creates this file and waits there (the bench then SIGKILLs the launcher);
                 EDGE_MARK.step: the step of the snapshot the fault struck (every rank writes it first)
    EDGE_FOREIGN foreign: another run's snapshot dir copied into this run's memory dir (commit: beside it, then rank
                 1 dies; persist: in place of the snapshot being copied)
"""

import argparse
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
args = parser.parse_args()

EVENT, MOMENT = os.environ.get("EDGE_EVENT"), os.environ.get("EDGE_MOMENT")
AT = int(os.environ.get("EDGE_STEP", "-1"))
RANK = int(os.environ.get("RANK", "0"))


def flip(snap: Path) -> None:
    shard = sorted(snap.glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def act(snap: Path) -> None:
    """The fault, on the rank that does it (the other ranks go on as they would)."""
    Path(os.environ["EDGE_MARK"] + ".step").write_text(snap.name[5:])
    if EVENT == "kill" and RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    elif EVENT == "launcher" and RANK == 0:
        Path(os.environ["EDGE_MARK"]).touch()
        time.sleep(600)  # the bench kills the launcher now: torchrun and the ranks die with it
    elif EVENT in ("tamper", "vanish") and RANK == (0 if MOMENT == "commit" else 1):
        flip(snap) if EVENT == "tamper" else shutil.rmtree(snap)
    elif EVENT == "foreign":
        theirs = Path(os.environ["EDGE_FOREIGN"])
        if MOMENT == "commit":  # copied beside this run's snapshot, then a rank dies: the launcher chooses
            if RANK == 0:
                shutil.copytree(theirs, snap.parent / f"{theirs.name}.copying")
                os.rename(snap.parent / f"{theirs.name}.copying", snap.parent / theirs.name)
            else:
                while not (snap.parent / theirs.name).is_dir():
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
        elif RANK == 1:  # in place of the snapshot being persisted
            shutil.rmtree(snap)
            shutil.copytree(theirs, snap)


if EVENT:
    from trainer.checkpointer import saver
    from trainer.checkpointer.core import Checkpointer

    if MOMENT == "commit":
        real_commit = Checkpointer._commit

        def _commit(self, ts, *a, **kw):  # noqa: ANN001, ANN202
            committed = real_commit(self, ts, *a, **kw)
            target = kw.get("target")
            if (
                committed
                and target is not None
                and target is self.memory
                and ts.step >= AT
                and not getattr(_commit, "done", False)
            ):
                _commit.done = True  # type: ignore[attr-defined]
                act(self.memory.checkpoint(ts.step))
            return committed

        Checkpointer._commit = _commit  # type: ignore[method-assign]
    else:
        real_copy = saver.copy_file

        def copy_file(src, dst, *a, **kw):  # noqa: ANN001, ANN202
            if Path(src).parent.name == f"step-{AT:08d}" and not getattr(copy_file, "done", False):
                copy_file.done = True  # type: ignore[attr-defined]
                act(Path(src).parent)
            return real_copy(src, dst, *a, **kw)

        saver.copy_file = copy_file

seg = sk.Segment()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, 2),
).to(seg.device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=seg.mesh)
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
seg.track(model=model, optimizer=opt)

per_rank = args.batch // seg.world_size
for step in seg.steps(samples_per_step=args.batch):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, 8, generator=g).to(seg.device)
    s = x.sum(dim=1, keepdim=True)
    y = torch.cat([s.sin(), s.cos()], dim=1)
    mine = slice(seg.rank * per_rank, (seg.rank + 1) * per_rank)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    seg.log(loss=float(total) / seg.world_size)
