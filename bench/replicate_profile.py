"""Where the peer-node copy of a memory snapshot goes: one rank's share, sent by one process, received by another.

    python bench/replicate_profile.py [--gb 0.46] [--reps 5] [--memory-dir /dev/shm/...]

Two processes on this host (a gloo group on loopback, as bench/memtier_bench.py's node-loss rows): process 0 holds a
file of ``--gb`` GB in a tmpfs dir, as a node's memory snapshot holds the lost node's files; process 1 receives it
into a fresh dir. Sides, alternated round by round (each round starts one side later), after one warm-up round:

* the copy as a restore runs it (``ckpt.memtier.replicate.send`` / ``receive``: the sender maps, hashes and sends,
  the receiver receives, hashes and writes, 32 MiB chunks pipelined);
* the same without the receiver's write (its writes skipped);
* the same without either side's hash (the digests taken as matching);
* gloo alone: the same bytes in the same chunks between buffers already in memory (no file, no hash).

The time of a side is the receiver's, from a barrier to the last byte handled. Medians (min-max); printed as a
markdown table and published as bench/results/replicate-profile.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import fmt, md_table, publish  # noqa: E402

SIDES = ("copy", "no_write", "no_hash", "gloo")
LABELS = {
    "copy": "the copy as a restore runs it: map + xxh3 + send / receive + xxh3 + write",
    "no_write": "the same, the receiver's writes skipped",
    "no_hash": "the same, neither side hashing",
    "gloo": "gloo alone: the same bytes and chunks between buffers already in memory",
}


class _AnyDigest:
    """An xxh3 stand-in that hashes nothing and reports the expected digest (the 'no_hash' side)."""

    expected = ""

    def update(self, _data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return self.expected


def worker(src: str, dst: str, entry: dict, reps: int) -> dict[str, list[float]]:
    """One of the two ranks (``tests.harness.spawn`` sets its environment); returns the receiver's times per side."""
    import torch
    import torch.distributed as dist

    from ckpt.memtier import replicate
    from schemas import FileEntry

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    files = [FileEntry(**entry)]
    size = files[0].size
    chunks = [(off, min(replicate.CHUNK, size - off)) for off in range(0, size, replicate.CHUNK)]
    whole = torch.ones(size, dtype=torch.uint8) if rank == 0 else None
    bufs = [torch.ones(replicate.CHUNK, dtype=torch.uint8) for _ in range(3)] if rank == 1 else []
    write, xxh = replicate._In._write, replicate.xxhash

    def gloo_alone() -> None:
        pending = []
        for k, (off, n) in enumerate(chunks):
            if rank == 0:
                assert whole is not None
                pending.append(dist.isend(whole[off : off + n], dst=1))
            else:
                pending.append(dist.irecv(bufs[k % 3][:n], src=0))
            if len(pending) > 2:
                pending.pop(0).wait()
        for req in pending:
            req.wait()

    def one(side: str) -> float:
        replicate._In._write = (lambda *_a: None) if side == "no_write" else write  # type: ignore[method-assign]
        _AnyDigest.expected = entry["xxh3_128"]
        replicate.xxhash = type("NoHash", (), {"xxh3_128": _AnyDigest}) if side == "no_hash" else xxh
        if rank == 1:
            shutil.rmtree(dst, ignore_errors=True)
            os.makedirs(dst)
        dist.barrier()
        t = time.perf_counter()
        if side == "gloo":
            gloo_alone()
        elif rank == 0:
            problem = replicate.send(Path(src), files, 1, None, {})
            assert problem is None, problem
        else:
            problem = replicate.receive(Path(dst), files, 0, None, {})
            assert problem is None, problem
        took = time.perf_counter() - t
        dist.barrier()
        return took

    times: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(reps + 1):
        for side in SIDES[r % len(SIDES) :] + SIDES[: r % len(SIDES)]:
            took = one(side)
            if r:  # the first round warms up (imports, first maps, the allocator)
                times[side].append(took)
    replicate._In._write, replicate.xxhash = write, xxh  # type: ignore[method-assign]
    dist.destroy_process_group()
    return times


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import xxhash

    from tests.harness import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.46, help="bytes of the file copied (one rank's share)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory-dir", default=f"/dev/shm/shardkeeper-replicate-{os.getpid()}")
    args = ap.parse_args(argv)
    if args.gb <= 0 or args.reps < 1:
        print("error: --gb must be > 0 and --reps >= 1", file=sys.stderr)
        return 2
    base = Path(args.memory_dir)
    src, dst = base / "node0", base / "node1"
    shutil.rmtree(base, ignore_errors=True)
    src.mkdir(parents=True)
    try:
        size = int(args.gb * 1e9)
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
        (src / "__1_0.distcp").write_bytes(data)
        entry = {"path": "__1_0.distcp", "size": size, "xxh3_128": xxhash.xxh3_128_hexdigest(data), "rank": 1}
        del data
        times = spawn(worker, 2, str(src), str(dst), entry, args.reps, timeout=1200)[1]  # the receiver's
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [[LABELS[s], f"{fmt(times[s], 3)} s", f"{args.gb / statistics.median(times[s]):.2f} GB/s"] for s in SIDES]
    body = md_table(["side", "time, median (min–max)", "rate at the median"], rows, "lrr")
    body += (
        f"\n\n- {args.gb:.2f} GB, one file in {base.parent} (tmpfs), {args.reps} rounds alternated after a warm-up "
        "round; the receiver's time from a barrier; two processes on this host, gloo over loopback"
    )
    publish("replicate-profile", body, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
