"""torchrun, holding everything its ranks start: ``python -m launch.contain torch.distributed.run ARGS...``.

This process makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), then runs torchrun's module in itself, as
``python -m`` would. A process a rank starts and leaves behind -- a multiprocessing helper, a daemon that forks twice
and starts a session of its own -- is re-parented to this process instead of to init when its parent exits, so it
stays inside the segment's process tree (where the launcher's watch and the ranks' parent-death signals reach it).
When torchrun returns (its ranks have ended: completed, failed or stopped), whatever still runs under it is a
leftover of the segment: it gets SIGTERM, then SIGKILL after ``SHARDKEEPER_LEFTOVER_GRACE_S`` seconds (default 10)
if it is still there, and one line names each (pid and command). The launcher waits for this process, so a segment
ends only once its leftovers are gone, and the run directory's locks are free for the next one.

Under Slurm the same wrapper runs on every node (``launch.base.torchrun_argv``); what it cannot reach -- a process
that escaped before it was adopted, or everything once this process is SIGKILLed -- is left to slurmd's
``ProctrackType``: ``proctrack/cgroup`` kills every process of the step when it ends, ``proctrack/linuxproc`` only
those it still finds by parent pid.

Stdlib only.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launch.procs import children, proc_stat, running, set_child_subreaper

GRACE_ENV = "SHARDKEEPER_LEFTOVER_GRACE_S"
DEFAULT_GRACE_S = 10.0
KILL_WAIT_S = 10.0  # after SIGKILL: a process stuck in the kernel is named, not waited for forever


def leftover_grace() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S)))
    except ValueError:
        return DEFAULT_GRACE_S


def descendants(root: int) -> dict[int, int]:
    """Every running process under ``root`` (pid -> start time), found through /proc."""
    found: dict[int, int] = {}
    todo = children(root)
    while todo:
        pid = todo.pop()
        stat = proc_stat(pid)
        if stat is None or pid in found:
            continue
        found[pid] = stat[1]
        todo += children(pid)
    return {pid: start for pid, start in found.items() if running(pid, start)}


def _command(pid: int) -> str:
    """What ``pid`` runs, and which rank it came from (a forked child keeps its rank's command line and RANK)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    cmd = " ".join(raw.decode("utf-8", "replace").split("\0")).strip()
    cmd = cmd[:80] + ("..." if len(cmd) > 80 else "")
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        env = []
    rank = next((v[5:].decode() for v in env if v.startswith(b"RANK=") and v[5:].isdigit()), None)
    return f"from rank {rank}: {cmd}" if rank is not None else cmd


def _reap() -> None:
    """Collect every exited child (adopted ones included): torchrun has collected its own already."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _signal_all(procs: dict[int, int], sig: int) -> None:
    for pid, start in procs.items():
        if running(pid, start):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _wait_gone(procs: dict[int, int], seconds: float) -> dict[int, int]:
    deadline = time.monotonic() + seconds
    while True:
        _reap()
        left = {pid: start for pid, start in procs.items() if running(pid, start)}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def end_leftovers(grace_s: float, say: Callable[[str], None] = _say) -> list[int]:
    """SIGTERM to every process still running under this one, SIGKILL to those still there after ``grace_s``;
    returns the pids that outlived even SIGKILL (stuck in the kernel). Each step is said in one line."""
    left = descendants(os.getpid())
    if not left:
        _reap()
        return []
    named = ", ".join(f"pid {pid} ({_command(pid)})" for pid in sorted(left))
    say(
        f"shardkeeper: {len(left)} process(es) the ranks started outlived them: {named}; SIGTERM now, SIGKILL after "
        f"{grace_s:g} s"
    )
    _signal_all(left, signal.SIGTERM)
    left = _wait_gone({**left, **descendants(os.getpid())}, grace_s)
    if left:
        say(
            f"shardkeeper: pid(s) {', '.join(map(str, sorted(left)))} still running {grace_s:g} s after SIGTERM: "
            "SIGKILL"
        )
        while left:  # what they start meanwhile is killed too
            _signal_all(left, signal.SIGKILL)
            more = descendants(os.getpid())
            if not set(more) - set(left):
                break
            left = {**left, **more}
        left = _wait_gone(left, KILL_WAIT_S)
        if left:
            say(
                f"shardkeeper: pid(s) {', '.join(map(str, sorted(left)))} did not exit after SIGKILL (stuck in the "
                "kernel?)"
            )
    _reap()
    return sorted(left)


def main() -> None:
    if len(sys.argv) < 2:
        print(
            "usage: python -m launch.contain MODULE [ARGS...]  (e.g. torch.distributed.run --standalone ...)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    module = sys.argv[1]
    set_child_subreaper()
    sys.argv = [sys.argv[0], *sys.argv[2:]]  # runpy puts the module's file first, as python -m does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # torchrun's own handlers (they raise) would cut the clean-up short: a stop signal now changes nothing more
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        end_leftovers(leftover_grace())


if __name__ == "__main__":
    main()
