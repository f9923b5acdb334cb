"""A real Slurm cluster on this machine: munged, slurmctld and N slurmd daemons emulating N nodes on loopback.

For trying ``shardkeeper train --launcher slurm`` without a cluster, and for the tests that run the Slurm
launcher against real daemons. Needs root (slurmd runs job steps as their user; munged runs as ``munge``) and
Debian's packages ``slurm-wlm slurmctld slurmd slurm-client munge`` (``make system-deps`` installs them).

    python -m infra.slurm_local start [--dir /tmp/shardkeeper-slurm] [--nodes 2] [--cpus 2]
    export SLURM_CONF=/tmp/shardkeeper-slurm/slurm.conf   # what `start` prints
    shardkeeper train --config configs/tiny.yaml --run-dir runs/slurm --launcher slurm --nodes 2 --nproc 1
    python -m infra.slurm_local stop [--dir ...]

Its nodes are ``n1..nN`` (all 127.0.0.1, slurmd ports from ``--port`` + 184), partition ``debug``. A node can be drained
(``scontrol update nodename=n2 state=drain reason=x``) or taken down (``state=down``) like a real one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("SHARDKEEPER_SLURM_DIR", "/tmp/shardkeeper-slurm"))
# slurmctld's port; the nodes' slurmd listen from CTLD_PORT + 184 on (two clusters on one machine need two bases).
CTLD_PORT = int(os.environ.get("SHARDKEEPER_SLURM_PORT", "16817"))
PACKAGES = "slurm-wlm slurmctld slurmd slurm-client munge"


class SlurmSetupError(RuntimeError):
    pass


# slurmd SIGKILLs a cancelled job's steps at most this long after their SIGTERM (slurm.conf KillWait)
KILL_WAIT_S = 30


def _conf(d: Path, nodes: int, cpus: int, memory_mb: int, port: int = CTLD_PORT) -> str:
    host = socket.gethostname()
    lines = [
        "ClusterName=shardkeeper",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "AuthInfo=cred_expire=10",
        "MailProg=/bin/true",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={d}/log/jobcomp.txt",
        "ReturnToService=2",
        "JobRequeue=1",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2",
        "SlurmdTimeout=10",
        f"KillWait={KILL_WAIT_S}",
        "MinJobAge=600",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
    ]
    for i in range(1, nodes + 1):
        lines.append(
            f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 Port={port + 183 + i} "
            f"CPUs={cpus} RealMemory={memory_mb}"
        )
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def available() -> str | None:
    """None when a loopback cluster can be started here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged)"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol") if not shutil.which(b)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install {PACKAGES}; or make system-deps)"
    return None


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _start_munge() -> None:
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return  # a munged already answers
    for d in ("/run/munge", "/var/lib/munge", "/var/log/munge", "/etc/munge"):
        Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["dd", "if=/dev/urandom", f"of={key}", "bs=1024", "count=1"], check=True, capture_output=True)
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True)


def start(
    d: Path = DEFAULT_DIR,
    nodes: int = 2,
    cpus: int | None = None,
    memory_mb: int = 4000,
    timeout_s: float = 60.0,
    port: int = CTLD_PORT,
) -> Path:
    """Start (or find running) the cluster in ``d``; returns the slurm.conf path (export it as SLURM_CONF)."""
    why = available()
    if why:
        raise SlurmSetupError(f"a loopback Slurm cluster cannot start here: {why}")
    cpus = cpus or max(1, os.cpu_count() or 1)
    d = Path(d).resolve()
    conf = d / "slurm.conf"
    text = _conf(d, nodes, cpus, memory_mb, port)
    if conf.exists() and conf.read_text() != text:
        stop(d)
    for sub in ["state", "log"] + [f"spool-n{i}" for i in range(1, nodes + 1)]:
        (d / sub).mkdir(parents=True, exist_ok=True)
    conf.write_text(text)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    _start_munge()
    if not _pid_alive(d / "slurmctld.pid"):
        subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, capture_output=True)
    for i in range(1, nodes + 1):
        if not _pid_alive(d / f"slurmd-n{i}.pid"):
            subprocess.run(["slurmd", "-f", str(conf), "-N", f"n{i}"], env=env, check=True, capture_output=True)
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        if len(states) == nodes and all(s.rstrip("*") in ("idle", "mix", "alloc") for s in states.values()):
            return conf
        if time.monotonic() > deadline:
            log = d / "log" / "slurmctld.log"
            tail = log.read_text().splitlines()[-3:] if log.exists() else []
            raise SlurmSetupError(
                f"Slurm nodes not idle after {timeout_s:g} s: {states or out.stderr.strip()}; "
                f"slurmctld log: {' | '.join(tail)}"
            )
        time.sleep(0.5)


def resume_all_nodes(conf: Path) -> None:
    """Bring drained or downed nodes back (between tests)."""
    env = {**os.environ, "SLURM_CONF": str(conf)}
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True).stdout
    for line in out.splitlines():
        name, state = line.split()
        if not state.rstrip("*").startswith(("idle", "mix", "alloc")):
            subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"], env=env, capture_output=True)


def stop(d: Path = DEFAULT_DIR) -> None:
    """Stop the daemons of the cluster in ``d`` (munged is left running: other clusters may use it)."""
    d = Path(d).resolve()
    for pidfile in sorted(d.glob("slurmd-*.pid")) + [d / "slurmctld.pid"]:
        pid = _pid_alive(pidfile)
        if pid:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                if not _pid_alive(pidfile):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.slurm_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state, spool and log directory")
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes (n1..nN)")
    ap.add_argument("--cpus", type=int, default=None, help="CPUs per node (default: this machine's)")
    ap.add_argument(
        "--port", type=int, default=CTLD_PORT, help="slurmctld port; the nodes use PORT+184.. (SHARDKEEPER_SLURM_PORT)"
    )
    args = ap.parse_args(argv)
    try:
        if args.action == "start":
            if args.nodes < 1:
                raise SlurmSetupError(f"--nodes {args.nodes}: must be at least 1")
            conf = start(args.dir, args.nodes, args.cpus, port=args.port)
            print(f"Slurm on loopback: {args.nodes} node(s), partition debug\nexport SLURM_CONF={conf}")
        else:
            stop(args.dir)
            print(f"stopped the Slurm daemons of {args.dir}")
    except (SlurmSetupError, subprocess.CalledProcessError, OSError) as e:
        msg = e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) and e.stderr else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
