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
# What `make bench` takes on the reference machine (2 cores, the torture's ~1.5 h included). The Makefile, the README
# and the docs state this figure; tests/test_docs.py fails when one of them says another.
MAKE_BENCH_TIME = "~3.5 h"


def machine() -> str:
    """Cores, memory and the disk the benches write to, in one line."""
    cores = os.cpu_count() or 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    disk = "unknown disk"
    try:
        out = (
            subprocess.run(["df", "--output=source,fstype,size", str(ROOT)], capture_output=True, text=True, timeout=10)
            .stdout.split("\n")[1]
            .split()
        )
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
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--", ".", ":!bench/results", ":!README.md"], cwd=root, timeout=30
            ).returncode
            != 0
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {rev or '?'}{'+changes' if dirty else ''}"


def _public_arg(arg: str, option: str | None) -> str:
    """One argument as published: a path inside the checkout relative to it, any other absolute path as the
    option's name in capitals (``--work /scratch/t`` -> ``--work WORK``), so that no machine's paths show."""
    if arg.startswith("--") and "=" in arg:
        opt, _, val = arg.partition("=")
        return f"{opt}={_public_arg(val, opt)}"
    if not arg.startswith(("/", "~")):
        return arg
    path = Path(arg).expanduser().resolve()
    if path == ROOT or ROOT in path.parents:
        return path.relative_to(ROOT).as_posix() or "."
    return (option or "").lstrip("-").replace("-", "_").upper() or "PATH"


def command_line(argv: list[str]) -> str:
    """``python bench/SCRIPT.py ARGS`` as a reader would type it in a checkout: the script relative to the
    repository, whatever interpreter ran it, machine paths replaced (``_public_arg``)."""
    if not argv:
        return "python ?"
    given = Path(argv[0]).expanduser()
    script = given.resolve()
    if ROOT in script.parents:
        shown = script.relative_to(ROOT).as_posix()
    elif not given.is_absolute() and (ROOT / given).is_file():  # relative to the checkout, run from elsewhere
        shown = given.as_posix()
    else:
        shown = script.name
    words, option = [], None
    for a in argv[1:]:
        words.append(shlex.quote(_public_arg(a, option)))
        if a.startswith("-"):
            option = a.partition("=")[0]
    return " ".join(["python", shown, *words])


def header(argv: list[str] | None = None) -> str:
    """The line every generated table starts with: date, machine, versions and the command that made it."""
    argv = sys.argv if argv is None else argv
    cmd = command_line(argv)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"_Measured {when} on {machine()}; load average {load} (1/5/15 min) when the table was printed; "
        f"{versions()}; {commit()}; command: `{cmd}`_"
    )


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


# --- plots beside the tables: drawn from the published table itself -----------------------------------------------
# A bench that has a plot calls ``plot_from_table`` right after ``publish`` (and ``--plot-only`` calls it alone): the
# figure is drawn from the rows of bench/results/NAME.md as published, so a plot never says something its table
# does not, and re-drawing one never needs the bench to run again.

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
PLOT_COLORS = ("#3f51b5", "#e65100", "#2e7d32", "#8e24aa", "#00838f", "#6d4c41")


def table_rows(name: str, index: int = 0, results: Path | None = None) -> list[dict[str, str]]:
    """The rows of the ``index``-th markdown table of bench/results/NAME.md, each as {column header: cell}."""
    lines = ((results or RESULTS) / f"{name}.md").read_text(encoding="utf-8").splitlines()
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif current:
            tables.append(current)
            current = []
    if index >= len(tables):
        raise ValueError(f"bench/results/{name}.md: no table number {index + 1} (it has {len(tables)})")
    head, _sep, *rows = tables[index]
    return [dict(zip(head, row)) for row in rows]


def numbers(cell: str) -> list[float]:
    """Every number of a table cell, in order: ``'**0.960** (met)'`` -> [0.96], ``'1.29 (1.14–1.36) GB/s'`` ->
    [1.29, 1.14, 1.36], ``'4,096'`` -> [4096.0]."""
    return [float(m.replace(",", "")) for m in _NUMBER.findall(cell.replace("–", " "))]


def spread(cell: str) -> tuple[float, float, float]:
    """``median (min–max)`` of a cell as three numbers; a single value is its own min and max."""
    found = numbers(cell)
    if not found:
        raise ValueError(f"no number in table cell {cell!r}")
    med = found[0]
    lo, hi = (found[1], found[2]) if len(found) >= 3 else (med, med)
    return med, lo, hi


def plot_from_table(
    name: str, draw: Callable[[Any], None], *, size: tuple[float, float] = (7.5, 3.6), results: Path | None = None
) -> Path:
    """Write bench/results/NAME.png: ``draw(figure)`` draws on a matplotlib figure (Agg, no display) from the
    published rows (``table_rows``). The PNG carries no timestamp or version, so the same rows give the same file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(
        {
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.prop_cycle": matplotlib.cycler(color=PLOT_COLORS),
            "axes.grid": True,
            "grid.alpha": 0.3,
            "svg.hashsalt": "shardkeeper",
        }
    ):
        fig = plt.figure(figsize=size, dpi=100)
        try:
            draw(fig)
            fig.tight_layout()
            out = (results or RESULTS) / f"{name}.png"
            tmp = out.with_suffix(".png.tmp")
            fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
            os.replace(tmp, out)
        finally:
            plt.close(fig)
    print(f"plot: {out.relative_to(ROOT) if ROOT in out.parents else out}")
    return out


def hbars(
    ax: Any, labels: list[str], cells: list[str], xlabel: str, *, grey: set[int] = frozenset(), digits: int = 2
) -> None:
    """Horizontal bars of ``median (min–max)`` cells, top to bottom in table order, each labelled with its median;
    the rows in ``grey`` (by index) are the baselines a bench compares with."""
    vals = [spread(c) for c in cells]
    ax.barh(
        labels,
        [v[0] for v in vals],
        color=[PLOT_COLORS[0] if i not in grey else "#9e9e9e" for i in range(len(vals))],
        xerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]],
        capsize=2,
        ecolor="#424242",
    )
    for i, v in enumerate(vals):
        ax.annotate(f"{v[0]:.{digits}f}", (v[2], i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(v[2] for v in vals) * 1.18)
    ax.set_xlabel(xlabel)


def plot_only_requested(argv: list[str] | None = None) -> bool:
    """``--plot-only`` on the command line: redraw the bench's plot from its published table and run nothing else."""
    return "--plot-only" in (sys.argv[1:] if argv is None else argv)
