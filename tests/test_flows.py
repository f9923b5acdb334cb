"""The Prefect flows end to end against a real local Prefect server, with real torchrun launches.

One train-and-export run (2 ranks to step 4, then 3 ranks to step 8, export, file:// publish) is
shared by the module; a preemption run, a failing run and the resume flow have their own. About
8 torchrun launches in all.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError

from ckpt.commit.lineage import read_events
from ckpt.guards.lock import RunLock
from schemas.requests import RunState, SegmentPlan, TrainExportRequest, TrainExportSummary
from tests.harness import copy_run, mark_preempted

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow


def read_artifacts(flow_run_id: Any) -> dict[str, Any]:
    """Artifacts of one flow run, read back through the Prefect client, by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    return {a.key: a for a in sorted(asyncio.run(go()), key=lambda a: a.created)}  # the latest version of each key


def run_flow(request: TrainExportRequest) -> tuple[TrainExportSummary, Any]:
    from flows.train_and_export import train_and_export

    state = train_and_export(**request.parameters(), return_state=True)
    return state.result(), state.state_details.flow_run_id


# ------------------------------------------------------------------------------------------ e2e
@pytest.fixture(scope="module")
def e2e(prefect_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainExportSummary, Any, Path]:
    run = tmp_path_factory.mktemp("flows") / "e2e"
    request = TrainExportRequest(
        config=TINY,
        overrides=["checkpoint.keep_last=10"],
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=4), SegmentPlan(nproc=3, until_step=8)],
        export_dtype="bfloat16",
        max_shard_size="100KB",
        publish_target=(run / "published").as_uri(),
        backoff_s=0,
    )
    summary, flow_run_id = run_flow(request)
    return summary, flow_run_id, run


def test_train_and_export_completes(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    summary, _, run = e2e
    assert summary.status == "completed" and summary.final_step == 8
    assert summary.final_checkpoint == str(run.resolve() / "checkpoints" / "step-00000008")
    first, second = summary.segments
    assert first.reshard is None and [a.status for a in first.attempts] == ["completed"]
    assert second.reshard is not None and (second.reshard.from_world_size, second.reshard.to_world_size) == (2, 3)
    assert [(a.status, a.start_step, a.end_step, a.topology.world_size) for a in second.attempts] == [
        ("completed", 4, 8, 3)
    ]
    assert summary.export.dtype == "bfloat16" and summary.export.num_shards > 1  # 100KB shards


def test_plan_is_recorded_in_the_run_and_completed_by_the_flow(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    """The plan and its progress live in the run directory (plan.json): both segments, the export and the publish
    done by this flow run (its id and name), the segments' lineage events and the plan artifact name it."""
    from ckpt.plan import read_plan

    summary, flow_run_id, run = e2e
    plan = read_plan(run)
    assert plan is not None and plan.status == "completed", plan
    assert [(s.nproc, s.until_step) for s in plan.segments] == [(2, 4), (3, 8)]
    assert plan.started_by.kind == "flow" and plan.started_by.flow_run_id == str(flow_run_id)
    assert [[d.kind for d in p.by] for p in plan.progress] == [["flow"], ["flow"]]
    assert [p.end_step for p in plan.progress] == [4, 8]
    assert plan.exported is not None and plan.exported.out == summary.export.out_dir and plan.exported.step == 8
    assert plan.published is not None and plan.published.by == plan.started_by
    segs = [e for e in read_events(run) if e.kind == "segment"]
    assert [e.data["by"] for e in segs] == [plan.started_by.line()] * 2 and "train-and-export" in segs[0].data["by"]
    art = read_artifacts(flow_run_id)[summary.artifacts.plan_key]
    assert "**completed**" in art.data and "| segment 1 | 3 ranks | 8 | completed | 8 | train-and-export" in art.data


def test_export_loads_with_transformers(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    summary, _, _ = e2e
    model = AutoModelForCausalLM.from_pretrained(summary.export.out_dir)
    assert next(model.parameters()).dtype == torch.bfloat16
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, 256) and torch.isfinite(out.logits.float()).all()


def test_publish_marker_exists(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    summary, _, run = e2e
    assert summary.publish is not None and not summary.publish.skipped
    marker = run / "published" / "step-00000008" / "shardkeeper.json"
    assert marker.is_file()
    listed = json.loads(marker.read_text())["files"]
    assert set(summary.export.files) - {"export.json"} <= set(listed) | {"README.md"}


def test_lineage_events_and_parents(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    summary, _, run = e2e
    events = {e.id: e for e in read_events(run)}
    kinds = {e.kind for e in events.values()}
    assert {"checkpoint", "segment", "resume", "reshard", "validate", "export", "publish"} <= kinds
    resume = events["resume:segment-1"]
    assert resume.parent == "checkpoint:step-00000004"
    assert (resume.data["from_world_size"], resume.data["to_world_size"]) == (2, 3)
    reshard = next(e for e in events.values() if e.kind == "reshard")
    assert reshard.parent == "checkpoint:step-00000004" and reshard.data["method"] == "dcp-load-time"
    assert events["checkpoint:step-00000008"].data["world_size"] == 3
    export = next(e for e in events.values() if e.kind == "export")
    assert export.parent == "checkpoint:step-00000008" and export.data["dtype"] == "bfloat16"
    publish = next(e for e in events.values() if e.kind == "publish")
    assert publish.parent == export.id
    for e in events.values():  # every parent is a recorded event
        assert e.parent is None or e.parent in events, e


def test_lineage_artifacts_in_prefect(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    summary, flow_run_id, _ = e2e
    arts = read_artifacts(flow_run_id)
    keys = summary.artifacts
    assert keys.table_key == "tiny-llama-e2e-lineage"
    assert {keys.table_key, keys.graph_key, keys.loss_key} <= set(arts)
    table = json.loads(arts[keys.table_key].data)
    assert {row["id"] for row in table} >= {"resume:segment-1", "checkpoint:step-00000008"}
    assert arts[keys.table_key].type == "table"
    graph = arts[keys.graph_key].data
    assert (
        "data:image/png;base64," in graph
        and "## Checkpoints now" in graph
        and "| 8 | storage | 3 | dcp | end |" in graph
    )
    now = json.loads(arts[keys.checkpoints_key].data)
    assert now[-1]["step"] == 8 and now[-1]["exported"].startswith("bfloat16") and now[-1]["published"]
    loss = arts[keys.loss_key].data
    assert "data:image/png;base64," in loss and "| 4 | reshard | 2 → 3 |" in loss
    assert summary.artifacts.loss_png and Path(summary.artifacts.loss_png).is_file()


def test_live_progress_artifacts(e2e: tuple[TrainExportSummary, Any, Path]) -> None:
    """Each train task moved a progress artifact to 100 % and wrote the live table (step, loss, tokens/s)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    summary, flow_run_id, _ = e2e

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    arts = asyncio.run(go())
    progress = [a for a in arts if a.type == "progress"]
    assert len(progress) == 2 and all(float(a.data) == 100.0 for a in progress)  # one per segment
    live = [a for a in arts if a.key == "tiny-llama-e2e-live"]
    texts = [a.data for a in sorted(live, key=lambda a: a.created)]
    assert "**step 4 / 4**" in texts[0] and "**step 8 / 8**" in texts[-1] and "| step | loss |" in texts[-1]


def test_assets_are_declared(e2e: tuple[TrainExportSummary, Any, Path], prefect_server: Any) -> None:
    """Export and publish emit Prefect asset materialization events (the OSS UI shows them as events)."""
    import httpx

    summary, _, run = e2e
    wanted = {Path(summary.export.out_dir).resolve().as_uri(), (run.resolve() / "published" / "step-00000008").as_uri()}
    # this run's assets only (the server is shared by the session's tests)
    body = {
        "filter": {
            "event": {"prefix": ["prefect.asset.materialization."]},
            "resource": {"id_prefix": [run.resolve().as_uri()]},
        },
        "limit": 50,
    }
    keys: set[str] = set()
    for _ in range(80):  # events are persisted asynchronously by the server: wait for both
        resp = httpx.post(f"{prefect_server.api_url}/events/filter", json=body, timeout=10)
        resp.raise_for_status()
        keys = {e["resource"]["prefect.resource.id"] for e in resp.json()["events"]}
        if wanted <= keys:
            break
        time.sleep(0.25)
    assert wanted <= keys, keys


# ----------------------------------------------------------------------------------- preemption
def preempt_once_training(run: Path, done: threading.Event) -> threading.Thread:
    """SIGTERM the torchrun process group (as a scheduler would) once the first step is logged."""

    def watch() -> None:
        metrics = run / "metrics.jsonl"
        while not done.is_set():
            if metrics.exists() and metrics.stat().st_size > 0:
                for child in psutil.Process().children():
                    if "torch.distributed.run" in " ".join(child.cmdline()):
                        os.killpg(child.pid, signal.SIGTERM)
                        return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_preempted_segment_is_resumed(prefect_server: Any, tmp_path: Path) -> None:
    run = tmp_path / "preempt"
    request = TrainExportRequest(
        config=TINY,
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=60)],
        export_dtype="float32",
        backoff_s=0.1,
    )
    done = threading.Event()
    watcher = preempt_once_training(run, done)
    try:
        summary, _ = run_flow(request)
    finally:
        done.set()
        watcher.join(5)
    attempts = summary.segments[0].attempts
    assert [a.status for a in attempts] == ["preempted", "completed"]
    stopped = attempts[0].end_step
    assert 1 <= stopped < 60 and attempts[1].start_step == stopped and summary.final_step == 60
    events = {e.id: e for e in read_events(run)}
    assert events[f"checkpoint:step-{stopped:08d}"].data["reason"] == "preempted"
    resume = events["resume:segment-1"]
    assert resume.parent == f"checkpoint:step-{stopped:08d}" and resume.data["to_world_size"] == 2
    assert events["segment:0"].data["status"] == "preempted"
    from ckpt.plan import read_plan

    plan = read_plan(run)  # the flow run resumed its own segment: one driver, the plan completed
    assert plan is not None and plan.status == "completed" and [d.kind for d in plan.progress[0].by] == ["flow"]


def test_failed_segment_stops_with_the_rank_error(prefect_server: Any, tmp_path: Path) -> None:
    from flows.common import SegmentFailed
    from flows.train_and_export import train_and_export
    from shardkeeper.config import load_run_spec

    spec = load_run_spec(TINY, ["model.config.num_key_value_heads=3"])  # builds, then fails in the first forward
    run = tmp_path / "failing"
    request = TrainExportRequest(
        spec=spec, run_dir=str(run), segments=[SegmentPlan(nproc=2, until_step=4)], backoff_s=0
    )
    with pytest.raises(SegmentFailed, match="failing rank's last lines") as err:
        train_and_export(**request.parameters())
    end = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()][-1]
    assert end["status"] == "failed" and end["failure"] and end["failure"] in str(err.value)
    assert not (run / "exports").exists()


def test_corrupt_final_checkpoint_stops_before_export(prefect_server: Any, tiny_run: Path, tmp_path: Path) -> None:
    """Deep validation fails (a flipped byte, same size): the flow raises and exports nothing."""
    from flows.train_and_export import train_and_export
    from tasks.stage_tasks import CheckpointInvalid

    run = copy_run(tiny_run, tmp_path / "corrupt")
    shard = sorted((run / "checkpoints" / "step-00000005").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    request = TrainExportRequest(
        config=TINY,
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=5)],
        publish_target=(tmp_path / "pub").as_uri(),
    )
    with pytest.raises(CheckpointInvalid, match="checksum .* the file is corrupted; nothing was exported"):
        train_and_export(**request.parameters())
    assert not (run / "exports").exists() and not (tmp_path / "pub").exists()


# ---------------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize(
    ("segments", "fragment"),
    [
        ([{"nproc": 2, "until_step": 8}, {"nproc": 3, "until_step": 8}], "segments[1].until_step 8 must be greater"),
        ([{"nproc": 2, "until_step": 8}, {"nproc": 3, "until_step": 4}], "strictly increasing until_step"),
        ([{"nproc": 0, "until_step": 8}], "greater than or equal to 1"),
        ([], "at least 1 item"),
    ],
)
def test_inconsistent_segments_fail_validation(segments: list[dict], fragment: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        TrainExportRequest.model_validate({"config": TINY, "run_dir": str(tmp_path / "r"), "segments": segments})


def test_bad_request_fails_the_flow_before_anything_runs(prefect_server: Any, tmp_path: Path) -> None:
    from prefect.exceptions import ParameterTypeError

    from flows.train_and_export import train_and_export

    run = tmp_path / "never"
    bad = {
        "config": TINY,
        "run_dir": str(run),
        "segments": [{"nproc": 2, "until_step": 8}, {"nproc": 3, "until_step": 2}],
    }
    with pytest.raises(ParameterTypeError, match="strictly increasing"):
        train_and_export(**bad)
    assert not run.exists()


def test_request_needs_exactly_one_spec_source(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="exactly one of config"):
        TrainExportRequest.model_validate({"run_dir": str(tmp_path), "segments": [{"nproc": 1, "until_step": 1}]})


# ---------------------------------------------------------------------------------------- resume
def test_resume_flow_resumes_preempted_and_skips_locked_and_done(
    prefect_server: Any, tiny_run: Path, tmp_path: Path
) -> None:
    from flows.resume import resume

    root = tmp_path / "runs"
    preempted = copy_run(tiny_run, root / "a-preempted")
    mark_preempted(preempted, 8)
    locked = copy_run(tiny_run, root / "b-locked")
    mark_preempted(locked, 8)
    done = copy_run(tiny_run, root / "c-done")
    (root / "not-a-run").mkdir()
    with RunLock(locked):
        state = resume(roots=[str(root)], nproc=3, backoff_s=0, return_state=True)
    summary = state.result()
    actions = {Path(i.run_dir).name: i.action for i in summary.items}
    overview = read_artifacts(state.state_details.flow_run_id)["runs-overview-runs"]  # the dashboard's runs table
    statuses = {r["run"]: r["status"] for r in json.loads(overview.data)}
    assert statuses == {"a-preempted": "completed", "b-locked": "running", "c-done": "completed"}
    assert actions == {"a-preempted": "resumed", "b-locked": "skipped-locked", "c-done": "skipped-done"}
    item = next(i for i in summary.items if i.action == "resumed")
    assert item.outcome is not None and item.outcome.reshard is not None
    assert [(a.status, a.start_step, a.end_step) for a in item.outcome.attempts] == [("completed", 5, 8)]
    events = read_events(preempted)
    resumes = [e for e in events if e.kind == "resume"]
    assert resumes and (resumes[-1].data["from_world_size"], resumes[-1].data["to_world_size"]) == (2, 3)
    assert (
        not (locked / "checkpoints" / "step-00000008").exists()
        and not (done / "checkpoints" / "step-00000008").exists()
    )
    again = resume(run_dirs=[str(preempted)], nproc=3, backoff_s=0)  # idempotent
    assert [i.action for i in again.items] == ["skipped-done"]


def test_triage_rules() -> None:
    from flows.resume import triage

    base = {"run_dir": "/r", "exists": True, "step": 5, "last_until_step": 8}
    assert triage(RunState(**base, last_status="preempted")) is None
    assert triage(RunState(**base, last_status="failed")) is None
    assert triage(RunState(**base, last_status="interrupted")) is None
    assert triage(RunState(**base, last_status="completed")).action == "skipped-done"
    assert triage(RunState(**base, last_status="cancelled")).action == "skipped-done"  # a person stopped it
    assert triage(RunState(**base, last_status="preempted", locked=True)).action == "skipped-locked"
    assert triage(RunState(**{**base, "step": 8}, last_status="preempted")).action == "skipped-done"
    assert triage(RunState(run_dir="/r", exists=False)).action == "skipped-not-a-run"


def _plan(run: Path, status: str, until: int = 8, **done: Any) -> Any:
    """A plan as a train-and-export flow run leaves it (one segment at 2 ranks to ``until``), with ``status``."""
    from ckpt.plan import write_plan
    from schemas.plan import Driver, RunPlan

    request = TrainExportRequest(
        config=TINY,
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=until)],
        export_dtype="float32",
        publish_target=(run.parent / "pub").as_uri(),
    )
    plan = RunPlan.from_request(request, plan_id="p1", started_by=Driver(kind="flow", flow_run_name="t"), now="t")
    plan = plan.model_copy(update={"status": status, **done})
    write_plan(run, plan)
    return plan


def test_resume_leaves_a_plan_another_flow_run_drives_and_a_finished_plan_alone(
    prefect_server: Any, tiny_run: Path, tmp_path: Path
) -> None:
    """Two resumers racing: the one that finds the plan lock held records "already running" and does not fail
    (nothing launched, nothing written); a finished plan is left alone; a plan.json that is not a plan fails
    that run only, with one line naming the file."""
    from ckpt.plan import PlanLock
    from flows.resume import resume
    from schemas.plan import Driver, StageDone

    root = tmp_path / "runs"
    driven, finished, broken = (copy_run(tiny_run, root / n) for n in ("driven", "finished", "broken"))
    for run in (driven, finished, broken):
        mark_preempted(run, 8)
    _plan(driven, "running")
    who = Driver(kind="automation", source="resume x on preemption", flow_run_name="resume x").line()
    done = StageDone(step=5, out="/x", by=Driver(kind="schedule"), time="t")
    _plan(finished, "completed", 5, exported=done, published=done, note="finished by schedule")
    (broken / "plan.json").write_text('{"format": 1}')
    before = {r: (r / "segments.jsonl").read_text() for r in (driven, finished)}
    with PlanLock(driven).acquire(who):
        summary = resume(run_dirs=[str(driven), str(finished)], backoff_s=0)
    items = {Path(i.run_dir).name: i for i in summary.items}
    assert (
        items["driven"].action == "skipped-locked"
        and f"already running: its plan is driven by {who}" in items["driven"].reason
    )
    assert items["finished"].action == "skipped-done" and "its plan is completed" in items["finished"].reason
    assert {r: (r / "segments.jsonl").read_text() for r in (driven, finished)} == before
    state = resume(run_dirs=[str(broken)], backoff_s=0, return_state=True)
    assert state.is_failed() and f"{broken}/plan.json: not a valid plan" in (state.message or ""), state.message


def test_a_run_without_a_plan_resumes_at_its_preempted_segments_world_size() -> None:
    """No nproc given: the preempted segment's nodes x nproc and launcher (segments.jsonl), not a deploy-time
    default; what is given wins."""
    from flows.resume import placement
    from schemas.requests import ResumeRequest, last_placement

    starts = [{"event": "start", "world_size": 2}, {"event": "start", "world_size": 8, "nodes": 2, "launcher": "slurm"}]
    state = RunState(
        run_dir="/r", exists=True, step=5, last_until_step=9, last_status="preempted", **last_placement(starts)
    )
    plan = placement(state, ResumeRequest(run_dirs=["/r"]))
    assert (plan.nodes, plan.nproc, plan.launcher, plan.until_step) == (2, 4, "slurm", 9)
    plan = placement(state, ResumeRequest(run_dirs=["/r"], nproc=3, launcher="local"))
    assert (plan.nodes, plan.nproc, plan.launcher) == (2, 3, "local")
    old = RunState(
        run_dir="/r", exists=True, step=5, last_until_step=9, last_status="preempted", **last_placement(starts[:1])
    )  # written before nodes and launcher were recorded
    assert (placement(old, ResumeRequest(run_dirs=["/r"])).nproc, old.last_nodes, old.last_launcher) == (2, 1, "local")


def test_plan_record_reads_beside_its_writer_and_refuses_what_is_not_a_plan(tmp_path: Path) -> None:
    """plan.json is replaced whole (a reader sees one plan or the other), a FIFO or a huge file is refused in
    one line, and the plan lock names its holder to the second driver."""
    import threading

    from ckpt.plan import MAX_PLAN_BYTES, PlanError, PlanLock, read_plan, write_plan
    from schemas.errors import RunLockedError

    run = tmp_path / "run"
    run.mkdir()
    plans = [_plan(run, status) for status in ("running", "handed-over")]
    stop, seen, errors = threading.Event(), set(), []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.add(read_plan(run).status)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - any error is the failure
                errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(200):
        write_plan(run, plans[i % 2])
    stop.set()
    thread.join()
    assert not errors and seen == {"running", "handed-over"}
    with PlanLock(run).acquire("automation 'resume x'"):
        with pytest.raises(RunLockedError, match="its plan is being driven by automation 'resume x' \\(pid"):
            PlanLock(run).acquire("schedule")
        assert PlanLock(run).is_locked()
    assert not PlanLock(run).is_locked()
    (run / "plan.json").unlink()
    os.mkfifo(run / "plan.json")
    with pytest.raises(PlanError, match="plan.json: not a regular file; remove it"):
        read_plan(run)
    (run / "plan.json").unlink()
    (run / "plan.json").write_text(" " * (MAX_PLAN_BYTES + 1))
    with pytest.raises(PlanError, match="larger than any plan"):
        read_plan(run)


def test_who_resumes_a_segment() -> None:
    """The flow while it has retries; then the automation, but only after progress (no endless resume loop)."""
    from flows.common import resumed_by
    from schemas import ClusterTopology, SegmentResult

    topo = ClusterTopology(procs_per_node=2)

    def seg(status: str, start: int, end: int) -> SegmentResult:
        return SegmentResult(
            run_dir="/r", status=status, exit_code=75, segment=1, start_step=start, end_step=end, topology=topo
        )

    assert resumed_by(seg("preempted", 5, 9), attempts=1, max_preemption_retries=3) == "flow"
    assert resumed_by(seg("preempted", 5, 9), attempts=4, max_preemption_retries=3) == "automation"
    assert resumed_by(seg("preempted", 5, 5), attempts=1, max_preemption_retries=0) == "none"
    assert resumed_by(seg("completed", 5, 9), attempts=1, max_preemption_retries=0) == "none"
    assert resumed_by(seg("cancelled", 5, 9), attempts=1, max_preemption_retries=0) == "none"


def test_flows_do_not_import_torch() -> None:
    code = "import sys, flows.train_and_export, flows.resume, infra.serve; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_only_publish_retries_and_never_on_user_errors() -> None:
    from prefect.states import Failed

    from schemas.errors import PublishError
    from tasks import stage_tasks as t

    assert t.publish.retries == t.PUBLISH_RETRIES > 0
    for other in (t.load_spec, t.inspect_run, t.plan_topology, t.train_segment, t.validate, t.reshard, t.export):
        assert not other.retries, other.name
    assert t._retry_unless_user_error(t.publish, None, Failed(data=ConnectionError("reset"))) is True
    assert t._retry_unless_user_error(t.publish, None, Failed(data=PublishError("not a repo id"))) is False


def test_train_and_export_runs_a_users_script_in_segments(
    prefect_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """train-and-export with script= (no config): two segments at 2 then 3 ranks of a user's transformers loop (3:
    a world size the unused default global_batch_size 8 would refuse; the script splits its own batch of 6), then
    deep validation, export (a from_pretrained folder) and lineage, as for the built-in trainer. The reshard
    between the segments, and `shardkeeper reshard` of the run's checkpoints after, follow the run's record."""
    from shardkeeper.cli import main

    run = tmp_path / "own"
    request = TrainExportRequest(
        script=str(ROOT / "examples" / "hf_model_loop.py"),
        script_args=["--batch", "6"],
        overrides=["checkpoint.interval=2"],
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=3), SegmentPlan(nproc=3, until_step=5)],
        export_dtype="float32",
        backoff_s=0,
    )
    summary, _ = run_flow(request)
    assert summary.status == "completed" and summary.final_checkpoint.endswith("step-00000005")
    assert summary.segments[1].reshard is not None and summary.segments[1].reshard.to_world_size == 3
    export = Path(summary.export.out_dir)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (export / "model.safetensors").is_file()
    spec = (run / "run.yaml").read_text()
    assert "hf_model_loop.py" in spec and "--batch" in spec
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in rows] == [2, 2, 2, 3, 3]
    capsys.readouterr()
    assert main(["reshard", summary.final_checkpoint, "--world-size", "5"]) == 0, capsys.readouterr().err
