"""The node's agent of a segment that restarts its ranks in place (``checkpoint.restarts`` > 0): torchrun, with
shardkeeper's rule for which failures a restart may cure, and a fork server that starts the restarted ranks.

    python -m launch.contain trainer.agent torch.distributed.run --standalone --max-restarts=3 ... \
        -m trainer.segment RUN_DIR 100 0

(``launch.base.torchrun_argv`` writes this command for every launcher; with ``checkpoint.restarts: 0`` it runs plain
``torch.distributed.run`` instead, without restarts.) This module runs torchrun's own ``main`` with its elastic agent
replaced by ``ShardkeeperAgent``, a ``LocalElasticAgent`` that changes three things:

1. **Which failures restart.** torchrun's ``--max-restarts`` restarts the worker group after any failure: the same
   Python exception, non-finite loss or refused input would then fail N more times, each after a restart. The
   agent looks at how each worker ended before torchrun decides (``launch.attribution.restart_verdict``): a death by
   a signal (SIGKILL, the OOM killer, SIGSEGV, SIGABRT ...) restarts, and so does a rank whose collective timed out
   or lost its peer (it leaves a note in ``$SHARDKEEPER_RANK_NOTES``, ``trainer.segment``); an exit code of the
   rank's own does not, and neither does a group that was only stopped (SIGTERM, exit 75): torchrun's remaining
   restarts are then set to 0, and it stops the group and fails exactly as it does without restarts.
2. **Each restart is said** as one line on stderr (``launch.attribution.restart_line``: the restart, the rank that
   died first, how), which every launcher reads from the output (local: the pipe; Slurm: the job's output file;
   Kubernetes: the pod's log) and records in lineage.
3. **Restarted ranks start from the fork server** (``trainer.forkserver``), which this agent starts with the
   segment: the ranks of a restart skip the seconds of importing torch.

A preemption during a restart stays a preemption: torchrun's own SIGTERM handling (``SignalException``) stops the
new ranks, which commit if they can (a rank stopped before its load exits 75 with nothing to save: the launcher
then persists the newest memory snapshot), and the agent exits without restarting. A node that is lost takes its
agent with it: the segment ends, and the next one restores from the peer node's memory.

torch is imported here (this is the agent process, which imports it anyway); the launcher does not import this
module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from launch.attribution import WorkerEnd, restart_line, restart_verdict, signal_name
from launch.procs import pdeathsig_preexec
from schemas.seam import RANK_NOTES_ENV
from trainer.dist import ATTEMPT_ENV
from trainer.forkserver import FORK_SERVER_ENV, RANK, SERVE, worker_module

HEARTBEAT_S = 0.5  # how often an agent beats in the round's store (Heartbeat)
PEER_WAIT_S = 3.0  # how long an agent about to restart waits for every other node's agent to beat


def consequence_note(notes: Path, rank: int) -> str | None:
    """What rank ``rank`` said about its failure when it only followed another's (``trainer.segment``), or None."""
    try:
        return (notes / f"consequence-{rank}").read_text(encoding="utf-8", errors="replace").strip() or "lost its peer"
    except OSError:
        return None


class ForkServer:
    """The agent's handle on its node's fork server (``trainer.forkserver``): started with the segment's first
    ranks, asked for each restarted rank, stopped with the agent."""

    def __init__(self, folder: Path, run_dir: str):
        self.path = folder / "fork.sock"
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server (it imports nothing before it is asked to); one line if it cannot start."""
        if self.proc is not None:
            return
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "trainer.forkserver", SERVE, str(self.path), self.run_dir],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(os.getpid()),
            )
        except OSError as e:
            print(
                f"shardkeeper: the fork server did not start ({e}); restarted ranks start as new processes",
                file=sys.stderr,
                flush=True,
            )

    def usable(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.path.exists()

    @contextlib.contextmanager
    def entrypoint(self, spec: Any) -> Iterator[None]:
        """Within: torchrun starts each worker as the fork server's client (``trainer.forkserver rank ARGS``)."""
        original = spec.args
        spec.args = ("-u", "-m", "trainer.forkserver", RANK, *original)
        try:
            yield
        finally:
            spec.args = original

    def stop(self) -> None:
        """The workers are gone: end the server (a rank it forked that still runs dies with it)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)


class Heartbeat:
    """This agent's pulse in the rendezvous round's store (a counter every ``HEARTBEAT_S``, from a thread of its own,
    so a main thread busy stopping its workers still beats): before a restart, the agents of a multi-node segment
    check that every other node's agent still beats. A lost node's agent cannot join the restart, and the others
    would wait torchrun's rendezvous timeout (600 s) for it; instead the segment ends, and the next one restores the
    lost node's files from its peer's memory."""

    def __init__(self) -> None:
        self._at: tuple[Any, int] | None = None  # (the round's store, this node's group rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardkeeper-agent-heartbeat", daemon=True)
        self._thread.start()

    def beat_in(self, store: Any, group_rank: int) -> None:
        self._at = (store, group_rank)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            at = self._at
            if at is not None:
                with contextlib.suppress(Exception):  # a store gone: the node that hosted it is lost
                    at[0].add(f"shardkeeper-heartbeat-{at[1]}", 1)

    def stop(self) -> None:
        self._stop.set()

    @staticmethod
    def lost(store: Any, group_rank: int, group_world_size: int, wait_s: float = PEER_WAIT_S) -> list[int]:
        """The other nodes (group ranks) whose agent did not beat within ``wait_s``."""
        others = [g for g in range(group_world_size) if g != group_rank]
        if not others:
            return []
        try:
            before = {g: store.add(f"shardkeeper-heartbeat-{g}", 0) for g in others}
        except Exception:  # noqa: BLE001 - the store's host (node 0's agent) is gone
            return others
        deadline = time.monotonic() + wait_s
        pending = set(others)
        while pending and time.monotonic() < deadline:
            time.sleep(HEARTBEAT_S / 2)
            try:
                pending = {g for g in pending if store.add(f"shardkeeper-heartbeat-{g}", 0) <= before[g]}
            except Exception:  # noqa: BLE001
                return sorted(pending)
        return sorted(pending)


class ShardkeeperAgent(LocalElasticAgent):
    """torchrun's ``LocalElasticAgent`` with shardkeeper's restart rule, its restart lines and its fork server."""

    def __init__(self, spec: Any, *args: Any, **kwargs: Any):
        super().__init__(spec, *args, **kwargs)
        self._heartbeat = Heartbeat()
        self._notes = Path(tempfile.mkdtemp(prefix="shardkeeper-agent-"))
        os.environ[RANK_NOTES_ENV] = str(self._notes)  # the workers inherit this process's environment
        self._forks: ForkServer | None = None
        if spec.max_restarts > 0 and os.environ.get(FORK_SERVER_ENV) != "off":
            self._forks = ForkServer(self._notes, _run_dir(spec.args))
            os.environ[FORK_SERVER_ENV] = str(self._forks.path)

    # ---------------------------------------------------------------- the decision
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._decide(worker_group, result)
        return result

    def _ends(self, worker_group: WorkerGroup, result: RunResult) -> list[WorkerEnd]:
        """How each worker that ended did: the failures in the order torchrun saw them, then any that exited 0."""
        ends = [
            WorkerEnd(rank=rank, exitcode=f.exitcode, pid=f.pid, consequence=consequence_note(self._notes, rank))
            for rank, f in result.failures.items()
        ]
        handlers = getattr(self._pcontext, "subprocess_handlers", {}) or {}
        for worker in worker_group.workers:
            handler = handlers.get(worker.local_rank)
            if handler is not None and handler.proc.returncode == 0 and worker.global_rank not in result.failures:
                ends.append(WorkerEnd(rank=worker.global_rank, exitcode=0, pid=handler.proc.pid))
        return ends

    def _decide(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """Before torchrun acts on a failed group: veto a restart a new process would not cure (torchrun then stops
        and fails as without restarts), or say the restart it is about to make."""
        spec = worker_group.spec
        if spec.max_restarts <= 0:
            return
        if result.state == WorkerState.UNHEALTHY:  # a rank stuck in the kernel: a new process is the cure
            first, why = WorkerEnd(rank=-1, exitcode=-int(signal.SIGKILL), consequence="stuck in the kernel"), None
        else:
            first, why = restart_verdict(self._ends(worker_group, result))
        if self._remaining_restarts <= 0:
            if first is not None:
                print(
                    f"shardkeeper: rank {first.rank} {_how(first)} after {spec.max_restarts} restart(s) in place "
                    f"(checkpoint.restarts: {spec.max_restarts}): the segment ends",
                    file=sys.stderr,
                    flush=True,
                )
            return
        lost = (
            []
            if why is not None
            else Heartbeat.lost(worker_group.store, worker_group.group_rank, worker_group.group_world_size)
        )
        if lost:
            why = (
                f"the agent of node {', '.join(map(str, lost))} is gone (its node lost?); the next segment restores "
                "its files from the peer node's memory"
            )
        if why is not None:
            self._remaining_restarts = 0
            print(f"shardkeeper: not restarted in place: {why}", file=sys.stderr, flush=True)
            return
        restart = spec.max_restarts - self._remaining_restarts + 1
        print(
            restart_line(restart, spec.max_restarts, first, spec.rdzv_handler.get_run_id()),  # type: ignore[arg-type]
            file=sys.stderr,
            flush=True,
        )

    # ---------------------------------------------------------------- the workers
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        for note in self._notes.glob("consequence-*"):  # a new group: no note of the last one counts
            note.unlink(missing_ok=True)
        os.environ[ATTEMPT_ENV] = self._attempt(worker_group)
        self._heartbeat.beat_in(worker_group.store, worker_group.group_rank)
        restart = worker_group.spec.max_restarts - self._remaining_restarts
        if self._forks is None or restart == 0 or not self._forks.usable():
            ids = super()._start_workers(worker_group)
            if self._forks is not None and restart == 0:
                self._forks.start()  # it waits, importing nothing, until the ranks' first step
            return ids
        with self._forks.entrypoint(worker_group.spec):
            return super()._start_workers(worker_group)

    @staticmethod
    def _attempt(worker_group: WorkerGroup) -> str:
        """One id for this rendezvous round, the same on every node (made by the first node, read from the round's
        own store): the prefix of the ranks' process-group keys (``trainer.dist``)."""
        store = worker_group.store
        if worker_group.group_rank == 0:
            store.set("shardkeeper-attempt", uuid.uuid4().hex)
        return store.get("shardkeeper-attempt").decode()

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        LocalElasticAgent._shutdown(self)  # the workers only: the next group forks from the same server

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        try:
            super()._shutdown(death_sig, timeout)
        finally:
            self._heartbeat.stop()
            if self._forks is not None:
                self._forks.stop()
            shutil.rmtree(self._notes, ignore_errors=True)


def _run_dir(worker_args: tuple) -> str:
    """The run directory in a rank's command (``-m trainer.segment RUN_DIR UNTIL SEGMENT``), else "-"."""
    target = worker_module([str(a) for a in worker_args])
    return target[1][0] if target and target[0] == "trainer.segment" and target[1] else "-"


def _how(end: WorkerEnd) -> str:
    if end.exitcode < 0:
        return f"died of {signal_name(-end.exitcode)}"
    return f"failed ({end.consequence})" if end.consequence else f"exited with code {end.exitcode}"


def main() -> None:
    """torchrun's ``main`` with ``ShardkeeperAgent`` as its agent: ``python -m trainer.agent torch.distributed.run
    ARGS...`` (the module is named on the command line, so that the agent reads as the torchrun it is)."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher import api

    if len(sys.argv) < 2 or sys.argv[1] != "torch.distributed.run":
        print("usage: python -m trainer.agent torch.distributed.run [TORCHRUN ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    del sys.argv[1]

    if not hasattr(api, "LocalElasticAgent"):  # a torch whose launcher makes its agent elsewhere: no veto possible
        print(
            "shardkeeper: this torch's launcher cannot take shardkeeper's agent; ranks are not restarted in place",
            file=sys.stderr,
            flush=True,
        )
        sys.argv = [a for a in sys.argv if not a.startswith(("--max-restarts", "--max_restarts"))]
    else:
        api.LocalElasticAgent = ShardkeeperAgent  # type: ignore[misc]
    torchrun.main()


if __name__ == "__main__":
    main()
