"""Register the shardkeeper flows as deployments for YOUR run, on a Prefect work pool:

    python -m infra.deploy --config configs/my-model.yaml --run-dir /data/runs/llama-ft \\
        --segments 8:2000 --resume-every 600
    PREFECT_WORKER_QUERY_SECONDS=1 prefect worker start --pool shardkeeper   # each machine that launches segments
    prefect deployment run 'train-and-export/llama-ft'           # the deployment's parameters ...
    prefect deployment run 'train-and-export/llama-ft' --param segments='[{"nproc": 4, "until_step": 4000}]'

What it registers (NAME defaults to the run directory's name):

``train-and-export/NAME``  flat parameters (``config``, ``run_dir``, ``segments``, ``export_dtype``,
                          ``publish_target``, ... see ``prefect deployment inspect``) whose defaults are the
                          values given here; ``--param`` overrides one at a time. ``base_dir`` is the folder
                          this command ran in: relative paths given later resolve against it.
``resume/NAME``            scans ``roots`` (default: the run directory's parent folder) and takes each
                          preempted / failed / interrupted run to the end of its plan (RUN_DIR/plan.json:
                          the remaining segments at the plan's world sizes, export, publish -- each once),
                          or, without a plan, to its recorded until_step at the preempted segment's world
                          size; runs another flow run drives, finished plans and runs a person cancelled
                          are skipped. Optional interval schedule (``--resume-every``), and an automation
                          (on unless ``--no-automation``) that runs it for one run as soon as a
                          ``shardkeeper.segment.preempted`` event says the flow run that trained it has
                          handed it over (its ``max_preemption_retries`` spent).

Flow runs execute wherever a worker of the pool runs (``process`` type: the worker starts each flow run
as a subprocess from this project folder). A worker asks for flow runs every ``PREFECT_WORKER_QUERY_SECONDS``
(10 by default): set 1 so that the automation's resume starts within seconds of a preemption. The configuration is
checked before anything is registered: a missing config, a world size that does not divide the batch, a model too large
for memory -- one line, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parent.parent  # the worker's flow runs load the flows from here
DEFAULT_POOL = "shardkeeper"
TRAIN_ENTRYPOINT = "flows/train_and_export.py:train_and_export"
RESUME_ENTRYPOINT = "flows/resume.py:resume"
WORKER_POLL_ENV = "PREFECT_WORKER_QUERY_SECONDS"  # bench/prefect_overhead.py --automation --via worker measures it


def parse_segments(text: str) -> list[dict[str, int]]:
    """``"2:10,3:20"`` -> two segments: 2 ranks to step 10, then 3 ranks to step 20; ``"2x4:1000"``: 2 nodes
    x 4 ranks to step 1000."""
    out = []
    for item in text.split(","):
        where, sep, until = item.strip().partition(":")
        nodes, x, nproc = where.strip().partition("x")
        if not x:
            nodes, nproc = "1", where
        if not sep or not all(v.strip().isdigit() for v in (nodes, nproc, until)):
            raise ValueError(
                f"--segments {text!r}: expected [NODESx]NPROC:UNTIL_STEP[,...], e.g. 2:10,3:20 or 2x4:1000"
            )
        out.append(
            {"nproc": int(nproc), "until_step": int(until), **({"nodes": int(nodes)} if int(nodes) != 1 else {})}
        )
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m infra.deploy",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, default=None, help="RunSpec YAML of the run (optional with --script)")
    p.add_argument(
        "--script",
        type=Path,
        default=None,
        help="train with your own script (it uses shardkeeper.Segment), as shardkeeper train --script",
    )
    p.add_argument(
        "--script-arg",
        dest="script_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one argument of the script (repeatable, in order; --script-arg=--lr for one that starts with -)",
    )
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (created at the first segment)")
    p.add_argument(
        "--segments",
        required=True,
        type=parse_segments,
        metavar="[NODESx]NPROC:STEP[,...]",
        help="the deployment's default segments, e.g. 2:1000 or 2:1000,4:2000 or 2x4:1000 (2 nodes x 4)",
    )
    p.add_argument(
        "--launcher",
        default="local",
        choices=["local", "slurm"],
        help="where segments run: torchrun on the worker's machine, or Slurm jobs submitted from it",
    )
    p.add_argument("--slurm-partition", default=None, help="Slurm partition (default: the cluster's)")
    p.add_argument(
        "--slurm-time",
        dest="slurm_time_min",
        type=int,
        default=None,
        metavar="MIN",
        help="Slurm time limit per job in minutes",
    )
    p.add_argument("--name", help="deployment name (default: the run directory's name)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, as `shardkeeper train --set` (repeatable)",
    )
    p.add_argument(
        "--pool", default=DEFAULT_POOL, help=f"work pool (created as type 'process' if missing; default {DEFAULT_POOL})"
    )
    p.add_argument("--export-dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-shard-size", default=None, help="largest safetensors file, e.g. 5GB")
    p.add_argument("--publish-target", default=None, help="ORG/NAME (Hub) or an fsspec URL; default: no publish")
    p.add_argument(
        "--max-preemption-retries",
        type=int,
        default=None,
        help="resumes inside the flow run before it gives up and leaves it to the automation (default 3)",
    )
    p.add_argument("--backoff-s", type=float, default=None, help="wait before an in-flow resume (default 5)")
    p.add_argument(
        "--root",
        dest="roots",
        type=Path,
        action="append",
        default=None,
        metavar="FOLDER",
        help="folder(s) of run directories the resume deployment scans (default: the run dir's parent)",
    )
    p.add_argument(
        "--resume-nproc",
        type=int,
        default=None,
        help="ranks per node to resume a run without a plan on "
        "(default: the preempted segment's; a train-and-export run resumes at its plan's world size)",
    )
    p.add_argument(
        "--resume-nodes",
        type=int,
        default=None,
        help="nodes to resume a run without a plan on, fewer if fewer are usable (default: the preempted segment's)",
    )
    p.add_argument(
        "--resume-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="schedule the resume deployment on this interval (default 0: no schedule)",
    )
    p.add_argument("--no-automation", action="store_true", help="no resume-on-preemption automation")
    p.add_argument("--tag", action="append", default=[], help="extra tag on both deployments (repeatable)")
    return p.parse_args(argv)


def requests(args: argparse.Namespace) -> tuple[Any, Any]:
    """The two deployments' parameters as validated requests (paths absolute, base_dir = this folder)."""
    from schemas.requests import ResumeRequest, TrainExportRequest

    base = str(Path.cwd())
    optional = {
        "export_dtype": args.export_dtype,
        "max_shard_size": args.max_shard_size,
        "publish_target": args.publish_target,
        "max_preemption_retries": args.max_preemption_retries,
        "backoff_s": args.backoff_s,
    }
    place = {"launcher": args.launcher, "slurm_partition": args.slurm_partition, "slurm_time_min": args.slurm_time_min}
    place = {k: v for k, v in place.items() if v is not None and v != "local"}
    segments = [{**seg, **place} for seg in args.segments]
    script = {"script": str(args.script), "script_args": args.script_args} if args.script is not None else {}
    train = TrainExportRequest(
        config=str(args.config) if args.config is not None else None,
        run_dir=str(args.run_dir),
        segments=segments,
        overrides=args.overrides,
        base_dir=base,
        **script,
        **{k: v for k, v in optional.items() if v is not None},
    ).resolved()
    roots = [str(r) for r in args.roots] if args.roots else [str(Path(train.run_dir).parent)]
    # No nproc/nodes unless asked for: a planned run resumes at its plan's world size, another at its preempted
    # segment's (not at the last planned segment's, which is what a deploy-time default would be).
    sizes = {k: v for k, v in (("nproc", args.resume_nproc), ("nodes", args.resume_nodes)) if v is not None}
    resume = ResumeRequest(
        roots=roots,
        base_dir=base,
        **place,
        **sizes,
        **({"max_preemption_retries": args.max_preemption_retries} if args.max_preemption_retries is not None else {}),
    ).resolved()
    return train, resume


def resume_trigger(name: str, roots: list[str]) -> Any:
    """The automation: a segment under one of ``roots`` was preempted and its flow run gave up -> resume/NAME
    for that run only (``run_dirs`` from the event; ``roots`` emptied so nothing else is touched)."""
    from prefect.events import DeploymentEventTrigger

    from tasks.events import RESUMED_BY_LABEL, run_resource_match

    return DeploymentEventTrigger(
        name=f"resume {name} on preemption",
        expect={"shardkeeper.segment.preempted"},
        match={"prefect.resource.id": [run_resource_match(r) for r in roots], RESUMED_BY_LABEL: "automation"},
        parameters={"run_dirs": ["{{ event.payload.run_dir }}"], "roots": []},
    )


async def ensure_pool(name: str) -> bool:
    """Create work pool ``name`` (type process) if missing; True if a worker polls it now."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    async with get_client() as client:
        try:
            pool = await client.read_work_pool(name)
        except ObjectNotFound:
            pool = await client.create_work_pool(
                WorkPoolCreate(
                    name=name,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                    description="shardkeeper segments: each flow run launches torchrun from the worker's machine",
                )
            )
            print(f"created work pool {name!r} (type process)")
        status = getattr(pool.status, "value", pool.status)
        return str(status).upper() == "READY"  # READY: at least one worker polled it recently


def deploy(args: argparse.Namespace) -> tuple[str, str]:
    """Register both deployments (their flows load from PROJECT on the worker's machine)."""
    from prefect import flow as prefect_flow

    train, resume = requests(args)
    name = args.name or Path(train.run_dir).name
    # enforce_parameter_schema=False: the flow checks its parameters itself and fails the flow run with one
    # line naming the parameter and the fix (Prefect's check would refuse the run with a list of schema errors).
    common = dict(work_pool_name=args.pool, tags=["shardkeeper", name, *args.tag], enforce_parameter_schema=False)
    train_dep = prefect_flow.from_source(source=str(PROJECT), entrypoint=TRAIN_ENTRYPOINT).to_deployment(
        name=name,
        parameters=train.parameters(),
        **common,
        description=f"Train {name} ({train.script or train.config}) in {train.run_dir}, "
        "then validate, export and publish. "
        "Parameters default to the values given at deploy time.",
    )
    resume_dep = prefect_flow.from_source(source=str(PROJECT), entrypoint=RESUME_ENTRYPOINT).to_deployment(
        name=name,
        parameters=resume.parameters(),
        interval=args.resume_every or None,
        triggers=[] if args.no_automation else [resume_trigger(name, resume.roots)],
        **common,
        description=f"Resume preempted runs under {', '.join(resume.roots)} and take each to its plan's end "
        "(segments at the plan's world sizes, export, publish); a run without a plan at "
        + (f"{resume.nproc} ranks per node." if resume.nproc else "its preempted segment's world size."),
    )
    for dep in (train_dep, resume_dep):
        dep.apply(work_pool_name=args.pool)
    return f"train-and-export/{name}", f"resume/{name}"


def _as_flags(message: str) -> str:
    """Name this command's flags in messages written for the flow's parameters."""
    for param, flag in (
        ("parameter config", "--config"),
        ("parameter script", "--script"),
        ("parameter run_dir", "--run-dir"),
        ("field segments", "--segments"),
        ("segments[", "--segments item ["),
    ):
        message = message.replace(param, flag)
    return message.replace(" (an absolute path, or relative to the parameter base_dir)", "")


def train_model(e: Any) -> Any:
    from schemas.requests import ResumeRequest, TrainExportRequest

    return TrainExportRequest if e.title == "TrainExportRequest" else ResumeRequest


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
    except ValueError as e:  # --segments
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from flows.common import check_train_request
    from infra.server import is_healthy
    from schemas.errors import ShardkeeperError
    from shardkeeper.config import explain

    try:
        train, _ = requests(args)
        check_train_request(train)  # before anything is registered: a bad config is one line, here
    except ShardkeeperError as e:
        print(f"error: {_as_flags(str(e))}", file=sys.stderr)
        return 2
    except ValidationError as e:  # the arguments, as the request models see them: one line
        print(f"error: {_as_flags(explain(e, 'infra.deploy', type(train_model(e))))}", file=sys.stderr)
        return 2
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api or not is_healthy(api):
        print(
            f"error: no Prefect server answers at {api or '(PREFECT_API_URL is not set)'}; start one with "
            "`python -m infra.server start` and export PREFECT_API_URL=http://127.0.0.1:4200/api",
            file=sys.stderr,
        )
        return 2
    worker_online = asyncio.run(ensure_pool(args.pool))
    train_name, resume_name = deploy(args)
    print(
        f"deployed {train_name} and {resume_name} on work pool {args.pool!r}"
        f"{'' if args.no_automation else ' (automation: resume on preemption)'}"
        f"{f', resume every {args.resume_every:g} s' if args.resume_every else ''}"
    )
    if not worker_online:
        print(
            f"no worker polls work pool {args.pool!r} yet: start one with "
            f"`{WORKER_POLL_ENV}=1 prefect worker start --pool {args.pool}` (a worker asks for flow runs every "
            f"{WORKER_POLL_ENV} seconds, 10 by default: up to that long before the automation's resume starts)"
        )
    print(f"run it:  prefect deployment run '{train_name}'   (override with --param KEY=VALUE)")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("SHARDKEEPER_LOG", "WARNING"))
    sys.exit(main())
