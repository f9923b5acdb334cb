"""The one training loop bench/peers_memtier.py runs under each system it compares (every rank runs this file).

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 bench/peers_memtier_loop.py \\
        --system torch --events E --storage S
    dlrover-run --nnodes 1 --nproc-per-node 2 --max-restarts 3 bench/peers_memtier_loop.py \\
        --system dlrover --events E --storage S
    shardkeeper train --script bench/peers_memtier_loop.py --run-dir S --until-step 28 --nproc 2 \\
        --set checkpoint.memory_interval=2 --set checkpoint.interval=8 -- --system shardkeeper --events E --storage S

The same model (a Llama from ``transformers``, fp32, FSDP2 over every decoder layer and the root), the same AdamW,
the same batches (step ``n``'s global batch is drawn from a generator seeded with ``1000 + n``, each rank takes its
slice) and the same schedule of saves under all three systems; only the checkpointing differs:

* ``shardkeeper``: the public API (``sk.Segment``: ``track``, ``steps``); snapshots every ``checkpoint.memory_interval``
  steps, storage checkpoints every ``checkpoint.interval`` (persisted from the snapshot of their step), resume by
  ``steps()``.
* ``dlrover``: DLRover's Flash Checkpoint engine for FSDP (``FsdpCheckpointEngine``: DCP into host shared memory,
  persisted to disk by the agent of ``dlrover-run``), given the DCP state dict of ``get_state_dict``;
  ``save_to_memory`` at the snapshot steps, ``save_to_storage`` at the storage steps, ``load`` (memory first) on a
  restart.
* ``torch``: ``torch.distributed.checkpoint.async_save`` of the same state dict at every one of those steps (it has no
  memory tier), ``dcp.load`` of the newest complete checkpoint on a restart.

Each boundary between two steps is timed on every rank after a barrier (the save of that boundary, if any, inside
it: for shardkeeper the whole ``next()`` of ``steps()``); after a boundary without a save the previous save is first
waited for and one host copy of the state (``get_state_dict`` + a copy into preallocated buffers) is timed, so
that every save and every copy starts with nothing in flight. After a storage save each rank waits until the
checkpoint is committed on disk in its system's own terms. After the snapshot of ``--kill-at`` is complete, rank 0
writes ``kill_point`` and training goes on: the bench SIGKILLs rank 1 then. Everything measured goes, one JSON
line per event, into ``--events`` (appended by every process, restarted ones included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SYSTEMS = ("shardkeeper", "dlrover", "torch")
POLL_S = 0.005  # how often a wait for a commit on disk looks again


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=SYSTEMS, required=True)
    ap.add_argument("--events", required=True, help="the JSON-lines file every rank appends its events to")
    ap.add_argument("--storage", required=True, help="checkpoint directory (shardkeeper: the run directory)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences, all ranks)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--memory-interval", type=int, default=2, help="a memory snapshot every this many steps")
    ap.add_argument("--interval", type=int, default=8, help="a storage save every this many steps")
    ap.add_argument(
        "--kill-at", type=int, default=26, help="rank 0 writes kill_point once this step's snapshot is complete"
    )
    ap.add_argument("--until", type=int, default=28, help="the step training ends at (shardkeeper: --until-step)")
    return ap.parse_args(argv)


def schedule(s: int, args: argparse.Namespace) -> str | None:
    """What the boundary after ``s`` steps saves: 'storage', 'memory' or nothing (shardkeeper's own rule)."""
    if s >= args.until:
        return None
    if s % args.interval == 0:
        return "storage"
    return "memory" if s % args.memory_interval == 0 else None


class Events:
    """One JSON line per event, appended with one write (O_APPEND), so that processes never interleave a line."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = int(os.environ.get("RANK", "0"))

    def __call__(self, ev: str, **data: Any) -> None:
        line = {"ev": ev, "rank": self.rank, "pid": os.getpid(), "t": time.time(), **data}
        os.write(self.fd, (json.dumps(line) + "\n").encode())


# --------------------------------------------------------------------------------------------- model, data, step
def build(args: argparse.Namespace, mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank and under every system
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(256, args.seq),
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train_step(model: Any, opt: Any, step: int, args: argparse.Namespace, rank: int, world: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 + step)  # step n's global batch, whoever trains it
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    per = args.batch // world
    mine = ids[rank * per : (rank + 1) * per]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def state_dict(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not there after {timeout_s:.0f} s")
        time.sleep(POLL_S)


# --------------------------------------------------------------------------------------------- the three systems
class Shardkeeper:
    """The public API; the schedule of saves is the run's policy (``checkpoint.memory_interval``/``interval``)."""

    def __init__(self, args: argparse.Namespace):
        import shardkeeper as sk

        self.args = args
        self.seg = sk.Segment()
        pol = self.seg.spec.checkpoint
        ours = (args.memory_interval, args.interval, args.until)
        if (pol.memory_interval, pol.interval, self.seg.until_step) != ours:
            raise SystemExit(
                f"peers_memtier_loop: the run's policy (memory_interval {pol.memory_interval}, interval "
                f"{pol.interval}, until {self.seg.until_step}) is not the loop's schedule "
                f"({args.memory_interval}, {args.interval}, {args.until})"
            )
        self.rank, self.world, self.mesh = self.seg.rank, self.seg.world_size, self.seg.mesh
        self.source = "see the run's lineage"

    def steps(self, model: Any, opt: Any) -> Iterator[int]:
        self.seg.track(model=model, optimizer=opt)
        return self.seg.steps(tokens_per_step=self.args.batch * self.args.seq, samples_per_step=self.args.batch)

    def log(self, loss: float) -> None:
        self.seg.log(loss=loss)

    def durable(self, s: int) -> None:
        manifest = Path(self.args.storage) / "checkpoints" / f"step-{s:08d}" / "manifest.json"
        wait_for(manifest.is_file, str(manifest))  # the commit's rename: the checkpoint exists once it is there

    def drain(self) -> None:
        assert self.seg._ckpt is not None
        self.seg._ckpt.wait()  # the save in flight (snapshot, or snapshot + persist) committed


class Plain:
    """torch's or DLRover's loop: a process group of its own, and the same schedule of saves by hand."""

    def __init__(self, args: argparse.Namespace):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.args = args
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,))
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.source = "fresh"
        self.model: Any = None
        self.opt: Any = None

    def steps(self, model: Any, opt: Any) -> Iterator[int]:
        self.model, self.opt = model, opt
        start = self.load() if self.restart else 0
        return self._steps(start)

    def _steps(self, start: int) -> Iterator[int]:
        s = start
        while s < self.args.until:
            yield s
            s += 1
            kind = schedule(s, self.args)
            if kind is not None:
                self.save(kind, s)

    def restore(self, sd: dict[str, Any]) -> int:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return int(sd["step"])

    def log(self, loss: float) -> None:
        pass

    def load(self) -> int:
        raise NotImplementedError

    def save(self, kind: str, s: int) -> None:
        raise NotImplementedError


class Torch(Plain):
    """``dcp.async_save`` at every save step (no memory tier); a restart loads the newest complete checkpoint."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        import torch.distributed as dist

        self.fut: Any = None
        self.pg = dist.new_group(backend="gloo")  # the background save's collectives never meet training's

    def path(self, s: int) -> Path:
        return Path(self.args.storage) / f"step-{s:08d}"

    def load(self) -> int:
        import torch.distributed.checkpoint as dcp

        done = sorted(p for p in Path(self.args.storage).glob("step-*") if (p / ".metadata").is_file())
        if not done:
            return 0
        sd = {**state_dict(self.model, self.opt), "step": 0}
        dcp.load(sd, checkpoint_id=str(done[-1]), process_group=self.pg)
        self.source = "storage"
        return self.restore(sd)

    def save(self, kind: str, s: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.fut is not None:  # at most one in flight (drained already at the boundary before)
            self.fut.result()
        self.fut = dcp.async_save(
            {**state_dict(self.model, self.opt), "step": s}, checkpoint_id=str(self.path(s)), process_group=self.pg
        )

    def durable(self, s: int) -> None:
        self.drain()  # the future completes after every file is written and fsynced and rank 0 wrote .metadata

    def drain(self) -> None:
        if self.fut is not None:
            self.fut.result()
            self.fut = None
            if self.rank == 0:  # keep the newest two complete checkpoints (the disk is not the question here)
                done = sorted(p for p in Path(self.args.storage).glob("step-*") if (p / ".metadata").is_file())
                for old in done[:-2]:
                    shutil.rmtree(old, ignore_errors=True)


class DLRover(Plain):
    """Flash Checkpoint's FSDP engine (the agent of ``dlrover-run`` holds the shared memory and persists it)."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        from dlrover.python.common.constants import CheckpointConstant
        from dlrover.python.common.storage import get_checkpoint_storage
        from dlrover.trainer.torch.flash_checkpoint.fsdp_engine import FsdpCheckpointEngine

        self.name = CheckpointConstant.MODEL_STATES_NAME
        self.tracker = Path(args.storage) / CheckpointConstant.TRACER_FILE_NAME
        self.engine = FsdpCheckpointEngine(args.storage, get_checkpoint_storage(None))
        self.skipped = 0
        self._name_the_rank()
        self._replicated_from_rank0()

    def _name_the_rank(self) -> None:
        """DLRover 0.6.1's FSDP engine leaves the rank out of the config it hands the agent with each snapshot (its
        other engines set it): every shard's done file is then named 0, the agent's commit never counts all shards,
        waits out its 600 s timeout and holds back the next storage save meanwhile. Set it, as they do."""
        from dlrover.python.elastic_agent.torch.ckpt_saver import DLROVER_CKPT_CONFIG_KEY

        meta, rank = self.engine._shm_handler.metadata, self.rank
        set_meta = meta.set

        def set_with_rank(d: dict[str, Any]) -> Any:
            d[DLROVER_CKPT_CONFIG_KEY].rank = rank
            return set_meta(d)

        meta.set = set_with_rank

    @staticmethod
    def _replicated_from_rank0() -> None:
        """DLRover's FSDP engine keeps the values no rank shards (AdamW's step counters) only as rank 0 wrote them
        and hands rank 0's to every rank at a load, as DCP's planner did when it was written (every replicated item
        saved by the lowest rank); DCP now spreads them over the ranks, and the load then misses rank 1's. Its
        snapshots are planned the old way (``dedup_save_to_lowest_rank``); nothing else of its save changes."""
        import torch.distributed.checkpoint as dcp
        from dlrover.trainer.torch.flash_checkpoint import fsdp_engine

        def save_state_dict(state_dict: Any, storage_writer: Any) -> Any:
            planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
            return dcp.save_state_dict(state_dict=state_dict, storage_writer=storage_writer, planner=planner)

        fsdp_engine.dist_cp = type("dcp_lowest_rank", (), {"save_state_dict": staticmethod(save_state_dict)})

    def load(self) -> int:
        import torch.distributed.checkpoint as dcp
        from dlrover.trainer.torch.flash_checkpoint.fsdp_engine import SharedMemoryReader

        reader = self.engine.load()
        if reader is None:
            return 0
        self.source = "memory" if isinstance(reader, SharedMemoryReader) else "storage"
        sd = {**state_dict(self.model, self.opt), "step": 0}
        dcp.load(sd, storage_reader=reader)
        return self.restore(sd)

    def save(self, kind: str, s: int) -> None:
        sd = {**state_dict(self.model, self.opt), "step": s}
        paths = {self.name: str(Path(self.args.storage) / str(s))}
        if kind == "memory":
            if not self.engine.save_to_memory(s, sd, paths):
                self.skipped += 1
        else:
            self.engine.save_to_storage(s, sd, paths)

    def durable(self, s: int) -> None:
        # The agent's commit: every shard written and fsynced (one done file each), then the tracker names the step
        # and the stage dir of done files is removed. (Rank 0's shard writes the tracker too, before the other
        # shards are done: the stage dir is still there then.)
        done = Path(self.args.storage) / "._dlrover_ckpt_stage" / f"{s}.done"

        def committed() -> bool:
            try:
                return self.tracker.read_text().strip() == str(s) and not done.exists()
            except OSError:
                return False

        wait_for(committed, f"DLRover's commit of step {s}")

    def drain(self) -> None:
        pass  # a memory save is synchronous; a storage save was waited for (durable) at its boundary


# --------------------------------------------------------------------------------------------- the loop
def main(argv: list[str] | None = None) -> None:
    import psutil

    args = parse(argv)
    ev = Events(args.events)
    ev(
        "start",
        created=psutil.Process().create_time(),
        system=args.system,
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    side = {"shardkeeper": Shardkeeper, "dlrover": DLRover, "torch": Torch}[args.system](args)
    ev("joined")  # the process group (and the system's own set-up) is there
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    model, opt = build(args, side.mesh)
    ev("built", params=sum(p.numel() for p in model.parameters()))
    it = side.steps(model, opt)
    step = next(it)  # resumes (or starts at 0)
    ev("loaded", step=step, source=side.source)
    bufs = None
    while True:
        loss = train_step(model, opt, step, args, side.rank, side.world)
        side.log(loss)
        s = step + 1
        if side.rank == 0:
            ev("step", s=s, loss=repr(loss))
        kind = schedule(s, args)
        if kind is None and s < args.until:
            side.drain()  # nothing in flight while the copy is timed, nor at the next save
            if bufs is None:  # the reference's buffers, allocated and touched once
                bufs = _create_cpu_state_dict(state_dict(model, opt))
                _copy_state_dict(state_dict(model, opt), bufs)
            dist.barrier()
            t0 = time.perf_counter()
            _copy_state_dict(state_dict(model, opt), bufs)
            ev("copy", s=s, dt=time.perf_counter() - t0)
        dist.barrier()
        t0, w0 = time.perf_counter(), time.time()
        try:
            step = next(it)
        except StopIteration:
            break
        ev("boundary", s=s, kind=kind, dt=time.perf_counter() - t0, skipped=getattr(side, "skipped", 0))
        if kind == "storage":
            side.durable(s)
            ev("durable", s=s, dt=time.time() - w0)
            side.drain()
        if kind == "memory" and s == args.kill_at:
            side.drain()
            dist.barrier()  # the snapshot complete on every rank (each has its own part of it)
            if side.rank == 0:
                ev("kill_point", s=s)
    ev("end", step=s)
    if args.system != "shardkeeper":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
