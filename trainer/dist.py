"""Process-group set-up on the rank side: CUDA+NCCL when GPUs are there, CPU+gloo otherwise."""

from __future__ import annotations

import datetime as _dt
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from schemas import ClusterTopology
from schemas.seam import SegmentLaunch
from trainer import lifetime

log = logging.getLogger("shardkeeper.trainer")

# Set by the node's agent (trainer.agent) for each set of ranks it starts, the same on every node of a rendezvous
# round: the ranks' process-group keys go under it in torchrun's shared store (below).
ATTEMPT_ENV = "SHARDKEEPER_ATTEMPT"


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup  # gloo: checkpoint planning/commit, usable from a background thread
    ctrl_group: dist.ProcessGroup  # gloo: small control messages (preemption agreement, fingerprints)
    topology: ClusterTopology

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def choose_device(local_rank: int, want: str = "auto") -> torch.device:
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available on this node")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(launch: SegmentLaunch | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """The process group of this rank. ``launch`` is what the launcher handed the ranks (None when started
    by hand: then SHARDKEEPER_DEVICE, or "auto")."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    dev = choose_device(local_rank, launch.device if launch else os.environ.get("SHARDKEEPER_DEVICE", "auto"))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cpu":
        from trainer.deepspeed.shm import skip_shm_op

        skip_shm_op()  # DeepSpeed's JIT-built CPU all-reduce op serves inference only (trainer.deepspeed.shm)
    with lifetime.rendezvous_window():  # a stop signal here ends the rank: a dead peer would leave it waiting
        if not dist.is_initialized():
            timeout = _dt.timedelta(seconds=timeout_s)
            dist.init_process_group(
                backend=backend,
                timeout=timeout,
                device_id=dev if dev.type == "cuda" else None,
                **_attempt_store(rank, world, timeout),
            )
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
        ckpt_group = dist.new_group(backend="gloo")
        ctrl_group = dist.new_group(backend="gloo")
    topo = ClusterTopology(
        nodes=max(1, world // max(1, local_world)),
        procs_per_node=local_world,
        device_type=dev.type,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
        launcher=launch.topology.launcher if launch else "local",
    )
    return DistEnv(rank, world, local_rank, dev, mesh, ckpt_group, ctrl_group, topo)


def _attempt_store(rank: int, world: int, timeout: _dt.timedelta) -> dict:
    """Under shardkeeper's agent: the process group's store is torchrun's shared store (the agent's, which outlives
    every set of ranks) under this set's own prefix. torchrun hands every set of ranks the same store without one, so
    ranks restarted in place would read the addresses the ranks before them left there (gloo then connects to a dead
    rank's port: torch issue 135712). Elsewhere: nothing (init_process_group reads MASTER_ADDR/MASTER_PORT)."""
    attempt = os.environ.get(ATTEMPT_ENV)
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return {"store": dist.PrefixStore(f"shardkeeper/{attempt}/", store), "rank": rank, "world_size": world}


def log0(env: DistEnv | None, msg: str, *args: object) -> None:
    """Log on rank 0 only (lazy formatting)."""
    if env is None or env.is_rank0:
        log.info(msg, *args)
