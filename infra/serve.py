"""Serve the flows as deployments on the local Prefect server (runs execute in this process's children).

    python -m infra.server start          # once: the server on 127.0.0.1:4200, PREFECT_HOME=.prefect/
    python -m infra.serve                 # deployments train-and-export/demo and resume/resume
    prefect deployment run 'train-and-export/demo' --watch    # with PREFECT_API_URL=http://127.0.0.1:4200/api

``train-and-export/demo`` runs the tiny model (configs/tiny.yaml) on 2 ranks to step 10, then on 3
ranks to step 20 (global batch 12 divides both), exports bfloat16 to RUN_DIR/exports/step-00000020 and
publishes to file://RUN_DIR/published; RUN_DIR is runs/demo. ``resume/resume`` takes every preempted run
under runs/ (or the ``--root`` folders) to its plan's end (a run train-and-export started: the remaining
segments at their world sizes, export, publish) or, without a plan, to its until_step at the preempted
segment's world size. An automation runs it for one run on each ``shardkeeper.segment.preempted`` event a
flow run hands over; its interval schedule is off unless ``--resume-every SECONDS``. The serving process
asks the server for flow runs to start every ``--poll-s`` seconds (default 1). For your own model, config and run root
use ``python -m infra.deploy`` (deployments on a work pool, run by ``prefect worker start``).
At most one flow run executes at a time (``--limit``): the ranks need the CPU cores.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from infra.server import (
    DEFAULT_HOME,
    DEFAULT_HOST,
    DEFAULT_PORT,
    SERVE_PID,
    SERVE_STOP_SIGNALS,
    prefect_env,
    setup_logging,
)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "runs"
DEMO_RUN_DIR = RUNS / "demo"
DEMO_DEPLOYMENT = "train-and-export/demo"
RESUME_DEPLOYMENT = "resume/resume"
# How often the serving process polls for flow runs to start. Prefect's default (10 s) is most of the wait between
# a preemption event and the automation's resumed flow run (bench/prefect_overhead.py --automation); a poll of a
# local server costs a few milliseconds.
POLL_S = 1.0


def demo_parameters(run_dir: Path = DEMO_RUN_DIR) -> dict[str, Any]:
    """Parameters of the demo deployment: two segments at world sizes 2 and 3, export, file:// publish."""
    from schemas.requests import SegmentPlan, TrainExportRequest

    req = TrainExportRequest(
        config=str(REPO / "configs" / "tiny.yaml"),
        run_dir=str(run_dir),
        segments=[SegmentPlan(nproc=2, until_step=10), SegmentPlan(nproc=3, until_step=20)],
        export_dtype="bfloat16",
        max_shard_size="5GB",
        publish_target=(run_dir / "published").as_uri(),
        backoff_s=2.0,
    )
    return req.parameters()


def resume_parameters(roots: list[Path]) -> dict[str, Any]:
    """No nproc: a planned run resumes at its plan's world sizes, another at its preempted segment's."""
    from schemas.requests import ResumeRequest

    return ResumeRequest(roots=[str(r) for r in roots], backoff_s=2.0).parameters()


def deployments(resume_every_s: float | None, roots: list[Path] | None = None) -> list[Any]:
    from flows.resume import resume
    from flows.train_and_export import train_and_export
    from infra.deploy import resume_trigger

    roots = roots or [RUNS]
    return [
        train_and_export.to_deployment(
            name="demo",
            parameters=demo_parameters(),
            tags=["shardkeeper", "demo"],
            description="Tiny model: 2 ranks to step 10, 3 ranks to step 20, export, publish",
        ),
        resume.to_deployment(
            name="resume",
            parameters=resume_parameters(roots),
            tags=["shardkeeper"],
            interval=resume_every_s or None,
            triggers=[resume_trigger("resume", [str(r) for r in roots])],
            description=f"Resume preempted runs under {', '.join(map(str, roots))} and finish their "
            "plans: on each preemption event (automation), and every --resume-every "
            "seconds",
        ),
    ]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infra.serve", description="Serve the shardkeeper flows as deployments.")
    p.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("SHARDKEEPER_PREFECT_PORT", DEFAULT_PORT)),
        help="port of the local server (ignored when PREFECT_API_URL is set)",
    )
    p.add_argument("--home", type=Path, default=DEFAULT_HOME, help="PREFECT_HOME (default .prefect/)")
    p.add_argument(
        "--resume-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="run the resume deployment on this interval (default 0: no schedule)",
    )
    p.add_argument(
        "--root",
        type=Path,
        action="append",
        default=None,
        metavar="FOLDER",
        help="folder of run directories the resume deployment scans (repeatable; default runs/)",
    )
    p.add_argument("--limit", type=int, default=1, help="flow runs executed at once")
    p.add_argument(
        "--poll-s",
        type=float,
        default=POLL_S,
        help=f"how often the serving process asks the server for "
        f"flow runs to start (default {POLL_S:g} s; Prefect's own default is 10 s): the largest part of "
        "the wait between a preemption event and the automation's resume",
    )
    return p.parse_args(argv)


def _stop_previous(home: Path) -> None:
    """Stop an earlier ``infra.serve`` of this PREFECT_HOME and wait for it to exit: a runner that exits
    pauses the schedules of its deployments, which would pause the ones registered by this process."""
    from infra.server import _read_pid, stop_process_group

    rec = _read_pid(home / SERVE_PID)
    if rec is None or rec[0] == os.getpid():
        return
    try:
        cmdline = Path(f"/proc/{rec[0]}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return  # gone
    if b"infra.serve" not in cmdline:
        return  # the pid was reused by something else
    print(f"stopping the previous serving process (pid {rec[0]}) first", file=sys.stderr)
    stop_process_group(rec[0], what="serving process", signals=SERVE_STOP_SIGNALS, grace_s=10.0)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    setup_logging()
    home = Path(os.environ.get("PREFECT_HOME", args.home)).resolve()
    # Settings come from the environment: fix them before prefect is imported.
    api_url = os.environ.get("PREFECT_API_URL") or f"http://{DEFAULT_HOST}:{args.port}/api"
    os.environ.update(prefect_env(home, api_url))
    home.mkdir(parents=True, exist_ok=True)
    args.root = [r.resolve() for r in args.root or []]  # from the caller's directory, before the chdir
    os.chdir(REPO)
    from infra.server import is_healthy

    if not is_healthy(api_url):
        print(
            f"error: no Prefect server answers at {api_url}; start one with: python -m infra.server start",
            file=sys.stderr,
        )
        return 2
    _stop_previous(home)
    (home / SERVE_PID).write_text(f"{os.getpid()}\n")
    try:
        from prefect import serve

        serve(
            *deployments(args.resume_every, args.root),
            limit=args.limit,
            print_starting_message=True,
            query_seconds=args.poll_s,
        )
    finally:
        (home / SERVE_PID).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
