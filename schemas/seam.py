"""The seam between the controller (``shardkeeper train``, a Prefect task, a Slurm or Kubernetes job) and
the ranks of one segment: one schema each way, the exit codes, and the files that carry them.

- To the ranks: ``SegmentLaunch``, written by the launcher (atomically) to ``RUN_DIR/.segment-launch.json``;
  its path reaches every rank in one environment variable, ``SHARDKEEPER_LAUNCH``. Every launcher hands the
  ranks this and nothing else of its own (torchrun's RANK/WORLD_SIZE/MASTER_* aside).
- Back: ``SegmentReport``, written by rank 0 to ``RUN_DIR/.segment-status.json`` when the segment ends.
- The process exit code of a rank, of torchrun and of ``shardkeeper train``: ``EXIT_*`` below.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.data import PreparedData
from schemas.errors import RunDirError, ShardkeeperError
from schemas.run import ClusterTopology

EXIT_COMPLETED = 0
EXIT_FAILED = 1  # failed (the failing rank's cause is shown); also a signal-killed torchrun or rank, or any other code
EXIT_REFUSED = 2  # bad input, refused in one line before a step trained (segment 'refused'; status unchanged)
EXIT_NONFINITE = 65  # EX_DATAERR: the loss or gradient norm became NaN/Inf; nothing of that step was committed
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", what a scheduler's requeue means
EXIT_CANCELLED = 130  # 128 + SIGINT: the shell's "stopped on request" (an orchestrator's cancellation)

# The launcher asks a rank for its Python stacks with this signal (faulthandler, see SegmentLaunch.stacks_dir).
# Ignored by default: a rank that is not listening yet is not harmed by it.
STACKS_SIGNAL = signal.SIGURG

LAUNCH_FILE = ".segment-launch.json"
REPORT_FILE = ".segment-status.json"
LAUNCH_ENV = "SHARDKEEPER_LAUNCH"  # absolute path of the SegmentLaunch file, set for every rank
NODE_ENV = "SHARDKEEPER_NODE_NAME"  # a node's name for its memory tier dir (set per agent when one host runs several)
# A rank that fails writes its cause as one line with this prefix, last, on stderr; the launcher shows it.
RANK_ERROR_PREFIX = "shardkeeper-error:"
# The node's agent (trainer.agent) says each in-place restart of its ranks (checkpoint.restarts) as one line with this
# prefix and a JSON object (restart, of, rank, cause, line) on its stderr; every launcher reads it from the output.
RESTART_PREFIX = "shardkeeper-restart:"
# Set by the node's agent for its ranks: a folder where a rank whose failure only follows another's (a collective
# that lost its peer or timed out) leaves a note (``consequence-RANK``), so that the agent restarts the ranks in place
# for it; a rank that fails without one failed for a cause of its own, which is never restarted.
RANK_NOTES_ENV = "SHARDKEEPER_RANK_NOTES"
# A user's script (shardkeeper train --script) that raised: the first failing rank writes the script's own
# traceback (its frames, not shardkeeper's) here; the controller shows it above the one-line failure. A rank whose
# error is only a consequence of another rank's end (a collective that lost its peer) writes none.
SCRIPT_TRACEBACK_FILE = ".script-traceback.txt"

# What a rank's error says when it is the consequence of another rank's end, not a cause of its own: the
# collective (gloo, NCCL) or the rendezvous store lost its peer, or waited for it until its timeout. Matched
# against the error's text (gloo's errors are plain RuntimeErrors), first match wins; the phrase is what the
# segment's failure line shows for that rank.
_COLLECTIVE_ERRORS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.I), phrase)
    for p, phrase in (
        (r"connection reset by peer", "connection reset by peer"),
        (r"connection closed by peer", "connection closed by peer"),
        (r"broken pipe", "broken pipe"),
        (r"failed to recv, got 0 bytes|recv.*got 0 bytes", "connection closed by peer"),
        (
            r"ncclRemoteError|remote process exited|NCCL communicator was aborted|NCCL.*(aborted|abort)",
            "NCCL communicator aborted (a peer is gone)",
        ),
        (
            r"Watchdog caught collective operation timeout|Timed out waiting|Socket Timeout|timed out in|"
            r"DistBackendError.*timeout|operation timed out",
            "timed out waiting in a collective",
        ),
        (r"connection refused", "connection refused"),
        (r"DistNetworkError", "network error in a collective"),
    )
)


def collective_error(text: str) -> str | None:
    """The short phrase for an error that only says a collective lost its peer (or timed out waiting for it),
    e.g. "connection reset by peer"; None for an error that is a cause of its own."""
    for pattern, phrase in _COLLECTIVE_ERRORS:
        if pattern.search(text):
            return phrase
    return None


ReportedStatus = Literal["completed", "preempted", "cancelled", "failed"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SegmentLaunch(_Frozen):
    """What a launcher hands the ranks of one segment."""

    run_dir: str = Field(description="absolute run directory (holds run.yaml)")
    until_step: int = Field(ge=0, description="train until this optimizer step, then commit a checkpoint")
    segment: int = Field(ge=0, description="segment index within the run")
    topology: ClusterTopology = Field(description="what the launcher allocated: nodes, procs per node, device")
    restart: bool = Field(False, description="the controller set the run's invalid checkpoints aside: start at 0")
    launcher_pid: int | None = Field(
        None,
        ge=1,
        description="pid of the process holding the run lock; the ranks stop when it dies (None: no watchdog on it)",
    )
    data: PreparedData | None = Field(
        None,
        description="data.source 'dataset': the token files the controller "
        "prepared (the ranks only open them) and their content keys",
    )
    launched_at: float | None = Field(
        None,
        description="Unix time at which the launcher started the ranks' "
        "processes (torchrun); the origin of the segment's SegmentTimes (None: "
        "the earliest rank start is)",
    )
    stacks_dir: str | None = Field(
        None,
        description="a folder on the launcher's host where each rank writes its "
        "Python stacks (rank-R.txt) when the launcher sends it STACKS_SIGNAL: ranks that "
        "do not stop within the grace are named with where they were (None: not asked)",
    )

    @property
    def device(self) -> str:
        return self.topology.device_type

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / LAUNCH_FILE
        _atomic_write(path, self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> SegmentLaunch:
        try:
            return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            first = " ".join(str(e).split())[:200]
            raise RunDirError(
                f"{path}: not a readable segment launch ({first}); start the segment through "
                "shardkeeper train (or unset SHARDKEEPER_LAUNCH when running torchrun by hand)"
            ) from None

    @classmethod
    def from_environ(cls) -> SegmentLaunch | None:
        """The launch of this rank (None when started by hand, without a launcher)."""
        path = os.environ.get(LAUNCH_ENV)
        return cls.read(path) if path else None


# The start-up phases of a segment, in the order every rank passes them (SegmentTimes' fields, ``*_s``).
START_PHASES = ("ranks_started", "imports", "process_group", "model_built", "loaded", "first_step")


class SegmentTimes(_Frozen):
    """When the segment reached each phase, in seconds since ``origin``, as the slower rank saw it (the phase is
    reached when every rank has reached it). Wall-clock times of one host's clock: on several nodes they
    include the nodes' clock skew. A phase the segment never reached is None."""

    origin: Literal["launcher", "ranks"] = Field(
        description="t = 0: the launcher starting the ranks' processes "
        "(SegmentLaunch.launched_at), or the earliest rank's process start"
    )
    origin_time: float = Field(description="Unix time of t = 0")
    ranks_started_s: float | None = Field(None, description="every rank's process exists (torchrun's start-up before)")
    imports_s: float | None = Field(None, description="the rank's modules imported (torch, transformers, ...)")
    process_group_s: float | None = Field(None, description="the process group (and the gloo side groups) is up")
    model_built_s: float | None = Field(None, description="model built and sharded, optimizer and Checkpointer made")
    loaded_s: float | None = Field(
        None,
        description="the checkpoint verified (checksums) and loaded (fingerprint and "
        "counters checked), or the fresh state ready",
    )
    first_step_s: float | None = Field(None, description="the first optimizer step of the segment done on every rank")
    stop_signal_s: float | None = Field(None, description="the first rank's Python handler saw SIGTERM/SIGUSR1")
    emergency_saved_s: float | None = Field(None, description="the preemption's checkpoint committed")
    closed_s: float | None = Field(None, description="the segment's report written (saves and re-reads finished)")

    @property
    def time_to_first_step_s(self) -> float | None:
        return self.first_step_s

    @property
    def emergency_save_s(self) -> float | None:
        """From the stop signal to the committed checkpoint (the part of a grace period the save takes)."""
        if self.stop_signal_s is None or self.emergency_saved_s is None:
            return None
        return self.emergency_saved_s - self.stop_signal_s

    def start_phases(self) -> dict[str, float]:
        """Duration of each start-up phase reached (seconds): from the previous phase reached, or from t = 0."""
        out: dict[str, float] = {}
        prev = 0.0
        for name in START_PHASES:
            at = getattr(self, f"{name}_s")
            if at is not None:
                out[name] = at - prev
                prev = at
        return out


class SegmentReport(_Frozen):
    """What rank 0 writes back when the segment ends."""

    segment: int = Field(ge=0)
    status: ReportedStatus
    start_step: int = Field(ge=0, description="step the ranks resumed from (after any fallback)")
    end_step: int = Field(ge=0, description="step of the checkpoint the segment ended on")
    checkpoint: str | None = Field(None, description="that checkpoint's directory, when it exists")
    world_size: int = Field(ge=1)
    topology: ClusterTopology
    note: str | None = Field(None, description="how the segment ended, in one line (a failure's cause and fix)")
    exit_code: int | None = Field(
        None, description="the ranks' exit code when the failure has its own (EXIT_NONFINITE); None: the status's code"
    )
    execution: dict[str, Any] | None = Field(
        None,
        description="how the ranks ran the math (performance section as applied: activation-checkpointed and "
        "compiled blocks, AdamW implementation); recorded on the segment's lineage event",
    )
    times: SegmentTimes | None = Field(
        None,
        description="when the segment reached each phase (start-up, preemption); "
        "for ranks restarted in place, their own phases, from their own start",
    )
    restarts: int = Field(
        0,
        ge=0,
        description="how often the segment's ranks had been restarted in place before the "
        "ranks that wrote this report started (checkpoint.restarts)",
    )

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / REPORT_FILE
        _atomic_write(path, self.model_dump_json(indent=2))
        return path

    @staticmethod
    def clear(run_dir: Path) -> None:
        """Before a launch: no report of an earlier segment may be taken for this one's."""
        (Path(run_dir) / REPORT_FILE).unlink(missing_ok=True)

    @classmethod
    def read(cls, run_dir: Path, segment: int) -> SegmentReport | None:
        """The report of ``segment``, or None when there is none (or it is unreadable, or of another segment)."""
        try:
            report = cls.model_validate_json((Path(run_dir) / REPORT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return report if report.segment == segment else None


def documented_exit_codes() -> frozenset[int]:
    """The ``EXIT_*`` codes above and those of the error classes (what the exit-codes reference lists)."""
    codes = {EXIT_COMPLETED, EXIT_FAILED, EXIT_REFUSED, EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_CANCELLED}
    todo: list[type] = [ShardkeeperError]
    while todo:
        cls = todo.pop()
        code = getattr(cls, "exit_code", None)
        if isinstance(code, int):
            codes.add(code)
        todo.extend(cls.__subclasses__())
    return frozenset(codes)


def exit_code_of(status: str, fallback: int) -> int:
    """The exit code a segment that ended with ``status`` returns (``fallback`` for a failure; a code outside the
    documented set, e.g. a signal-killed torchrun's -9, is EXIT_FAILED)."""
    code = {
        "completed": EXIT_COMPLETED,
        "preempted": EXIT_PREEMPTED,
        "cancelled": EXIT_CANCELLED,
        "refused": EXIT_REFUSED,
    }.get(status, fallback or EXIT_FAILED)
    return code if code in documented_exit_codes() else EXIT_FAILED


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
