"""No process of a segment outlives the process that holds the run lock (real CLI, real torchrun,
2 ranks of configs/tiny.yaml); a SIGTERM during start-up is a preemption; a Prefect cancellation
stops the ranks and ends the segment 'cancelled'.

Launches: 4 for one run directory killed three ways (a rank during start-up, the whole process group, torchrun) and
resumed once, 1 for each early SIGTERM, 1 flow run (served deployment) for the cancellation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt.commit.layout import RunDir
from ckpt.validate.checks import latest_valid, validate
from tests.reliability.procs import (
    ROOT,
    TINY,
    cli_env,
    no_survivors,
    rank_alone_in_rendezvous,
    run_train,
    segment_processes,
    segment_records,
    start_train,
    wait_ranks,
    wait_training,
    wait_until,
)

pytestmark = pytest.mark.slow
BIG = 100_000  # an until_step the tests never reach


def _kill_and_expect_failure(run: Path, victim: str) -> tuple[subprocess.CompletedProcess, float, str]:
    """Start a segment, SIGKILL one of its processes (``victim``: "startup-rank", a rank that has not reached
    rendezvous while its peer waits there; "torchrun", once it trains); return the CLI's result, its seconds after the
    kill and how the victim would be named ("rank R (pid P)")."""
    # a killed rank ends the segment (checkpoint.restarts=0): its restart in place is test_failure_attribution.py's
    proc = start_train(run, BIG, sets=("checkpoint.restarts=0",) if victim == "startup-rank" else ())
    try:
        if victim == "startup-rank":  # one rank waits in rendezvous for the other, which dies before it gets there
            targets = [rank_alone_in_rendezvous(run)[1]]
            assert not (run / "metrics.jsonl").exists()
        else:
            wait_training(
                run,
                steps=(len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0)
                + 2,
            )
            targets = segment_processes(run, "torchrun")
        assert targets, f"no {victim} process found"
        named = f"rank {targets[-1].environ().get('RANK')} (pid {targets[-1].pid})"
        os.kill(targets[-1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    no_survivors(run, within=5.0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), took, named


def test_killed_rank_process_group_and_torchrun_leave_no_survivors_a_second_train_is_refused_then_resumes(
    tmp_path: Path,
) -> None:
    """One run directory, killed three ways, then resumed once:
    - a rank killed during start-up ends the segment within 10 s (its peer does not wait in rendezvous for
      torchrun's 30 s teardown), in one line naming the rank and the signal;
    - the whole process group SIGKILLed while it trains (as `setsid shardkeeper train ... &`, then what a scheduler,
      the OOM killer or a closed terminal does): no orphans; while it trained, a second train was refused in one line
      and wrote nothing;
    - torchrun killed while training (a rank killed while training: tests/reliability/test_kill_torture.py);
    each leaves no survivors and a valid checkpoint to resume from, and the resume starts there."""
    run = tmp_path / "run"
    res, took, named = _kill_and_expect_failure(run, "startup-rank")
    _assert_failed_in_one_line(res)
    assert took < 10.0, f"the CLI ended {took:.1f} s after a rank was killed during start-up: {res.stderr[-2000:]}"
    err_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert f"{named} was killed by SIGKILL" in err_lines[0], err_lines
    assert segment_records(run)[-1]["status"] == "failed"

    proc = start_train(run, BIG, new_session=True)  # as `setsid shardkeeper train ... &`
    try:
        wait_training(run, steps=6)  # one interval checkpoint (every 5 steps) committed
        # While it trains, a second writer is refused with one line and writes nothing.
        mine = (
            "run.yaml",
            "segments.jsonl",
            ".lock",
            ".lock.ranks",
            ".segment-status.json",
            ".segment-launch.json",
        )  # what `train` writes
        before = {n: (run / n).read_bytes() for n in mine if (run / n).exists()}
        second = run_train(run, 8, timeout=120)
        assert second.returncode == 3, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "locked by pid" in lines[0], lines
        after = {n: (run / n).read_bytes() for n in mine if (run / n).exists()}
        assert after == before
        assert len(segment_processes(run, "rank")) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # what a scheduler, the OOM killer or a closed terminal does
        proc.wait(timeout=30)
        no_survivors(run, within=5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    found = latest_valid(RunDir.at(run))
    assert found is not None and validate(found[0], deep=True).valid

    res, _, _ = _kill_and_expect_failure(run, "torchrun")
    _assert_failed_in_one_line(res)
    assert "torchrun was killed by SIGKILL" in [ln for ln in res.stderr.splitlines() if ln.startswith("error:")][0]
    assert segment_records(run)[-1]["status"] == "failed"
    found = latest_valid(RunDir.at(run))
    assert found is not None and validate(found[0], deep=True).valid

    resumed = run_train(run, found[1].step + 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ends = [r for r in segment_records(run) if r["event"] == "end"]
    assert ends[-1]["status"] == "completed" and ends[-1]["start_step"] == found[1].step
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == found[1].step + 2 and rows[-1]["segment"] == 3  # segments 0-2 were killed
    assert "Traceback" not in resumed.stderr


def _assert_failed_in_one_line(res: subprocess.CompletedProcess) -> None:
    assert res.returncode not in (0, 75), res.stderr[-2000:]
    err_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(err_lines) == 1 and "failed" in err_lines[0], res.stderr[-2000:]


@pytest.mark.parametrize("target", ["cli", "rank"])
def test_sigterm_before_the_first_step_is_a_preemption_without_traceback(tmp_path: Path, target: str) -> None:
    """To the CLI (twice), or to one rank alone while it imports (what a node's scheduler may deliver)."""
    run = tmp_path / "run"
    proc = start_train(run, BIG)
    try:
        wait_ranks(run, 2)  # ranks exist (starting up: importing torch, joining the group), no step yet
        assert not (run / "metrics.jsonl").exists()
        if target == "rank":
            os.kill(segment_processes(run, "rank")[0].pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)  # repeated: still one orderly stop
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "SignalException" not in err, err[-3000:]
    end = segment_records(run)[-1]
    assert end["status"] == "preempted" and end["exit_code"] == 75 and end["checkpoint"] is None
    assert "next segment starts clean" in end["note"]
    assert not (run / "metrics.jsonl").exists()
    no_survivors(run, within=5.0)


# ------------------------------------------------------------------------------ Prefect cancellation
def _flow_run_state(flow_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def test_prefect_cancellation_stops_the_ranks_and_starts_no_further_segment(
    prefect_server: Any, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling, StateType

    from schemas.requests import SegmentPlan, TrainExportRequest

    run = tmp_path / "cancel"
    name = f"cancel-{os.getpid()}"
    # The runner polls for scheduled and cancelling flow runs every second (not the default 10 s).
    env = {
        **cli_env(),
        "PREFECT_API_URL": prefect_server.api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(tmp_path / "home")),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    serve = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.serve_flow", name],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:

        def deployed() -> bool:
            with get_client(sync_client=True) as client:
                try:
                    client.read_deployment_by_name(f"train-and-export/{name}")
                    return True
                except Exception:  # noqa: BLE001 - not registered yet
                    return False

        wait_until(deployed, 180, "the served deployment", period=0.2)
        request = TrainExportRequest(
            config=TINY,
            run_dir=str(run),
            backoff_s=0,
            max_preemption_retries=3,
            segments=[SegmentPlan(nproc=2, until_step=BIG - 1), SegmentPlan(nproc=2, until_step=BIG)],
        )
        flow_run = run_deployment(f"train-and-export/{name}", parameters=request.parameters(), timeout=0)
        wait_training(run, steps=2, timeout=300)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
        final = wait_until(
            lambda: (s := _flow_run_state(flow_run.id)) and s.is_final() and s, 120, "the flow run to end", period=0.2
        )
        assert final.type == StateType.CANCELLED, final
        no_survivors(run, within=5.0)
        records = segment_records(run)
        assert [r["event"] for r in records] == ["start", "end"]  # no further segment, no resume
        end = records[-1]
        assert end["status"] == "cancelled" and end["exit_code"] == 130, end
        assert end["checkpoint"] and validate(end["checkpoint"], deep=True).valid  # the ranks committed first
        time.sleep(3)
        assert [r["event"] for r in segment_records(run)] == ["start", "end"]
        from ckpt.plan import PlanLock, read_plan
        from flows.resume import resume

        plan = read_plan(run)  # the plan says so too, its lock is free, and no resumer takes it up
        assert plan is not None and plan.status == "cancelled" and "cancelled at step" in plan.note, plan
        assert not PlanLock(run).is_locked()
        (item,) = resume(run_dirs=[str(run)], backoff_s=0).items
        assert item.action == "skipped-done" and "its plan was cancelled" in item.reason, item
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            out, _ = serve.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            out, _ = serve.communicate()
        print(out[-6000:])  # shown when the test fails: what the runner and the flow run said


def test_resume_flow_leaves_a_cancelled_run_alone() -> None:
    from flows.resume import triage
    from schemas.requests import RunState

    state = RunState(run_dir="/r", exists=True, step=5, last_until_step=8, last_status="cancelled")
    item = triage(state)
    assert item is not None and item.action == "skipped-done" and "cancelled" in item.reason


def _commit_after_the_launcher_died(tmp: str) -> list[object]:
    """Rank 0 about to commit while its launcher is a zombie (SIGKILLed, not reaped yet: kill(pid, 0) still
    finds it): the commit is not made, the .partial stays, nothing is listed as committed."""
    import torch.distributed as dist

    from launch.procs import is_zombie
    from tests.harness import tiny_spec
    from trainer import lifetime
    from trainer.checkpointer.common import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = tiny_spec()
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    run = RunDir.at(Path(tmp) / "run")
    run.root.mkdir()
    ck = DCPCheckpointer(run, spec, model, build_optimizer(model, spec), env, segment=0)
    ck.save(TrainState(step=2), reason="interval", blocking=True)  # the launcher alive: committed
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while not is_zombie(zombie.pid):
        time.sleep(0.01)
    lifetime._DOG[:] = [lifetime._Watchdog(os.getppid(), zombie.pid, None)]
    said: list[str] = []

    def die(reason: str) -> None:
        said.append(reason)
        raise SystemExit(137)

    lifetime.die_orphaned = die  # the real one SIGKILLs this rank
    try:
        ck.save(TrainState(step=4), reason="interval", blocking=True)
    except SystemExit:
        pass
    zombie.wait()
    out = [
        said,
        run.checkpoint(2).is_dir(),
        run.checkpoint(4).exists(),
        sorted(p.name for p in run.checkpoint(2).parent.iterdir()),
    ]
    dist.destroy_process_group()
    return out


def test_rank_zero_does_not_commit_once_its_launcher_is_gone(tmp_path: Path) -> None:
    from tests.harness import spawn

    [(said, kept, committed, names)] = spawn(_commit_after_the_launcher_died, 1, str(tmp_path))
    assert len(said) == 1 and "launcher (pid" in said[0] and "step-00000004.partial is not committed" in said[0], said
    assert kept and not committed and "step-00000004.partial" in names, names
