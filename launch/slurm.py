"""The Slurm launcher: a segment as a Slurm batch job, one torchrun agent per node joined by c10d rendezvous.

Why ``sbatch`` and not submitit: a segment is a shell command (torchrun on each node, through ``srun``), and
what makes it survive preemption are Slurm's own switches: ``--requeue`` (a preempted or requeued job runs
again and its ranks resume from the latest valid checkpoint), ``--signal=TERM@G`` (SIGTERM reaches every
rank G seconds before the time limit, so the trainer's preemption path commits a checkpoint before the kill)
and ``--open-mode=append`` (the output of every attempt stays in one file). submitit pickles a Python
callable, runs it as its own task and installs its own SIGUSR2 handler to checkpoint and requeue: that would
sit between Slurm's signal and the trainer's, and the ranks would start from submitit's pickle, not from the
typed seam. The batch script here is generated, readable, kept in ``RUN_DIR/slurm/`` and resubmittable by hand.

The seam is the local launcher's: the ranks read ``SegmentLaunch`` from ``RUN_DIR/.segment-launch.json`` (the
run directory is on storage every node sees) through ``SHARDKEEPER_LAUNCH`` and rank 0 writes
``SegmentReport`` back. The launching process waits for the job and returns the same exit codes as the
local launcher (0 completed / 75 preempted / 130 cancelled / 1 failed), with the job id, its final state and
how often it was requeued. A stop signal, a cancellation or a timeout sends SIGTERM to the job's steps (the
ranks commit a checkpoint), then cancels the job. A job that can no longer be placed (nodes drained or down,
fewer usable nodes in the partition than it asks for) is cancelled and the segment ends 'preempted': the
next segment resumes on the nodes there are.

Stdlib and schemas only: no torch, no prefect.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from launch.attribution import RankEnd
from launch.base import (
    InPlaceRestart,
    LaunchOutcome,
    LaunchRequest,
    LogSink,
    OutputSplitter,
    Rendezvous,
    restart_from_record,
    restart_said,
    segment_failure,
    torchrun_argv,
)
from launch.early import pending_stop, received_stop
from launch.slurm_ctl import (
    FINAL_STATES,
    SlurmError,
    SlurmJob,
    clear_job,
    job_info,
    partition_nodes,
    record_job,
    run_command,
)
from schemas import ClusterTopology
from schemas.errors import ConfigError
from schemas.seam import EXIT_CANCELLED, EXIT_FAILED, EXIT_PREEMPTED, LAUNCH_ENV

POLL_S = 1.0
CTLD_PATIENCE_S = 120.0  # how long slurmctld may not answer while a job is watched
KILL_MARGIN_S = 15.0
# Slurm reports a cancelled job CANCELLED at once, while slurmd may kill its steps' processes only up to KillWait
# (30 s by default) later: the launcher waits that long, and the ranks' grace, for the ranks to be gone.
STEP_KILL_WAIT_S = 30.0
RANKS_LOCK = ".lock.ranks"  # = ckpt.guards.lock.RANKS_LOCK_NAME: the shared flock every live rank of a segment holds
RDZV_PORT_BASE = 29400  # + job id % 1000: two jobs sharing a node never share a rendezvous port
LOST_ALLOCATION = {"TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
# How long a pending job may stay unplaceable (fewer usable nodes than it asks for) before it is cancelled and
# the segment ends 'preempted' (a node coming back from a reboot is worth a short wait).
UNPLACEABLE_AFTER_S = float(os.environ.get("SHARDKEEPER_SLURM_UNPLACEABLE_S", "60"))


def check_text(value: str, what: str) -> None:
    """Refuse text with control characters (a newline in a run directory or an sbatch argument would end a line
    of the generated batch script: a command of its own)."""
    bad = [c for c in value if ord(c) < 32 or ord(c) == 127]
    if bad:
        raise ConfigError(
            f"{what} {value!r}: contains control characters ({', '.join(repr(c) for c in sorted(set(bad)))}); "
            "use a plain path or value"
        )


def ranks_alive(run_dir: Path) -> bool:
    """Does a process hold ``RUN_DIR/.lock.ranks`` (shared, as every live rank of a segment does)? A probe that
    takes the lock exclusively without waiting and lets it go at once (ckpt.guards.lock does the same for the CLI)."""
    import fcntl

    try:
        fd = os.open(run_dir / RANKS_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def script_path(req: LaunchRequest) -> Path:
    return Path(req.run_dir).resolve() / "slurm" / f"segment-{req.segment}.sbatch"


class SlurmLauncher:
    """A segment as one ``sbatch`` job of ``topology.nodes`` nodes, one torchrun agent per node."""

    name = "slurm"

    def __init__(
        self,
        partition: str | None = None,
        time_min: int | None = None,
        grace_s: float = 60.0,
        python: str | None = None,
        extra_args: tuple[str, ...] = (),
        poll_s: float = POLL_S,
        cancel_settle_s: float = 3.0,
        unplaceable_after_s: float = UNPLACEABLE_AFTER_S,
    ):
        if time_min is not None and time_min < 1:
            raise ConfigError(f"--slurm-time {time_min}: must be a positive number of minutes")
        for arg in extra_args:
            check_text(arg, "--slurm-arg")
        if partition is not None:
            check_text(partition, "--slurm-partition")
        self.partition = partition
        self.time_min = time_min
        self.grace_s = grace_s
        self.python = python or sys.executable
        self.extra_args = tuple(extra_args)
        self.poll_s = poll_s
        self.cancel_settle_s = cancel_settle_s
        self.unplaceable_after_s = unplaceable_after_s

    def max_world_size(self) -> int | None:
        return None  # the partition decides; preflight() checks nodes and CPUs

    def usable_nodes(self) -> int:
        """Nodes of the partition that are up now (not down, drained or failing)."""
        return partition_nodes(self.partition)[1]

    def has_gpus(self) -> bool:
        """Whether the partition's nodes offer GPUs (GRES gpu): what --device auto means for a Slurm segment."""
        argv = ["sinfo", "-h", "-o", "%G"] + (["-p", self.partition] if self.partition else [])
        try:
            return "gpu" in run_command(argv, "reading the partition's GRES")
        except SlurmError:
            return False

    def preflight(self, topology: ClusterTopology) -> None:
        """Refuse, before anything is written, a job the partition can never place."""
        if self.extra_args:
            what = "; ".join(self.extra_args)
            if any(a.split("=", 1)[0] in ("--wrap", "--output", "-o", "--job-name", "-J") for a in self.extra_args):
                raise ConfigError(f"--slurm-arg {what}: shardkeeper sets --output, --job-name and the script itself")
        where = f"partition {self.partition}" if self.partition else "the default partition"
        try:
            total, usable, cpus = partition_nodes(self.partition)
        except SlurmError as e:
            raise SlurmError(f"--launcher slurm: {e}") from None
        if total == 0:
            raise ConfigError(
                f"--slurm-partition {self.partition}: no such partition (or it has no nodes); "
                "see `sinfo -s` for the partitions there are"
            )
        if topology.nodes > total:
            raise ConfigError(f"--nodes {topology.nodes}: {where} has {total} node(s); use --nodes <= {total}")
        if topology.nodes > usable:
            raise ConfigError(
                f"--nodes {topology.nodes}: only {usable} of the {total} node(s) of {where} are up "
                f"(the others are down or drained); use --nodes <= {usable} to start now"
            )
        if topology.device_type == "cpu" and cpus and topology.procs_per_node > cpus:
            raise ConfigError(
                f"--nproc {topology.procs_per_node}: the nodes of {where} have {cpus} CPU(s); use --nproc <= {cpus}"
            )

    # -- the job --------------------------------------------------------------------------------------
    def job_name(self, req: LaunchRequest) -> str:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(req.run_dir).name)[:60]
        return f"shardkeeper-{name}-s{req.segment}"

    def submit_args(self, req: LaunchRequest, output: Path) -> list[str]:
        """The sbatch options that carry user text (paths, the job name, --slurm-arg): given on sbatch's command
        line, never as ``#SBATCH`` lines, which sbatch splits at whitespace and which a newline would end."""
        return [f"--job-name={self.job_name(req)}", f"--output={output}", *self.extra_args]

    def batch_script(self, req: LaunchRequest, launch_file: Path, output: Path) -> str:
        topo = req.topology
        q = shlex.quote
        root = str(Path(__file__).resolve().parent.parent)
        sb = [
            f"--nodes={topo.nodes}",
            "--ntasks-per-node=1",
            "--requeue",
            f"--signal=TERM@{max(1, int(self.grace_s))}",
            "--open-mode=append",
            "--kill-on-invalid-dep=yes",
        ]
        if topo.device_type == "cuda":
            sb.append(f"--gpus-per-node={topo.procs_per_node}")
        else:
            sb.append(f"--cpus-per-task={topo.procs_per_node}")
        if self.partition:
            sb.append(f"--partition={self.partition}")
        if self.time_min:
            sb.append(f"--time={self.time_min}")
        # The shell expressions are evaluated on each node by the srun task (single-quoted below).
        rdzv = Rendezvous(
            endpoint='"$SK_RDZV_ADDR:$SK_RDZV_PORT"',
            run_id='"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
            node_rank='"$SLURM_NODEID"',
            is_host='"$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)"',
        )
        # --nnodes is the allocation's node count: a job Slurm gives fewer nodes (--nodes=MIN-MAX in --slurm-arg)
        # trains at that world size; the ranks record what they ran on.
        argv = torchrun_argv(
            q(self.python),
            topo,
            self.grace_s,
            q(str(Path(req.run_dir).resolve())),
            req.until_step,
            req.segment,
            rdzv,
            nnodes='"$SLURM_JOB_NUM_NODES"',
            restarts=req.restarts,
        )
        node_cmd = "exec " + " ".join(argv)
        # Every value below is shell-quoted; run directories and sbatch arguments with control characters are
        # refused before this (check_text), so no line of this script can be ended early by user text.
        resubmit = " ".join(q(a) for a in ["sbatch", *self.submit_args(req, output), str(script_path(req))])
        lines = [
            "#!/bin/bash",
            f"# shardkeeper segment {req.segment}: train until step {req.until_step}",
            f"# generated by launch/slurm.py; resubmit by hand with: {resubmit}",
        ]
        lines += [f"#SBATCH {a}" for a in sb]
        lines += [
            "set -u",
            f"export {LAUNCH_ENV}={q(str(launch_file))}",
            f"export PYTHONPATH={q(root)}${{PYTHONPATH:+:$PYTHONPATH}}",
            "export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
            "# node 0 hosts the c10d rendezvous store, at the address Slurm knows it by",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'export SK_RDZV_ADDR=$(scontrol show node -o "$head" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
            f"export SK_RDZV_PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 1000 ))",
            'echo "shardkeeper: job $SLURM_JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST'
            ' ($SLURM_JOB_NUM_NODES nodes), rendezvous $SK_RDZV_ADDR:$SK_RDZV_PORT"',
            "# Slurm signals the steps itself (requeue, preemption, --signal); the batch shell only waits for them,",
            "# so torchrun gets exactly one SIGTERM (a second one would cut the ranks' checkpoint short).",
            "trap : TERM INT USR1",
            f'srun --kill-on-bad-exit=0 --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" bash -c {q(node_cmd)} &',
            "step=$!",
            'wait "$step"; rc=$?',
            'while kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done',
            'exit "$rc"',
        ]
        return "\n".join(lines) + "\n"

    def submit(self, script: Path, args: list[str] = ()) -> str:  # type: ignore[assignment]
        out = run_command(["sbatch", "--parsable", *args, str(script)], f"submitting {script}")
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch answered {out.strip()!r} for {script}, not a job id")
        return job_id

    def launch(self, req: LaunchRequest, sink: LogSink) -> LaunchOutcome:
        from launch.local import stopped_before_start

        t0 = time.monotonic()
        early = stopped_before_start(req, "the job was submitted")
        if early is not None:
            return early
        run_dir = Path(req.run_dir).resolve()
        jobs_dir = run_dir / "slurm"
        jobs_dir.mkdir(exist_ok=True)
        # The ranks may run on other machines: no watchdog on this process's pid there.
        launch_file = req.seam(launcher_pid=None).write(run_dir)
        output = jobs_dir / f"segment-{req.segment}.out"
        script = script_path(req)
        script.write_text(self.batch_script(req, launch_file, output))
        job_id = self.submit(script, self.submit_args(req, output))
        record_job(run_dir, job_id)
        sink(
            f"shardkeeper: submitted Slurm job {job_id} ({req.topology.nodes} node(s) x {req.topology.procs_per_node} "
            f"rank(s)); output in {output}"
        )
        return _JobWatch(self, req, job_id, output, sink, t0).run()


class _JobWatch:
    """Waits for one job: follows its output file, reports state changes and requeues, stops it on request."""

    def __init__(
        self,
        launcher: SlurmLauncher,
        req: LaunchRequest,
        job_id: str,
        output: Path,
        sink: LogSink,
        t0: float,
    ):
        self.l, self.req, self.job_id, self.output, self.sink, self.t0 = launcher, req, job_id, output, sink, t0
        self.out = OutputSplitter(sink)
        self.offset = output.stat().st_size if output.exists() else 0
        self.stop_reason: str | None = None
        self.stop_at: float | None = None
        self.signal: int | None = None
        self.cancelled = False
        self.note: str | None = None
        self.lost = False
        self.unplaceable_since: float | None = None
        self.restarts: list[InPlaceRestart] = []

    def on_signal(self, signum: int, _frame: object) -> None:
        received_stop.append(signum)  # a second one gives up the upload after the stop (shardkeeper.remote)
        if self.signal is None:
            self.signal = signum
        self.request_stop(f"signal {signal.Signals(signum).name}")

    def request_stop(self, reason: str) -> None:
        """SIGTERM to the job's steps (the ranks commit a checkpoint); the job itself is cancelled after the
        grace period. A pending job is cancelled at once. Runs in a signal handler too: no locks, no waiting."""
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self.stop_at = time.monotonic()
        threading.Thread(target=self._stop_job, name="slurm-stop", daemon=True).start()

    def _stop_job(self) -> None:
        """A pending job is cancelled (Slurm refuses to signal it); a running one gets SIGTERM in its steps."""
        try:
            job = job_info(self.job_id)
        except SlurmError:
            job = None
        commands = (
            [["scancel", self.job_id]]
            if job is not None and job.state == "PENDING"
            else [["scancel", "--state=PENDING", self.job_id], ["scancel", "--signal=TERM", self.job_id]]
        )
        for argv in commands:
            try:
                subprocess.run(argv, capture_output=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass

    def follow(self) -> None:
        try:
            with open(self.output, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        cut = data.rfind(b"\n") + 1
        if cut:
            self.offset += cut
            for line in data[:cut].decode("utf-8", "replace").splitlines():
                self.out.feed(line)
        self._take_restarts()

    def _take_restarts(self) -> None:
        """The restarts in place the nodes' agents said in the job's output: named from the output alone (no rank is
        watched from this host), said in one line and handed to the controller."""
        while len(self.restarts) < len(self.out.generations):
            record, ended = self.out.generations[len(self.restarts)]
            restart = restart_from_record(len(self.restarts) + 1, record, ended)
            self.restarts.append(restart)
            self.sink(restart_said(restart))
            if self.req.on_restart is not None:
                self.req.on_restart(restart)

    def run(self) -> LaunchOutcome:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
            if pending_stop:
                # a stop signal came while the job was being submitted (the early handler took it; the launch's
                # first look found none): stop the job
                self.signal = pending_stop[0]
                self.request_stop(f"signal {signal.Signals(self.signal).name}")
        last: SlurmJob | None = None
        seen_state = ""
        unreachable_since: float | None = None
        try:
            while True:
                try:
                    job = job_info(self.job_id)
                    unreachable_since = None
                except SlurmError as e:  # slurmctld restarting, a network blip: keep waiting a while
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since > CTLD_PATIENCE_S:
                        subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)
                        raise SlurmError(
                            f"lost contact with slurmctld for {CTLD_PATIENCE_S:g} s while waiting for job "
                            f"{self.job_id} ({e}); asked Slurm to cancel it: resume with the same command "
                            "once `scontrol ping` answers"
                        ) from None
                    time.sleep(self.l.poll_s)
                    continue
                self.follow()
                if job is None:  # aged out of slurmctld: the last state seen is what it ended as
                    break
                last = job
                label = f"{job.state}{'' if job.reason in ('None', '') else f' ({job.reason})'}"
                if label != seen_state:
                    attempt = f", attempt {job.restarts + 1}" if job.restarts else ""
                    self.sink(
                        f"shardkeeper: Slurm job {self.job_id}: {label}{attempt}"
                        f"{'' if job.nodelist in ('(null)', '') else f' on {job.nodelist}'}"
                    )
                    seen_state = label
                if job.state in FINAL_STATES:
                    break
                self._poll_stop(job)
                time.sleep(self.l.poll_s)
            if self.signal is not None and not self.cancelled:
                self.cancelled = self._settle_cancel()
        finally:
            for sig, prev in previous.items():
                signal.signal(sig, prev)  # type: ignore[arg-type]
        time.sleep(0.2)
        self.follow()
        if last is None or last.state in FINAL_STATES:
            self._wait_ranks_gone()
            clear_job(Path(self.req.run_dir).resolve())
        return self._outcome(last)

    def _wait_ranks_gone(self) -> None:
        """The job has ended in Slurm's books; return only once none of its ranks holds the run's ranks lock (a
        step slurmd has not killed yet still trains and commits): nothing of the segment outlives this process."""
        run_dir = Path(self.req.run_dir).resolve()
        deadline = time.monotonic() + self.l.grace_s + KILL_MARGIN_S + STEP_KILL_WAIT_S
        said = False
        while ranks_alive(run_dir):
            if time.monotonic() > deadline:
                self.sink(
                    f"shardkeeper: Slurm job {self.job_id} has ended, but a rank still holds "
                    f"{run_dir / RANKS_LOCK}; the next train of this run waits for it (scancel --full "
                    f"{self.job_id} or kill it on its node)"
                )
                return
            if not said:
                self.sink(f"shardkeeper: Slurm job {self.job_id} has ended; waiting for its ranks to exit")
                said = True
            time.sleep(0.2)

    def _poll_stop(self, job: SlurmJob) -> None:
        req = self.req
        if not self.cancelled and req.cancel_check is not None and req.cancel_check():
            self.cancelled = True
            why = getattr(req.cancel_check, "reason", None)  # a stop check may say why (the run's lease was lost)
            self.sink(
                f"shardkeeper: {(why and why()) or 'cancellation requested'}: stopping the job (its ranks commit a "
                "checkpoint first)"
            )
            self.request_stop("cancelled")
        if req.timeout_s and time.monotonic() - self.t0 > req.timeout_s:
            self.request_stop("timeout")
        if self.stop_at is not None and time.monotonic() - self.stop_at > self.l.grace_s + KILL_MARGIN_S:
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)
            self.stop_at = None
        if job.state != "PENDING" or self.stop_reason is not None:
            self.unplaceable_since = None
            return
        total, usable, _ = partition_nodes(self.l.partition)
        want = job.num_nodes or req.topology.nodes
        if usable >= want:
            self.unplaceable_since = None
            return
        now = time.monotonic()
        if self.unplaceable_since is None:
            self.unplaceable_since = now
            self.sink(
                f"shardkeeper: Slurm job {self.job_id} waits for {want} node(s); {usable} of {total} usable now "
                f"(cancelled after {self.l.unplaceable_after_s:g} s)"
            )
        if now - self.unplaceable_since >= self.l.unplaceable_after_s:
            self.note = (
                f"Slurm job {self.job_id} could not be placed: {usable} of {total} node(s) usable, it asks "
                f"for {want}; cancelled it: resume with --nodes {max(1, usable)}"
            )
            self.sink(f"shardkeeper: {self.note}")
            self.lost = True
            self.stop_reason = "allocation lost"
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)

    def _settle_cancel(self) -> bool:
        if self.req.cancel_check is None:
            return False
        deadline = time.monotonic() + self.l.cancel_settle_s
        while time.monotonic() < deadline:
            if self.req.cancel_check():
                return True
            time.sleep(0.25)
        return False

    def _outcome(self, job: SlurmJob | None) -> LaunchOutcome:
        state = job.state if job else "UNKNOWN"
        requeues = job.restarts if job else 0
        code, preempted, note = EXIT_FAILED, False, self.note
        if state == "COMPLETED":
            code = 0
        elif self.cancelled:
            code = EXIT_CANCELLED
        elif self.signal is not None:
            code = 128 + self.signal
        elif self.lost or state in LOST_ALLOCATION:
            code, preempted = EXIT_PREEMPTED, True
            note = (
                note
                or f"Slurm ended job {self.job_id} as {state}; "
                "the next segment resumes from the latest valid checkpoint"
            )
        elif state == "CANCELLED":
            if self.stop_reason == "timeout":
                code = EXIT_PREEMPTED
            else:
                code, self.cancelled = EXIT_CANCELLED, True
                note = note or f"Slurm job {self.job_id} was cancelled outside shardkeeper (scancel)"
        elif job is not None and job.exit_code:
            code = job.exit_code
        elif job is not None and job.exit_signal:
            code = 128 + job.exit_signal
        tail = self.out.lines()
        if state == "OUT_OF_MEMORY":
            tail.append(
                f"Slurm killed job {self.job_id} for exceeding its memory: ask for more memory per node "
                "(--set or the partition's defaults) or use more nodes"
            )

        def kill_cause(end: RankEnd) -> RankEnd:  # this host sees no node's kernel: Slurm's job state says what it can
            if state == "OUT_OF_MEMORY":
                return replace(
                    end,
                    oom="likely",
                    killed_how=f"most likely by the OOM killer: Slurm ended job {self.job_id} as OUT_OF_MEMORY",
                )
            return replace(
                end, killed_how="by the OOM killer or from outside: the node's kernel log is not readable from here"
            )

        # From the job's output alone (torchrun's summaries, the ranks' lines): no rank is watched from this host.
        failure = segment_failure(Path(self.req.run_dir).resolve(), self.req.segment, self.out, kill_cause=kill_cause)
        return LaunchOutcome(
            exit_code=code,
            timed_out=self.stop_reason == "timeout",
            tail=tail,
            seconds=time.monotonic() - self.t0,
            cancelled=self.cancelled,
            stop_signal=self.signal,
            held_back=list(self.out.held),
            scheduler_job=self.job_id,
            scheduler_state=state,
            requeues=requeues,
            note=note,
            scheduler_preempted=preempted,
            failure=failure,
            restarts=list(self.restarts),
        )
