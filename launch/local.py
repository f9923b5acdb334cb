"""The local launcher: the ranks of one segment on this machine, through torchrun, supervised.

The interface is small so Slurm and Kubernetes launchers fit beside the local one without touching
flows: ``launch(request) -> LaunchOutcome``. The local launcher runs torchrun as a supervised
subprocess in its own process group: its output is streamed line by line to a sink (the CLI's
console or a Prefect task's logger), SIGTERM/SIGINT/SIGUSR1 received by the caller stop every rank
(that is what a preemption looks like: they commit a checkpoint), a segment that runs past its
timeout is stopped the same way, and so is one whose ``cancel_check`` turns true (a Prefect
cancellation): the outcome then says ``cancelled``.

No process of a segment outlives the launching process (which holds the run lock): torchrun is
started with PR_SET_PDEATHSIG=SIGKILL, and each rank sets the same, checks its parent and the
launcher pid (``SegmentLaunch.launcher_pid``) and runs a watchdog (trainer.lifetime). PDEATHSIG fires
when the *thread* that started torchrun exits: ``launch`` waits for torchrun in that same thread
(the CLI's main thread, or the worker thread a Prefect task runs in), so it always outlives it.
The launcher records torchrun's descendants (pid and start time) while torchrun lives and, once torchrun
has exited, waits for each of them by pid (a pidfd) before it returns: when ``launch`` returns, and so
before the run lock is released, no rank of the segment runs any more, however loaded the machine.
torchrun itself runs inside ``launch.contain`` (a child subreaper): what the ranks fork and leave behind is
adopted by it and ended with the segment.

The launcher also watches each rank (``launch.procs.RankWatch``): when its process ended and its exit status,
so that a failed segment's line names the rank that failed first (``LaunchOutcome.failure``,
``launch.attribution``); ranks still running near the end of a stop's grace are asked for their Python stacks
(``LaunchOutcome.stuck``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from launch.attribution import RankEnd, stuck_line
from launch.base import (
    InPlaceRestart,
    LaunchOutcome,
    LaunchRequest,
    LogSink,
    OutputSplitter,
    Rendezvous,
    combined_exit_code,
    restart_from_record,
    restart_said,
    segment_failure,
    torchrun_argv,
)
from launch.early import STOP_SIGNALS, received_stop
from launch.early import pending_stop as _pending_stop
from launch.procs import Descendants, RankWatch, WatchedRank, pdeathsig_preexec, reap_orphans, running, why_silent
from schemas import ClusterTopology
from schemas.errors import ConfigError
from schemas.seam import EXIT_CANCELLED, LAUNCH_ENV, NODE_ENV, STACKS_SIGNAL

POLL_S = 0.25
STACKS_LEAD_S = 5.0  # the ranks still running this long before the end of a stop's grace are asked for their stacks
STACKS_WRITE_S = 1.0  # the time they get to write them
KILL_MARGIN_S = 10.0  # torchrun SIGKILLs the ranks at its --shutdown-timeout (= grace); it gets this long more
CANCEL_SETTLE_S = 3.0  # > the Prefect cancel watcher's poll period


class _Supervisor:
    """One launch: streams the output of the torchrun agents (one per node; one unless a multi-node
    segment runs on loopback), asks the ranks to stop at most once, escalates to SIGKILL.

    A stop (preemption signal, cancellation, timeout) is a single SIGTERM to each torchrun, which forwards
    it to its ranks (they commit a checkpoint) and SIGKILLs them after ``--shutdown-timeout`` (the
    launcher's grace); the launcher SIGKILLs torchrun itself a little later, and the ranks die with it
    (PR_SET_PDEATHSIG). Repeated signals are not forwarded again: a second SIGTERM would make torchrun
    abandon its graceful shutdown and kill the ranks in the middle of their checkpoint."""

    def __init__(self, procs: list[subprocess.Popen], grace_s: float, sink: LogSink, stacks_dir: str | None = None):
        self.procs = procs
        self.grace_s = grace_s
        self.sink = sink
        self.out = OutputSplitter(sink)
        self.stop_reason: str | None = None
        self.signal: int | None = None
        self._killer: threading.Timer | None = None
        self._asker: threading.Timer | None = None
        self.stacks_dir = stacks_dir
        self.stacks: dict[int, str] = {}  # rank -> its Python stacks, asked for at the end of a stop's grace
        self.silent: dict[int, str | None] = {}  # rank -> why (its process state) for those asked that wrote none
        self._termed: set[int] = set()
        self.trees: list[Descendants] = []
        self.ranks = RankWatch()
        self.restarts: list[InPlaceRestart] = []  # the agents' restarts in place, as the launcher named them
        self._generations_seen = 0

    def watch(self, proc: subprocess.Popen) -> None:
        self.procs.append(proc)
        self.trees.append(Descendants(proc.pid))

    def scan(self) -> None:
        """Record the agents' descendants while the agents live, and watch their ranks (when each ends, and how)."""
        for tree in self.trees:
            tree.scan()
            self.ranks.consider(tree.root)

    def take_restarts(self, req: LaunchRequest, t0: float) -> None:
        """The restarts the agents said since the last look: each named from what this launcher saw of the ranks
        that ended (their output, their ends, the kernel's word on a SIGKILL), said in one line and handed to the
        controller (``LaunchRequest.on_restart``)."""
        while self._generations_seen < len(self.out.generations):
            record, ended = self.out.generations[self._generations_seen]
            self._generations_seen += 1
            generation = int(record["restart"]) - 1
            watched = {w.rank_pid: w for w in self.ranks.watched(generation)}
            restart = restart_from_record(
                len(self.restarts) + 1, record, ended, _observed(watched), _kill_cause(watched, t0)
            )
            self.restarts.append(restart)
            self.sink(restart_said(restart))
            if req.on_restart is not None:
                req.on_restart(restart)

    def reap(self) -> list[int]:
        """Once every agent has exited: wait (by pid) until nothing they started runs; the pids that would not go."""
        return [pid for tree in self.trees for pid in reap_orphans(tree)]

    def request_stop(self, reason: str) -> None:
        # No lock: this also runs as a signal handler in the main thread, which may hold any lock.
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self.term_unsignalled()
        self._killer = threading.Timer(self.grace_s + KILL_MARGIN_S, self.kill)
        self._killer.daemon = True
        self._killer.start()
        if self.stacks_dir is not None:
            ask_at = max(0.0, self.grace_s - min(STACKS_LEAD_S, self.grace_s / 4))
            self._asker = threading.Timer(ask_at, self.ask_stacks)
            self._asker.daemon = True
            self._asker.start()

    def ask_stacks(self) -> None:
        """Near the end of the stop's grace (torchrun kills the ranks at its end): every rank still running writes
        its Python stacks (faulthandler, trainer.lifetime), read back a moment later."""
        asked: dict[int, tuple[int, int]] = {}  # rank -> (pid, start)
        for w in self.ranks.watched():
            if w.ended_at is None and running(w.pid, w.start):
                try:
                    os.kill(w.pid, STACKS_SIGNAL)
                    asked[w.rank] = (w.pid, w.start)
                except ProcessLookupError:
                    pass
        if not asked:
            return
        time.sleep(STACKS_WRITE_S)
        for rank, (pid, start) in asked.items():
            try:
                text = Path(str(self.stacks_dir), f"rank-{rank}.txt").read_text(errors="replace")
            except OSError:
                text = ""
            if text.strip():
                self.stacks[rank] = text[-20000:]
            elif running(pid, start):  # alive and silent (stopped, or stuck where no handler runs); not one that ended
                self.silent[rank] = why_silent(pid)

    def term_unsignalled(self) -> None:
        """SIGTERM to each agent not yet asked to stop (an agent started after the stop request included)."""
        for proc in list(self.procs):
            if proc.pid in self._termed:
                continue
            self._termed.add(proc.pid)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def on_signal(self, signum: int, _frame: object) -> None:
        received_stop.append(signum)  # a second one gives up the upload after the stop (shardkeeper.remote)
        if self.signal is None:
            self.signal = signum
        self.request_stop(f"signal {signal.Signals(signum).name}")

    def kill(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def read_output(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.out.feed(line)

    def wait(self, timeout: float | None = None) -> list[int]:
        """Exit codes of every agent; raises subprocess.TimeoutExpired if one still runs after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return [p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())) for p in self.procs]

    def any_running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def cancel_timer(self) -> None:
        for timer in (self._killer, self._asker):
            if timer:
                timer.cancel()


def stopped_before_start(req: LaunchRequest, what: str) -> LaunchOutcome | None:
    """The outcome of a launch that must not start (``what``: "the ranks started", "the job was submitted"):
    cancelled already, or a stop signal arrived while the CLI was still preparing. None: go ahead."""
    if req.cancel_check is not None and req.cancel_check():
        return LaunchOutcome(
            exit_code=EXIT_CANCELLED, timed_out=False, tail=[f"cancelled before {what}"], seconds=0.0, cancelled=True
        )
    return stopped_by_signal(what)


def stopped_by_signal(what: str) -> LaunchOutcome | None:
    """The outcome of a launch stopped by a signal the early handler (launch.early) took; None when none came.
    Asked by ``stopped_before_start`` and again once the launcher's own handlers are in place: a signal taken in
    between would otherwise be remembered by nobody, and the segment would train on."""
    if not _pending_stop:
        return None
    signum = _pending_stop[0]
    return LaunchOutcome(
        exit_code=128 + signum, timed_out=False, tail=[f"stopped before {what}"], seconds=0.0, stop_signal=signum
    )


def _install_signal_handlers(sup: _Supervisor) -> dict[int, object]:
    """SIGTERM/SIGINT/SIGUSR1 to the launching process stop the segment (only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, sup.on_signal) for s in STOP_SIGNALS}


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the driver's /proc entries, narrowed by
    CUDA_VISIBLE_DEVICES when set (0 without a driver)."""
    try:
        present = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    return min(present, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))


class LocalTorchrun:
    """Ranks on this machine through torchrun: ``--standalone`` for one node; for ``topology.nodes > 1``
    one torchrun agent per node on loopback, joined by c10d rendezvous exactly as the nodes of a cluster
    join (what the Slurm launcher runs on each node), so multi-node segments are exercised without one."""

    name = "local"

    def __init__(self, python: str | None = None, grace_s: float = 60.0, cancel_settle_s: float = CANCEL_SETTLE_S):
        self.python = python or sys.executable
        self.grace_s = grace_s
        self.cancel_settle_s = cancel_settle_s

    def max_world_size(self) -> int | None:
        gpus = visible_gpus()
        return gpus if gpus else max(8, 4 * (os.cpu_count() or 1))

    def preflight(self, topology: ClusterTopology) -> None:
        limit = self.max_world_size()
        if limit is not None and topology.world_size > limit:
            what = (
                f"--nodes {topology.nodes} x --nproc {topology.procs_per_node}"
                if topology.nodes > 1
                else f"--nproc {topology.procs_per_node}"
            )
            raise ConfigError(
                f"{what}: more ranks than this machine can run ({limit}); use at most {limit} ranks here, "
                "or --launcher slurm for more nodes"
            )

    def commands(self, req: LaunchRequest) -> list[list[str]]:
        """One torchrun command per node."""
        topo = req.topology
        if topo.nodes == 1:
            return [
                torchrun_argv(
                    self.python,
                    topo,
                    self.grace_s,
                    str(req.run_dir),
                    req.until_step,
                    req.segment,
                    restarts=req.restarts,
                )
            ]
        endpoint = f"127.0.0.1:{free_port()}"
        run_id = f"shardkeeper-{os.getpid()}-{req.segment}-{time.monotonic_ns()}"
        return [
            torchrun_argv(
                self.python,
                topo,
                self.grace_s,
                str(req.run_dir),
                req.until_step,
                req.segment,
                Rendezvous(endpoint, run_id, node_rank=str(n), is_host="1" if n == 0 else "0"),
                restarts=req.restarts,
            )
            for n in range(topo.nodes)
        ]

    def environment(self, req: LaunchRequest, stacks_dir: str | None = None) -> dict[str, str]:
        # written just before torchrun starts: the ranks time their start-up phases from here
        seam = req.seam(launcher_pid=os.getpid(), launched_at=time.time(), stacks_dir=stacks_dir)
        launch_file = seam.write(req.run_dir)
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            **req.env,
            LAUNCH_ENV: str(launch_file),
        }
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        t0 = time.monotonic()
        early = stopped_before_start(req, "the ranks started")
        if early is not None:
            return early
        stacks_dir = _stacks_dir()
        env = self.environment(req, stacks_dir)
        procs: list[subprocess.Popen] = []
        sup = _Supervisor(procs, self.grace_s, sink, stacks_dir)
        previous = _install_signal_handlers(sup)
        late = stopped_by_signal("the ranks started")  # taken since the check above: nothing started
        if late is not None:
            for sig, prev in previous.items():
                signal.signal(sig, prev)  # type: ignore[arg-type]
            sup.cancel_timer()
            sup.ranks.close()
            shutil.rmtree(stacks_dir, ignore_errors=True)
            return late
        readers: list[threading.Thread] = []
        cancelled = False
        codes: list[int] = []
        try:
            # Each torchrun dies with this process (PDEATHSIG, set in the child before exec) and takes its ranks along.
            commands = self.commands(req)
            for n, argv in enumerate(commands):
                # Several agents on this host emulate several nodes: each its own name, so its own memory tier dir.
                env_n = {**env, NODE_ENV: f"node{n}"} if len(commands) > 1 else env
                proc = subprocess.Popen(
                    argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    bufsize=1,
                    env=env_n,
                    start_new_session=True,
                    preexec_fn=pdeathsig_preexec(os.getpid()),
                )
                sup.watch(proc)
                readers.append(
                    threading.Thread(target=sup.read_output, args=(proc,), name="torchrun-output", daemon=True)
                )
                readers[-1].start()
                if sup.stop_reason is not None:  # a signal arrived while the agents were being started
                    sup.term_unsignalled()
            cancelled = self._supervise(sup, req, t0)
            codes = sup.wait()
            for reader in readers:  # every line read (a restart said just before the end included)
                reader.join(timeout=1)
            sup.take_restarts(req, t0)
            cancelled = cancelled or self._settle_cancel(sup, req)
        finally:
            sup.cancel_timer()
            for sig, prev in previous.items():
                signal.signal(sig, prev)  # type: ignore[arg-type]
            if sup.any_running():
                sup.kill()
                codes = sup.wait()
            stuck = sup.reap()
            if stuck:
                sink(f"shardkeeper: processes {stuck} of the segment did not exit after SIGKILL (stuck in the kernel?)")
            sup.ranks.close()
            shutil.rmtree(stacks_dir, ignore_errors=True)
            for reader in readers:
                reader.join(timeout=10)
        return LaunchOutcome(
            exit_code=combined_exit_code(codes),
            timed_out=sup.stop_reason == "timeout",
            tail=sup.out.lines(),
            seconds=time.monotonic() - t0,
            cancelled=cancelled,
            stop_signal=sup.signal,
            held_back=list(sup.out.held),
            failure=self._failure(req, sup, t0),
            stuck=stuck_line(sup.stacks, self.grace_s, sup.silent),
            restarts=list(sup.restarts),
        )

    @staticmethod
    def _failure(req: LaunchRequest, sup: _Supervisor, t0: float) -> str | None:
        """The first rank that failed, from torchrun's summary, the ranks' lines and what the watch saw of each rank
        (when it ended, its exit status, its memory cgroup for a SIGKILL): the last generation's, after restarts."""
        watched = {w.rank_pid: w for w in sup.ranks.watched()}
        return segment_failure(req.run_dir, req.segment, sup.out, _observed(watched), _kill_cause(watched, t0))

    def _supervise(self, sup: _Supervisor, req: LaunchRequest, t0: float) -> bool:
        """Wait for the agents, polling the cancel check and the timeout, saying each restart in place as it comes;
        True if cancelled meanwhile."""
        cancelled = False
        while True:
            sup.scan()
            sup.take_restarts(req, t0)
            try:
                sup.wait(timeout=POLL_S)
                return cancelled
            except subprocess.TimeoutExpired:
                pass
            if not cancelled and req.cancel_check is not None and req.cancel_check():
                cancelled = True
                why = getattr(req.cancel_check, "reason", None)  # a stop check may say why (the run's lease was lost)
                sup.sink(
                    f"shardkeeper: {(why and why()) or 'cancellation requested'}: stopping the ranks (they commit a "
                    "checkpoint first)"
                )
                sup.request_stop("cancelled")
            if req.timeout_s and time.monotonic() - t0 > req.timeout_s:
                sup.request_stop("timeout")

    def _settle_cancel(self, sup: _Supervisor, req: LaunchRequest) -> bool:
        """After a stop signal, was it a cancellation? A flow-run cancellation arrives as SIGTERM too;
        the cancel check (which polls the orchestrator) may need a moment to see it."""
        if req.cancel_check is None or sup.signal is None:
            return False
        deadline = time.monotonic() + self.cancel_settle_s
        while True:
            if req.cancel_check():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def _observed(watched: dict[int, WatchedRank]) -> list[RankEnd]:
    return [
        RankEnd(rank=w.rank, local_rank=w.local_rank, pid=w.rank_pid, exitcode=w.status, ended_at=w.ended_at)
        for w in watched.values()
    ]


def _kill_cause(watched: dict[int, WatchedRank], t0: float):  # noqa: ANN202 - RankEnd -> RankEnd
    """For a rank that died of SIGKILL: what the kernel says about it (launch._oom), from the watch's record."""
    from launch._oom import sigkill_cause

    def kill_cause(end: RankEnd) -> RankEnd:
        w = watched.get(end.pid or -1)
        oom, how = sigkill_cause(
            end.pid or -1, w.comm if w else None, w.ended_at if w else None, w.memory if w else None, since=t0
        )  # type: ignore[arg-type]
        return replace(end, oom=oom, killed_how=how)

    return kill_cause


STACKS_PREFIX = "shardkeeper-stacks-"


def _stacks_dir() -> str:
    """A fresh folder for the ranks' stacks (removed when the launch ends), named after this launcher's pid: the
    folders of launchers that were SIGKILLed before removing theirs are swept here."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"{STACKS_PREFIX}*-*"):
        pid = old.name[len(STACKS_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def free_port() -> int:
    """A TCP port free on loopback now (for the rendezvous store node 0 hosts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
