"""The container entry of a rank pod (rendered by ``launch.kubernetes``)::

    python -m launch.k8s_pod -- python -m torch.distributed.run --nnodes=2 ... -m trainer.segment RUN_DIR 100 3

1. A new run: the run directory has no ``run.yaml`` yet, so the RunSpec from the ConfigMap
   (``SHARDKEEPER_RUN_SPEC``) is installed there (atomically; the first pod wins, the others find it).
   An existing run keeps its own ``run.yaml``, as ``shardkeeper train`` does.
2. torchrun runs as a child; SIGTERM/SIGUSR1 to this process (the kubelet's preemption) are forwarded once
   (a second SIGTERM would make torchrun abandon the ranks' checkpoint).
3. The container's exit code says how the segment ended, in the terms of the job controller: torchrun exits 1
   for any non-zero rank, so the segment's report (``RUN_DIR/.segment-status.json``, written by rank 0, which
   may run in another pod) decides: 0 completed, 143 preempted (retryable for Kubeflow's ExitCode policy and
   the JobSet's podFailurePolicy), 1 failed (permanent). A pod that was asked to stop and saw no report (a
   preemption during start-up) is preempted too.

Stdlib and schemas only (runs before anything heavy, like trainer.lifetime).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from schemas.errors import ShardkeeperError
from schemas.seam import LAUNCH_FILE, REPORT_FILE, SegmentLaunch, SegmentReport

EXIT_POD_COMPLETED = 0
EXIT_POD_FAILED = 1
EXIT_POD_PREEMPTED = 143  # 128 + SIGTERM; launch.kubernetes renders the retry policies around this value
SPEC_ENV = "SHARDKEEPER_RUN_SPEC"
REPORT_WAIT_S = 30.0  # rank 0 (perhaps in another pod) writes the report after the last commit


def pod_exit_code(torchrun_code: int, report: SegmentReport | None, stopped: bool) -> int:
    """The container's exit code for a segment that ended so."""
    if torchrun_code == 0:
        return EXIT_POD_COMPLETED
    if report is not None:
        return EXIT_POD_PREEMPTED if report.status == "preempted" else EXIT_POD_FAILED
    return EXIT_POD_PREEMPTED if stopped else EXIT_POD_FAILED


def install_run_spec(run_dir: Path, source: str | None) -> str:
    """Put the ConfigMap's run.yaml into a run directory that has none; what happened, as a line."""
    target = run_dir / "run.yaml"
    if target.exists():
        return f"{target}: the run keeps its own spec"
    if not source:
        return f"{target}: missing and {SPEC_ENV} is not set; the ranks will refuse the run directory"
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".run.yaml.{os.getpid()}.{os.uname().nodename}.tmp"
    tmp.write_text(Path(source).read_text(encoding="utf-8"), encoding="utf-8")
    try:
        os.link(tmp, target)  # never replaces: the first pod's copy wins, the others are the same text anyway
        return f"{target}: installed from {source}"
    except FileExistsError:
        return f"{target}: installed by another pod"
    finally:
        tmp.unlink(missing_ok=True)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def fresh_report(run_dir: Path, segment: int, before: tuple[int, int] | None, wait_s: float) -> SegmentReport | None:
    """The report of ``segment`` written since ``before`` (an earlier attempt's must not decide this one)."""
    deadline = time.monotonic() + wait_s
    while True:
        stamp = _stamp(run_dir / REPORT_FILE)
        if stamp is not None and stamp != before:
            report = SegmentReport.read(run_dir, segment)
            if report is not None:
                return report
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def run(command: list[str], launch: SegmentLaunch, wait_s: float = REPORT_WAIT_S) -> int:
    run_dir = Path(launch.run_dir)
    print(f"shardkeeper-pod: {install_run_spec(run_dir, os.environ.get(SPEC_ENV))}", flush=True)
    before = _stamp(run_dir / REPORT_FILE)
    proc = subprocess.Popen(command)
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not stopped:
            proc.send_signal(signum)
        stopped.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    code = proc.wait()
    report = None if code == 0 else fresh_report(run_dir, launch.segment, before, wait_s)
    exit_code = pod_exit_code(code, report, bool(stopped))
    status = "completed" if code == 0 else (report.status if report else "unreported")
    print(
        f"shardkeeper-pod: torchrun exited {code}; segment {launch.segment} "
        f"{status}{' after a stop signal' if stopped else ''}; "
        f"container exits {exit_code}",
        flush=True,
    )
    return exit_code


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m launch.k8s_pod -- TORCHRUN COMMAND...", file=sys.stderr)
        return 2
    try:
        launch = SegmentLaunch.from_environ()
    except ShardkeeperError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_POD_FAILED
    if launch is None:
        print(f"error: SHARDKEEPER_LAUNCH is not set; it names the {LAUNCH_FILE} the manifest mounts", file=sys.stderr)
        return EXIT_POD_FAILED
    return run(argv[1:], launch)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
