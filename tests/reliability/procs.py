"""Helpers for process-lifetime tests (not a test module): start the CLI, find a segment's processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def cli_env() -> dict[str, str]:
    return {
        **os.environ,
        "SHARDKEEPER_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def train_args(run: Path, until_step: int, nproc: int = 2, sets: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--nproc",
        str(nproc),
        "--until-step",
        str(until_step),
        *[a for s in sets for a in ("--set", s)],
    ]


def start_train(
    run: Path, until_step: int, *, new_session: bool = False, sets: tuple[str, ...] = ()
) -> subprocess.Popen:
    return subprocess.Popen(
        train_args(run, until_step, sets=sets),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=ROOT,
        start_new_session=new_session,
    )


def run_train(run: Path, until_step: int, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_args(run, until_step), capture_output=True, text=True, env=cli_env(), cwd=ROOT, timeout=timeout
    )


def segment_processes(run: Path, kind: str | None = None) -> list[psutil.Process]:
    """Live processes whose command line names ``run`` (the CLI, torchrun, the ranks); ``kind``:
    'torchrun' or 'rank' to pick one kind."""
    needle = str(run)
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if needle not in cmd or p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        is_torchrun = "torch.distributed.run" in cmd
        is_rank = "trainer.segment" in cmd and not is_torchrun
        if kind is None or (kind == "torchrun" and is_torchrun) or (kind == "rank" and is_rank):
            found.append(p)
    return found


def wait_until(predicate, timeout: float, what: str, period: float = 0.1):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def metrics_steps(run: Path) -> int:
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def wait_training(run: Path, steps: int = 1, timeout: float = 240) -> None:
    wait_until(lambda: metrics_steps(run) >= steps, timeout, f"{steps} training steps in {run}")


def wait_ranks(run: Path, n: int = 2, timeout: float = 240) -> list[psutil.Process]:
    return wait_until(
        lambda: (ps := segment_processes(run, "rank")) and len(ps) >= n and ps, timeout, f"{n} ranks of {run}"
    )


def no_survivors(run: Path, within: float = 5.0) -> None:
    """Every process of the segment is gone within ``within`` seconds (excluding the test itself)."""
    try:
        wait_until(lambda: not segment_processes(run), within, "the segment's processes to go", period=0.05)
    except AssertionError:
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in segment_processes(run)]
        raise AssertionError(f"processes of {run} still alive {within:g} s later: {left}") from None


def segment_records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()]


def tcp_connected(p: psutil.Process) -> bool:
    """The process has a TCP connection (a rank that reached rendezvous: its store client, its group's sockets)."""
    try:
        return any(c.status == psutil.CONN_ESTABLISHED for c in p.net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def rank_alone_in_rendezvous(run: Path, timeout: float = 240) -> tuple[psutil.Process, psutil.Process]:
    """(waiting, stopped): as soon as both ranks exist, one is SIGSTOPped (still importing torch) until the other has
    connected to the rendezvous store; killing ``stopped`` then leaves ``waiting`` alone in rendezvous."""
    ranks = sorted(wait_ranks(run, 2, timeout), key=lambda p: p.pid)
    stopped, waiting = ranks[-1], ranks[0]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: tcp_connected(waiting), timeout, f"rank pid {waiting.pid} of {run} to reach rendezvous")
    except BaseException:
        os.kill(stopped.pid, signal.SIGCONT)
        raise
    return waiting, stopped
