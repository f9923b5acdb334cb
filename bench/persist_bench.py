"""The memory tier's persist: one rank's snapshot file copied from the memory dir into a storage ``.partial``, the way
the ranks do it (``ckpt.formats.dcp.direct_io.copy_file``: read into the O_DIRECT hashing stream's staging buffers,
written around the page cache) against the buffered copy it replaced (``ckpt.memtier.persist._copy_buffered``: read,
hash, buffered write, fsync).

    python bench/persist_bench.py                  # ~1 min; publishes bench/results/memtier-persist.md
    python bench/persist_bench.py --mb 100 --reps 2 --no-publish

What a persist costs training is the CPU it takes from it (the ranks train while their persist runs in the
background): the table gives each copy's wall time, the copying process's CPU time and the whole machine's busy CPU
time during it (/proc/stat: the kernel's writeback threads included). Both sides alternate, each after a sync and
the same pause, from the same tmpfs file into the same storage folder (bench/out/persist); the copy is removed
after each one.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

REST_S = 2.0


def busy_cpu_s() -> float:
    """CPU seconds every core spent busy so far (/proc/stat's first line, idle and iowait excluded)."""
    with open("/proc/stat", encoding="ascii") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=470, help="file size (the 77M-parameter bench model's rank share: 470)")
    ap.add_argument("--reps", type=int, default=5, help="alternated copies of each kind")
    ap.add_argument("--memory-dir", default=f"/dev/shm/shardkeeper-persist-bench-{os.getpid()}")
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()

    from benchlib import fmt, md_table

    from ckpt.formats.dcp.direct_io import copy_file
    from ckpt.memtier.persist import _copy_buffered

    src_dir, out = Path(args.memory_dir), ROOT / "bench" / "out" / "persist"
    src_dir.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    src = src_dir / "__0_0.distcp"
    block = os.urandom(1 << 20)
    with open(src, "wb") as fh:
        for _ in range(args.mb):
            fh.write(block)
    kinds = {"O_DIRECT hashing stream (copy_file)": copy_file, "buffered read + write + fsync": _copy_buffered}
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    try:
        for r in range(args.reps):
            for name in list(kinds) if r % 2 == 0 else list(reversed(kinds)):
                dst = out / f"copy-{r}"
                os.sync()
                time.sleep(REST_S)
                ru0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), busy_cpu_s(), time.perf_counter()
                size, _ = kinds[name](src, dst)
                wall, c1, ru1 = time.perf_counter() - t0, busy_cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
                assert size == args.mb << 20, size
                proc = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
                got[name].append((wall, proc, c1 - c0))
                dst.unlink()
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    direct, buffered = (got[k] for k in kinds)
    rows = []
    for name, v in got.items():
        rows.append(
            [
                name,
                f"{fmt([x[0] for x in v], 2)} s",
                f"{fmt([x[1] for x in v], 2)} s",
                f"{fmt([x[2] for x in v], 2)} s",
                f"{args.mb / statistics.median(x[0] for x in v) / 1024:.2f} GiB/s",
            ]
        )
    ratio = lambda i: statistics.median(x[i] for x in buffered) / statistics.median(x[i] for x in direct)  # noqa: E731
    body = md_table(
        [
            "copy of one rank's snapshot file",
            "wall, median (min–max)",
            "copying process CPU",
            "machine busy CPU",
            "rate",
        ],
        rows,
    )
    body += (
        f"\n\n- {args.mb} MiB from tmpfs ({src_dir.parent}) to storage (bench/out/persist), {args.reps} of each "
        f"alternated, each after a sync and a {REST_S:.0f} s pause; the stream is {ratio(0):.1f}x faster and takes "
        f"{ratio(2):.1f}x less of the machine's CPU (what a background persist takes from training)"
    )
    if args.no_publish:
        print(body)
        return
    from benchlib import publish

    publish("memtier-persist", body)


if __name__ == "__main__":
    main()
