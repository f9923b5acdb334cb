"""What every launcher shares: the request a controller hands a launcher, the outcome it gets back, the
``Launcher`` interface, and how a launcher reads torchrun's output (which lines are a rank's, which are
torchrun's closing noise, which line names a rank's failure).

A launcher turns a ``LaunchRequest`` into ranks that receive a ``schemas.seam.SegmentLaunch`` (written to
the run directory; its path in ``SHARDKEEPER_LAUNCH``) and, when they end, a ``SegmentReport`` read back by
the controller. Slurm and Kubernetes launchers plug in here without new channels to the ranks.
Stdlib and schemas only: no torch, no prefect.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from schemas import ClusterTopology
from schemas.seam import RANK_ERROR_PREFIX, SegmentLaunch

LogSink = Callable[[str], None]
CancelCheck = Callable[[], bool]
RANK_LINE_RE = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]")
# torchrun's own log lines, e.g. "W1122 10:00:00.123000 4242 .../torch/distributed/elastic/agent/server/api.py:725] ..."
TORCHRUN_LOG_RE = re.compile(r"^\[?[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/")
TORCHRUN_SUMMARY = ("ChildFailedError", "torch.distributed.elastic", "Root Cause", "Failures:", "====")
_ERROR_RE = re.compile(r"(^|\s)(error:|\w*(Error|Exception|Mismatch)\b)|Traceback")


@dataclass(frozen=True)
class LaunchRequest:
    run_dir: Path
    until_step: int
    segment: int
    topology: ClusterTopology
    timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = False  # the controller set the run's invalid checkpoints aside: the ranks start at step 0
    # Polled ~4x a second: when it returns True the ranks are stopped (SIGTERM: they commit a
    # checkpoint) and the outcome is 'cancelled'. Also asked after a stop signal, to tell a
    # cancellation (a Prefect runner cancels by SIGTERM) from a preemption.
    cancel_check: CancelCheck | None = None

    def seam(self, launcher_pid: int | None) -> SegmentLaunch:
        """What the ranks of this request receive."""
        return SegmentLaunch(run_dir=str(Path(self.run_dir).resolve()), until_step=self.until_step,
                             segment=self.segment, topology=self.topology, restart=self.restart,
                             launcher_pid=launcher_pid)


@dataclass(frozen=True)
class LaunchOutcome:
    exit_code: int
    timed_out: bool
    tail: list[str]  # last lines of output, for the failure report
    seconds: float
    cancelled: bool = False  # stopped because cancel_check said so (or it said so after a stop signal)
    stop_signal: int | None = None  # the signal the launching process received (and turned into a stop)
    held_back: list[str] = field(default_factory=list)  # torchrun's closing lines, not streamed to the sink

    @property
    def stop_requested(self) -> bool:
        """The launcher asked the ranks to stop (signal, cancellation or timeout)."""
        return self.timed_out or self.cancelled or self.stop_signal is not None


class Launcher(Protocol):
    name: str

    def max_world_size(self) -> int | None:
        """Largest world size this launcher can give now (None = unknown/unbounded)."""

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        """Run one segment to its end and report how it ended."""




def _closing_cut(lines: list[str]) -> int:
    """Index where torchrun's closing starts: its summary, or the traceback of its own that leads to it."""
    cut = len(lines)
    for i, line in enumerate(lines):
        if any(marker in line for marker in TORCHRUN_SUMMARY):
            cut = i
            break
    for j in range(cut - 1, -1, -1):  # torchrun's own traceback that leads to its summary
        if lines[j].startswith("Traceback"):
            if any("distributed/run.py" in ln or "elastic" in ln for ln in lines[j:cut]):
                cut = j
            break
    return cut


def failing_rank_lines(tail: list[str], limit: int = 8) -> str:
    """The failing rank's own error lines: torchrun's closing summary (which only says a child failed)
    is cut off first, so it cannot push the real exception out of the window. A rank's own one-line
    cause (``RANK_ERROR_PREFIX``) wins: the first one printed, since the others usually follow from it."""
    for line in tail:
        at = line.find(RANK_ERROR_PREFIX)
        if at >= 0:
            return line[at + len(RANK_ERROR_PREFIX):].strip()
    body = tail[:_closing_cut(tail)] or tail
    errs = [ln for ln in body if _ERROR_RE.search(ln)]
    return "\n".join((errs or body)[-limit:])


def without_torchrun_closing(lines: list[str]) -> list[str]:
    """Held-back lines worth showing when the segment did not fail: torchrun's log lines and its closing
    traceback + summary (a ChildFailedError or SignalException that only says the ranks stopped) removed."""
    return [ln for ln in lines[:_closing_cut(lines)] if not TORCHRUN_LOG_RE.search(ln)]
