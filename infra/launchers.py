"""Launchers start the ranks of one segment and supervise them.

The interface is small so Slurm and Kubernetes launchers fit beside the local one without touching
flows: ``launch(request) -> LaunchOutcome``. The local launcher runs torchrun as a supervised
subprocess in its own process group: its output is streamed line by line to a sink (the CLI's
console or a Prefect task's logger), SIGTERM/SIGINT received by the caller are forwarded to every
rank (that is what a preemption looks like), and a segment that runs past its timeout is stopped.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from schemas import ClusterTopology

LogSink = Callable[[str], None]
_RANK_RE = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]")


@dataclass(frozen=True)
class LaunchRequest:
    run_dir: Path
    until_step: int
    segment: int
    topology: ClusterTopology
    timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchOutcome:
    exit_code: int
    timed_out: bool
    tail: list[str]  # last lines of output, for the failure report
    seconds: float


class Launcher(Protocol):
    name: str

    def max_world_size(self) -> int | None:
        """Largest world size this launcher can give now (None = unknown/unbounded)."""

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        """Run one segment to its end and report how it ended."""


def _forward_signals(proc: subprocess.Popen) -> dict[int, object]:
    """Forward SIGTERM/SIGINT/SIGUSR1 to the child's process group (only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, _frame: object) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM if signum == signal.SIGINT else signum)
        except ProcessLookupError:
            pass

    return {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}


class LocalTorchrun:
    """Ranks on this machine through ``python -m torch.distributed.run --standalone``."""

    name = "local"

    def __init__(self, python: str | None = None, grace_s: float = 60.0):
        self.python = python or sys.executable
        self.grace_s = grace_s

    def max_world_size(self) -> int | None:
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.device_count()
        except ImportError:
            pass
        return max(8, 4 * (os.cpu_count() or 1))

    def command(self, req: LaunchRequest) -> list[str]:
        # Positional arguments only: torchrun claims options that prefix its own (--log, --start, ...).
        return [self.python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={req.topology.procs_per_node}",
                "-m", "trainer.segment", str(req.run_dir), str(req.until_step), str(req.segment)]

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1",
               "SHARDKEEPER_LAUNCHER": self.name, **req.env}
        if req.topology.device_type == "cpu":
            env["SHARDKEEPER_DEVICE"] = "cpu"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.monotonic()
        proc = subprocess.Popen(self.command(req), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, env=env, start_new_session=True)
        previous = _forward_signals(proc)
        tail: collections.deque[str] = collections.deque(maxlen=60)
        timed_out = threading.Event()
        timer = threading.Timer(req.timeout_s, self._stop, (proc, timed_out)) if req.timeout_s else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                sink(line)
            code = proc.wait()
        finally:
            if timer:
                timer.cancel()
            for sig, prev in previous.items():
                signal.signal(sig, prev)  # type: ignore[arg-type]
            if proc.poll() is None:
                self._kill(proc)
        return LaunchOutcome(exit_code=code, timed_out=timed_out.is_set(), tail=list(tail), seconds=time.monotonic() - t0)

    def _stop(self, proc: subprocess.Popen, flag: threading.Event) -> None:
        """Timeout: ask for a checkpoint (SIGTERM), then kill the group after the grace period."""
        flag.set()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            self._kill(proc)
        except ProcessLookupError:
            pass

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


LAUNCHERS: dict[str, Callable[[], Launcher]] = {"local": LocalTorchrun}


def get_launcher(name: str) -> Launcher:
    try:
        return LAUNCHERS[name]()
    except KeyError:
        raise ValueError(f"launcher {name!r} is not available here; choose one of {sorted(LAUNCHERS)}") from None


# A rank that fails writes its cause as one line with this prefix, last, on stderr (trainer.segment.main).
RANK_ERROR_PREFIX = "shardkeeper-error:"
_TORCHRUN_SUMMARY = ("ChildFailedError", "torch.distributed.elastic", "Root Cause", "Failures:", "====")
_ERROR_RE = re.compile(r"(^|\s)(error:|\w*(Error|Exception|Mismatch)\b)|Traceback")


def failing_rank_lines(tail: list[str], limit: int = 8) -> str:
    """The failing rank's own error lines: torchrun's closing summary (which only says a child failed)
    is cut off first, so it cannot push the real exception out of the window. A rank's own one-line
    cause (``RANK_ERROR_PREFIX``) wins: the first one printed, since the others usually follow from it."""
    for line in tail:
        at = line.find(RANK_ERROR_PREFIX)
        if at >= 0:
            return line[at + len(RANK_ERROR_PREFIX):].strip()
    cut = len(tail)
    for i, line in enumerate(tail):
        if any(marker in line for marker in _TORCHRUN_SUMMARY):
            cut = i
            break
    for j in range(cut - 1, -1, -1):  # torchrun's own traceback that leads to its summary
        if tail[j].startswith("Traceback"):
            if any("distributed/run.py" in ln or "elastic" in ln for ln in tail[j:cut]):
                cut = j
            break
    body = tail[:cut] or tail
    errs = [ln for ln in body if _ERROR_RE.search(ln)]
    return "\n".join((errs or body)[-limit:])
