"""What Prefect costs per stage: each stage called as a plain function vs as a Prefect task in a flow; and
where the time goes between a preemption event and the segment the automation resumes.

    python bench/prefect_overhead.py                 # ~1 min: a local server, one 2-rank tiny run, 5 reps
    python bench/prefect_overhead.py --reps 20 --train   # also one train segment each way (2 launches more)
    python bench/prefect_overhead.py --automation --reps 3 --poll-s 10,1   # ~3 min: 6 resumes, 6 launches

``--automation``: ``python -m infra.serve`` (its resume deployment and its automation, as a user runs them)
serves a run root holding one tiny run; each repetition marks the run preempted (one more step to train), emits
the ``shardkeeper.segment.preempted`` event the flow run would send when it hands a run over, and follows the
chain to the resumed segment: the server receives the event, the automation runs the resume deployment (its
flow run is created), the serving process picks the flow run up (it polls every ``--poll-s`` seconds), the
flow run's process starts, the train task starts, torchrun starts the ranks, every rank has loaded the
checkpoint, the first step is done. It prints, per phase, the seconds since the event (median, min-max), once
per poll interval given (Prefect's default is 10 s; infra.serve's is 1 s). ``--via worker``: the same with the
deployments ``python -m infra.deploy`` registers, run by ``prefect worker start`` (PREFECT_WORKER_QUERY_SECONDS).

Starts its own Prefect server (SQLite, temporary PREFECT_HOME) unless PREFECT_API_URL is set, trains
the tiny model 5 steps on 2 ranks, then times every cheap stage ``--reps`` times both ways (after one
warm-up call each) and prints a markdown table: mean milliseconds plain, as a task, and the difference.
The task figure includes creating the task run, its state changes, its log lines and its result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Stage = tuple[str, Callable[[], Any], Callable[[], Any]]


def timed(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm-up: imports, first connection
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def stages(run: Path, work: Path) -> list[Stage]:
    """(name, plain call, task call) for each stage that is cheap enough to repeat."""
    from schemas import RunSpec
    from shardkeeper import stages as plain
    from shardkeeper.config import load_run_spec
    from tasks import stage_tasks as tasks
    from tasks.lineage import mirror_lineage

    spec: RunSpec = load_run_spec(run / "run.yaml")
    ckpt = str(run / "checkpoints" / "step-00000005")
    export_dir = str(work / "export")
    return [
        ("load-run-spec", lambda: load_run_spec(run / "run.yaml"), lambda: tasks.load_spec(str(run / "run.yaml"))),
        ("plan-topology", lambda: plain.plan_topology(spec, 2), lambda: tasks.plan_topology(spec, 2)),
        ("inspect-run", lambda: plain.run_state(run), lambda: tasks.inspect_run(str(run))),
        ("reshard (DCP no-op)", lambda: plain.reshard(ckpt, 3), lambda: tasks.reshard(ckpt, 3)),
        (
            "validate (deep)",
            lambda: plain.validate_checkpoint(ckpt, deep=True),
            lambda: tasks.validate(ckpt, deep=True),
        ),
        (
            "export (bf16)",
            lambda: plain.export_and_record(ckpt, export_dir, dtype="bfloat16", overwrite=True),
            lambda: tasks.export(ckpt, export_dir, dtype="bfloat16", overwrite=True),
        ),
        ("mirror-lineage", lambda: _mirror_plain(run), lambda: mirror_lineage(str(run), spec.name)),
    ]


def _mirror_plain(run: Path) -> None:
    """What mirror-lineage computes, without the artifacts: the baseline of that task."""
    from ckpt.commit.lineage import read_events
    from tasks.dashboard import checkpoints_now, draw_lineage_graph, lineage_graph
    from tasks.render import loss_curve_png, segment_statuses, table_rows

    events = read_events(run)
    now = checkpoints_now(run, events)
    draw_lineage_graph(
        lineage_graph(events, {f"checkpoint:{Path(r['path']).name}" for r in now}), run / "lineage.png", title="bench"
    )
    table_rows(events)
    loss_curve_png(run, run / "loss.png", statuses=segment_statuses(events))


def measure(run: Path, work: Path, reps: int, train: bool) -> list[tuple[str, float, float]]:
    from prefect import flow

    rows: list[tuple[str, float, float]] = []
    the_stages = stages(run, work)

    @flow(name="prefect-overhead-bench")
    def bench_flow() -> None:
        for name, plain_call, task_call in the_stages:
            plain_ms = statistics.mean(timed(plain_call, reps))
            task_ms = statistics.mean(timed(task_call, reps))
            rows.append((name, plain_ms, task_ms))
        if train:
            rows.append(_train_both_ways(run))

    t0 = time.perf_counter()

    @flow(name="prefect-overhead-empty")
    def empty() -> None:
        return None

    empty_ms = statistics.mean(timed(empty, reps))
    bench_flow()
    rows.append(("(empty flow run)", 0.0, empty_ms))
    print(f"measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rows


def _train_both_ways(run: Path) -> tuple[str, float, float]:
    """One more segment each way (5 steps each): torchrun start-up dominates, so one rep is enough."""
    from shardkeeper import stages as plain
    from shardkeeper.config import load_run_spec
    from tasks import stage_tasks as tasks

    spec = load_run_spec(run / "run.yaml")
    topo = plain.plan_topology(spec, 2)
    step = plain.run_state(run).step
    t0 = time.perf_counter()
    plain.train_segment(spec, run, topo, step + 5, sink=lambda line: None)
    plain_ms = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    tasks.train_segment(spec, str(run), topo, step + 10)
    return "train-segment (5 steps, 2 ranks)", plain_ms, (time.perf_counter() - t0) * 1000


def table(rows: list[tuple[str, float, float]], reps: int) -> str:
    lines = [
        f"Prefect overhead per stage (mean of {reps} calls after a warm-up; ms)",
        "",
        "| stage | plain call | Prefect task | overhead |",
        "|---|---:|---:|---:|",
    ]
    for name, plain_ms, task_ms in rows:
        lines.append(f"| {name} | {plain_ms:.1f} | {task_ms:.1f} | {task_ms - plain_ms:+.1f} |")
    return "\n".join(lines)


def _train_tiny(run: Path) -> None:
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import plan_topology, train_segment

    spec = load_run_spec(ROOT / "configs" / "tiny.yaml")
    res = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), 5, sink=lambda line: None)
    if res.status != "completed":
        raise SystemExit(f"error: the tiny training run {res.status}: {res.failure}")


# --------------------------------------------------------------------------- automation latency
PHASES = (  # (key, what happened), in the order they happen
    ("received", "the server received the event"),
    ("action", "the automation ran the resume deployment (flow run created)"),
    ("pending", "the serving process picked the flow run up (Pending)"),
    ("running", "the flow run's process started it (Running)"),
    ("task", "the train task started (scan, plan, spec, topology done)"),
    ("launched", "torchrun launched (the segment's t = 0)"),
    ("imports", "every rank imported its modules (torch, transformers)"),
    ("loaded", "every rank loaded the checkpoint"),
    ("first_step", "the first step of the resumed segment done"),
)


def _api(fn: Callable[[Any], Any]) -> Any:
    import asyncio

    from prefect.client.orchestration import get_client

    async def go() -> Any:
        async with get_client() as client:
            return await fn(client)

    return asyncio.run(go())


def _events(body: dict[str, Any]) -> list[dict[str, Any]]:
    async def go(client: Any) -> list[dict[str, Any]]:
        r = await client._client.post("/events/filter", json={"filter": body, "limit": 50})
        r.raise_for_status()
        return r.json()["events"]

    return _api(go)


def _wait(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.25)
    raise SystemExit(f"error: no {what} within {timeout:.0f} s")


def _stamp(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _preempt(run: Path) -> tuple[int, int]:
    """Make the run's last segment a preempted one with one more step to train; returns (segment, until_step)."""
    import json

    from shardkeeper.stages import run_state

    state = run_state(run)
    lines = (run / "segments.jsonl").read_text().splitlines()
    seg = sum(1 for x in lines if json.loads(x).get("event") == "start")
    until = state.step + 1
    with open(run / "segments.jsonl", "a") as f:
        for rec in (
            {
                "event": "start",
                "segment": seg,
                "until_step": until,
                "start_step": state.step,
                "world_size": 2,
                "nodes": 1,
                "launcher": "local",
                "time": "2026-01-01T00:00:00Z",
            },
            {
                "event": "end",
                "segment": seg,
                "status": "preempted",
                "exit_code": 75,
                "start_step": state.step,
                "end_step": state.step,
                "run_dir": str(run),
                "checkpoint": None,
                "seconds": 1.0,
                "failure": None,
            },
        ):
            f.write(json.dumps(rec) + "\n")
    return seg, until


def _one_resume(run: Path) -> dict[str, float]:
    """Emit one preemption event for ``run`` and follow the chain; seconds since the event, per phase."""
    from prefect.events.worker import EventsWorker

    from schemas import ClusterTopology, SegmentResult
    from schemas.seam import SegmentReport
    from tasks.events import emit_segment, run_resource

    seg, until = _preempt(run)
    since = time.time() - 1
    result = SegmentResult(
        run_dir=str(run),
        status="preempted",
        exit_code=75,
        segment=seg,
        start_step=until - 1,
        end_step=until - 1,
        topology=ClusterTopology(procs_per_node=2),
    )
    emit_segment(str(run), "tiny-llama", result, until, 2, resumed_by="automation")
    EventsWorker.drain_all()
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(since)) + "Z"
    event = _wait(
        lambda: _events(
            {
                "event": {"name": ["shardkeeper.segment.preempted"]},
                "occurred": {"since": iso},
                "resource": {"id": [run_resource(run)["prefect.resource.id"]]},
            }
        ),
        60,
        "preemption event on the server",
    )[0]
    t0 = _stamp(event["occurred"])

    def executed() -> dict[str, Any] | None:
        for e in _events({"event": {"name": ["prefect.automation.action.executed"]}, "occurred": {"since": iso}}):
            related = {r.get("prefect.resource.role"): r["prefect.resource.id"] for r in e.get("related", [])}
            if related.get("triggering-event") == f"prefect.event.{event['id']}" and "flow-run" in related:
                return {"at": e["occurred"], "flow_run": related["flow-run"].rpartition(".")[2]}
        return None

    action = _wait(executed, 120, "automation action for the event")
    import uuid

    run_id = uuid.UUID(action["flow_run"])
    flow_run = _wait(
        lambda: (r := _api(lambda c: c.read_flow_run(run_id))).state and r.state.is_final() and r,
        300,
        "end of the resumed flow run",
    )
    if not flow_run.state.is_completed():
        raise SystemExit(f"error: the resume flow run ended {flow_run.state.name}: {flow_run.state.message}")
    states = {s.name: s.timestamp.timestamp() for s in _api(lambda c: c.read_flow_run_states(run_id))}
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    tasks = _api(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))))
    train = next(t for t in tasks if t.name.startswith("train-to-step"))
    report = SegmentReport.read(run, seg + 1)
    times = report.times if report is not None else None
    if times is None or times.origin != "launcher":
        raise SystemExit("error: the resumed segment reported no start-up times")
    out = {
        "received": _stamp(event["received"]),
        "action": _stamp(action["at"]),
        "pending": states["Pending"],
        "running": states["Running"],
        "task": train.start_time.timestamp(),
        "launched": times.origin_time,
        "imports": times.origin_time + (times.imports_s or float("nan")),
        "loaded": times.origin_time + (times.loaded_s or float("nan")),
        "first_step": times.origin_time + (times.first_step_s or float("nan")),
    }
    return {k: v - t0 for k, v in out.items()}


def _start_resumer(via: str, root: Path, poll_s: float, log: Path) -> Any:
    """What runs the automation's flow runs: ``python -m infra.serve`` over ``root`` (via "serve"), or the
    deployments of ``python -m infra.deploy`` and a ``prefect worker`` of their pool (via "worker"); returns the
    process once the resume deployment and its automation are registered."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if via == "serve":
        cmd = [sys.executable, "-m", "infra.serve", "--root", str(root), "--poll-s", str(poll_s)]
        deployment, automation = "resume/resume", "resume resume on preemption"
    else:
        from infra.deploy import main as deploy

        pool = f"bench-{os.getpid()}"
        if (
            deploy(
                [
                    "--config",
                    str(ROOT / "configs" / "tiny.yaml"),
                    "--run-dir",
                    str(root / "auto"),
                    "--segments",
                    "2:1000",
                    "--pool",
                    pool,
                    "--name",
                    "auto",
                ]
            )
            != 0
        ):
            raise SystemExit("error: infra.deploy failed")
        cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool]
        env["PREFECT_WORKER_QUERY_SECONDS"] = f"{poll_s:g}"
        deployment, automation = "resume/auto", "resume auto on preemption"
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 - the child keeps it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def ready() -> bool:
        if proc.poll() is not None:
            raise SystemExit(f"error: {' '.join(cmd[1:4])} exited: {log.read_text()[-2000:]}")
        from prefect.exceptions import ObjectNotFound

        try:
            _api(lambda c: c.read_deployment_by_name(deployment))
        except ObjectNotFound:
            return False
        return bool(_api(lambda c: c.read_automations_by_name(automation)))

    _wait(ready, 120, f"resume deployment and automation ({via})")
    time.sleep(max(poll_s, 2.0) + 3.0)  # the first poll has happened (a worker also announces itself first)
    return proc


def automation_latency(work: Path, reps: int, polls: list[float], via: str) -> str:
    from infra.server import stop_process_group

    root = work / "runs"
    _train_tiny(root / "auto")
    results: dict[float, list[dict[str, float]]] = {}
    for poll in polls:
        proc = _start_resumer(via, root, poll, work / f"{via}-{poll:g}.log")
        try:
            results[poll] = [_one_resume(root / "auto") for _ in range(reps)]
        finally:
            stop_process_group(proc.pid, grace_s=10.0, what=via)
    who = "serving process (infra.serve)" if via == "serve" else "worker (infra.deploy's pool)"
    head = ["seconds after the preemption event", *[f"{via} polls every {p:g} s" for p in polls]]
    rows = [
        [what.replace("serving process", who.split(" (")[0]), *[_fmt([r[key] for r in results[p]]) for p in polls]]
        for key, what in PHASES
    ]
    return (
        f"Automation latency: a preemption event -> the resumed segment, the automation's flow run run by a {who}; "
        f"median (min-max) of {reps} resumes, seconds since the event\n\n"
        + "\n".join(
            [
                "| " + " | ".join(head) + " |",
                "|---" + "|---:" * len(polls) + "|",
                *["| " + " | ".join(r) + " |" for r in rows],
            ]
        )
    )


def _fmt(samples: list[float]) -> str:
    return f"{statistics.median(samples):.1f} ({min(samples):.1f}–{max(samples):.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="calls per stage and way (after one warm-up); resumes per poll interval with --automation",
    )
    p.add_argument("--train", action="store_true", help="also time one train segment each way")
    p.add_argument(
        "--automation",
        action="store_true",
        help="time the chain from a preemption event to the resumed segment instead (see above)",
    )
    p.add_argument(
        "--poll-s",
        default="10,1",
        help="with --automation: the poll intervals to compare, comma-separated (default 10,1)",
    )
    p.add_argument(
        "--via",
        choices=["serve", "worker"],
        default="serve",
        help="with --automation: who runs the "
        "automation's flow runs: infra.serve, or a process worker of infra.deploy's pool",
    )
    args = p.parse_args(argv)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the table, not a log per task run
    import logging

    from infra.server import PrefectServer
    from tests.harness import free_port

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="prefect-overhead-") as tmp:
        work = Path(tmp)
        server = None
        if "PREFECT_API_URL" not in os.environ:
            server = PrefectServer(work / "prefect-home", port=free_port()).start()
            os.environ.update(server.env())
        try:
            if args.automation:
                body = automation_latency(work, args.reps, [float(x) for x in args.poll_s.split(",")], args.via)
            else:
                _train_tiny(work / "run")
                body = table(measure(work / "run", work, args.reps, args.train), args.reps)
        finally:
            if server is not None:
                server.stop()
    from benchlib import publish

    publish(f"automation-latency-{args.via}" if args.automation else "prefect-overhead", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
