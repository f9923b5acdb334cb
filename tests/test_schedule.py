"""A scheduled deployment really runs: the server's scheduler creates runs from an interval schedule
and a served deployment executes them (a dependency pin once broke this silently: SQLAlchemy 2.1
made every scheduler cycle fail while the UI still showed the schedule as active).

The real ``resume`` flow is served in a subprocess against the session's Prefect server, with a
5-second interval over a run root holding one preempted run: the first scheduled run resumes it to its
until_step, the later ones find nothing to do.
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

from infra.server import prefect_env, stop_process_group
from tests.harness import copy_run, mark_preempted

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

SERVE = """
import sys
from flows.resume import resume
resume.serve(name=sys.argv[2], parameters={"roots": [sys.argv[1]], "nproc": 2, "backoff_s": 0.0}, interval=5, limit=1)
"""


def _runs_of(deployment_name: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name])))

    return asyncio.run(go())


def test_interval_schedule_resumes_a_preempted_run(prefect_server: Any, tiny_run: Path, tmp_path: Path) -> None:
    from ckpt.lineage import read_events
    from shardkeeper.stages import run_state

    name = f"schedule-{os.getpid()}-{int(time.time())}"  # own deployment: no reliance on the server's other state
    root = tmp_path / "runs"
    run = copy_run(tiny_run, root / "preempted")
    mark_preempted(run, 8)
    # The runner polls for scheduled flow runs every second (not the default 10 s): the two runs come sooner.
    env = {**prefect_env(Path(os.environ.get("PREFECT_HOME", tmp_path)), prefect_server.api_url),
           "PYTHONPATH": str(ROOT), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(root), name], cwd=ROOT, env=env,
                            stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        completed: list[Any] = []
        runs: list[Any] = []
        while time.monotonic() < deadline and len(completed) < 2:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
            runs = _runs_of(name)
            completed = [r for r in runs if r.state_type and r.state_type.value == "COMPLETED"]
        assert len(completed) >= 2, (f"scheduled runs: {[(r.name, r.state_type) for r in runs]}; serve log:\n"
                                     + (tmp_path / "serve.log").read_text()[-2000:])
        # They came from the schedule, not from anyone calling the deployment.
        assert all(r.auto_scheduled for r in completed)
        state = run_state(run)
        assert state.step == 8 and state.last_status == "completed", state
        # The first scheduled run resumed it (its resume is recorded while that flow run ran); later runs skipped it.
        first = min(completed, key=lambda r: r.start_time)
        resumes = [e for e in read_events(run) if e.kind == "resume"]
        assert len(resumes) == 1
        when = datetime.fromisoformat(resumes[0].time.replace("Z", "+00:00"))
        assert first.start_time <= when <= first.end_time, (first.start_time, when, first.end_time)
    finally:
        stop_process_group(proc.pid, grace_s=5.0, what="serve")
