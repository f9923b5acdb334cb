"""What the bench scripts share: timing after a warm-up, and medians with min–max for the tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of ``reps`` calls of ``fn``, after one warm-up call that is not counted."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fmt(samples: list[float] | None, digits: int = 2) -> str:
    """``median (min–max)``; ``n/a`` when nothing was measured."""
    if not samples:
        return "n/a"
    return f"{statistics.median(samples):.{digits}f} ({min(samples):.{digits}f}–{max(samples):.{digits}f})"
