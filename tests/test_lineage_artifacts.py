"""Lineage rendering (graph image, checkpoints now, runs overview, event table, loss curve with markers) and
its mirror into Prefect artifacts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt.commit.lineage import read_events
from schemas import LineageEvent
from tasks.dashboard import checkpoints_now, draw_lineage_graph, lineage_graph, markdown_rows, runs_overview
from tasks.render import loss_by_step, loss_curve_png, markers, read_metrics, segment_statuses, slug, table_rows

ROOT = Path(__file__).resolve().parent.parent


def test_slug_and_artifact_prefix() -> None:
    from tasks.lineage import artifact_keys, artifact_prefix

    assert slug("Tiny Llama_v2 (run #3)") == "tiny-llama-v2-run-3"
    assert slug("???") == "run"
    assert artifact_prefix("/x/runs/Demo", "tiny-llama") == "tiny-llama-demo"
    assert artifact_prefix("/x/runs/tiny-llama-7", "tiny-llama") == "tiny-llama-7"
    assert artifact_prefix("/x/runs/demo") == "demo"
    assert artifact_keys("tiny-llama-demo") == (
        "tiny-llama-demo-lineage",
        "tiny-llama-demo-lineage-graph",
        "tiny-llama-demo-loss-curve",
    )


def test_loss_takes_the_last_written_value_per_step(lineage_run: Path) -> None:
    curve = loss_by_step(read_metrics(lineage_run))
    assert list(curve) == list(range(1, 11))
    assert curve[7] == pytest.approx(5.0 - 0.7) and curve[8] == pytest.approx(
        5.0 - 0.8
    )  # the failed segment's values lost


def test_markers_at_resume_and_reshard_points(lineage_run: Path) -> None:
    found = [(m.step, m.kind, m.from_world_size, m.to_world_size) for m in markers(read_metrics(lineage_run))]
    assert found == [(6, "resume", 2, 2), (6, "reshard", 2, 3)]
    # with the segments' statuses: the first resume was planned (segment 0 completed), the reshard followed a failure
    statuses = segment_statuses(read_events(lineage_run))
    assert statuses == {0: "completed", 1: "failed"}
    assert [m.cause for m in markers(read_metrics(lineage_run), statuses)] == ["planned", "failed"]


def test_loss_curve_png(lineage_run: Path, tmp_path: Path) -> None:
    out = loss_curve_png(lineage_run, tmp_path / "plots" / "loss.png", title="demo")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    (tmp_path / "empty").mkdir()
    assert loss_curve_png(tmp_path / "empty", tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def _event(id: str, kind: str, parent: str | None = None, **data: Any) -> LineageEvent:
    return LineageEvent(id=id, kind=kind, parent=parent, time="2026-01-01T00:00:00Z", data=data)  # type: ignore[arg-type]


def long_run(n_segments: int = 4, per_segment: int = 250) -> list[LineageEvent]:
    """A synthetic lineage of n_segments * per_segment checkpoints: preempted, completed, resharded, exported."""
    events, prev, step = [], None, 0
    plan = [(2, "preempted"), (2, "completed"), (4, "preempted"), (3, "completed")]
    for seg in range(n_segments):
        ws, status = plan[seg % len(plan)]
        events.append(_event(f"segment:{seg}", "segment", prev, status=status, world_size=ws))
        for i in range(per_segment):
            step += 1
            reason = "interval" if i < per_segment - 1 else ("preempted" if status == "preempted" else "end")
            cid = f"checkpoint:step-{step:08d}"
            events.append(
                LineageEvent(
                    id=cid,
                    kind="checkpoint",
                    parent=prev,
                    step=step,
                    time="2026-01-01T00:00:00Z",
                    data={"reason": reason, "world_size": ws, "segment": seg},
                )
            )
            prev = cid
    events.append(_event("export:last:bfloat16", "export", prev, dtype="bfloat16"))
    return events


def test_graph_folds_a_long_run_into_a_few_nodes(tmp_path: Path) -> None:
    import time

    events = long_run()
    last = [e.id for e in events if e.kind == "checkpoint"][-2:]
    t0 = time.perf_counter()
    model = lineage_graph(events, existing=set(last))
    png = draw_lineage_graph(model, tmp_path / "g.png", title="long")
    seconds = time.perf_counter() - t0
    ckpt_nodes = [n for n in model.nodes if n.kind == "checkpoint"]
    assert model.checkpoints == 1000 and len(ckpt_nodes) <= 12  # segment starts and ends + what exists
    assert model.folded == 1000 - len(ckpt_nodes)
    assert {n.id for n in ckpt_nodes if n.exists} == set(last)  # retired ones drawn apart from the ones on disk
    kinds = [e.kind for e in model.edges]
    assert kinds.count("preempted") == 1 and kinds.count("reshard") == 2 and "export" in kinds
    first = next(e for e in model.edges if e.dst == "checkpoint:step-00000250")  # segment 0: step 1 -> its end
    assert (first.src, first.kind, first.folded, first.label) == (
        "checkpoint:step-00000001",
        "train",
        248,
        "… 248 checkpoints …",
    )
    xs = [n.x for n in sorted(ckpt_nodes, key=lambda n: int(n.label))]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # left to right by step
    assert [label for _, label in model.lanes] == [
        "segment 0 · 2 ranks · preempted",
        "segment 1 · 2 ranks · completed",
        "segment 2 · 4 ranks · preempted",
        "segment 3 · 3 ranks · completed",
    ]
    assert any(e.label == "reshard 4→3 after preempted" for e in model.edges)
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (1600, 620)  # 16 in wide at most, 1.8 + 1.1 in per lane high
    assert seconds < 10  # the bench-free sanity bound; bench/dashboard_bench.py measures the figure


def test_graph_of_many_segments_stays_the_same_size(tmp_path: Path) -> None:
    """100 segments of 10 checkpoints (a run preempted every few minutes): the middle segments share one lane,
    one edge jumps over them, and the figure is as large as for 8 segments."""
    import time

    from PIL import Image

    from tasks.dashboard import MAX_LANES
    from tasks.render import lineage_graph_png

    events = long_run(100, 10)
    last = [e.id for e in events if e.kind == "checkpoint"][-3:]
    model = lineage_graph(events, existing=set(last))
    assert len(model.lanes) == MAX_LANES and model.hidden_segments == 100 - (MAX_LANES - 1)
    assert model.lanes[1][1].startswith("segments 1–93 folded · 93 segments · 2/3/4 ranks · ")
    assert model.folded_lane == model.lanes[1][0]
    jump = [e for e in model.edges if e.kind == "folded"]
    assert len(jump) == 1 and jump[0].label == "… 93 segments · 930 checkpoints …"
    assert (model.node(jump[0].src).label, model.node(jump[0].dst).label) == ("10", "941")  # segment 0 -> 94
    assert (model.node(jump[0].src).lane, model.node(jump[0].dst).lane) == (0, 2)
    ckpt_nodes = model.checkpoint_nodes()
    assert len(ckpt_nodes) == 2 * (MAX_LANES - 1) + 2  # first and last of each shown segment, + 2 more on disk
    assert model.folded == 1000 - len(ckpt_nodes) and model.on_disk == 3
    assert all(n.lane != 1 for n in ckpt_nodes)  # nothing of the folded segments exists or was exported
    t0 = time.perf_counter()
    png = lineage_graph_png(events, tmp_path / "many.png", title="many", existing=set(last))
    seconds = time.perf_counter() - t0
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (1600, round(100 * (1.8 + 1.1 * MAX_LANES)))
    assert seconds < 10


def test_graph_folds_old_checkpoints_on_disk() -> None:
    """keep_last 50: the newest MAX_ON_DISK_NODES plain checkpoints on disk are nodes, the older ones fold."""
    from tasks.dashboard import MAX_ON_DISK_NODES

    events = long_run(1, 60)
    ids = [e.id for e in events if e.kind == "checkpoint"]
    model = lineage_graph(events, existing=set(ids[-50:]))
    nodes = {int(n.label): n for n in model.checkpoint_nodes()}
    assert sorted(nodes) == [1, *range(60 - MAX_ON_DISK_NODES, 61)]
    assert not nodes[1].exists and all(nodes[s].exists for s in range(54, 61))
    edge = next(e for e in model.edges if e.dst == ids[60 - MAX_ON_DISK_NODES - 1])
    assert edge.label == "… 52 checkpoints (43 on disk) …" and model.on_disk == 50


def test_graph_draws_exports_publishes_and_conversions(lineage_run: Path, tmp_path: Path) -> None:
    from ckpt.commit import lineage

    lineage.record(
        lineage_run,
        "publish",
        "publish:org/m@main:step-00000010",
        parent="export:step-00000010:bfloat16",
        target="org/m",
        revision="main",
    )
    lineage.record(
        lineage_run,
        "reshard",
        "convert:step-00000010:deepspeed:1",
        parent="checkpoint:step-00000010",
        step=10,
        uri="file:///x/ds/checkpoints/step-00000010",
        method="convert-to-deepspeed",
    )
    model = lineage_graph(read_events(lineage_run), existing={"checkpoint:step-00000010"})
    ck = model.node("checkpoint:step-00000010")
    out = {n.kind: n for n in model.nodes if n.kind != "checkpoint"}
    assert (out["export"].label, out["publish"].label, out["convert"].label) == ("bfloat16", "org/m", "→ deepspeed")
    assert all(n.x > ck.x and n.y < ck.y for n in out.values())  # below-right of their checkpoint, no overlap
    assert len({(n.x, n.y) for n in out.values()}) == 3
    assert {(e.src, e.kind) for e in model.edges if e.dst in {n.id for n in out.values()}} == {
        (ck.id, "export"),
        ("export:step-00000010:bfloat16", "publish"),
        (ck.id, "convert"),
    }
    # the DCP reshard at load time is the resume edge, not an output
    assert not any(n.id.startswith("reshard:") for n in model.nodes)
    # the run the conversion wrote: its first checkpoint says where it came from
    converted = [
        LineageEvent(
            id="checkpoint:step-00000010",
            kind="checkpoint",
            step=10,
            time="2026-01-01T00:00:00Z",
            data={"reason": "converted", "world_size": 1, "source": f"file://{lineage_run}/checkpoints/step-00000010"},
        )
    ]
    assert lineage_graph(converted).nodes[0].note == "from lineage-run/step-00000010"


def test_graph_of_the_lineage_fixture(lineage_run: Path) -> None:
    model = lineage_graph(read_events(lineage_run), existing={"checkpoint:step-00000010"})
    by_id = {n.id: n for n in model.nodes}
    assert set(by_id) >= {
        "checkpoint:step-00000003",
        "checkpoint:step-00000006",
        "checkpoint:step-00000009",
        "checkpoint:step-00000010",
        "export:step-00000010:bfloat16",
    }
    assert by_id["checkpoint:step-00000010"].exists and not by_id["checkpoint:step-00000006"].exists
    edge = next(e for e in model.edges if e.dst == "checkpoint:step-00000009")
    assert (
        edge.src == "checkpoint:step-00000006" and edge.kind == "reshard" and edge.label == "reshard 2→3 after failed"
    )
    assert [label for _, label in model.lanes][1:] == [
        "segment 1 · 2 ranks · failed",
        "segment 2 · 3 ranks · in progress",
    ]


def test_graph_draws_no_lane_for_a_segment_the_ranks_refused(lineage_run: Path) -> None:
    """A segment refused before its first step trained nothing: the graph is the one without it, as status and the
    resume flow see the run."""
    from ckpt.commit import lineage

    before = lineage_graph(read_events(lineage_run))
    lineage.record(
        lineage_run, "segment", "segment:3", parent="checkpoint:step-00000010", step=10, status="refused", world_size=4
    )
    after = lineage_graph(read_events(lineage_run))
    assert after.lanes == before.lanes and [e.label for e in after.edges] == [e.label for e in before.edges]


def test_checkpoints_now_lists_only_what_exists(tiny_run: Path, tmp_path: Path) -> None:
    import shutil

    from ckpt.commit import lineage

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".lock"))
    on_disk = sorted(p.name for p in (run / "checkpoints").glob("step-*") if (p / "manifest.json").is_file())
    assert on_disk == ["step-00000005"]
    ck = f"checkpoint:{on_disk[-1]}"
    for step in (1, 3):  # written once, deleted by retention since
        lineage.record(run, "checkpoint", lineage.checkpoint_event_id(step), step=step, reason="interval", world_size=2)
    shutil.copytree(run / "checkpoints" / on_disk[-1], run / "checkpoints" / "step-00000007.partial")  # never committed
    (run / "checkpoints" / "step-00000008").mkdir()  # no manifest: not a checkpoint
    ever = [e.id for e in read_events(run) if e.kind == "checkpoint"]
    shutil.rmtree(run / "verified", ignore_errors=True)
    assert checkpoints_now(run, read_events(run))[0]["validity"] == "not checked since commit"

    lineage.record(run, "validate", "validate:x:1", parent=ck, valid=False)
    lineage.record(run, "validate", "validate:x:2", parent=ck, valid=True)  # the latest check counts
    lineage.record(
        run,
        "export",
        f"export:{on_disk[-1]}:bfloat16",
        parent=ck,
        dtype="bfloat16",
        uri=(run / "exports" / on_disk[-1]).as_uri(),
    )
    lineage.record(
        run,
        "publish",
        f"publish:org/m@main:{on_disk[-1]}",
        parent=f"export:{on_disk[-1]}:bfloat16",
        target="org/m",
        revision=None,
    )
    rows = checkpoints_now(run, read_events(run))
    assert [f"step-{r['step']:08d}" for r in rows] == on_disk and len(ever) == len(on_disk) + 2
    last = rows[-1]
    assert last["world_size"] == 2 and last["backend"] == "dcp" and last["size"].endswith("MB")
    assert last["validity"].startswith("valid (deep") and last["exported"] == f"bfloat16 → {on_disk[-1]}"
    assert last["published"] == "org/m@main" and last["path"] == str((run / "checkpoints" / on_disk[-1]).resolve())
    lineage.record(run, "validate", "validate:x:3", parent=ck, valid=False)
    assert checkpoints_now(run, read_events(run))[0]["validity"].startswith("INVALID (deep")
    md = markdown_rows(rows, ["step", "validity"])
    assert md.count("\n") == len(rows) + 2


def test_runs_overview_rows(tiny_run: Path, tmp_path: Path) -> None:
    """One row per run under a root, each in another state, with its last activity as an age."""
    import os
    import time

    from ckpt.guards.lock import RunLock
    from shardkeeper.stages import scan_runs
    from tests.harness import copy_run, mark_preempted, mark_segment

    root = tmp_path / "runs"
    done = copy_run(tiny_run, root / "done")
    mark_preempted(copy_run(tiny_run, root / "stopped"), 9)
    mark_segment(copy_run(tiny_run, root / "broken"), 9, "failed")
    mark_segment(copy_run(tiny_run, root / "halted"), 9, "cancelled", exit_code=130)
    mark_segment(copy_run(tiny_run, root / "killed"), 9, None)  # started, never ended, nobody holds the lock
    mark_segment(copy_run(tiny_run, root / "live"), 12, None)
    (root / "empty").mkdir()
    now = time.time()
    for f in ("lineage.jsonl", "metrics.jsonl", "segments.jsonl"):
        os.utime(done / f, (now - 7200, now - 7200))
    with RunLock(root / "live"):  # a segment trains there now
        rows = {r["run"]: r for r in runs_overview(scan_runs([str(root)], []), now=now)}
    assert set(rows) == {"done", "stopped", "broken", "halted", "killed", "live"}  # "empty" is no run
    assert {k: r["status"] for k, r in rows.items()} == {
        "done": "completed",
        "stopped": "preempted",
        "broken": "failed",
        "halted": "cancelled",
        "killed": "interrupted",
        "live": "running",
    }
    assert rows["done"]["step"] == 5 and rows["done"]["last_checkpoint"] == "step-00000005"
    assert rows["done"]["world_size"] == 2 and rows["done"]["last_activity"] == "2h ago"
    assert rows["stopped"]["until_step"] == 9 and rows["live"]["until_step"] == 12
    assert rows["stopped"]["last_activity"].endswith("s ago") and rows["done"]["run_dir"] == str(done.resolve())
    md = markdown_rows(list(rows.values()), ["run", "status", "step"])
    assert "| live | running | 5 |" in md and "| broken | failed | 5 |" in md


def test_event_table_rows(lineage_run: Path) -> None:
    events = read_events(lineage_run)
    rows = table_rows(events)
    assert len(rows) == len(events) and rows[0]["kind"] == "checkpoint"
    assert any(r["details"] == "from_world_size=2, to_world_size=3, method=dcp-load-time" for r in rows)
    odd = markdown_rows([{"a": "x|y"}])
    assert "x\\|y" in odd


def test_lineage_render_imports_no_prefect() -> None:
    code = "import sys, tasks.render; assert 'prefect' not in sys.modules and 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def mirror_in_flow(run_dir: Path, run_name: str) -> tuple[Any, Any]:
    """Run the mirror-lineage task inside a flow; return its LineageArtifacts and the flow run id."""
    from prefect import flow

    from tasks.lineage import mirror_lineage

    @flow(name="mirror-lineage-test")
    def mirror() -> Any:
        return mirror_lineage(str(run_dir), run_name)

    state = mirror(return_state=True)
    return state.result(), state.state_details.flow_run_id


def artifacts_with_keys(keys: list[str]) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))

    return asyncio.run(go())


def test_mirror_lineage_creates_versioned_artifacts(prefect_server: Any, lineage_run: Path) -> None:
    result, flow_run_id = mirror_in_flow(lineage_run, "Artifacts Test")
    assert result.table_key == "artifacts-test-lineage-run-lineage" and result.events == len(read_events(lineage_run))
    keys = [result.table_key, result.graph_key, result.loss_key, result.checkpoints_key]
    arts = {a.key: a for a in artifacts_with_keys(keys) if a.flow_run_id == flow_run_id}
    assert set(arts) == set(keys)
    rows = json.loads(arts[result.table_key].data)
    assert [r["id"] for r in rows] == [e.id for e in read_events(lineage_run)]
    graph = arts[result.graph_key].data
    assert "![lineage graph of Artifacts Test (lineage-run)](data:image/png;base64," in graph
    assert "flowchart" not in graph and "## Checkpoints now (0)" in graph  # hand-written lineage: nothing on disk
    assert Path(result.graph_png).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(arts[result.checkpoints_key].data) == []
    loss = arts[result.loss_key].data
    assert "![loss curve of Artifacts Test (lineage-run)](data:image/png;base64," in loss
    assert "| 6 | reshard | 2 → 3 | **failed** |" in loss and Path(result.loss_png).is_file()
    _, second_id = mirror_in_flow(lineage_run, "Artifacts Test")  # a second version under the same key
    # counted among this test's own two flow runs only: the session's server is shared with other tests
    versions = [a for a in artifacts_with_keys([result.table_key]) if a.flow_run_id in (flow_run_id, second_id)]
    assert len(versions) == 2 and {a.flow_run_id for a in versions} == {flow_run_id, second_id}
