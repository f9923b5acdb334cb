"""Which rank of a failed segment failed first, how, and what followed from it: the segment's one failure line.

A rank that dies takes its peers with it: they fail in their next collective ("connection reset by peer"), and
torchrun stops the others. The line must name the first one, not the survivor that happened to print last. The
facts come from three places, each what it knows best:

- torchrun, the ranks' parent: how each failed rank ended (exit code or signal), from its closing summary (the
  ``ChildFailedError`` "Failures" and "Root Cause" blocks: rank, local rank, pid, exit code) and its
  ``failed (exitcode: X) local_rank: N (pid: P)`` line. Its "root cause" is the failure it observed first, at
  one-second resolution (``ProcessFailure.timestamp``: the error file's time, else the time it polled), so a
  rank killed at 12.9 s and its peer failing at 13.0 s may be ranked either way: it only breaks ties here.
- the ranks' own failure lines (``schemas.seam.RANK_ERROR_PREFIX``), timed as they reach the launcher; a line
  that only says a collective lost its peer (``schemas.seam.collective_error``) is a consequence, not a cause.
- the local launcher's own watch (``launch.procs.RankWatch``): the moment each rank process ended (its pidfd),
  its exit status (read from the zombie before torchrun reaps it), and for a SIGKILL what the kernel says about
  the OOM killer (``launch._oom``).

Stdlib and schemas only.
"""

from __future__ import annotations

import json
import math
import re
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from schemas.seam import EXIT_PREEMPTED, RANK_ERROR_PREFIX, RESTART_PREFIX, collective_error

_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_BLOCK_RANK_RE = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: (\d+)\)")
_BLOCK_EXIT_RE = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
_ERROR_RANK_RE = re.compile(r"^rank (\d+)\b")
_TERMINATE_RE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT_RE = re.compile(r"^\s*what\(\):\s*(.*)")
MAX_CONSEQUENCES = 3


@dataclass(frozen=True)
class RankEnd:
    """How one rank of the segment ended, as far as it is known."""

    rank: int
    local_rank: int | None = None
    pid: int | None = None
    exitcode: int | None = None  # waitpid's convention: >= 0 an exit code, < 0 the signal that killed it
    ended_at: float | None = None  # the launcher's monotonic clock: when its process ended
    line: str | None = None  # its own failure line ("rank R: ..."), the first it wrote
    line_at: float | None = None  # the launcher's monotonic clock: when that line arrived
    killed_how: str | None = None  # for a SIGKILL: what the kernel says about it (launch._oom), in a few words
    oom: str = ""  # "yes": the kernel log names the OOM killer's kill of it; "likely": the kernel suggests it
    torchrun_first: bool = False  # torchrun observed it first (its "failed (exitcode" line / root cause)
    order: int = 0  # order of appearance in the output (ties without times)

    @property
    def failed_at(self) -> float:
        """When this rank failed, as the launcher saw it: its failure line or its end, whichever came first."""
        times = [t for t in (self.line_at, self.ended_at) if t is not None]
        return min(times) if times else math.inf


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ----------------------------------------------------------------------------------------------- reading the output
def rank_error_lines(line: str) -> list[str]:
    """The ranks' failure lines in one output line (two ranks' lines may reach the pipe without a newline between
    them), each without the prefix: ``["rank 1: ValueError: boom", ...]``."""
    parts = line.split(RANK_ERROR_PREFIX)[1:]
    return [p.strip() for p in parts if p.strip()]


def torchrun_ends(lines: Iterable[str]) -> list[RankEnd]:
    """How torchrun says its failed ranks ended: the ``ChildFailedError`` blocks (global rank, local rank, pid, exit
    code; the "Root Cause" one marked first) and its ``failed (exitcode ...)`` line (local rank and pid only)."""
    ends: dict[int, RankEnd] = {}
    first_pids: set[int] = set()
    rank: tuple[int, int] | None = None
    in_root = False
    for line in lines:
        m = _FAILED_RE.search(line)
        if m:
            first_pids.add(int(m.group(3)))
            continue
        if "Root Cause" in line:
            in_root = True
        elif line.startswith("Failures:") or line.startswith("====") or "FAILED" in line:
            in_root = False
        m = _BLOCK_RANK_RE.match(line)
        if m:
            rank = (int(m.group(1)), int(m.group(2)))
            continue
        m = _BLOCK_EXIT_RE.match(line)
        if m and rank is not None:
            ends[rank[0]] = RankEnd(
                rank=rank[0],
                local_rank=rank[1],
                pid=int(m.group(2)),
                exitcode=int(m.group(1)),
                torchrun_first=in_root,
                order=len(ends),
            )
            rank = None
    return [replace(e, torchrun_first=e.torchrun_first or e.pid in first_pids) for e in ends.values()]


@dataclass(frozen=True)
class Abort:
    """A C++ runtime's last words before abort() (``terminate called after throwing ...`` / ``what(): ...``): the
    error line of a rank that died of SIGABRT, which prints no line of its own."""

    at: float | None
    text: str


def aborts(lines: Iterable[tuple[float | None, str]]) -> list[Abort]:
    """The C++ terminate messages among ``(arrival time, line)`` pairs, each joined with its ``what():`` line."""
    found: list[Abort] = []
    pending: tuple[float | None, str] | None = None
    for at, line in lines:
        m = _TERMINATE_RE.search(line)
        if m:
            if pending:
                found.append(Abort(*pending))
            pending = (at, f"terminate called after throwing {m.group(1)}")
            continue
        m = _WHAT_RE.match(line)
        if m and pending:
            found.append(Abort(pending[0], f"{pending[1]}: {' '.join(m.group(1).split())}"))
            pending = None
    if pending:
        found.append(Abort(*pending))
    return found


def merge(
    text_ends: list[RankEnd],
    error_lines: list[tuple[float | None, str]],
    observed: list[RankEnd] = (),  # type: ignore[assignment]
    listing: bool = True,
) -> list[RankEnd]:
    """One RankEnd per rank: the launcher's observation (``observed``), completed by torchrun's account
    (``text_ends``: its exit code wins, it is the parent) and the ranks' own first failure lines. ``listing``:
    ``text_ends`` holds every rank that failed (torchrun's closing summary), so a rank seen to end whose status was
    not read exited 0; False (a restart in place, after which torchrun lists nothing) leaves its status unknown."""
    by_rank: dict[int, RankEnd] = {e.rank: e for e in observed}
    listed = {t.rank for t in text_ends}
    for r, e in by_rank.items():
        # ended, status not read (torchrun reaped it first) and not among the failures torchrun lists: exit 0
        if listing and e.exitcode is None and e.ended_at is not None and r not in listed:
            by_rank[r] = replace(e, exitcode=0)
    for t in text_ends:
        seen = by_rank.get(t.rank)
        if seen is None:
            by_rank[t.rank] = t
            continue
        by_rank[t.rank] = replace(
            seen,
            exitcode=t.exitcode,
            local_rank=seen.local_rank if seen.local_rank is not None else t.local_rank,
            pid=seen.pid or t.pid,
            torchrun_first=t.torchrun_first,
            order=t.order,
        )
    for n, (at, text) in enumerate(error_lines):
        m = _ERROR_RANK_RE.match(text)
        if not m:
            continue
        r = int(m.group(1))
        seen = by_rank.get(r, RankEnd(rank=r, order=1000 + n))
        if seen.line is None:
            by_rank[r] = replace(seen, line=text, line_at=at)
    return sorted(by_rank.values(), key=lambda e: e.rank)


# ----------------------------------------------------------------------------------------------- the line
def _failed(e: RankEnd, completed: bool) -> bool:
    if e.line is not None:
        return True
    if e.exitcode is None:
        return False
    return e.exitcode != 0 or not completed


def _stopped_by_torchrun(e: RankEnd) -> bool:
    """torchrun stops the other ranks of a failed segment with SIGTERM: a rank that dies of it, or exits 75 after a
    stop it could not complete, ended because of another rank."""
    return e.line is None and e.exitcode in (-int(signal.SIGTERM), EXIT_PREEMPTED)


def _consequence(e: RankEnd) -> bool:
    return _stopped_by_torchrun(e) or (e.line is not None and collective_error(e.line) is not None)


def first_failure(ends: list[RankEnd], completed: bool = False) -> RankEnd | None:
    """The rank whose failure the others followed: the earliest that failed for a cause of its own (not a
    collective that lost its peer, not torchrun's stop); when every failure is a consequence (a network that
    really failed), the earliest of them. Ties (no times: the output of a batch job) go to the rank torchrun
    observed first, then to the order in which the output named them."""
    failed = [e for e in ends if _failed(e, completed)]
    if not failed:
        return None
    return min(failed, key=lambda e: (_consequence(e), e.failed_at, not e.torchrun_first, e.order))


def _how(e: RankEnd, abort: Abort | None) -> str:
    """How the first failed rank ended, in words, with its last error line."""
    who = f"rank {e.rank}" + (f" (pid {e.pid})" if e.pid else "")
    code = e.exitcode
    if e.line is not None:
        return e.line
    if code is not None and code < 0:
        sig = -code
        if sig == signal.SIGKILL:
            if e.oom == "yes":
                evidence = f"; {e.killed_how}" if e.killed_how else ""
                return f"{who} was killed by the kernel's OOM killer (SIGKILL{evidence})"
            how = e.killed_how or "by the OOM killer or from outside: not known here"
            return f"{who} was killed by SIGKILL ({how})"
        return f"{who} died of {signal_name(sig)}" + (f": {abort.text}" if abort else "")
    if code == 0:
        return f"{who} exited with code 0 before its segment ended"
    return f"{who} exited with code {code} without an error line"


def _after(e: RankEnd) -> str:
    """What another rank did after the first one failed, in a few words."""
    if e.line is not None:
        phrase = collective_error(e.line)
        rest = _ERROR_RANK_RE.sub("", e.line, count=1).lstrip(": ").strip()
        return f"rank {e.rank} then failed: {phrase or (rest[:100] + ('...' if len(rest) > 100 else ''))}"
    if e.exitcode is not None and e.exitcode < 0:
        return f"rank {e.rank} was then killed by {signal_name(-e.exitcode)}"
    return f"rank {e.rank} then exited with code {e.exitcode}"


def _fix(e: RankEnd) -> str:
    if e.oom:
        return (
            f"; {'it ran out of memory' if e.oom == 'yes' else 'if it ran out of memory'}: lower the memory each "
            "rank needs (smaller batch, more ranks) and resume"
        )
    if e.line is None and e.exitcode == -int(signal.SIGKILL):  # a kill from outside: nothing to fix in the code
        return "; rerun the same command to resume from the latest valid checkpoint"
    return ""


def failure_line(
    ends: list[RankEnd], completed: bool = False, abort_lines: list[Abort] = (), fix: bool = True
) -> str | None:  # type: ignore[assignment]
    """The segment's failure in one line: the first failed rank, how it ended and its last error line, then what
    the others did because of it (at most ``MAX_CONSEQUENCES``), then (``fix``) what to do about it. ``completed``:
    the ranks reported the segment completed (a rank that exits 0 then did nothing wrong). None when no rank is
    known to have failed."""
    first = first_failure(ends, completed)
    if first is None:
        return None
    abort = None
    if first.exitcode == -int(signal.SIGABRT) and abort_lines:
        aborted = [e for e in ends if e.exitcode == -int(signal.SIGABRT)]
        abort = abort_lines[0] if len(aborted) == 1 else None  # whose abort it was is only certain for one
    others = sorted((e for e in ends if e is not first and _failed(e, completed)), key=lambda e: (e.failed_at, e.order))
    failed_on = [e for e in others if not _stopped_by_torchrun(e)]
    said = [_after(e) for e in failed_on[:MAX_CONSEQUENCES]]
    if len(failed_on) > MAX_CONSEQUENCES:
        said.append(f"{len(failed_on) - MAX_CONSEQUENCES} more rank(s) then failed")
    stopped = [e.rank for e in others if _stopped_by_torchrun(e)]
    if stopped:
        said.append(f"torchrun then stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}")
    return _how(first, abort) + "".join(f"; {s}" for s in said) + (_fix(first) if fix else "")


def short_cause(e: RankEnd) -> str:
    """How a rank's failure came about, in a few words: "SIGKILL", "the OOM killer (SIGKILL)", "SIGSEGV", or what its
    collective said ("connection closed by peer"), else its error's first words."""
    if e.exitcode is not None and e.exitcode < 0 and e.line is None:
        name = signal_name(-e.exitcode)
        return (
            f"the OOM killer ({name})"
            if e.oom == "yes"
            else (f"{name}, likely the OOM killer" if e.oom == "likely" else name)
        )
    if e.line is not None:
        text = _ERROR_RANK_RE.sub("", e.line, count=1).lstrip(": ").strip()
        return collective_error(text) or (text[:80] + ("..." if len(text) > 80 else ""))
    return f"exit code {e.exitcode}"


def describe(
    lines: list[str],
    error_lines: list[tuple[float | None, str]] | None = None,
    observed: list[RankEnd] = (),
    completed: bool = False,  # type: ignore[assignment]
    kill_cause: Callable[[RankEnd], RankEnd] | None = None,
) -> str | None:
    """``failure_line`` from a launch's output (``lines``: torchrun's and the ranks') and what the launcher
    observed; ``error_lines`` default to the ranks' failure lines found in ``lines`` (no arrival times)."""
    if error_lines is None:
        error_lines = [(None, t) for ln in lines for t in rank_error_lines(ln)]
    ends = merge(torchrun_ends(lines), error_lines, observed)
    if kill_cause is not None:
        ends = [kill_cause(e) if e.exitcode == -int(signal.SIGKILL) else e for e in ends]
    return failure_line(ends, completed, aborts((None, ln) for ln in lines))


# ------------------------------------------------------------------------------------- restarts in place
# Signals that stop a rank on purpose (a preemption, torchrun stopping the survivors of a failure): a rank that dies
# of one was stopped, not killed, and is no reason to restart.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP})


@dataclass(frozen=True)
class WorkerEnd:
    """How one worker of a node's failed group ended, as its agent (torchrun) saw it."""

    rank: int
    exitcode: int  # waitpid's convention: >= 0 an exit code, < 0 the signal that killed it
    pid: int | None = None
    consequence: str | None = None  # the rank's own note: its failure only followed another's (schemas.seam)


def restart_verdict(ends: list[WorkerEnd]) -> tuple[WorkerEnd | None, str | None]:
    """Whether a node's failed worker group may be restarted in place: ``(the end it restarts for, None)``, or
    ``(None, why not)``. ``ends``: every worker that ended, the first one its agent saw failing first.

    Restarted: a death by a signal other than a stop signal (SIGKILL -- from outside or the OOM killer --, SIGSEGV,
    SIGBUS, SIGABRT, ...), and a rank whose collective timed out or lost its peer (its note says so) when no rank
    failed for a cause of its own: neither says anything about the ranks' code, and a new process may well succeed.
    Not restarted: a rank that exited with a code of its own (a Python exception, bad input, a non-finite loss, an
    ``os._exit``; exit 0 before the group ended) without such a note, which the same code and state would repeat;
    and a group whose ranks were only stopped (SIGTERM, exit 75: a preemption's doing)."""
    own = [e for e in ends if e.exitcode >= 0 and e.exitcode != EXIT_PREEMPTED and e.consequence is None]
    if own:
        e = own[0]
        what = (
            "exited with code 0 before the others ended"
            if e.exitcode == 0
            else f"failed with exit code {e.exitcode}, an error of its own"
        )
        return None, f"rank {e.rank} {what}: a restart would fail the same way"
    deaths = [e for e in ends if e.exitcode < 0 and -e.exitcode not in STOP_SIGNALS]
    if deaths:
        return deaths[0], None
    lost = [e for e in ends if e.consequence is not None]
    if lost:
        return lost[0], None
    return None, "the ranks were stopped, not killed"


def restart_cause(end: WorkerEnd) -> str:
    """A few words for why a group restarted: the signal, or what its collective said (``timed out waiting ...``)."""
    return signal_name(-end.exitcode) if end.exitcode < 0 else (end.consequence or f"exit code {end.exitcode}")


def restart_line(restart: int, of: int, end: WorkerEnd, run_id: str | None = None) -> str:
    """The agent's line for one in-place restart (``RESTART_PREFIX`` and a JSON object), read by every launcher.
    ``run_id``: the rendezvous's id, the same for every node's agent of one torchrun launch."""
    who = f"rank {end.rank}" + (f" (pid {end.pid})" if end.pid else "") if end.rank >= 0 else "a rank"
    how = f"died of {signal_name(-end.exitcode)}" if end.exitcode < 0 else f"failed: {end.consequence}"
    return (
        RESTART_PREFIX
        + " "
        + json.dumps(
            {
                "restart": restart,
                "of": of,
                "rank": end.rank,
                "pid": end.pid,
                "cause": restart_cause(end),
                "exitcode": end.exitcode,  # torchrun's own status of the rank (the launcher may not have read it)
                "line": f"{who} {how}",
                "run_id": run_id,
            }
        )
    )


def parse_restart_line(line: str) -> dict | None:
    """The agent's restart record in one output line (``restart_line``), or None."""
    at = line.find(RESTART_PREFIX)
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len(RESTART_PREFIX) :].strip())
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("restart"), int):
        return None
    return record


# ------------------------------------------------------------------------------------- ranks that did not stop
_FRAME_RE = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def _main_thread(stacks: str) -> list[tuple[str, int, str]]:
    """The frames (innermost first) of the main thread in a faulthandler dump: the thread that runs a ``<module>``
    (the others start in threading's ``_bootstrap``)."""
    blocks: list[list[tuple[str, int, str]]] = []
    truncated: list[bool] = []
    for line in stacks.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
            truncated.append(False)
            continue
        m = _FRAME_RE.match(line)
        if m and blocks:
            blocks[-1].append((m.group(1), int(m.group(2)), m.group(3)))
        elif blocks and line.strip() == "...":
            truncated[-1] = True
    mains = [b for b in blocks if any(fn == "<module>" for _, _, fn in b)]
    if mains:
        return mains[0]
    # faulthandler writes at most 100 frames of a thread, then "  ...": a deep stack loses its <module> frame. The
    # main thread is then the one cut short that is not a thread started by threading (whose frames end in
    # _bootstrap, when they are not cut short too).
    cut = [b for b, cut_short in zip(blocks, truncated) if cut_short and not any(fn == "_bootstrap" for *_, fn in b)]
    return cut[0] if len(cut) == 1 else []


def _library(path: str) -> bool:
    return (
        path.startswith("<")
        or "site-packages" in path
        or "dist-packages" in path
        or re.search(r"/lib/python3\.\d+/", path) is not None
    )


def where_stuck(stacks: str) -> tuple[bool, str] | None:
    """(in a collective?, where) for one rank's stack dump, e.g. ``(True, "all_reduce at train.py line 40")``;
    None when the dump has no main thread."""
    frames = _main_thread(stacks)
    if not frames:
        return None
    own = next(((f, n, fn) for f, n, fn in frames if not _library(f)), frames[0])
    at = f"{own[0].rsplit('/', 1)[-1]} line {own[1]} in {own[2]}"
    c10d = [fn for f, _, fn in frames if f.endswith("distributed_c10d.py")]
    # torch.distributed's own frames, or the stop agreement's wait on its all-reduce (trainer.signals)
    dist = [fn for f, _, fn in frames if "torch/distributed/" in f or f.endswith("trainer/signals.py")]
    if c10d or dist:
        return True, f"{(c10d or dist)[0]} called at {at}"
    return False, at


def stuck_line(stacks: dict[int, str], grace_s: float, silent: dict[int, str | None] | None = None) -> str | None:
    """The ranks still running at the end of their stop's grace, in one line: the ones that could not answer (stopped,
    in uninterruptible sleep) and those outside any collective first (the others waited for them), then where the
    others waited; a rank that gave no stack for no known reason is said last, as a rank to look at, not as the cause.

    Args:
        stacks: rank -> its faulthandler dump, for the ranks that wrote one.
        grace_s: the stop's grace, said in the line.
        silent: rank -> why (``launch.procs.why_silent``: stopped, uninterruptible sleep; None when its state says
            nothing) for the ranks asked for their stacks that wrote none.

    Returns:
        The line, or None when no rank said or withheld anything."""
    where = {r: w for r, w in ((r, where_stuck(t)) for r, t in sorted(stacks.items())) if w is not None}
    mute = {r: why for r, why in sorted((silent or {}).items()) if r not in where}
    unread = [r for r, t in sorted(stacks.items()) if r not in where and r not in mute and t.strip()]
    if not (where or mute or unread):
        return None
    blocked = [f"rank {r} wrote no stack when asked: {why}" for r, why in mute.items() if why]
    outside = [f"rank {r} was at {at}" for r, (coll, at) in where.items() if not coll]
    waiting = "; ".join(f"rank {r} in {at}" for r, (coll, at) in where.items() if coll)
    unknown = sorted(
        [(r, "wrote no stack in time") for r, why in mute.items() if not why]
        + [(r, "wrote a stack that could not be read") for r in unread]
    )
    late = "; ".join(f"rank {r} {what}" for r, what in unknown)
    grace = f"{grace_s:g}" if grace_s < 1e5 else f"{grace_s:.0f}"
    head = f"the ranks did not stop within the {grace} s grace and were killed"
    culprits = blocked + ([f"{'; '.join(outside)}, outside any collective"] if outside and waiting else outside)
    if culprits and waiting:
        them = "it" if len(blocked) + len(outside) == 1 else "them"
        line = f"{head}: {'; '.join(culprits)}, so the others waited for {them} ({waiting})"
    elif waiting:
        who = "every rank whose stack was read" if unknown else "every rank"
        line = f"{head}: {who} waited in a collective ({waiting})"
        if unknown:  # the one that said nothing may be the one the others waited for
            return f"{line}; {late}: look at {'it' if len(unknown) == 1 else 'them'} first"
        line += ": the ranks called different collectives, or a peer is gone"
    elif culprits:
        line = f"{head}: {'; '.join(culprits)}" + ("" if blocked or unknown else " (none in a collective)")
    else:
        return f"{head}: {late}"
    return f"{line}; {late}" if late else line
