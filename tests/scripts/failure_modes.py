"""A user's script that fails on purpose, for the failure-attribution tests and bench/failure_attribution.py.

A tiny FSDP2 MLP trained through shardkeeper.Segment; at step --at, rank --rank (every rank with --rank -1) does what
--mode says:

--mode train       nothing: train to the end
--mode kill        SIGKILL itself (what a user's `kill -9` or a scheduler does)
--mode oom         allocate memory until the kernel's OOM killer ends it: first moved into a child memory cgroup
                   limited to --oom-mb MiB above its own size (cgroup v1 or v2, where this process may create one:
                   root, or a delegated subtree), so that only this rank is killed; where it may not, it SIGKILLs
                   itself and says so on stderr ("oom: no memory cgroup here")
--mode raise       raise ValueError in the user's own code
--mode exit0       os._exit(0) inside the loop (the segment has not ended)
--mode exit3       os._exit(3) inside the loop
--mode hang        sleep forever inside the loop (its peers wait in the next collective: a deadlock)
--mode stop        SIGSTOP itself inside the loop (a debugger, a `kill -STOP`): no signal handler of it runs any more
--mode widths      nothing at --at: rank --rank builds its model --width + 8 wide, so the ranks' collectives disagree
--mode orphan      fork a grandchild (double fork: re-parented away from the rank) that ignores SIGTERM and sleeps
                   --orphan-s seconds holding the rank's open files, then train to the end; its pid goes to
                   --orphan-pid-file
--sleep S          sleep S seconds per step (time to be killed from outside)
--times N          misbehave only in the first N sets of ranks of the segment (ranks restarted in place N times or
                   more train on: checkpoint.restarts); default: every time
--wait-for FILE    ranks restarted in place wait at their first step until FILE exists (a test looks at the
                   segment meanwhile)
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import shardkeeper as sk

p = argparse.ArgumentParser()
p.add_argument("--mode", default="train")
p.add_argument("--rank", type=int, default=1, help="the rank that misbehaves; -1: every rank")
p.add_argument("--at", type=int, default=3)
p.add_argument("--width", type=int, default=16)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--oom-mb", type=int, default=256)
p.add_argument("--orphan-s", type=float, default=600.0)
p.add_argument("--orphan-pid-file", default=None)
p.add_argument("--times", type=int, default=None)
p.add_argument("--wait-for", default=None)
a = p.parse_args()

seg = sk.Segment()
restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
me = a.rank in (-1, seg.rank) and (a.times is None or restarted < a.times)
width = a.width + (8 if a.mode == "widths" and me else 0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
seg.track(model=model, optimizer=opt)


def memory_cgroup(limit_extra: int) -> bool:
    """Move this process into a new child memory cgroup limited to its size + ``limit_extra`` bytes."""
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit_file, extra = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", ("memory.swap.max", "0")
        elif "memory" in controllers.split(","):
            base, limit_file, extra = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes", None
        else:
            continue
        child = base / f"shardkeeper-oom-{os.getpid()}"
        try:
            child.mkdir()
            (child / limit_file).write_text(str(rss + limit_extra))
            if extra and (child / extra[0]).exists():
                (child / extra[0]).write_text(extra[1])
            (child / "cgroup.procs").write_text(str(os.getpid()))
            return True
        except OSError:
            try:
                child.rmdir()
            except OSError:
                pass
    return False


def misbehave() -> None:
    if a.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if a.mode == "oom":
        if not memory_cgroup(a.oom_mb << 20):
            print("oom: no memory cgroup here; SIGKILL instead", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        hog = []
        while True:
            hog.append(torch.ones(8 << 20))  # 32 MiB, touched
    if a.mode == "raise":
        raise ValueError(f"boom on rank {seg.rank} at step {step}")
    if a.mode == "exit0":
        os._exit(0)
    if a.mode == "exit3":
        os._exit(3)
    if a.mode == "hang":
        time.sleep(3600)
    if a.mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


if a.mode == "orphan" and me and os.fork() == 0:  # the child forks the grandchild and exits: it is re-parented
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if a.orphan_pid_file:
            Path(f"{a.orphan_pid_file}.{seg.rank}").write_text(str(os.getpid()))
        time.sleep(a.orphan_s)
    os._exit(0)

for step in seg.steps():
    while restarted and a.wait_for and not os.path.exists(a.wait_for):
        time.sleep(0.05)
    if step == a.at and me:
        misbehave()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step * 10 + seg.rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    seg.log(loss=float(loss))
    if a.sleep:
        time.sleep(a.sleep)
