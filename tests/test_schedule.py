"""A scheduled deployment really runs: the server's scheduler creates runs from an interval schedule
and a served deployment executes them (a dependency pin once broke this silently: SQLAlchemy 2.1
made every scheduler cycle fail while the UI still showed the schedule as active).

The real ``resume`` flow is served in a subprocess against the session's Prefect server, with a
5-second interval over a run root holding one preempted run whose train-and-export flow run handed its plan
over (plan.json: one segment at 2 ranks, export, publish to a file:// target): the first scheduled run takes
the plan over and finishes it (the segment at the plan's 2 ranks, export, publish, recorded as the schedule's
doing), the later ones find the plan finished and do nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from ckpt.plan import read_plan, write_plan
from infra.server import prefect_env, stop_process_group
from schemas.plan import Driver, RunPlan
from schemas.requests import SegmentPlan, TrainExportRequest
from tests.harness import copy_run, mark_preempted

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")

pytestmark = pytest.mark.slow

SERVE = """
import sys
from flows.resume import resume
resume.serve(name=sys.argv[2], parameters={"roots": [sys.argv[1]], "backoff_s": 0.0}, interval=5, limit=1)
"""


def _runs_of(deployment_name: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name]))
            )

    return asyncio.run(go())


def test_interval_schedule_resumes_a_preempted_run(prefect_server: Any, tiny_run: Path, tmp_path: Path) -> None:
    from ckpt.commit.lineage import read_events
    from shardkeeper.stages import run_state

    name = f"schedule-{os.getpid()}-{int(time.time())}"  # own deployment: no reliance on the server's other state
    root = tmp_path / "runs"
    run = copy_run(tiny_run, root / "preempted")
    mark_preempted(run, 8)
    published = tmp_path / "published"
    request = TrainExportRequest(
        config=TINY,
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=8)],
        export_dtype="float32",
        publish_target=published.as_uri(),
    )
    handed = RunPlan.from_request(request, plan_id="p1", started_by=Driver(kind="flow", flow_run_name="t"), now="t")
    write_plan(run, handed.model_copy(update={"status": "handed-over"}))
    # The runner polls for scheduled flow runs every second (not the default 10 s): the two runs come sooner.
    env = {
        **prefect_env(Path(os.environ.get("PREFECT_HOME", tmp_path)), prefect_server.api_url),
        "PYTHONPATH": str(ROOT),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(root), name],
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / "serve.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        completed: list[Any] = []
        runs: list[Any] = []
        while time.monotonic() < deadline and len(completed) < 2:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
            runs = _runs_of(name)
            completed = [r for r in runs if r.state_type and r.state_type.value == "COMPLETED"]
        assert len(completed) >= 2, (
            f"scheduled runs: {[(r.name, r.state_type) for r in runs]}; serve log:\n"
            + (tmp_path / "serve.log").read_text()[-2000:]
        )
        # They came from the schedule, not from anyone calling the deployment.
        assert all(r.auto_scheduled for r in completed)
        state = run_state(run)
        assert state.step == 8 and state.last_status == "completed", state
        # The first scheduled run resumed it (its resume is recorded while that flow run ran); later runs skipped it.
        first = min(completed, key=lambda r: r.start_time)
        events = read_events(run)
        resumes = [e for e in events if e.kind == "resume"]
        assert len(resumes) == 1
        when = datetime.fromisoformat(resumes[0].time.replace("Z", "+00:00"))
        assert first.start_time <= when <= first.end_time, (first.start_time, when, first.end_time)
        # ... and finished its plan once, recorded as the schedule's doing; the later runs left it alone
        plan = read_plan(run)
        assert plan is not None and plan.status == "completed", plan
        assert plan.progress[0].by[-1].kind == "schedule" and plan.progress[0].by[-1].flow_run_id == str(first.id)
        assert plan.exported.by.kind == plan.published.by.kind == "schedule" and plan.exported.step == 8
        assert [e.kind for e in events].count("export") == 1 and [e.kind for e in events].count("publish") == 1
        last = [e for e in events if e.kind == "segment"][-1]
        assert last.data["by"] == plan.progress[0].by[-1].line() and last.data["by"].startswith("schedule 'resume/")
        assert (published / "step-00000008" / "model.safetensors").is_file()
    finally:
        stop_process_group(proc.pid, grace_s=5.0, what="serve")
