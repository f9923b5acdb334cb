"""How long the lineage dashboard takes for long runs: rendering, mirroring into Prefect, and the page in a browser.

    python bench/dashboard_bench.py                 # ~1-2 min: 10 / 100 / 1,000 / 10,000 checkpoints, 5 reps
    python bench/dashboard_bench.py --no-browser    # rendering only (no Prefect server, no Chromium)
    python bench/dashboard_bench.py --no-browser --sizes 1000 --segments 100   # a run preempted over and over

For each size it writes a run directory with that many checkpoint events in lineage.jsonl (4 segments:
preempted, completed, resharded 2 -> 4, preempted, resharded 4 -> 3; an export and a publish) and one
metrics line per checkpoint; the last 3 checkpoints count as on disk (the graph marks them by id; no
tensor files are written). Times, as medians with min-max of ``--reps`` runs after one warm-up:

- render: lineage graph model + PNG, loss curve PNG, event-table rows (what ``mirror-lineage`` computes);
- mirror: the whole ``mirror-lineage`` task against a local Prefect server (creates the four artifacts);
- page: headless Chromium opening the graph artifact's page until its image has loaded (needs the
  ``chromium`` package and ``playwright``; skipped with a note otherwise).

Goal (issue: dashboard pages render in < 2 s for a run of 1,000 checkpoints). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import fmt, timed  # noqa: E402 - bench/ is on the path when run as a script

SIZES = (10, 100, 1000, 10000)


def make_run(run: Path, n: int, segments: int = 4) -> None:
    """A run directory whose lineage holds ``n`` checkpoints over ``segments`` segments (preempted, completed,
    resharded 2 -> 4, preempted, resharded 4 -> 3, again), plus an export and a publish."""
    from ckpt.commit.fsutil import append_jsonl
    from ckpt.commit.lineage import checkpoint_event_id as ck
    from ckpt.commit.lineage import record

    cycle = [(2, "preempted"), (2, "completed"), (4, "preempted"), (3, "completed")]
    plan = [cycle[i % len(cycle)] for i in range(segments)]
    per = max(n // len(plan), 1)
    prev, step = None, 0
    for seg, (ws, status) in enumerate(plan):
        record(run, "segment", f"segment:{seg}", parent=prev, step=step, status=status, world_size=ws)
        count = per if seg < len(plan) - 1 else n - per * (len(plan) - 1)
        for i in range(count):
            step += 1
            reason = "interval" if i < count - 1 else ("preempted" if status == "preempted" else "end")
            record(
                run,
                "checkpoint",
                ck(step),
                parent=prev,
                step=step,
                reason=reason,
                world_size=ws,
                segment=seg,
                uri=(run / "checkpoints" / f"step-{step:08d}").as_uri(),
            )
            append_jsonl(
                run / "metrics.jsonl",
                {
                    "step": step,
                    "loss": 5.0 / (1 + step / n),
                    "segment": seg,
                    "world_size": ws,
                    "tokens": step * 4096,
                    "step_seconds": 0.1,
                },
            )
            prev = ck(step)
    record(run, "export", f"export:step-{step:08d}:bfloat16", parent=prev, step=step, dtype="bfloat16")
    record(
        run,
        "publish",
        "publish:org/model@main",
        parent=f"export:step-{step:08d}:bfloat16",
        target="org/model",
        revision="main",
    )


def graph(run: Path) -> None:
    """The lineage graph alone: read the lineage, lay it out, draw the PNG."""
    from ckpt.commit.lineage import read_events
    from tasks.render import lineage_graph_png

    events = read_events(run)
    on_disk = [e.id for e in events if e.kind == "checkpoint"][-3:]  # keep_last 3
    lineage_graph_png(events, run / "lineage.png", title=run.name, existing=set(on_disk))


def render(run: Path) -> None:
    from ckpt.commit.lineage import read_events
    from tasks.dashboard import checkpoints_now, draw_lineage_graph, lineage_graph
    from tasks.render import loss_curve_png, segment_statuses, table_rows

    events = read_events(run)
    ids = [e.id for e in events if e.kind == "checkpoint"][-3:]  # keep_last 3: what exists on disk
    checkpoints_now(run, events)
    draw_lineage_graph(lineage_graph(events, set(ids)), run / "lineage.png", title=run.name)
    loss_curve_png(run, run / "loss.png", statuses=segment_statuses(events))
    table_rows(events)


def page_times(server: Any, runs: dict[int, Path], reps: int) -> dict[int, list[float]]:
    """Mirror each run in a flow run, then time Chromium opening its graph artifact until the image loads."""
    import asyncio
    import importlib.util

    if importlib.util.find_spec("playwright") is None or not (shutil.which("chromium") or os.environ.get("CHROMIUM")):
        print("page: skipped (needs `chromium` and the playwright package)", file=sys.stderr)
        return {}
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.lineage import mirror_lineage

    ids: dict[int, str] = {}

    @flow(name="dashboard-bench")
    def mirror(run: str) -> Any:
        return mirror_lineage(run, "bench")

    for n, run in runs.items():
        keys = mirror(str(run))

        async def latest(key: str = keys.graph_key) -> str:
            from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

            async with get_client() as client:
                arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
                return str(max(arts, key=lambda a: a.created).id)

        ids[n] = asyncio.run(latest())
    from playwright.sync_api import sync_playwright

    out: dict[int, list[float]] = {n: [] for n in runs}
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=os.environ.get("CHROMIUM") or shutil.which("chromium"), args=flags)
        for n in runs:
            for i in range(reps + 1):  # the first is the warm-up (UI bundle into the cache)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                t0 = time.perf_counter()
                page.goto(f"{server.url}/artifacts/artifact/{ids[n]}")
                img = page.locator("img[src^='data:image/png']").first
                img.wait_for(timeout=60_000)
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
                if i:
                    out[n].append(time.perf_counter() - t0)
                page.close()
        browser.close()
    return out


def mirror_times(runs: dict[int, Path], reps: int) -> dict[int, list[float]]:
    from prefect import flow

    from tasks.lineage import mirror_lineage

    out: dict[int, list[float]] = {}

    @flow(name="dashboard-bench-mirror")
    def bench(run: str) -> list[float]:
        return timed(lambda: mirror_lineage(run, "bench"), reps)

    for n, run in runs.items():
        out[n] = bench(str(run))
    return out


def plot() -> Path:
    """bench/results/dashboard.png: each part's seconds against the checkpoints in the lineage, from the published
    table (the goal: a 1,000-checkpoint run's page in under 2 s)."""
    from benchlib import plot_from_table
    from scale_bench import draw_lines

    def draw(fig) -> None:
        draw_lines(
            fig,
            "dashboard",
            "checkpoints in lineage",
            [
                ("graph (read + layout + PNG)", "lineage graph"),
                ("render (graph + loss + rows)", "all artifacts rendered"),
                ("mirror-lineage task (4 artifacts)", "Prefect task (4 artifacts)"),
                ("graph page in Chromium (image loaded)", "page in Chromium"),
            ],
            goal=2.0,
            goal_label="goal: < 2 s",
            xlabel="checkpoints in the run's lineage (log)",
            title="Lineage dashboard: seconds against the run's length",
            legend="upper left",
            ylog=False,
        )

    return plot_from_table("dashboard", draw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-browser", action="store_true", help="rendering only: no Prefect server, no Chromium")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--segments", type=int, default=4, help="segments the checkpoints are spread over")
    ap.add_argument("--plot-only", action="store_true", help="redraw bench/results/dashboard.png from the table")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot()
        return 0
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="dashboard-bench-") as tmp:
        runs = {}
        for n in args.sizes:
            runs[n] = Path(tmp) / f"run-{n}"
            make_run(runs[n], n, args.segments)
        graphs = {n: timed(lambda r=run: graph(r), args.reps) for n, run in runs.items()}
        rendered = {n: timed(lambda r=run: render(r), args.reps) for n, run in runs.items()}
        mirrored: dict[int, list[float]] = {}
        pages: dict[int, list[float]] = {}
        if not args.no_browser:
            from infra.server import PrefectServer
            from tests.harness import free_port

            server = PrefectServer(Path(tmp) / "prefect-home", port=free_port()).start()
            os.environ.update(server.env())
            try:
                mirrored = mirror_times(runs, args.reps)
                pages = page_times(server, runs, args.reps)
            finally:
                server.stop()
    from benchlib import md_table, publish

    rows = [[f"{n:,}", fmt(graphs[n]), fmt(rendered[n]), fmt(mirrored.get(n)), fmt(pages.get(n))] for n in args.sizes]
    publish(
        "dashboard",
        f"Lineage dashboard, seconds: median (min–max) of {args.reps} after a warm-up, "
        f"{args.segments} segments:\n\n"
        + md_table(
            [
                "checkpoints in lineage",
                "graph (read + layout + PNG)",
                "render (graph + loss + rows)",
                "mirror-lineage task (4 artifacts)",
                "graph page in Chromium (image loaded)",
            ],
            rows,
            "rrrrr",
        ),
    )
    plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
