"""What the bench scripts share: timing after a warm-up, medians with min–max, and the tables the README
includes (``publish``: each with the date, machine, versions and command that produced it)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of ``reps`` calls of ``fn``, after one warm-up call that is not counted. ``clock``
    time.process_time: this process's CPU seconds (what an idle machine would take for single-threaded work)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (flushed first, so the pages are clean and can go): the next
    read comes from the disk. Works without root, unlike /proc/sys/vm/drop_caches."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches(paths: list[Path] | None = None) -> str:
    """Cold cache before a timed read, the same for every side compared: the whole page cache when this process
    may (root: /proc/sys/vm/drop_caches), else ``evict(paths)`` -- give every file any side will read. Returns
    the cache state, for the table."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped (/proc/sys/vm/drop_caches) before each timed read"
    except OSError as e:
        if paths is None:
            return f"page cache NOT dropped ({e.strerror}); every side read in the same (warm) state"
        evict([p for p in paths if p.is_file()])
        return "files read evicted from the page cache (posix_fadvise DONTNEED; no root) before each timed read"


def fmt(samples: list[float] | None, digits: int = 2) -> str:
    """``median (min–max)``; ``n/a`` when nothing was measured."""
    if not samples:
        return "n/a"
    return f"{statistics.median(samples):.{digits}f} ({min(samples):.{digits}f}–{max(samples):.{digits}f})"


# --- tables the README includes: every table carries when, where and how it was measured ---------------------

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def machine() -> str:
    """Cores, memory and the disk the benches write to, in one line."""
    cores = os.cpu_count() or 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    disk = "unknown disk"
    try:
        out = subprocess.run(["df", "--output=source,fstype,size", str(ROOT)], capture_output=True,
                             text=True, timeout=10).stdout.split("\n")[1].split()
        dev = Path(out[0]).name
        rot = Path(f"/sys/block/{dev}/queue/rotational")
        kind = "" if not rot.is_file() else (" rotational" if rot.read_text().strip() == "1" else " non-rotational")
        disk = f"{out[0]} {out[1]} {int(out[2]) / 2**20:.0f} GiB{kind}"
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", {torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cores} CPU cores, {mem:.1f} GiB memory, {disk}{gpu}"


def versions() -> str:
    out = [f"python {platform.python_version()}"]
    for mod in ("torch", "deepspeed", "safetensors", "transformers"):
        try:
            out.append(f"{mod} {importlib.metadata.version(mod)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def commit() -> str:
    """The checkout's commit, ``+changes`` when tracked files differ from it (SHARDKEEPER_BENCH_COMMIT names it
    where the tree was copied without its git history, e.g. onto a GPU node)."""
    if os.environ.get("SHARDKEEPER_BENCH_COMMIT"):
        return f"commit {os.environ['SHARDKEEPER_BENCH_COMMIT']}"
    root = ROOT
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":!bench/results", ":!README.md"],
                               cwd=root, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {rev or '?'}{'+changes' if dirty else ''}"


def header(argv: list[str] | None = None) -> str:
    """The line every generated table starts with: date, machine, versions and the command that made it."""
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), ROOT) if argv else "?"
    cmd = " ".join(["python", script, *(shlex.quote(a) for a in argv[1:])])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"_Measured {when} on {machine()}; load average {load} (1/5/15 min) when the table was printed; "
            f"{versions()}; {commit()}; command: `{cmd}`_")


def publish(name: str, body: str, argv: list[str] | None = None) -> Path:
    """Print a table (markdown ``body``) under its header and keep it as bench/results/NAME.md, from where
    ``python bench/readme_tables.py`` copies it into the README between ``<!-- bench:NAME -->`` markers."""
    if not re.fullmatch(r"[a-z0-9_-]+", name):
        raise ValueError(f"table name {name!r}: use lowercase letters, digits, '-' and '_'")
    text = header(argv) + "\n\n" + body.strip() + "\n"
    print("\n" + text)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def md_table(head: list[str], rows: list[list[Any]] | list[tuple[Any, ...]], align: str | None = None) -> str:
    """A markdown table; ``align`` one character per column ('l' or 'r')."""
    align = align or "l" * len(head)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
