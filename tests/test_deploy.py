"""Deployments as a user makes them (``python -m infra.deploy``) and runs them on a real process work pool
with a real ``prefect worker`` against the session's Prefect server; one worker serves every check here.

End to end: deploy (two segments, 2 then 3 ranks, export, publish to a file:// target) -> ``run_deployment``
-> the worker trains -> SIGTERM to one rank -> the segment is preempted, the flow run hands its plan over
(max_preemption_retries 0) and emits ``shardkeeper.segment.preempted`` -> the automation runs ``resume/NAME``
for that run only -> it finishes the plan: the preempted segment at its 2 ranks, the second at 3, export and
publish once; a resumer racing it records "already running", a later one finds the plan finished; the
handed-over flow run ends Completed. Also: flat parameters with the deployment's defaults, meaningful flow
run names, checkpoint events, and bad parameters failing the flow run with one line and nothing written.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from infra.server import prefect_env, stop_process_group
from tests.reliability.procs import segment_processes, wait_training, wait_until

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
UNTIL = 120  # far past the steps trained before the SIGTERM (2-5); the resume trains the rest, so not more
UNTIL2 = 126  # the plan's second segment, at 3 ranks (tiny.yaml's global batch 12 divides 2 and 3)
AUTOMATION_GOAL_S = 15.0  # issue goal: resumed within 15 s of the preemption event

pytestmark = pytest.mark.slow


def _api(coro_fn: Any) -> Any:
    from prefect.client.orchestration import get_client

    async def go() -> Any:
        async with get_client() as client:
            return await coro_fn(client)

    return asyncio.run(go())


def flow_run(run_id: Any) -> Any:
    return _api(lambda c: c.read_flow_run(run_id))


def runs_of(deployment: str) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    name = deployment.split("/", 1)[1]

    async def go(c: Any) -> list[Any]:
        deps = await c.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])))
        wanted = [d.id for d in deps if (await c.read_flow(d.flow_id)).name == deployment.split("/")[0]]
        return [r for r in await c.read_flow_runs() if r.deployment_id in wanted]

    return _api(go)


def shardkeeper_events(run_dir: Path) -> list[dict[str, Any]]:
    async def go(c: Any) -> list[dict[str, Any]]:
        prefixes = [f"shardkeeper.run.{run_dir}", f"shardkeeper.checkpoint.{run_dir}/"]
        r = await c._client.post("/events/filter", json={"filter": {"resource": {"id_prefix": prefixes}}, "limit": 50})
        r.raise_for_status()
        return r.json()["events"]

    return [e for e in _api(go) if e["payload"].get("run_dir") == str(run_dir)]


def final(run_id: Any, timeout: float) -> Any:
    return wait_until(
        lambda: (r := flow_run(run_id)).state is not None and r.state.is_final() and r,
        timeout,
        f"flow run {run_id} to end",
        period=0.25,
    )


@pytest.fixture(scope="module")
def deployed(prefect_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``infra.deploy`` for a fresh run under a fresh root, and one process worker on a fresh pool."""
    from infra.deploy import main as deploy

    tag = f"{os.getpid()}-{int(time.time())}"
    base = tmp_path_factory.mktemp("deploy")
    root = base / "runs"
    root.mkdir()
    pool, name = f"sk-pool-{tag}", f"auto-{tag}"
    cwd = os.getcwd()
    os.chdir(base)  # relative paths resolve against the folder the user deploys from
    try:
        assert (
            deploy(
                [
                    "--config",
                    TINY,
                    "--run-dir",
                    f"runs/{name}",
                    "--segments",
                    f"2:{UNTIL},3:{UNTIL2}",
                    "--pool",
                    pool,
                    "--set",
                    "checkpoint.interval=20",
                    "--set",
                    "global_batch_size=6",  # tiny.yaml says 12: a deploy-time override reaches the run
                    "--max-preemption-retries",
                    "0",
                    "--backoff-s",
                    "0",
                    "--export-dtype",
                    "float32",
                    "--publish-target",
                    (base / "published").as_uri(),
                ]
            )
            == 0
        )
    finally:
        os.chdir(cwd)
    env = {
        **prefect_env(Path(os.environ.get("PREFECT_HOME", base)), prefect_server.api_url),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        "SHARDKEEPER_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    log = open(base / "worker.log", "w")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--limit", "3"],
        cwd=base,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield {"pool": pool, "name": name, "root": root, "run": root / name, "base": base, "log": base / "worker.log"}
    finally:
        stop_process_group(worker.pid, grace_s=10, what="prefect worker")
        log.close()


def test_deployment_defaults_are_the_flat_deploy_time_parameters(deployed: dict[str, Any]) -> None:
    name = deployed["name"]
    dep = _api(lambda c: c.read_deployment_by_name(f"train-and-export/{name}"))
    p = dep.parameters
    assert p["config"] == TINY and p["run_dir"] == str(deployed["run"]) and p["base_dir"] == str(deployed["base"])
    assert p["segments"] == [{"nproc": 2, "until_step": UNTIL}, {"nproc": 3, "until_step": UNTIL2}]
    assert p["max_preemption_retries"] == 0 and p["publish_target"] == (deployed["base"] / "published").as_uri()
    assert "request" not in dep.parameter_openapi_schema["properties"]  # flat, documented parameters
    assert "published dtype" in dep.parameter_openapi_schema["properties"]["export_dtype"]["description"]
    assert dep.work_pool_name == deployed["pool"] and "shardkeeper" in dep.tags and "demo" not in dep.tags
    resume = _api(lambda c: c.read_deployment_by_name(f"resume/{name}"))
    # no nproc: a planned run resumes at its plan's world sizes, another at its preempted segment's
    assert resume.parameters["roots"] == [str(deployed["root"])] and "nproc" not in resume.parameters


def test_bad_parameters_fail_the_flow_run_with_one_line(deployed: dict[str, Any]) -> None:
    from prefect.deployments import run_deployment

    name, base = deployed["name"], deployed["base"]
    bad_config = run_deployment(
        f"train-and-export/{name}", timeout=0, parameters={"config": "configs/nope.yaml", "run_dir": "runs/never"}
    )
    bad_root = run_deployment(f"resume/{name}", timeout=0, parameters={"roots": ["/no/such/root"]})
    bad_segments = run_deployment(
        f"train-and-export/{name}", timeout=0, parameters={"segments": [{"nproc": 2}], "run_dir": "runs/never"}
    )
    expect = {
        bad_config.id: f"parameter config {base}/configs/nope.yaml: does not exist",
        bad_root.id: "parameter roots[0] /no/such/root: does not exist",
        bad_segments.id: "segments.0.until_step",
    }
    for run_id, fragment in expect.items():
        state = final(run_id, 180).state
        assert state.is_failed(), state
        assert fragment in (state.message or "") and "\n" not in (state.message or ""), state.message
    assert not (base / "runs" / "never").exists()


def test_preemption_hands_the_plan_to_the_automation_which_finishes_it(deployed: dict[str, Any]) -> None:
    from prefect.deployments import run_deployment

    from ckpt.commit.lineage import read_events
    from ckpt.plan import read_plan
    from flows.resume import resume

    name, run = deployed["name"], deployed["run"]
    train = run_deployment(f"train-and-export/{name}", timeout=0)
    wait_training(run, steps=2, timeout=240)
    ranks = segment_processes(run, "rank")
    assert ranks, "no rank of the deployment's segment found"
    os.kill(ranks[-1].pid, signal.SIGTERM)  # a preemption notice to one rank

    ended = final(train.id, 240)
    assert ended.state.is_failed() and ended.state.name == "HandedOver", ended.state
    assert "preempted 1 time" in ended.state.message and "handed over" in ended.state.message, ended.state.message
    assert "0 of 2 segments done; export, publish to come" in ended.state.message
    assert ended.name == f"{name} → step {UNTIL2} on 2,3 ranks"
    resumed = wait_until(
        lambda: [r for r in runs_of(f"resume/{name}") if r.parameters.get("run_dirs") == [str(run)]],
        120,
        "the automation's resume flow run",
        period=0.25,
    )[0]
    # A second resumer racing the automation (the schedule, a person): "already running", and no failure.
    wait_until(
        lambda: (p := read_plan(run)) is not None and p.driver is not None and p.driver.kind == "automation",
        120,
        "the automation to take the plan over",
        period=0.25,
    )
    (racing,) = resume(run_dirs=[str(run)], backoff_s=0).items
    assert racing.action == "skipped-locked" and "already running" in racing.reason and "automation" in racing.reason
    done = final(resumed.id, 300)
    assert done.state.is_completed(), (done.state, deployed["log"].read_text()[-3000:])
    assert done.parameters["roots"] == [] and done.name == f"resume {name}"

    plan = read_plan(run)
    assert plan is not None and plan.status == "completed", plan
    automation = plan.progress[1].by[0]
    assert automation.kind == "automation" and automation.flow_run_id == str(resumed.id)
    assert automation.source == f"resume {name} on preemption" and automation.flow_run_name == f"resume {name}"
    assert [[d.kind for d in p.by] for p in plan.progress] == [["flow", "automation"], ["automation"]]
    assert plan.exported.by == plan.published.by == automation and plan.exported.step == UNTIL2
    # where each segment ran: the preempted one resumed at its own 2 ranks, the plan's next one at 3
    starts = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines() if '"start"' in x]
    assert [(r["world_size"], r["until_step"], r["by"].split(" ")[0]) for r in starts] == [
        (2, UNTIL, "train-and-export"),
        (2, UNTIL, "automation"),
        (3, UNTIL2, "automation"),
    ]
    events = read_events(run)
    assert [e.data["by"] for e in events if e.kind == "segment"][1:] == [automation.line()] * 2  # who resumed
    assert [e.kind for e in events].count("export") == 1 and [e.kind for e in events].count("publish") == 1
    assert (deployed["base"] / "published" / f"step-{UNTIL2:08d}" / "model.safetensors").is_file()
    # The handed-over flow run ends Completed once its plan did, saying who finished it; its history keeps both.
    states = _api(lambda c: c.read_flow_run_states(train.id))
    assert [s.name for s in states][-2:] == ["HandedOver", "Completed"], [s.name for s in states]
    assert f"finished by automation 'resume {name} on preemption'" in states[-1].message, states[-1].message
    # A later resume (the schedule, the automation again) finds the plan finished: nothing to do, no failure.
    (again,) = resume(run_dirs=[str(run)], backoff_s=0).items
    assert again.action == "skipped-done" and "its plan is completed" in again.reason, again

    shard_events = shardkeeper_events(run)
    kinds = [e["event"] for e in shard_events]
    preempted = next(e for e in shard_events if e["event"] == "shardkeeper.segment.preempted")
    assert preempted["resource"]["shardkeeper.resumed-by"] == "automation"
    assert kinds.count("shardkeeper.segment.completed") == 2 and kinds.count("shardkeeper.checkpoint.committed") >= 2
    import yaml

    spec = yaml.safe_load((run / "run.yaml").read_text())  # the deploy-time overrides reached the run
    assert spec["global_batch_size"] == 6 and spec["checkpoint"]["interval"] == 20
    latency = (done.start_time - datetime.fromisoformat(preempted["occurred"].replace("Z", "+00:00"))).total_seconds()
    print(f"\nautomation: resume flow run started {latency:.1f} s after the preemption event")
    assert latency <= AUTOMATION_GOAL_S, f"resume started {latency:.1f} s after the preemption event"


def test_deploy_takes_a_script_without_a_config(tmp_path: Path) -> None:
    """infra.deploy --script (no --config): the train-and-export deployment's parameters carry the script (absolute)
    and its arguments in order; the resume deployment needs neither (the run remembers its script)."""
    from infra.deploy import _parse, requests

    train, resume = requests(
        _parse(
            [
                "--script",
                "examples/fsdp2_loop.py",
                "--script-arg=--lr",
                "--script-arg",
                "1e-3",
                "--run-dir",
                str(tmp_path / "own"),
                "--segments",
                "2:10",
            ]
        )
    )
    params = train.parameters()
    assert "config" not in params and params["script"] == str(Path.cwd() / "examples" / "fsdp2_loop.py")
    assert params["script_args"] == ["--lr", "1e-3"] and resume.nproc is None  # the run's own world size
