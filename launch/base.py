"""What every launcher shares: the request a controller hands a launcher, the outcome it gets back, the
``Launcher`` interface, and how a launcher reads torchrun's output (which lines are a rank's, which are
torchrun's closing noise, which line names a rank's failure).

A launcher turns a ``LaunchRequest`` into ranks that receive a ``schemas.seam.SegmentLaunch`` (written to
the run directory; its path in ``SHARDKEEPER_LAUNCH``) and, when they end, a ``SegmentReport`` read back by
the controller. Slurm and Kubernetes launchers plug in here without new channels to the ranks.
Stdlib and schemas only: no torch, no prefect.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from launch.attribution import (
    RankEnd,
    aborts,
    describe,
    failure_line,
    first_failure,
    merge,
    parse_restart_line,
    rank_error_lines,
    short_cause,
    torchrun_ends,
)
from schemas import ClusterTopology
from schemas.data import PreparedData
from schemas.seam import RANK_ERROR_PREFIX, RESTART_PREFIX, SegmentLaunch, SegmentReport

LogSink = Callable[[str], None]
MAX_TIMED_LINES = 1000  # failure lines kept with their arrival time (a rank writes one, twice at most)
CancelCheck = Callable[[], bool]
RANK_LINE_RE = re.compile(r"\[rank(\d+)\]|\[default(\d+)\]")
# torchrun's own log lines, e.g. "W1122 10:00:00.123000 4242 .../torch/distributed/elastic/agent/server/api.py:725] ..."
TORCHRUN_LOG_RE = re.compile(r"^\[?[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/")
TORCHRUN_SUMMARY = ("ChildFailedError", "torch.distributed.elastic", "Root Cause", "Failures:", "====")
_ERROR_RE = re.compile(r"(^|\s)(error:|\w*(Error|Exception|Mismatch)\b)|Traceback")


@dataclass(frozen=True)
class InPlaceRestart:
    """One restart of a segment's ranks in place (``checkpoint.restarts``): which rank died first and how."""

    index: int  # 1 for the segment's first restart in place (a requeued Slurm job's agent counts again from 1)
    restart: int  # the agent's count: 1 for the first restart of its ranks
    of: int  # checkpoint.restarts
    rank: int | None  # the rank that failed first (None: not known)
    cause: str  # a few words: "SIGKILL", "the OOM killer (SIGKILL)", "timed out waiting in a collective"
    line: str  # the ended ranks' failure in one line (launch.attribution), as for a failed segment
    at: float  # Unix time at which the launcher learnt of it

    @property
    def summary(self) -> str:
        """``rank 1: SIGKILL``, as the segment's result lists its restarts."""
        return f"rank {self.rank}: {self.cause}" if self.rank is not None else self.cause


RestartSink = Callable[[InPlaceRestart], None]


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
    data: PreparedData | None = None  # data.source 'dataset': the token files prepared by the controller
    # checkpoint.restarts: how often the node's agent may restart the ranks in place when one dies (trainer.agent);
    # each restart is handed to on_restart as soon as the launcher learns of it (the controller records it)
    restarts: int = 0
    on_restart: RestartSink | None = None

    def seam(
        self, launcher_pid: int | None, launched_at: float | None = None, stacks_dir: str | None = None
    ) -> SegmentLaunch:
        """What the ranks of this request receive. ``launched_at``: Unix time at which the launcher starts their
        processes (the origin of the segment's phase times); None where that is not now (a scheduler's queue).
        ``stacks_dir``: where the ranks write their stacks when asked (a launcher on their host)."""
        return SegmentLaunch(
            run_dir=str(Path(self.run_dir).resolve()),
            until_step=self.until_step,
            segment=self.segment,
            topology=self.topology,
            restart=self.restart,
            launcher_pid=launcher_pid,
            data=self.data,
            launched_at=launched_at,
            stacks_dir=stacks_dir,
        )


@dataclass(frozen=True)
class LaunchOutcome:
    exit_code: int
    timed_out: bool
    tail: list[str]  # last lines of output, for the failure report
    seconds: float
    cancelled: bool = False  # stopped because cancel_check said so (or it said so after a stop signal)
    stop_signal: int | None = None  # the signal the launching process received (and turned into a stop)
    held_back: list[str] = field(default_factory=list)  # torchrun's closing lines, not streamed to the sink
    # A batch scheduler's view (Slurm): the job id, its final state, how often it was requeued, and a note
    # for the segment result (e.g. "node n2 lost: 1 of 2 nodes available").
    scheduler_job: str | None = None
    scheduler_state: str | None = None
    requeues: int = 0
    note: str | None = None

    # The scheduler took the allocation away (preemption, node failure, time limit): like a stop request,
    # a segment without a report from its ranks ended 'preempted', not 'failed'.
    scheduler_preempted: bool = False
    # The ranks' failure in one line (launch.attribution): the first rank that failed, how (exit code, signal, the
    # OOM killer when the kernel says so) and its last error line, then what the others did because of it. None
    # when no rank is known to have failed (the segment's result then reads the output's last error lines).
    failure: str | None = None
    # Ranks asked to stop that were still running at the end of the grace, and where each was (its Python stack):
    # the one outside any collective is the one the others waited for. None: every rank stopped in time.
    stuck: str | None = None
    # The restarts of the ranks in place during the segment, in order (the outcome above is the last ranks').
    restarts: list[InPlaceRestart] = field(default_factory=list)

    @property
    def stop_requested(self) -> bool:
        """The launcher asked the ranks to stop (signal, cancellation or timeout)."""
        return self.timed_out or self.cancelled or self.stop_signal is not None


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous across nodes. Fields are passed to the shell as they are, so a batch
    script can hand in the scheduler's variables (``$SLURM_NODEID``)."""

    endpoint: str  # host:port of the store node 0 hosts
    run_id: str  # one id per launch: agents of another launch never join this one
    node_rank: str = "0"
    is_host: str = "0"  # "1" on the node that hosts the store (explicit: on loopback every node matches the host)


def torchrun_argv(
    python: str,
    topology: ClusterTopology,
    grace_s: float,
    run_dir: str,
    until_step: int,
    segment: int,
    rdzv: Rendezvous | None = None,
    nnodes: str | None = None,
    restarts: int = 0,
) -> list[str]:
    """The torchrun command one node runs: ``--standalone`` for one node, c10d rendezvous for several
    (world size = nodes x procs per node; ``nnodes`` overrides the count, e.g. with the allocation's
    ``"$SLURM_JOB_NUM_NODES"``). Positional arguments to the ranks only: torchrun claims
    options that prefix its own (--log, --start, ...). torchrun runs inside ``launch.contain``: what the ranks start
    and leave behind stays in the segment and ends with it. ``restarts`` (checkpoint.restarts) > 0: torchrun with
    shardkeeper's agent (``trainer.agent``) and ``--max-restarts``, which restarts the ranks in place when one dies."""
    agent = ["trainer.agent"] if restarts > 0 else []  # torchrun with shardkeeper's agent (trainer.agent)
    argv = [python, "-m", "launch.contain", *agent, "torch.distributed.run"]
    if rdzv is None:
        if topology.nodes != 1:
            raise ValueError(f"{topology.nodes} nodes need a rendezvous endpoint")
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={nnodes or topology.nodes}",
            f"--node-rank={rdzv.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv.endpoint}",
            f"--rdzv-id={rdzv.run_id}",
            f"--rdzv-conf=is_host={rdzv.is_host}",
        ]
    grace = [f"--shutdown-timeout={max(1, int(grace_s))}"] if torchrun_has_shutdown_timeout() else []
    if restarts > 0:
        grace.append(f"--max-restarts={restarts}")
    return argv + [
        f"--nproc-per-node={topology.procs_per_node}",
        *grace,
        "-m",
        "trainer.segment",
        str(run_dir),
        str(until_step),
        str(segment),
    ]


@functools.lru_cache(maxsize=1)
def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (newer releases; older ones refuse the option and
    use their own fixed grace). Read from its source, so the controller does not import torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    run_py = Path(list(spec.submodule_search_locations)[0]) / "distributed" / "run.py"
    try:
        return "--shutdown-timeout" in run_py.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True


def combined_exit_code(codes: list[int]) -> int:
    """One exit code for the torchrun agents of all nodes: 0 when all are 0; else the first node's when it
    failed (the others usually fail because it did), else the first failing node's."""
    failing = [c for c in codes if c != 0]
    if not failing:
        return 0
    return codes[0] if codes[0] != 0 else failing[0]


class Launcher(Protocol):
    name: str

    def max_world_size(self) -> int | None:
        """Largest world size this launcher can give now (None = unknown/unbounded)."""

    def preflight(self, topology: ClusterTopology) -> None:
        """Refuse (one-line ConfigError/ShardkeeperError) a topology this launcher can never run."""

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        """Run one segment to its end and report how it ended."""


@dataclass(frozen=True)
class Generation:
    """What the output said of one set of ranks that ended (before a restart in place): its lines, the ranks'
    failure lines and C++ abort messages with their arrival times."""

    lines: list[str]
    rank_errors: list[tuple[float, str]]
    abort_lines: list[tuple[float, str]]


class OutputSplitter:
    """Splits the ranks' and torchrun's output: rank lines go to the sink at once; torchrun's own closing
    lines (from its first log line or traceback on) are held back until the outcome is known, since a
    ChildFailedError summary is noise when the segment was preempted or cancelled. Keeps the last lines
    for the failure report (``lines``), and the first rank's own failure line however much followed it.

    The agent's line for a restart in place (``schemas.seam.RESTART_PREFIX``) ends a generation of ranks: what
    the output said of it is kept in ``generations`` with the agent's record (for the launcher to record the
    restart), and the splitter starts again, so that everything above describes the ranks running now."""

    def __init__(self, sink: LogSink, keep: int = 60):
        self.sink = sink
        self.keep = keep
        self.generations: list[tuple[dict, Generation]] = []  # (the agent's record, the ended ranks' output)
        self._restarts_seen: set[tuple[str, int]] = set()
        self._reset()

    def _reset(self) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=self.keep)
        self.held: list[str] = []
        self._holding = False
        self.reported: str | None = None
        # every rank's failure line and every C++ abort message, with the time it arrived (time.monotonic()): the
        # order in which the ranks failed (launch.attribution)
        self.rank_errors: list[tuple[float, str]] = []
        self.abort_lines: list[tuple[float, str]] = []

    def _restart(self, record: dict) -> None:
        """The agent restarts the ranks: keep what was said of the ended ones, start over. With several nodes each
        node's agent says the same restart (the same rendezvous run id and count): the first says it."""
        key = (str(record.get("run_id")), record["restart"])
        if key in self._restarts_seen:
            return
        self._restarts_seen.add(key)
        ended = Generation([*self.held, *self.tail], list(self.rank_errors), list(self.abort_lines))
        self._reset()
        self.generations.append((record, ended))

    def lines(self) -> list[str]:
        """The last lines, led by the first rank's failure line when it has left them."""
        kept = list(self.tail)
        return kept if self.reported is None or self.reported in kept else [self.reported, *kept]

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        record = parse_restart_line(line) if RESTART_PREFIX in line else None
        if record is not None:
            self._restart(record)
            return
        self.tail.append(line)
        if RANK_ERROR_PREFIX in line:
            if self.reported is None:
                self.reported = line
            if len(self.rank_errors) < MAX_TIMED_LINES:
                self.rank_errors += [(time.monotonic(), t) for t in rank_error_lines(line)]
        elif ("terminate called" in line or "what():" in line) and len(self.abort_lines) < MAX_TIMED_LINES:
            self.abort_lines.append((time.monotonic(), line))
        if self._hold(line):
            self.held.append(line)
        else:
            self.sink(line)

    def _hold(self, line: str) -> bool:
        if RANK_LINE_RE.search(line):
            return False
        if not self._holding and (
            TORCHRUN_LOG_RE.search(line) or line.startswith("Traceback") or any(m in line for m in TORCHRUN_SUMMARY)
        ):
            self._holding = True
        return self._holding


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


def segment_failure(
    run_dir: Path,
    segment: int,
    out: OutputSplitter,
    observed: Iterable[RankEnd] = (),
    kill_cause: Callable[[RankEnd], RankEnd] | None = None,
) -> str | None:
    """The failure line of a launch (``LaunchOutcome.failure``): torchrun's account of its failed ranks (its
    closing summary, held back in ``out``), the ranks' failure lines as they arrived, what the launcher observed
    of each rank (``observed``), and for a SIGKILL what ``kill_cause`` finds out (the OOM killer). A rank that
    exited 0 counts as failed unless the ranks reported the segment completed."""
    report = SegmentReport.read(Path(run_dir), segment)
    completed = report is not None and report.status == "completed"
    gen = Generation([*out.held, *out.tail], list(out.rank_errors), list(out.abort_lines))
    return generation_failure(gen, observed, kill_cause, completed)[1]


def generation_failure(
    gen: Generation,
    observed: Iterable[RankEnd] = (),
    kill_cause: Callable[[RankEnd], RankEnd] | None = None,
    completed: bool = False,
    fix: bool = True,
    known: Iterable[RankEnd] = (),
    listing: bool = True,
) -> tuple[RankEnd | None, str | None]:
    """(the rank that failed first, the failure line) of one generation of ranks (``segment_failure``); ``fix``:
    the line ends with what to do about it (not for a restart, which is what is done about it); ``known``: ends
    whose exit status torchrun's agent read (its restart record), taken as torchrun's own account is; ``listing``:
    torchrun's closing summary lists every failed rank (not so before a restart in place: ``merge``)."""
    ends = merge([*known, *torchrun_ends(gen.lines)], list(gen.rank_errors), list(observed), listing)
    if kill_cause is not None:
        ends = [kill_cause(e) if e.exitcode == -int(signal.SIGKILL) else e for e in ends]
    return first_failure(ends, completed), failure_line(ends, completed, aborts(gen.abort_lines), fix=fix)


def restart_from_record(
    index: int,
    record: dict,
    gen: Generation,
    observed: Iterable[RankEnd] = (),
    kill_cause: Callable[[RankEnd], RankEnd] | None = None,
) -> InPlaceRestart:
    """The segment's ``index``-th restart, which the agent said (``record``), named from what the launcher knows of
    the ranks that ended (their output, and where it watched them, their ends): its own account when it has one,
    else the agent's."""
    # The agent read the exit status of the rank it names: a rank the launcher saw end without reading its status
    # (torchrun reaped it first) is not taken for one that exited 0 when the agent says a signal killed it. Only a
    # signal: an exit code of its own comes with the agent's note of what the rank's collective said (its record's
    # cause), and a status the launcher read itself is never overruled. (Its pid may differ from the record's: the
    # record names a forked rank's fork-server client, the launcher the rank's own process.)
    observed = list(observed)
    said_rank, said_code, said_pid = record.get("rank"), record.get("exitcode"), record.get("pid")
    said_pid = said_pid if type(said_pid) is int else None
    seen = next((e for e in observed if e.rank == said_rank), None)
    known = (
        [RankEnd(rank=said_rank, exitcode=said_code, pid=said_pid)]
        if type(said_rank) is int
        and said_rank >= 0
        and type(said_code) is int
        and said_code < 0
        and (seen is None or seen.exitcode is None)
        else []
    )
    first, line = generation_failure(gen, observed, kill_cause, fix=False, known=known, listing=False)
    rank = first.rank if first is not None else record.get("rank")
    cause = short_cause(first) if first is not None else str(record.get("cause") or "unknown")
    return InPlaceRestart(
        index=index,
        restart=int(record["restart"]),
        of=int(record.get("of") or 0),
        rank=rank if isinstance(rank, int) and rank >= 0 else None,
        cause=cause,
        line=line or str(record.get("line") or cause),
        at=time.time(),
    )


def restart_said(r: InPlaceRestart) -> str:
    """The launcher's line for a restart in place."""
    return (
        f"shardkeeper: {r.line}; restarting the ranks in place ({r.restart} of {r.of}, checkpoint.restarts) "
        "from the newest snapshot"
    )


def failing_rank_lines(tail: list[str], limit: int = 8) -> str:
    """The failing rank's own error lines, from the output alone: the first rank that failed for a cause of its
    own, how and its line, then what the others did (``launch.attribution``). Without any rank's failure line or
    torchrun's account of one: the last error lines, torchrun's closing summary (which only says a child failed)
    cut off first, so it cannot push the real exception out of the window."""
    described = describe(tail)
    if described:
        return described
    for line in tail:
        at = line.find(RANK_ERROR_PREFIX)
        if at >= 0:  # two ranks' lines that reached the pipe without a newline between them: the first one
            return line[at + len(RANK_ERROR_PREFIX) :].split(RANK_ERROR_PREFIX, 1)[0].strip()
    killed = _killed_rank(tail)
    if killed:
        return killed
    body = tail[: _closing_cut(tail)] or tail
    errs = [ln for ln in body if _ERROR_RE.search(ln)]
    return "\n".join((errs or body)[-limit:])


_RANK_FAILED_RE = re.compile(r"failed \(exitcode: (-\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def _killed_rank(tail: list[str]) -> str | None:
    """torchrun's line for a rank that a signal killed (SIGKILL by the OOM killer or a user), in one sentence."""
    for line in tail:
        m = _RANK_FAILED_RE.search(line)
        if m:
            num = -int(m.group(1))
            name = signal.Signals(num).name if num in signal.Signals._value2member_map_ else f"signal {num}"
            return (
                f"local rank {m.group(2)} (pid {m.group(3)}) was killed by {name} and torchrun stopped the other "
                "ranks; rerun the same command to resume from the latest valid checkpoint"
            )
    return None


_RANK_EXIT_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def first_rank_exit_code(lines: list[str]) -> int | None:
    """The exit code of the first rank torchrun saw fail (its "failed (exitcode: N) local_rank: R" line; negative:
    killed by that signal), or None when no rank failed or torchrun said nothing. torchrun's own exit code is 1 for
    any rank's failure; this is the rank's own (2: a ShardkeeperError of bad input, 65: a non-finite step, ...)."""
    first = next((m for m in map(_RANK_EXIT_RE.search, lines) if m), None)
    return int(first.group(1)) if first is not None else None


def rank_stopped_at_startup(lines: list[str]) -> bool:
    """Did the first rank torchrun saw fail end as a stop during start-up? A rank that got SIGTERM/SIGUSR1 before its
    process group formed exits 75 with nothing to save, and one that got it while the group formed dies of it
    (trainer.lifetime: the default action there); once the group has formed, a stop signal is always a checkpoint
    and exit 75 with a report. torchrun's own SIGTERMs to the other ranks come after that first failure."""
    from schemas.seam import EXIT_PREEMPTED

    return first_rank_exit_code(lines) in {EXIT_PREEMPTED, -int(signal.SIGTERM), -int(signal.SIGUSR1)}


def without_torchrun_closing(lines: list[str]) -> list[str]:
    """Held-back lines worth showing when the segment did not fail: torchrun's log lines and its closing
    traceback + summary (a ChildFailedError or SignalException that only says the ranks stopped) removed."""
    return [ln for ln in lines[: _closing_cut(lines)] if not TORCHRUN_LOG_RE.search(ln)]
