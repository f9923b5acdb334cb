"""What Prefect costs per stage: each stage called as a plain function vs as a Prefect task in a flow.

    python bench/prefect_overhead.py                 # ~1 min: a local server, one 2-rank tiny run, 5 reps
    python bench/prefect_overhead.py --reps 20 --train   # also one train segment each way (2 launches more)

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
        ("validate (deep)", lambda: plain.validate_checkpoint(ckpt, deep=True), lambda: tasks.validate(ckpt, deep=True)),
        ("export (bf16)", lambda: plain.export_and_record(ckpt, export_dir, dtype="bfloat16", overwrite=True),
         lambda: tasks.export(ckpt, export_dir, dtype="bfloat16", overwrite=True)),
        ("mirror-lineage", lambda: _mirror_plain(run), lambda: mirror_lineage(str(run), spec.name)),
    ]


def _mirror_plain(run: Path) -> None:
    """What mirror-lineage computes, without the artifacts: the baseline of that task."""
    from ckpt.lineage import read_events
    from tasks.dashboard import checkpoints_now, draw_lineage_graph, lineage_graph
    from tasks.render import loss_curve_png, segment_statuses, table_rows

    events = read_events(run)
    now = checkpoints_now(run, events)
    draw_lineage_graph(lineage_graph(events, {f"checkpoint:{Path(r['path']).name}" for r in now}), run / "lineage.png",
                       title="bench")
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
    lines = [f"Prefect overhead per stage (mean of {reps} calls after a warm-up; ms)", "",
             "| stage | plain call | Prefect task | overhead |", "|---|---:|---:|---:|"]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="calls per stage and way (after one warm-up)")
    p.add_argument("--train", action="store_true", help="also time one train segment each way")
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
            _train_tiny(work / "run")
            rows = measure(work / "run", work, args.reps, args.train)
        finally:
            if server is not None:
                server.stop()
    from benchlib import publish

    publish("prefect-overhead", table(rows, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
