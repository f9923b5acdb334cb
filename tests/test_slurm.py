"""Multi-node segments: torchrun agents joined by c10d rendezvous on loopback, and the Slurm launcher
against real Slurm daemons (slurmctld + two slurmd emulating nodes n1, n2 on loopback; infra.slurm_local).

What a user of a preemptible Slurm cluster needs to hold:
- a segment across 2 nodes trains bitwise what the same world size trains on one machine;
- ``scontrol requeue`` in the middle of training (what a preemption does) -> the ranks commit an emergency
  checkpoint, Slurm runs the job again and it resumes from that step: 0 completed steps lost, every step
  bitwise equal to an uninterrupted run;
- a node drained while its job is requeued -> the job cannot be placed, the segment ends 'preempted'
  (exit 75) naming the node count to use, and the run resumes on 1 node within 1e-6 relative;
- mistakes (no slurmctld, a partition that does not exist, more nodes than it has) are one line, before
  anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import assert_bitwise, max_rel, metrics

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 240  # ~8 s of training on 2 CPU ranks: long enough to requeue in the middle
INTERVAL = ["--set", "checkpoint.interval=20"]


def _cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The uninterrupted run every Slurm run is compared with: 2 ranks on this machine, steps 0 -> STEPS."""
    run = tmp_path_factory.mktemp("slurm-ref") / "ref"
    proc = _cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        str(STEPS),
        "--device",
        "cpu",
        *INTERVAL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return metrics(run)


def _node_procs(name: str, run: Path) -> list[int]:
    """The processes of emulated node ``name`` of the run in ``run`` (its torchrun agent and ranks)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if f"SHARDKEEPER_NODE_NAME={name}".encode() in env and str(run).encode() in cmd:
            pids.append(int(d.name))
    return pids


def test_two_local_agents_lose_a_node_and_restore_from_the_peers_memory(
    tmp_path: Path, reference: dict[int, dict]
) -> None:
    """No scheduler: two torchrun agents (the local launcher's --nodes 2, nodes node0 and node1) meet through c10d
    rendezvous and train bitwise what one machine trains. Memory snapshots every 5 steps, storage only every 100.
    Node 1 dies whole (agent and rank SIGKILLed) and its memory is gone: the launcher persists node 0's whole copy;
    the next segment restores from memory, node 1's files from node 0's RAM, still bitwise like one machine."""
    run, mem, log = tmp_path / "mn", tmp_path / "shm", tmp_path / "mn.log"
    args = [
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--device",
        "cpu",
        "--set",
        "checkpoint.interval=100",
        "--set",
        "checkpoint.memory_interval=5",
        "--set",
        f"checkpoint.memory_dir={mem}",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardkeeper", *args, "--until-step", str(STEPS)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    # The survivor holds a snapshot of a step >= 20 committed on both nodes: the nodes rename their copies one after
    # the other, and rank 0 says "committed step-N to memory" once every node has (node 0's copy alone is not enough).
    node0 = mem / "nodes" / "node0" / "checkpoints"
    deadline = time.monotonic() + 180
    while not any(
        int(n) >= 20 and (node0 / f"step-{n}" / "manifest.json").is_file()
        for n in re.findall(r"committed step-(\d+) to memory", log.read_text())
    ):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for pid in _node_procs("node1", run):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(mem / "nodes" / "node1")
    assert proc.wait(timeout=180) != 0
    text = log.read_text()
    step = int(re.search(r"persisted the memory snapshot\s+step-(\d+)\s+to", text).group(1))
    assert 20 <= step < 100, text[-2000:]
    again = _cli(*args, "--until-step", str(step + 10))
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"resumed from step-{step:08d} in memory" in out and "(2 nodes x 1)" in out, out[-3000:]
    assert_bitwise(reference, metrics(run), range(1, step + 11))
    manifest = json.loads((run / "checkpoints" / f"step-{step + 10:08d}" / "manifest.json").read_text())
    assert manifest["topology"]["nodes"] == 2 and manifest["topology"]["procs_per_node"] == 1


# -- real Slurm ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from infra import slurm_local

    why = slurm_local.available()
    if why:
        pytest.skip(f"real Slurm daemons: {why}")
    conf = slurm_local.start(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2)
    env = {**os.environ, "SLURM_CONF": str(conf), "SHARDKEEPER_SLURM_UNPLACEABLE_S": "3"}
    yield env
    for job in subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split():
        subprocess.run(["scancel", job], env=env, capture_output=True)
    slurm_local.stop(conf.parent)


@pytest.fixture
def nodes_back(slurm: dict[str, str]) -> None:
    """Whatever a test drains comes back for the next one."""
    from infra import slurm_local

    yield
    slurm_local.resume_all_nodes(Path(slurm["SLURM_CONF"]))


def _scontrol(env: dict[str, str], *args: str) -> None:
    proc = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _start_train(env: dict[str, str], run: Path, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardkeeper",
                "train",
                "--config",
                str(TINY),
                "--run-dir",
                str(run),
                "--launcher",
                "slurm",
                *args,
                *INTERVAL,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert proc.poll() is None, f"train ended before {pattern!r}:\n{_shown(log)}"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    raise AssertionError(f"no {pattern!r} after {timeout:g} s:\n{_shown(log)}")


def _shown(log: Path) -> str:
    """What a failure shows: the launcher's lines (every attempt of a requeued job) and the log's last lines; with
    the ranks' own output of each attempt (segment-*.out)."""
    text = log.read_text()
    lines = text.splitlines()
    head = [
        ln
        for ln in lines[:-40]
        if ln.startswith("shardkeeper:") or "preempt" in ln or "signal" in ln or "Traceback" in ln or "Error" in ln
    ]
    outs = sorted(log.parent.glob("*/slurm/segment-*.out"))
    ranks = "".join(
        f"\n--- {p} (last lines):\n" + "\n".join(p.read_text(errors="replace").splitlines()[-60:]) for p in outs
    )
    return "\n".join(head[-60:] + ["..."] + lines[-40:]) + ranks


def test_segment_across_two_slurm_nodes_matches_local_bitwise(
    slurm: dict[str, str], tmp_path: Path, reference: dict[int, dict]
) -> None:
    """Also the memory tier across the two nodes: each node (n1, n2) keeps a whole copy (its files + its peer's);
    n2 lost (its memory gone), the next job restores from memory, n2's files coming from n1's RAM."""
    run, mem = tmp_path / "two", tmp_path / "shm"
    tier = ["--set", "checkpoint.memory_interval=5", "--set", f"checkpoint.memory_dir={mem}"]
    proc = _cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
        "--launcher",
        "slurm",
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--until-step",
        "30",
        *INTERVAL,
        *tier,
        env=slurm,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from ckpt.validate.checks import validate

    for node in ("n1", "n2"):
        assert validate(mem / "nodes" / node / "checkpoints" / "step-00000030", deep=True).valid, node
    shutil.rmtree(mem / "nodes" / "n2")
    again = _cli(
        "train",
        "--config",
        str(TINY),
        "--run-dir",
        str(run),
        "--launcher",
        "slurm",
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--until-step",
        "40",
        *INTERVAL,
        *tier,
        env=slurm,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step-00000030 in memory" in again.stdout + again.stderr, (again.stdout + again.stderr)[-2000:]
    assert validate(mem / "nodes" / "n2" / "checkpoints" / "step-00000040", deep=True).valid
    assert_bitwise(reference, metrics(run), range(1, 41))
    assert re.search(r"\[Slurm job \d+ COMPLETED\]", proc.stdout + proc.stderr), proc.stdout + proc.stderr
    out = (run / "slurm" / "segment-0.out").read_text()
    assert re.search(r"attempt 1 on n\[1-2\] \(2 nodes\)", out), out[:500]
    script = (run / "slurm" / "segment-0.sbatch").read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --nodes=2", "#SBATCH --signal=TERM@"):
        assert line in script
    seg = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines() if '"segment:0"' in x][-1]
    assert seg["data"]["launcher"] == "slurm" and seg["data"]["scheduler_state"] == "COMPLETED"
    assert seg["data"]["scheduler_job"].isdigit() and seg["data"]["nodes"] == 2
    manifest = json.loads((run / "checkpoints" / "step-00000030" / "manifest.json").read_text())
    assert manifest["topology"]["nodes"] == 2 and manifest["topology"]["launcher"] == "slurm"


def test_requeue_mid_training_loses_no_step(slurm: dict[str, str], tmp_path: Path, reference: dict[int, dict]) -> None:
    """``scontrol requeue`` = SIGTERM to every rank, then Slurm runs the job again (--requeue)."""
    run, log = tmp_path / "rq run $(x)", tmp_path / "rq.log"  # a space and a '$(' in the path: quoted everywhere
    proc = _start_train(slurm, run, log, "--nodes", "2", "--nproc", "1", "--until-step", str(STEPS))
    job = _wait_for(log, r"submitted Slurm job (\d+)", proc).group(1)
    _wait_for(log, r"committed step-00000020 \(interval", proc)
    _scontrol(slurm, "requeue", job)
    stopped = int(_wait_for(log, r"committed step-(\d+) \(preempted", proc).group(1))
    # the requeued job's own PENDING line (the first one, at submission, is already in the log): updated while it is
    # still COMPLETING, its start time is not moved and Slurm holds it back for ~2 min
    _wait_for(log, r"PENDING[^\n]*attempt 2", proc)
    _scontrol(slurm, "update", f"jobid={job}", "StartTime=now")  # a requeued job waits ~2 min otherwise
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    text = log.read_text()
    resumed = int(re.search(r"resumed from step-\d+ at step (\d+)", text).group(1))
    assert resumed == stopped, f"the requeued job resumed at {resumed}, the emergency checkpoint was at {stopped}"
    assert re.search(rf"\[Slurm job {job} COMPLETED, requeued 1x\]", text), text[-800:]
    assert_bitwise(reference, metrics(run), range(1, STEPS + 1))  # 0 completed steps lost, none trained twice apart
    out = (run / "slurm" / "segment-0.out").read_text()
    assert "attempt 1" in out and "attempt 2" in out  # --open-mode=append keeps both attempts


def test_drained_node_preempts_the_segment_and_the_resume_flow_resumes_on_one_node(
    slurm: dict[str, str],
    nodes_back: None,
    prefect_server: object,
    tmp_path: Path,
    reference: dict[int, dict],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, log = tmp_path / "drain", tmp_path / "drain.log"
    proc = _start_train(slurm, run, log, "--nodes", "2", "--nproc", "1", "--until-step", str(STEPS))
    job = _wait_for(log, r"submitted Slurm job (\d+)", proc).group(1)
    _wait_for(log, r"committed step-00000040", proc)
    _scontrol(slurm, "update", "nodename=n2", "state=drain", "reason=maintenance")
    _scontrol(slurm, "requeue", job)
    assert proc.wait(timeout=180) == 75, log.read_text()[-3000:]
    text = log.read_text()
    stopped = int(re.search(r"committed step-(\d+) \(preempted", text).group(1))
    assert "1 of 2 node(s) usable" in text and "resume with --nodes 1" in text
    # The resume flow (what the schedule or the preemption automation runs) asks for 2 nodes; n2 is still
    # drained, so it resubmits the run on the one node usable: world size 1, within 1e-6 of the 2-rank reference.
    from flows.resume import resume

    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    summary = resume(run_dirs=[str(run)], nproc=1, nodes=2, launcher="slurm", backoff_s=0)
    (item,) = summary.items
    assert item.action == "resumed", item
    assert f"step {stopped} -> {STEPS} on 1 ranks via slurm" in item.reason, item.reason
    last = item.outcome.attempts[-1]
    assert last.status == "completed" and last.scheduler_job and last.topology.nodes == 1
    got = metrics(run)
    assert_bitwise(reference, got, range(1, stopped + 1))
    assert max_rel(reference, got, range(stopped + 1, STEPS + 1)) <= 1e-6


def test_sigterm_to_the_launching_cli_stops_the_job_with_a_checkpoint(
    slurm: dict[str, str], tmp_path: Path, reference: dict[int, dict]
) -> None:
    """The process that submitted the job is preempted (or Ctrl-C'd): the ranks commit, no job stays behind."""
    run, log = tmp_path / "term", tmp_path / "term.log"
    proc = _start_train(slurm, run, log, "--nodes", "2", "--nproc", "1", "--until-step", str(STEPS))
    job = _wait_for(log, r"submitted Slurm job (\d+)", proc).group(1)
    _wait_for(log, r"committed step-00000020 \(interval", proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75, log.read_text()[-3000:]
    text = log.read_text()
    stopped = int(re.search(r"committed step-(\d+) \(preempted", text).group(1))
    assert f"segment 0 preempted: steps 0 -> {stopped}" in text, text[-800:]
    queue = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm, capture_output=True, text=True).stdout
    assert queue.strip() in ("", "COMPLETED", "FAILED", "CANCELLED"), queue
    assert_bitwise(reference, metrics(run), range(1, stopped + 1))


def test_a_killed_launcher_leaves_no_second_writer_and_a_pending_job_stops_at_once(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """kill -9 of `shardkeeper train` while its job is pending: the job stays recorded, a second train of the
    run directory is refused (exit 3) instead of training beside it; SIGTERM to a train whose job is pending
    cancels the job within seconds (Slurm refuses to signal a pending job)."""
    busy = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--exclusive", f"--output={tmp_path / 'blocker.out'}", "--wrap", "sleep 60"],
        env=slurm,
        capture_output=True,
        text=True,
    )
    assert busy.returncode == 0, busy.stderr
    blocker = busy.stdout.strip().split(";")[0]
    run, log = tmp_path / "pending", tmp_path / "p.log"
    try:
        proc = _start_train(slurm, run, log, "--nodes", "2", "--nproc", "1", "--until-step", "8")
        job = _wait_for(log, r"submitted Slurm job (\d+)", proc).group(1)
        proc.kill()
        proc.wait()
        again = _cli(
            "train",
            "--config",
            str(TINY),
            "--run-dir",
            str(run),
            "--launcher",
            "slurm",
            "--nodes",
            "2",
            "--nproc",
            "1",
            "--until-step",
            "8",
            *INTERVAL,
            env=slurm,
        )
        err = (again.stdout + again.stderr).strip()
        assert again.returncode == 3 and f"Slurm job {job} of an earlier segment is still pending" in err, err
        assert f"scancel {job}" in err and len(err.splitlines()) == 1
        subprocess.run(["scancel", job], env=slurm, capture_output=True)
        # The record is cleared once Slurm says the job ended: the next train submits (and is stopped pending).
        log2 = tmp_path / "p2.log"
        for _ in range(50):
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm, capture_output=True, text=True)
            if state.stdout.strip() in ("", "CANCELLED"):
                break
            time.sleep(0.2)
        proc = _start_train(slurm, run, log2, "--nodes", "2", "--nproc", "1", "--until-step", "8")
        second = _wait_for(log2, r"submitted Slurm job (\d+)", proc).group(1)
        _wait_for(log2, r"PENDING", proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75, log2.read_text()[-2000:]
        assert time.monotonic() - t0 < 20, f"a pending job took {time.monotonic() - t0:.0f} s to stop"
        state = subprocess.run(["scontrol", "show", "job", "-o", second], env=slurm, capture_output=True, text=True)
        assert "JobState=CANCELLED" in state.stdout, state.stdout
    finally:
        subprocess.run(["scancel", blocker], env=slurm, capture_output=True)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--nodes", "3", "--nproc", "1"], "--nodes 3: the default partition has 2 node(s); use --nodes <= 2"),
        (["--nodes", "1", "--nproc", "3"], "--nproc 3: the nodes of the default partition have 2 CPU(s)"),
        (["--slurm-partition", "nope"], "--slurm-partition nope: no such partition"),
        (["--slurm-time", "0"], "--slurm-time 0: must be a positive number of minutes"),
        (["--slurm-arg=--comment=x\ntouch /tmp/shardkeeper-injected"], "contains control characters"),
        (["--slurm-arg=--wrap=id"], "shardkeeper sets --output, --job-name and the script itself"),
    ],
)
def test_slurm_bad_input_is_one_line_before_anything_is_written(
    slurm: dict[str, str], tmp_path: Path, args: list[str], expect: str
) -> None:
    run = tmp_path / "bad"
    proc = _cli("train", "--config", str(TINY), "--run-dir", str(run), "--launcher", "slurm", *args, env=slurm)
    assert proc.returncode not in (0, 75), proc.stdout
    err = (proc.stdout + proc.stderr).strip()
    assert expect in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not run.exists()


def test_a_run_dir_with_a_newline_never_reaches_a_batch_script(slurm: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "injected"
    run = f"{tmp_path}/nl\ntouch {marker}\n#"
    proc = _cli("train", "--config", str(TINY), "--run-dir", run, "--launcher", "slurm", "--until-step", "2", env=slurm)
    err = (proc.stdout + proc.stderr).strip()
    assert proc.returncode not in (0, 75) and "contains control characters" in err and len(err.splitlines()) == 1, err
    time.sleep(2)
    assert not marker.exists() and not Path(f"{tmp_path}/nl").exists()


def test_unreachable_slurmctld_is_one_line(tmp_path: Path) -> None:
    """No daemon needed: a SLURM_CONF that points at a controller nobody runs."""
    if not subprocess.run(["which", "sinfo"], capture_output=True).returncode == 0:
        pytest.skip("Slurm client commands not installed")
    conf = tmp_path / "slurm.conf"
    # MessageTimeout=2: the client gives up on the dead port in ~1 s per command, not the default ~9 s
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nSlurmctldPort=1\nAuthType=auth/none\nMessageTimeout=2\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1 Default=YES\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    run = tmp_path / "r"
    proc = _cli("train", "--config", str(TINY), "--run-dir", str(run), "--launcher", "slurm", env=env, timeout=120)
    err = (proc.stdout + proc.stderr).strip()
    assert proc.returncode not in (0, 75) and "--launcher slurm:" in err and len(err.splitlines()) == 1, err
    assert not run.exists()
