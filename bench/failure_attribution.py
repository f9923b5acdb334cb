"""Failure attribution: how a segment ended, as `shardkeeper train` says it, for each way a rank can fail.

    python bench/failure_attribution.py                                    # this checkout
    python bench/failure_attribution.py --baseline /path/to/other/checkout # and the same cases on another checkout

Every case is a real `shardkeeper train --script tests/scripts/failure_modes.py --nproc 2` (a tiny FSDP2 MLP
through shardkeeper.Segment, gloo on CPU) in which one rank does something at step 3 (or is done something to):
SIGKILLed from outside (rank 0, then rank 1), out of memory (a real kernel OOM kill inside a memory cgroup of its
own where this process may make one, else a SIGKILL that must not be called an OOM), an exception of its own,
os._exit(0) inside the loop (every rank, then rank 1 alone), os._exit(3), a hang while its peer waits in a
collective then SIGTERM to the CLI (torchrun kills the ranks at the end of its 60 s grace), the same with the rank
SIGSTOPped instead (it cannot write its stack when asked), ranks that build
models of different widths, and a forked daemon that ignores SIGTERM (then the same run trained again). The
table gives the CLI's line and whether its first clause names the rank that failed first and the right cause;
``--baseline`` runs the same cases on another checkout (the script is this checkout's) for comparison.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import md_table, publish  # noqa: E402 - bench/ is on the path when run as a script

SCRIPT = ROOT / "tests" / "scripts" / "failure_modes.py"


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]  # failure_modes.py arguments
    rank: int | None  # the rank the line must name first (None: any)
    cause: str  # a regex the first clause must match
    outside: str | None = None  # "kill0", "kill1": SIGKILL from outside once 3 steps are logged; "term": SIGTERM
    until: int = 6


def memory_cgroup_here() -> bool:
    from tests.reliability.test_failure_attribution import memory_cgroup_here as probe

    return probe()


def cases(oom_real: bool) -> list[Case]:
    # without a memory cgroup the rank SIGKILLs itself: right is a SIGKILL that does not claim the OOM killer
    oom_cause = (
        r"OOM killer" if oom_real else r"^(?!.*(OOM killer \(SIGKILL|most likely by the kernel)).*killed by SIGKILL"
    )
    return [
        Case(
            "SIGKILL rank 1 (kill -9 from outside)",
            ("--mode", "train", "--sleep", "0.3"),
            1,
            r"killed by SIGKILL",
            outside="kill1",
            until=200,
        ),
        Case(
            "SIGKILL rank 0 (kill -9 from outside)",
            ("--mode", "train", "--sleep", "0.3"),
            0,
            r"killed by SIGKILL",
            outside="kill0",
            until=200,
        ),
        Case(
            "out of memory on rank 1"
            + (
                " (real OOM kill, memory cgroup)"
                if oom_real
                else " (no memory cgroup here: SIGKILL, no OOM may be claimed)"
            ),
            ("--mode", "oom", "--rank", "1"),
            1,
            oom_cause,
        ),
        Case("raise ValueError on rank 1", ("--mode", "raise", "--rank", "1"), 1, r"ValueError: boom on rank 1"),
        Case(
            "os._exit(0) in the loop, every rank",
            ("--mode", "exit0", "--rank", "-1"),
            None,
            r"exited with code 0 before its segment ended",
        ),
        Case(
            "os._exit(0) in the loop, rank 1",
            ("--mode", "exit0", "--rank", "1"),
            1,
            r"exited with code 0 before its segment ended",
        ),
        Case("os._exit(3) on rank 1", ("--mode", "exit3", "--rank", "1"), 1, r"code 3"),
        Case(
            "rank 1 hangs (deadlock), then SIGTERM",
            ("--mode", "hang", "--rank", "1", "--sleep", "0.1"),
            1,
            r"outside any collective",
            outside="term",
            until=1000,
        ),
        # a stopped rank cannot run the handler that writes its stack: named from its state in /proc
        Case(
            "rank 1 stopped (SIGSTOP, as a debugger does), then SIGTERM",
            ("--mode", "stop", "--rank", "1", "--sleep", "0.1"),
            1,
            r"it was stopped \(SIGSTOP",
            outside="term",
            until=1000,
        ),
        # rank 0 receives rank 1's longer message: gloo's size check aborts it (rank 1 then loses its peer)
        Case(
            "different widths per rank (rank 1 wider)",
            ("--mode", "widths", "--rank", "1"),
            0,
            r"SIGABRT: terminate called after throwing gloo::EnforceNotMet",
        ),
        Case(
            "a forked daemon ignoring SIGTERM (rank 1), then train again",
            ("--mode", "orphan", "--rank", "1"),
            1,
            r"outlived them",
        ),
    ]


def rank_pid(run: Path, rank: int) -> int | None:
    """The pid of rank ``rank`` of the segment training ``run`` (not a process it forked: a rank leads its
    session, as torchrun starts it)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if (
                str(run) in cmd
                and "trainer.segment" in cmd
                and "torch.distributed.run" not in cmd
                and p.environ().get("RANK") == str(rank)
                and os.getsid(p.pid) == p.pid
            ):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return None


def no_restarts(root: Path) -> list[str]:
    """``--set checkpoint.restarts=0`` where the checkout has it: a death ends its segment, whose line is measured
    here (a rank restarted in place: bench/recovery_bench.py --kill)."""
    schema = root / "schemas" / "run.py"
    return ["--set", "checkpoint.restarts=0"] if schema.is_file() and "restarts: int" in schema.read_text() else []


def steps(run: Path) -> int:
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def train(root: Path, run: Path, case: Case) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SHARDKEEPER_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "1000",
        "SHARDKEEPER_PROGRESS_S": "0",
        "PYTHONPATH": str(root),
    }
    argv = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--script",
        str(SCRIPT),
        "--run-dir",
        str(run),
        "--until-step",
        str(case.until),
        "--nproc",
        "2",
        *no_restarts(root),
        "--",
        *case.args,
    ]
    proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if case.outside:
            deadline = time.monotonic() + 300
            while steps(run) < (2 if case.outside == "term" else 3):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{run}: the segment did not train")
                time.sleep(0.05)
            if case.outside == "term":
                time.sleep(1.0)  # rank 1 sleeps in its loop; rank 0 waits for it in the next collective
                proc.send_signal(signal.SIGTERM)
            else:
                pid = rank_pid(run, int(case.outside[-1]))
                if pid is None:
                    raise RuntimeError(f"{run}: rank {case.outside[-1]} not found")
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def the_line(res: subprocess.CompletedProcess) -> str:
    """What the CLI says of the segment's end (its last `segment N ...` or `error: segment N ...` line), plus the
    launcher's lines about leftovers."""
    lines = res.stderr.splitlines()
    said = [ln.strip() for ln in lines if re.match(r"^(error: )?segment \d+ ", ln.strip())]
    said = said or [ln.strip() for ln in lines if ln.startswith("error: ")]  # refused before it started
    extra = [ln.strip() for ln in lines if ln.startswith("shardkeeper: ") and ("outlived" in ln or "SIGTERM:" in ln)]
    return " / ".join([*extra, *(said[-1:] or ["(no segment line; rc %d)" % res.returncode])])  # noqa: UP031


def first_clause(line: str) -> str:
    """The part of the line that must name the cause: after the segment's summary, up to what followed."""
    m = re.search(r" s(?: \([^)]*\))?: (.*)$", line) or re.search(r"checkpoint \S+ \((.*)\)\s*$", line)
    body = m.group(1) if m else line
    return re.split(r"; (?:rank \d+ (?:then|was then)|torchrun then|\d+ more rank)", body)[0]


def judge(case: Case, line: str) -> tuple[str, str]:
    head = line if case.name.startswith("a forked") else first_clause(line)
    named = re.search(r"\brank (\d+)\b", head)
    rank_ok = named is not None and (case.rank is None or int(named.group(1)) == case.rank)
    return ("yes" if rank_ok else "no"), ("yes" if re.search(case.cause, head) else "no")


def public(line: str, run: Path) -> str:
    """A printed line as the table shows it: the run directory as RUN_DIR, the interpreter as ``python``, the bench's
    scratch folder as WORK (no machine's paths in published text)."""
    line = line.replace(str(run), "RUN_DIR").replace(sys.executable, "python")
    return re.sub(r"/tmp/failure-attribution-[^/\s)]*", "WORK", line)


def run_case(root: Path, work: Path, case: Case) -> tuple[str, str, str]:
    run = work / re.sub(r"\W+", "-", case.name)[:40]
    shutil.rmtree(run, ignore_errors=True)
    if case.name.startswith("a forked"):
        case = Case(
            case.name,
            (*case.args, "--orphan-pid-file", str(run.parent / f"{run.name}.daemon")),
            case.rank,
            case.cause,
            case.outside,
            case.until,
        )
    res = train(root, run, case)
    line = public(the_line(res), run)
    if case.name.startswith("a forked"):
        try:
            again = train(root, run, Case(case.name, ("--mode", "train"), None, "", until=case.until + 2))
            line += f" / then: {public(the_line(again), run)} (rc {again.returncode})"
        finally:
            end_daemons(run)
    rank_ok, cause_ok = judge(case, line)
    return line, rank_ok, cause_ok


def end_daemons(run: Path) -> None:
    """The forked daemons of the orphan case that a checkout left running (it ignores SIGTERM): SIGKILL."""
    for f in run.parent.glob(f"{run.name}.daemon.*"):
        try:
            pid = int(f.read_text())
            if str(run) in " ".join(psutil.Process(pid).cmdline()):
                os.kill(pid, signal.SIGKILL)
        except (ValueError, OSError, psutil.NoSuchProcess):
            pass
        f.unlink(missing_ok=True)


def remove_oom_cgroups() -> None:
    from tests.reliability.test_failure_attribution import _remove_oom_cgroups

    _remove_oom_cgroups()


def cell(text: str, limit: int | None = None) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if limit is None or len(text) <= limit else text[:limit] + "…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to run the same cases on")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    args = ap.parse_args()
    oom_real = memory_cgroup_here()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="failure-attribution-"))
    try:
        for case in cases(oom_real):
            if args.only and args.only not in case.name:
                continue
            line, rank_ok, cause_ok = run_case(ROOT, work / "this", case)
            print(f"{case.name}: {line}\n  rank {rank_ok}, cause {cause_ok}", flush=True)
            row = [cell(case.name), f"`{cell(line)}`", rank_ok, cause_ok]
            if args.baseline:
                b_line, b_rank, b_cause = run_case(args.baseline.resolve(), work / "base", case)
                print(f"  baseline: {b_line}\n  rank {b_rank}, cause {b_cause}", flush=True)
                row += [f"`{cell(b_line, 600)}`", f"{b_rank} / {b_cause}"]
            rows.append(row)
            remove_oom_cgroups()
    finally:
        remove_oom_cgroups()
        shutil.rmtree(work, ignore_errors=True)
    head = ["case (2 ranks, step 3)", "the line `shardkeeper train` prints", "right rank", "right cause"]
    if args.baseline:
        head += ["baseline's line", "baseline right rank / cause"]
    right = sum(r[2] == "yes" and r[3] == "yes" for r in rows)
    body = (
        md_table(head, rows)
        + f"\n\n{right} of {len(rows)} cases name the right rank and cause"
        + (f"; the baseline: {sum(r[-1] == 'yes / yes' for r in rows)} of {len(rows)}." if args.baseline else ".")
    )
    publish("failure-attribution", body)


if __name__ == "__main__":
    main()
