"""A small spawn harness: run a function on N real gloo ranks on CPU (like DCP's own tests)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, queue: Any, device: str) -> None:
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SHARDKEEPER_DEVICE": device, "OMP_NUM_THREADS": "1",
    })
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(*args)))
    except BaseException as e:  # report, do not hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300,
          on_start: Callable[[list[mp.Process]], None] | None = None, device: str = "cpu") -> list[Any]:
    """Run ``fn(*args)`` on ``world`` ranks; return the per-rank results, or raise with the first error."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, device), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    if on_start:
        on_start(procs)
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, kind, value = queue.get(timeout=timeout)
            if kind == "error":
                errors.append(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
