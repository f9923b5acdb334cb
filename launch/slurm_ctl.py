"""Slurm's control plane as the launcher sees it: its client commands (one line naming the fix when they fail),
a job as slurmctld reports it, a partition's usable nodes, and the job a run's segment submitted (a second
segment must not start beside a job Slurm still holds).

Stdlib and schemas only: no torch, no prefect.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from schemas.errors import ShardkeeperError

# Job states after which Slurm runs the job no more (a requeued job goes back to PENDING instead).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "SPECIAL_EXIT",
}
USABLE_NODE_STATES = ("idle", "mix", "alloc", "comp", "resv", "plnd")


ACTIVE_JOB = "active-job"  # RUN_DIR/slurm/active-job: the id of the job a segment submitted, until it ends


def record_job(run_dir: Path, job_id: str) -> None:
    path = Path(run_dir) / "slurm" / ACTIVE_JOB
    tmp = path.with_suffix(".tmp")
    tmp.write_text(job_id + "\n")
    os.replace(tmp, path)


def clear_job(run_dir: Path) -> None:
    (Path(run_dir) / "slurm" / ACTIVE_JOB).unlink(missing_ok=True)


def live_job(run_dir: Path) -> SlurmJob | None:
    """The job an earlier segment of ``run_dir`` submitted, when Slurm still holds it pending or running (its
    launching command was killed before it could wait for it): a second segment must not start beside it."""
    try:
        job_id = (Path(run_dir) / "slurm" / ACTIVE_JOB).read_text().strip()
    except OSError:
        return None
    if not job_id.isdigit() or not environment_ok():
        return None
    try:
        job = job_info(job_id)
    except SlurmError:
        return None
    if job is None or job.state in FINAL_STATES:
        clear_job(run_dir)
        return None
    return job


class SlurmError(ShardkeeperError):
    """Slurm could not be reached or refused the job (one line, names the command and the fix)."""


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str
    reason: str
    exit_code: int
    exit_signal: int
    restarts: int
    num_nodes: int
    nodelist: str


def run_command(argv: list[str], what: str, timeout: float = 30.0) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"{argv[0]}: not found on PATH; install the Slurm client commands (sbatch, squeue, scontrol, "
            "sinfo) or use --launcher local"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{argv[0]} did not answer in {timeout:g} s while {what}: is slurmctld reachable? "
            "(check SLURM_CONF and `scontrol ping`)"
        ) from None
    if proc.returncode != 0:
        err = " ".join((proc.stderr or proc.stdout).split())[:300] or f"exit code {proc.returncode}"
        fix = (
            "; is slurmctld running and SLURM_CONF the cluster's? (`scontrol ping`)"
            if "Unable to contact" in err or "configuration" in err
            else ""
        )
        raise SlurmError(f"{argv[0]} failed while {what}: {err}{fix}")
    return proc.stdout


def parse_job(text: str) -> SlurmJob | None:
    """``scontrol show job -o`` output (key=value pairs on one line) -> SlurmJob."""
    fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))
    if "JobId" not in fields:
        return None
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return SlurmJob(
        job_id=fields["JobId"],
        state=fields.get("JobState", "UNKNOWN"),
        reason=fields.get("Reason", "None"),
        exit_code=int(code or 0),
        exit_signal=int(sig or 0),
        restarts=int(fields.get("Restarts", "0") or 0),
        num_nodes=int((fields.get("NumNodes", "0") or "0").split("-")[0]),
        nodelist=fields.get("NodeList", "(null)"),
    )


def job_info(job_id: str) -> SlurmJob | None:
    """The job as slurmctld sees it now (None once it has aged out of slurmctld's memory)."""
    try:
        out = run_command(["scontrol", "show", "job", "-o", job_id], f"reading job {job_id}")
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return None
        raise
    return parse_job(out)


def partition_nodes(partition: str | None) -> tuple[int, int, int]:
    """(nodes in the partition, nodes usable now (not down/drained/failing), CPUs of its smallest node)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %t %c"] + (["-p", partition] if partition else [])
    out = run_command(argv, f"reading partition {partition or '(default)'}")
    nodes: dict[str, tuple[str, int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            nodes[parts[0]] = (parts[1].rstrip("*~#!%$@^-"), int(parts[2]) if parts[2].isdigit() else 0)
    usable = sum(1 for state, _ in nodes.values() if state.startswith(USABLE_NODE_STATES))
    return len(nodes), usable, min((c for _, c in nodes.values()), default=0)


def environment_ok() -> bool:
    """Slurm's client commands are on PATH (whether slurmctld answers is preflight's question)."""
    return all(
        any(os.access(os.path.join(d, c), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))
        for c in ("sbatch", "scontrol", "sinfo", "scancel")
    )
