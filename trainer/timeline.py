"""When this rank reached each phase of its segment: process start, imports, process group, model built,
checkpoint loaded and verified, first optimizer step, and on a preemption the stop signal, the committed
emergency checkpoint and the end. Rank 0 turns every rank's marks into the report's ``SegmentTimes``
(``schemas.seam``): seconds since the launcher started the ranks, as the slower rank saw each phase.

Stdlib only at import: ``trainer.lifetime`` marks a stop signal that arrives before torch is imported.
Marks are Unix times (``time.time()``), so ranks of one host compare directly; the first mark of a name wins.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_marks: dict[str, float] = {}

# the marks the ranks' code sets, in SegmentTimes' names; "stop_signal" is reduced with min (the first rank
# that saw it started the preemption), every other mark with max (the phase is reached when every rank is)
MARKS = (
    "ranks_started",
    "imports",
    "process_group",
    "model_built",
    "loaded",
    "first_step",
    "stop_signal",
    "emergency_saved",
    "closed",
)


def mark(name: str, at: float | None = None) -> None:
    """This rank reached ``name`` now (or at ``at``); a later mark of the same name is ignored."""
    _marks.setdefault(name, time.time() if at is None else at)


def begin_segment() -> None:
    """A second segment in the same process (a test harness): forget the previous one's phases."""
    if "process_group" in _marks:
        for name in [n for n in _marks if n not in ("imports", "stop_signal")]:
            del _marks[name]


def process_start_time(pid: int | None = None) -> float | None:
    """Unix time at which process ``pid`` (default: this one) started, from /proc (clock-tick resolution)."""
    try:
        raw = Path(f"/proc/{pid or os.getpid()}/stat").read_bytes()
        ticks = int(raw[raw.rfind(b")") + 2 :].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def local_marks() -> dict[str, float]:
    """This rank's marks, with its process start."""
    start = process_start_time()
    if start is not None:
        mark("ranks_started", start)
    return dict(_marks)


def summarize(per_rank: list[dict[str, float]], launched_at: float | None) -> Any:
    """``SegmentTimes`` from every rank's marks: seconds since ``launched_at`` (else since the earliest rank start)."""
    from schemas.seam import SegmentTimes

    starts = [m["ranks_started"] for m in per_rank if "ranks_started" in m]
    if launched_at is not None:
        origin, origin_time = "launcher", launched_at
    elif starts:
        origin, origin_time = "ranks", min(starts)
    else:
        return None
    out: dict[str, float | None] = {}
    for name in MARKS:
        seen = [m[name] for m in per_rank if name in m]
        # a phase counts as reached when every rank reached it (a stop signal: when the first rank saw it)
        if name == "stop_signal":
            out[f"{name}_s"] = round(min(seen) - origin_time, 3) if seen else None
        else:
            out[f"{name}_s"] = round(max(seen) - origin_time, 3) if len(seen) == len(per_rank) else None
    return SegmentTimes(origin=origin, origin_time=origin_time, **out)  # type: ignore[arg-type]
