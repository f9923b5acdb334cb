"""Your own FSDP2 training loop under shardkeeper: commits, resume at any world size, preemption, lineage.

    shardkeeper train --script examples/fsdp2_loop.py --run-dir runs/own --until-step 20 --nproc 2
    shardkeeper train --run-dir runs/own --until-step 40 --nproc 1      # resumes on 1 rank (same script)

A small MLP regression model; the batch of each step derives from (seed, step), so the data position needs no
state. The LR scheduler is tracked: its state is restored exactly on resume.
"""

import argparse

import torch
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
args = parser.parse_args()

seg = sk.Segment()  # joins the segment: process group, run dir, until_step, checkpoint policy
torch.manual_seed(0)  # the same initial weights on every rank (the checkpoint replaces them on a resume)
model = torch.nn.Sequential(
    torch.nn.Linear(8, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, args.width),
    torch.nn.GELU(),
    torch.nn.Linear(args.width, 1),
).to(seg.device)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=seg.mesh)
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
seg.track(model=model, optimizer=opt, scheduler=sched)

per_rank = args.batch // seg.world_size
for step in seg.steps(samples_per_step=args.batch):
    g = torch.Generator().manual_seed(1000 + step)  # this step's global batch, whatever the world size
    x = torch.randn(args.batch, 8, generator=g).to(seg.device)
    y = x.sum(dim=1, keepdim=True).sin()
    mine = slice(seg.rank * per_rank, (seg.rank + 1) * per_rank)
    loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    seg.log(loss=float(total) / seg.world_size, lr=sched.get_last_lr()[0])
