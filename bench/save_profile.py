"""Where a sync save's time goes, one rank's share of the checkpoint bench's model, in one process (no group).

    python bench/save_profile.py [--gb 1.5] [--threads 2] [--reps 3]

Each part alone, over the same tensors (fp32, the sizes of the 254M-parameter model's shards): torch.save's
serialization into a sink that keeps nothing, xxh3-128 of every byte, the copy into the aligned buffer, the
O_DIRECT writes + fsync of that many bytes (``--threads`` files in parallel, as DCP's writer threads), the whole
hashing O_DIRECT stream (hashing on and off; torch's CRC-32 on, and off as shardkeeper's saves run), and
parallel ``dd oflag=direct conv=fsync`` (same streams). Medians (min–max) of ``--reps`` alternated rounds; printed as a
markdown table and published as bench/results/save-profile.md.
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import fmt, md_table, publish  # noqa: E402

OUT = ROOT / "bench" / "out" / "save-profile"


def tensors(gb: float) -> list:
    """fp32 tensors of the bench model's shard sizes (1024 hidden, 2816 intermediate, 32000 vocab, halved)."""
    import torch

    sizes = [32000 * 1024 // 2] + [2816 * 1024 // 2] * 3 * 16 + [1024 * 1024 // 2] * 3 * 16 + [32000 * 1024 // 2]
    out, total = [], 0
    while total < gb * 1e9:
        for n in sizes:
            out.append(torch.randn(n))
            total += 4 * n
            if total >= gb * 1e9:
                break
    return out


class Null(io.RawIOBase):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # noqa: ANN001
        n = memoryview(b).nbytes
        self.n += n
        return n

    def tell(self) -> int:
        return self.n


def split(ts: list, k: int) -> list[list]:
    return [ts[i::k] for i in range(k)]


def in_threads(fn, parts) -> float:  # noqa: ANN001
    t = time.perf_counter()
    threads = [threading.Thread(target=fn, args=(i, p)) for i, p in enumerate(parts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch
    import xxhash

    from ckpt.formats.dcp import direct_io
    from ckpt.formats.dcp.direct_io import _HashingDirectStream, write_direct

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    ts = tensors(args.gb)
    nbytes = sum(t.numel() * 4 for t in ts)
    parts = split(ts, args.threads)
    res: dict[str, list[float]] = {}

    def serialize(_i: int, p: list) -> None:
        for t in p:
            torch.save(t, Null())

    def serialize_nocrc(_i: int, p: list) -> None:  # what torch.save costs without its CRC-32 of every record
        torch.serialization.set_crc32_options(False)
        try:
            for t in p:
                torch.save(t, Null())
        finally:
            torch.serialization.set_crc32_options(True)

    def hashing(_i: int, p: list) -> None:
        from ckpt.formats.pickle.torchzip import byte_view

        h = xxhash.xxh3_128()
        for t in p:
            h.update(byte_view(t))

    def copying(_i: int, p: list) -> None:
        buf = np.frombuffer(mmap.mmap(-1, direct_io._BUF), dtype=np.uint8)
        for t in p:
            a = t.view(torch.uint8).numpy()
            for s in range(0, len(a), len(buf)):
                np.copyto(buf[: min(len(buf), len(a) - s)], a[s : s + len(buf)])

    def direct(i: int, p: list) -> None:
        n = sum(t.numel() * 4 for t in p)
        buf = mmap.mmap(-1, direct_io._BUF)
        fd = os.open(OUT / f"raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for _ in range(-(-n // direct_io._BUF)):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)

    def stream(hash_on: bool, pipelined: bool = True, crc: bool = True):
        def go(i: int, p: list) -> None:
            _HashingDirectStream.hashing, _HashingDirectStream.pipelined = hash_on, pipelined
            torch.serialization.set_crc32_options(crc)  # this thread's torch.save only
            try:
                write_direct(OUT / f"s-{i}", lambda s: [torch.save(t, s) for t in p])
            finally:
                _HashingDirectStream.hashing, _HashingDirectStream.pipelined = True, True
                torch.serialization.set_crc32_options(True)

        return go

    def dd(_i: int, p: list) -> None:
        n = sum(t.numel() * 4 for t in p)
        subprocess.run(
            [
                "dd",
                "if=/dev/zero",
                f"of={OUT / f'dd-{_i}'}",
                "bs=64M",
                f"count={max(1, round(n / 2**26))}",
                "oflag=direct",
                "conv=fsync",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    sides = {
        "serialize": serialize,
        "serialize_nocrc": serialize_nocrc,
        "hash": hashing,
        "copy": copying,
        "direct": direct,
        "stream_before": stream(True, False),
        "stream": stream(True),
        "stream_nohash": stream(False),
        "stream_nocrc": stream(True, crc=False),
        "dd": dd,
    }
    for i in range(args.reps + 1):
        for name, fn in sides.items():
            dt = in_threads(fn, parts)
            for f in OUT.iterdir():
                f.unlink()
            if i:
                res.setdefault(name, []).append(dt)
    gb = nbytes / 1e9
    labels = {
        "serialize": "torch.save of every tensor into a sink (DCP's serialization, no I/O)",
        "serialize_nocrc": "the same with torch's CRC-32 of each record off (set_crc32_options(False)), for scale",
        "hash": "xxh3-128 of every byte",
        "copy": "copy into the 16 MiB aligned buffer (np.copyto)",
        "direct": "O_DIRECT writes of 16 MiB + fsync (no serialization, hash or copy)",
        "stream_before": "the hashing O_DIRECT stream, before: one buffer, xxh3 of the source, then copy, then write",
        "stream": "the hashing O_DIRECT stream, now: copy + xxh3 per 1 MiB piece while pool threads write "
        "the other two buffers",
        "stream_nohash": "the same, hashing off",
        "stream_nocrc": "the same, hashing on, torch's CRC-32 off (what shardkeeper's DCP saves do now)",
        "dd": "dd oflag=direct conv=fsync (bs=64M)",
    }
    rows = [
        [
            labels[k],
            f"{fmt(v)} s",
            f"{gb / statistics.median(v):.2f} GB/s",
            f"{statistics.median(v) / statistics.median(res['dd']):.2f}x dd",
        ]
        for k, v in res.items()
    ]
    body = md_table(["part", "seconds (median (min–max))", "rate", "vs dd"], rows)
    body += (
        f"\n\n{gb:.2f} GB in {len(ts)} fp32 tensors of the shard sizes of bench/checkpoint_bench.py's model "
        "(a rank there writes 1.5 GB), "
        f"{args.threads} threads (files) in parallel, {args.reps} alternated rounds after a warm-up; one process."
    )
    publish("save-profile", body)
    shutil.rmtree(OUT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
