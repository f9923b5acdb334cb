"""Preemption: a signal on any rank becomes an agreement of all ranks at a step boundary.

The per-step agreement runs in the background of the next step (``start_agree``/``finish_agree``), so a signal is
acted on one step later than it would be with a blocking collective; a step that saves agrees blocking first.

A signal that arrived during start-up (recorded by trainer.lifetime before torch was imported)
counts as if it arrived after ``install()``: the first agreement stops the segment.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

from trainer import lifetime, timeline

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    """Install handlers that only set a flag; ``should_stop()`` is a collective (MAX over ranks)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._flag = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._pending: tuple[torch.Tensor, Any] | None = None  # an agreement in flight (start_agree)

    def install(self) -> PreemptionWatcher:
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        early = lifetime.stop_requested()
        if early is not None:
            self._handle(early, None)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        timeline.mark("stop_signal")  # an early signal keeps the time lifetime recorded it at
        self.signum = signum
        self._flag.set()

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]

    def agree(self, flag: bool) -> tuple[bool, bool]:
        """One collective for two questions (MAX over ranks): did any rank get a stop signal, and is ``flag`` set
        on any rank?"""
        both = torch.tensor([1 if self._flag.is_set() else 0, 1 if flag else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return bool(both[0].item()), bool(both[1].item())

    def start_agree(self, flag: bool) -> None:
        """``agree`` without waiting: the all-reduce runs while the next step computes; ``finish_agree`` (at the next
        step boundary, or before anything that must not race a stop or a non-finite step) returns its answer."""
        both = torch.tensor([1 if self._flag.is_set() else 0, 1 if flag else 0], dtype=torch.int32)
        work = (
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if self.group is not None
            else None
        )
        self._pending = (both, work)

    def finish_agree(self) -> tuple[bool, bool]:
        """The answer of the agreement ``start_agree`` began ((False, False) when none is in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False, False
        both, work = pending
        if work is not None:
            work.wait()
        return bool(both[0].item()), bool(both[1].item())

    def should_stop(self) -> bool:
        flag = torch.tensor([1 if self._flag.is_set() else 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
