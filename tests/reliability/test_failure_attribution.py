"""A failed segment's line names the rank that failed first and how; a rank that dies is restarted in place
(checkpoint.restarts), an error of its own never is; what a script's ranks start is contained in the segment and
ended with it; a run is never locked by a dead segment's leftovers.

Launches (real CLI, real torchrun, 2 ranks of tests/scripts/failure_modes.py, two at a time): rank 1 SIGKILLed once
with the memory tier on (restarted in place, while a second train of the run is refused), rank 1 SIGKILLed every
time (the restarts used up), ranks of different widths, every rank os._exit(0) inside the loop, rank 1 out of memory
twice (a real OOM kill in a memory cgroup where this process may make one; the second in a rank the fork server
forked), a rank that forks a SIGTERM-ignoring daemon then the same run trained again
(the uninterrupted reference of the restart), and (through the stage function, with a short grace) a rank that hangs
while its peer waits in a collective and the segment is cancelled. The rest runs no launch: torchrun's summary and
the ranks' lines read back, the subreaper, the ranks lock in forked children, stack dumps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from tests.harness import ROOT, metrics, outcome, side_by_side

SCRIPT = ROOT / "tests" / "scripts" / "failure_modes.py"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The segment's environment, with the fork server's default preload (restarts in place fork from it)."""
    return {
        **{k: v for k, v in os.environ.items() if k != "SHARDKEEPER_FORK_PRELOAD"},
        "OMP_NUM_THREADS": "1",
        "SHARDKEEPER_DEVICE": "cpu",
        "SHARDKEEPER_PROGRESS_S": "0",
        "COLUMNS": "400",
        **(extra or {}),
    }


def _args(run: Path, until: int, sets: tuple[str, ...], script_args: tuple[str, ...]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--script",
        str(SCRIPT),
        "--run-dir",
        str(run),
        "--until-step",
        str(until),
        "--nproc",
        "2",
        *[a for s in sets for a in ("--set", s)],
        "--",
        *script_args,
    ]


def _train(
    run: Path, until: int, *script_args: str, env: dict[str, str] | None = None, sets: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    return subprocess.run(
        _args(run, until, sets, script_args), capture_output=True, text=True, env=_env(env), cwd=ROOT, timeout=400
    )


def _preempted_while_restarting(run: Path) -> subprocess.CompletedProcess:
    """Rank 1 SIGKILLed at step 7 (a snapshot every 2 steps); SIGTERM to the CLI as soon as the restart is recorded,
    while its ranks restart."""
    sets = (
        "checkpoint.memory_interval=2",
        f"checkpoint.memory_dir={run.parent / 'shm-preempt'}",
        "checkpoint.interval=100",
    )
    proc = subprocess.Popen(
        _args(run, 20, sets, ("--mode", "kill", "--rank", "1", "--at", "7", "--times", "1", "--sleep", "0.2")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    records, deadline = run / "segments.jsonl", time.monotonic() + 300
    while not (records.exists() and "restarted-in-place" in records.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _restart_in_place(run: Path) -> dict:
    """Rank 1 SIGKILLed once at step 7 (the memory tier on: a snapshot every 2 steps). From the moment the controller
    records the restart, the run lock is probed (a non-blocking flock, let go at once) and a second train of the run
    is started; the restarted ranks wait for it to end (--wait-for) before they train on to step 10."""
    import fcntl
    import json
    import threading

    gate = run.parent / f"{run.name}.gate"
    sets = (
        "checkpoint.memory_interval=2",
        f"checkpoint.memory_dir={run.parent / 'shm-restart'}",
        "checkpoint.interval=100",
    )
    with open(run.parent / f"{run.name}.err", "w+") as err:
        proc = subprocess.Popen(
            _args(
                run,
                10,
                sets,
                (
                    "--mode",
                    "kill",
                    "--rank",
                    "1",
                    "--at",
                    "7",
                    "--times",
                    "1",
                    "--sleep",
                    "0.2",
                    "--wait-for",
                    str(gate),
                ),
            ),
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        deadline = time.monotonic() + 300
        records = run / "segments.jsonl"
        while not (records.exists() and "restarted-in-place" in records.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, err.seek(0) or err.read()[-3000:]
            time.sleep(0.02)
        probes = {"held": 0, "free": 0}
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                fd = os.open(run / ".lock", os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    probes["free"] += 1
                except BlockingIOError:
                    probes["held"] += 1
                finally:
                    os.close(fd)  # lets go of it at once if it was taken
                time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        second = subprocess.run(
            [sys.executable, "-m", "shardkeeper", "train", "--run-dir", str(run), "--until-step", "10", "--nproc", "2"],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=ROOT,
            timeout=300,
        )
        done.set()
        prober.join()
        gate.touch()
        code = proc.wait(timeout=300)
        err.seek(0)
        stderr = err.read()
    return {
        "returncode": code,
        "stderr": stderr,
        "second": second,
        "probes": probes,
        "lineage": [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()],
        "segments": [json.loads(x) for x in records.read_text().splitlines()],
        "report": json.loads((run / ".segment-status.json").read_text()),
    }


def _error_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: segment")]
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def memory_cgroup_here() -> bool:
    """Can a process here make a child memory cgroup of its own (root, or a delegated cgroup v2 subtree)? Then
    failure_modes.py --mode oom is killed by the kernel's real OOM killer."""
    from launch._oom import _mounts

    v2, v1 = _mounts()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        base = (
            Path(v2) / path.lstrip("/")
            if controllers == "" and v2
            else Path(v1) / path.lstrip("/")
            if "memory" in controllers.split(",") and v1
            else None
        )
        if base is None:
            continue
        probe = base / f"shardkeeper-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            continue
        probe.rmdir()
        return True
    return False


def _remove_oom_cgroups() -> None:
    """The empty memory cgroups failure_modes.py --mode oom made (its rank died in them)."""
    for pattern in ("/sys/fs/cgroup/**/shardkeeper-oom-*", "/sys/fs/cgroup/memory/**/shardkeeper-oom-*"):
        for d in Path("/").glob(pattern.lstrip("/")):
            try:
                d.rmdir()
            except OSError:
                pass


def _hang_cancelled(run: Path, mode: str = "hang") -> object:
    """Rank 1 sleeps inside the loop (``mode`` 'hang'; 'stop': it SIGSTOPs itself) while rank 0 waits for it in a
    collective; the segment is cancelled once two steps are logged (the launcher's stop path: SIGTERM to torchrun,
    SIGKILL at the end of a 6 s grace)."""
    from shardkeeper.config import train_spec
    from shardkeeper.stages import plan_topology, train_segment

    spec = train_spec(None, [], str(run), script=str(SCRIPT), script_args=["--mode", mode, "--sleep", "0.1"])
    rows = run / "metrics.jsonl"
    seen: list[float] = []

    def cancel() -> bool:
        if rows.exists() and len(rows.read_text().splitlines()) >= 2:
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 2.0

    return train_segment(
        spec,
        run,
        plan_topology(spec, 2, device="cpu"),
        1000,
        sink=lambda line: None,
        cancel_check=cancel,
        launcher_options={"grace_s": 6},
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("failures")
    oom = memory_cgroup_here()
    short_grace = partial(_train, env={"SHARDKEEPER_LEFTOVER_GRACE_S": "2"})  # for what the rank leaves behind
    no_restart = partial(_train, sets=("checkpoint.restarts=0",))  # attribution of a death that ends the segment
    one_restart = partial(_train, sets=("checkpoint.restarts=1",))
    chains = [
        [("restart", _restart_in_place, base / "restart")],
        [("preempt-restart", _preempted_while_restarting, base / "preempt-restart")],
        [("kill", one_restart, base / "kill", 6, "--mode", "kill", "--rank", "1")],
        [("widths", no_restart, base / "widths", 6, "--mode", "widths", "--rank", "1")],
        [("exit0", _train, base / "exit0", 6, "--mode", "exit0", "--rank", "-1")],
        [("oom", one_restart, base / "oom", 6, "--mode", "oom", "--rank", "1")],
        [
            (
                "orphan",
                short_grace,
                base / "orphan",
                4,
                "--mode",
                "orphan",
                "--rank",
                "1",
                "--orphan-pid-file",
                str(base / "orphan.pid"),
            ),
            ("orphan-next", short_grace, base / "orphan", 10),
        ],  # also the uninterrupted reference of "restart"
        [("hang", _hang_cancelled, base / "hang")],
        [("stopped", _hang_cancelled, base / "stopped", "stop")],
    ]
    try:
        results = side_by_side(chains, 2)
    finally:
        _remove_oom_cgroups()
    return {"base": base, "oom_cgroup": oom, **results}


def test_a_killed_rank_is_restarted_in_place_under_the_same_lock_and_trains_on_bitwise(launched: dict) -> None:
    res = outcome(launched, "restart")
    err = res["stderr"]
    assert res["returncode"] == 0, err[-3000:]
    summary = [ln for ln in err.splitlines() if "segment 0 " in ln and not ln.startswith("20")]
    assert (
        "segment 0 completed: steps 0 -> 10 on 2 ranks" in err and "restarted in place 1x (rank 1: SIGKILL)" in err
    ), summary
    said = [ln for ln in err.splitlines() if "restarting the ranks in place" in ln]
    assert len(said) == 1 and said[0].startswith("shardkeeper: rank 1 (pid ") and ") was killed by SIGKILL (" in said[0]
    assert "rank 0 then failed: connection" in said[0] and "(1 of 3, checkpoint.restarts)" in said[0], said
    second = res["second"]  # the same run trained again while its ranks restart: refused, the lock never let go
    assert second.returncode == 3 and "locked by pid" in second.stderr, second.stderr[-2000:]
    assert res["probes"]["held"] > 10 and res["probes"]["free"] == 0, res["probes"]
    events = {e["id"]: e for e in res["lineage"]}
    restart = events["restart-in-place:segment-0:1"]
    assert restart["data"]["action"] == "restarted in place (rank 1: SIGKILL)" and restart["data"]["rank"] == 1
    resumed = events["resume:segment-0:restart-1"]
    assert resumed["data"]["tier"] == "memory" and 7 - resumed["step"] <= 2  # killed at step 7: lost <= memory_interval
    assert [r["cause"] for r in res["segments"] if r["event"] == "restarted-in-place"] == ["SIGKILL"]
    end = res["segments"][-1]
    assert end["event"] == "end" and end["restarts"] == 1 and end["restart_causes"] == ["rank 1: SIGKILL"], end
    assert res["report"]["restarts"] == 1 and res["report"]["status"] == "completed"
    # every step's loss as the uninterrupted run of the same script trained it (the "orphan" run: the same model)
    ref, got = metrics(launched["base"] / "orphan"), metrics(launched["base"] / "restart")
    assert [got[s]["loss"] for s in range(1, 11)] == [ref[s]["loss"] for s in range(1, 11)]


def test_a_preemption_while_the_ranks_restart_commits_the_newest_snapshot_and_exits_75(launched: dict) -> None:
    res = outcome(launched, "preempt-restart")
    assert res.returncode == 75, res.stderr[-3000:]
    assert "restarting the ranks in place (1 of 3" in res.stderr and "segment 0 preempted" in res.stderr
    from ckpt.commit.layout import RunDir
    from ckpt.validate.checks import latest_valid, validate

    found = latest_valid(RunDir.at(launched["base"] / "preempt-restart"))
    # storage held nothing (interval 100): the newest snapshot before the kill persisted, or the restarted ranks' own
    assert found is not None and found[1].step >= 6 and validate(found[0], deep=True).valid, res.stderr[-3000:]


def test_a_rank_killed_every_time_uses_up_its_restarts_and_is_named_with_its_signal(launched: dict) -> None:
    res = outcome(launched, "kill")
    line = _error_line(res)
    assert "rank 1 (pid " in line and ") was killed by SIGKILL (" in line, line
    assert "rank 0 then failed: connection" in line, line  # the survivor's gloo error, as what followed
    assert line.index("rank 1 (pid") < line.index("rank 0 then failed")
    assert line.endswith("(after 1 restart(s) in place of checkpoint.restarts: 1: rank 1: SIGKILL)"), line
    assert "rank 1 died of SIGKILL after 1 restart(s) in place (checkpoint.restarts: 1): the segment ends" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]  # no survivor's torch traceback shown as the cause


def test_ranks_of_different_widths_name_the_rank_that_aborted_with_glooss_message(launched: dict) -> None:
    line = _error_line(outcome(launched, "widths"))
    assert "rank 0 (pid " in line, line
    assert "died of SIGABRT: terminate called after throwing gloo::EnforceNotMet" in line, line
    assert "collective mismatch" in line and "rank 1 then failed: connection" in line, line


def test_ranks_that_exit_0_inside_the_loop_are_named_as_such(launched: dict) -> None:
    line = _error_line(outcome(launched, "exit0"))
    assert "exited with code 0 before its segment ended" in line, line
    assert ("rank 0 (pid" in line and "rank 1 then exited with code 0" in line) or (
        "rank 1 (pid" in line and "rank 0 then exited with code 0" in line
    ), line


def test_an_out_of_memory_rank_is_named_with_what_the_kernel_says(launched: dict) -> None:
    """Out of memory twice: a rank torchrun started, restarted once in place; then the rank the fork server forked for
    the restart (the kernel names its pid, not its client's)."""
    res = outcome(launched, "oom")
    line = _error_line(res)
    said = [ln for ln in res.stderr.splitlines() if "restarting the ranks in place" in ln]
    assert len(said) == 1 and "rank 1 (pid " in said[0] and "rank 1 (pid " in line, (said, line)
    assert "(after 1 restart(s) in place of checkpoint.restarts: 1: rank 1: " in line, line
    for text in (said[0], line):
        if launched["oom_cgroup"]:  # a real OOM kill: the kernel log names it (root), or its cgroup counted it
            assert (
                "was killed by the kernel's OOM killer (SIGKILL; kernel log: " in text
                or "most likely by the kernel's OOM killer" in text
            ), text
        else:  # the rank SIGKILLed itself (no memory cgroup to limit it in): no OOM may be claimed
            assert "was killed by SIGKILL (" in text and "the kernel's OOM killer (SIGKILL" not in text, text
    if launched["oom_cgroup"]:
        assert "ran out of memory: lower the memory each rank needs" in line, line


def test_what_a_rank_leaves_behind_ends_with_the_segment_and_never_locks_the_run(launched: dict) -> None:
    first, nxt = outcome(launched, "orphan"), outcome(launched, "orphan-next")
    assert first.returncode == 0, first.stderr[-3000:]
    pid = int((launched["base"] / "orphan.pid.1").read_text())
    said = [ln for ln in first.stderr.splitlines() if "outlived them" in ln or "after SIGTERM" in ln]
    assert len(said) == 2 and f"pid {pid} (from rank 1: " in said[0] and "SIGKILL after 2 s" in said[0], said
    assert f"pid(s) {pid} still running 2 s after SIGTERM: SIGKILL" in said[1], said  # it ignored SIGTERM
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] in "ZX"
    assert nxt.returncode == 0, nxt.stderr[-3000:]  # the next train of the run is not refused
    assert "segment 1 completed: steps 4 -> 10" in nxt.stderr, nxt.stderr[-2000:]


def test_a_rank_that_hangs_while_its_peer_waits_is_named_from_its_stack(launched: dict) -> None:
    res = outcome(launched, "hang")
    assert res.status == "cancelled", res
    assert res.note.startswith(
        "the ranks did not stop within the 6 s grace and were killed: rank 1 was at failure_modes.py line "
    ), res.note
    assert "in misbehave, outside any collective, so the others waited for it (rank 0 in " in res.note, res.note


def test_a_stopped_rank_that_cannot_answer_for_its_stack_is_named_as_the_one_the_others_waited_for(
    launched: dict,
) -> None:
    res = outcome(launched, "stopped")
    assert res.status == "cancelled", res
    assert res.note.startswith(
        "the ranks did not stop within the 6 s grace and were killed: rank 1 wrote no stack when asked: it was "
        "stopped (SIGSTOP, or a debugger attached), so the others waited for it (rank 0 in "
    ), res.note
    assert "rank 1 was at" not in res.note and "every rank waited" not in res.note, res.note


# ------------------------------------------------------------------------------------------------ without a launch
SUMMARY = """\
E1204 15:56:25.019000 12180 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) \
local_rank: 0 (pid: 12185) of binary: /usr/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer.segment FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-04_15:56:25
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 2 (pid: 12186)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_15:56:25
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 12185)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 12185
============================================================"""
ABORT = [
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 170 vs 114. Is there a distributed "
    "collective mismatch in your code?",
]


def test_torchruns_summary_and_the_ranks_lines_read_back_from_the_output_alone() -> None:
    """What a Slurm job's output gives: torchrun's blocks (exit code per rank), the ranks' lines, a C++ abort."""
    from launch.base import failing_rank_lines
    from schemas.seam import RANK_ERROR_PREFIX

    survivor = (
        f"{RANK_ERROR_PREFIX} rank 1: x.py line 9: RuntimeError: [pair.cc:537] Read error: Connection reset by peer"
    )
    line = failing_rank_lines([*ABORT, survivor, *SUMMARY.splitlines()])
    assert line == (
        "rank 0 (pid 12185) died of SIGABRT: terminate called after throwing gloo::EnforceNotMet: "
        "[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 170 vs 114. Is there a distributed "
        "collective mismatch in your code?; rank 1 then failed: connection reset by peer"
    ), line


def test_the_launchers_own_times_outrank_torchruns_one_second_root_cause() -> None:
    """torchrun stamps failures to the second and breaks ties by local rank: here it calls rank 0 the root cause,
    while the launcher saw rank 1 end 40 ms before rank 0's line arrived."""
    from launch.attribution import RankEnd, failure_line, merge, torchrun_ends

    summary = SUMMARY.replace("exitcode  : 2 (pid: 12186)", "exitcode  : -9 (pid: 12186)").replace(
        "exitcode  : -6 (pid: 12185)  (SIGABRT)", "exitcode  : 1 (pid: 12185)"
    )
    observed = [RankEnd(rank=0, pid=12185, ended_at=10.30), RankEnd(rank=1, pid=12186, ended_at=10.00)]
    ends = merge(
        torchrun_ends(summary.splitlines()), [(10.04, "rank 0: x.py line 3: RuntimeError: Socket Timeout")], observed
    )
    assert [e.torchrun_first for e in ends] == [True, False]
    assert failure_line(ends).startswith(
        "rank 1 (pid 12186) was killed by SIGKILL (by the OOM killer or from outside: "
        "not known here); rank 0 then failed: timed out waiting in a collective"
    )
    # a cause of its own beats an earlier consequence; a rank torchrun stopped is named as stopped
    ends = [
        RankEnd(rank=0, exitcode=1, line="rank 0: ValueError: bad batch", line_at=2.0),
        RankEnd(rank=1, exitcode=1, line="rank 1: RuntimeError: Connection closed by peer", line_at=1.0),
        RankEnd(rank=2, exitcode=-15, ended_at=3.0),
    ]
    assert failure_line(ends) == (
        "rank 0: ValueError: bad batch; rank 1 then failed: connection closed by peer; torchrun then stopped rank 2"
    )
    # exit 0 is a failure only when the segment did not end
    zero = [
        RankEnd(rank=0, pid=7, exitcode=0, ended_at=1.0),
        RankEnd(rank=1, exitcode=1, line="rank 1: boom", line_at=2.0),
    ]
    assert failure_line(zero).startswith("rank 0 (pid 7) exited with code 0 before its segment ended; rank 1 then")
    assert failure_line(zero, completed=True) == "rank 1: boom"
    # a rank seen to end whose status torchrun reaped first, and which torchrun does not list as failed: exit 0
    unread = merge(torchrun_ends(summary.splitlines()), [], [RankEnd(rank=2, pid=99, ended_at=9.0)])
    assert [e.exitcode for e in unread if e.rank == 2] == [0]


def test_a_restart_names_the_signal_the_agent_read_when_the_launcher_could_not_read_the_status() -> None:
    """Under load torchrun reaps a killed rank before the launcher reads its status, and its restart prints no
    "failed (exitcode" line: the agent's restart record (torchrun's own status of the rank) says how it died, never
    "exited with code 0"; a SIGKILL then goes to the kernel's word on it (the OOM killer)."""
    from dataclasses import replace

    from launch.attribution import RankEnd, WorkerEnd, parse_restart_line, restart_line
    from launch.base import Generation, restart_from_record

    record = parse_restart_line(restart_line(1, 1, WorkerEnd(rank=1, exitcode=-9, pid=20881), "run"))
    assert record is not None and record["exitcode"] == -9
    gen = Generation([], [(5.2, "rank 0: x.py line 3: RuntimeError: Connection closed by peer")], [])
    observed = [RankEnd(rank=1, pid=20881, ended_at=5.0), RankEnd(rank=0, pid=20880, ended_at=5.3)]
    looked: list[int] = []

    def kill_cause(e: RankEnd) -> RankEnd:
        looked.append(e.rank)
        return replace(e, killed_how="the kernel's OOM killer", oom="yes")

    r = restart_from_record(1, record, gen, observed, kill_cause)
    assert r.rank == 1 and looked == [1] and "exited with code 0" not in r.line, r.line
    assert r.line.startswith("rank 1 (pid 20881) was killed by the kernel's OOM killer"), r.line
    # Slurm: no rank watched from the launching host, only the output: the record's status and pid name it
    remote = restart_from_record(1, record, Generation([], [], []))
    assert remote.rank == 1 and remote.line.startswith("rank 1 (pid 20881) was killed by SIGKILL"), remote.line
    # a record from an agent that did not say the status: the launcher's own account, which no longer guesses 0 for
    # a status it did not read (torchrun lists nothing before a restart): the agent's line stands
    older = {k: v for k, v in record.items() if k != "exitcode"}
    assert restart_from_record(1, older, Generation([], [], []), observed).line == "rank 1 (pid 20881) died of SIGKILL"
    # the others ended with their status unread (torchrun stopped them): not said to have exited 0
    quiet = restart_from_record(1, record, Generation([], [], []), observed, kill_cause)
    assert "exited with code 0" not in quiet.line and "rank 0" not in quiet.line, quiet.line
    # a status the launcher read itself is never overruled by the record
    read = [RankEnd(rank=1, pid=20881, exitcode=-15, ended_at=5.0)]
    assert restart_from_record(1, record, Generation([], [], []), read).line == "rank 1 (pid 20881) died of SIGTERM"
    # an exit code of the rank's own comes with the agent's note of what its collective said: that note stands
    timed_out = parse_restart_line(
        restart_line(1, 1, WorkerEnd(rank=0, exitcode=1, pid=40, consequence="timed out waiting in a collective"))
    )
    assert timed_out is not None
    for where in (Generation([], [], []), gen):
        said = restart_from_record(1, timed_out, where, [RankEnd(rank=0, pid=40, ended_at=5.0)])
        assert "exited with code" not in said.line and said.cause != "exit code 1", said


STACK_WAITING = """\
Thread 0x00007ff3fa3a36c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/repo/trainer/lifetime.py", line 113 in loop
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007ff3fc3d1b80 (most recent call first):
  File "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/v/lib/python3.11/site-packages/torch/distributed/fsdp/_fsdp_collectives.py", line 364 in foreach_all_gather
  File "/v/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778 in _wrapped_call_impl
  File "/home/u/train.py", line 115 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/trainer/segment.py", line 244 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
STACK_SLEEPING = """\
Current thread 0x00007fd8aabbdb80 (most recent call first):
  File "/home/u/train.py", line 100 in misbehave
  File "/home/u/train.py", line 113 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/trainer/segment.py", line 244 in <module>
"""


def test_ranks_that_did_not_stop_are_named_from_their_stacks() -> None:
    from launch.attribution import stuck_line

    assert stuck_line({0: STACK_WAITING, 1: STACK_SLEEPING}, 60) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 1 was at train.py line 100 in misbehave, "
        "outside any collective, so the others waited for it (rank 0 in all_gather_single called at train.py line "
        "115 in <module>)"
    )
    assert "every rank waited in a collective" in stuck_line({0: STACK_WAITING, 1: STACK_WAITING}, 60)
    assert stuck_line({0: "garbage"}, 60) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 0 wrote a stack that could not be read"
    )
    # a rank that could not answer (stopped) is the one the others waited for, said first
    stopped = "it was stopped (SIGSTOP, or a debugger attached)"
    assert stuck_line({0: STACK_WAITING}, 60, {1: stopped}) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 1 wrote no stack when asked: it was "
        "stopped (SIGSTOP, or a debugger attached), so the others waited for it (rank 0 in all_gather_single called "
        "at train.py line 115 in <module>)"
    )
    assert stuck_line({0: STACK_SLEEPING}, 60, {1: stopped}) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 1 wrote no stack when asked: it was "
        "stopped (SIGSTOP, or a debugger attached); rank 0 was at train.py line 100 in misbehave"
    )
    # one silent for no known reason (running, slow to write) is said last and blamed for nothing
    assert stuck_line({0: STACK_WAITING, 1: STACK_SLEEPING}, 60, {2: None}) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 1 was at train.py line 100 in misbehave, "
        "outside any collective, so the others waited for it (rank 0 in all_gather_single called at train.py line "
        "115 in <module>); rank 2 wrote no stack in time"
    )
    assert stuck_line({}, 60, {2: None}) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 2 wrote no stack in time"
    )
    assert stuck_line({}, 60, {}) is None and stuck_line({0: " \n"}, 60, {}) is None
    # the others all in a collective and one silent for no known reason: not "every rank", and it is pointed at
    assert stuck_line({0: STACK_WAITING}, 60, {1: None}) == (
        "the ranks did not stop within the 60 s grace and were killed: every rank whose stack was read waited in a "
        "collective (rank 0 in all_gather_single called at train.py line 115 in <module>); rank 1 wrote no stack in "
        "time: look at it first"
    )
    # faulthandler cuts a thread's dump at 100 frames ("  ..."): a deep stack has no <module> frame, and is still read
    deep = (
        "Current thread 0x00007fd8aabbdb80 (most recent call first):\n"
        + "".join(f'  File "/home/u/train.py", line {100 + k % 3} in recurse\n' for k in range(100))
        + "  ...\n"
    )
    assert stuck_line({0: STACK_WAITING, 1: deep}, 60) == (
        "the ranks did not stop within the 60 s grace and were killed: rank 1 was at train.py line 100 in recurse, "
        "outside any collective, so the others waited for it (rank 0 in all_gather_single called at train.py line "
        "115 in <module>)"
    )
    assert stuck_line({0: STACK_WAITING, 1: deep[:80]}, 60) == (  # a dump cut mid-write: said, never dropped
        "the ranks did not stop within the 60 s grace and were killed: every rank whose stack was read waited in a "
        "collective (rank 0 in all_gather_single called at train.py line 115 in <module>); rank 1 wrote a stack "
        "that could not be read: look at it first"
    )
    two = stuck_line({0: STACK_WAITING}, 60, {1: stopped, 2: stopped})
    assert two is not None and ", so the others waited for them (rank 0 in " in two, two


def test_why_a_live_process_is_silent_comes_from_its_state() -> None:
    from launch.procs import why_silent

    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert why_silent(proc.pid) is None  # sleeping as usual: it could have answered
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while why_silent(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert why_silent(proc.pid) == "it was stopped (SIGSTOP, or a debugger attached)"
    finally:
        proc.kill()
        proc.wait()
    assert why_silent(proc.pid) is None  # gone


DAEMON = """\
import os, signal, sys, time
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(os.getpid(), flush=True)
        time.sleep(600)
    os._exit(0)
time.sleep(0.5)
"""


def test_the_subreaper_ends_a_daemon_that_left_its_parent_and_ignores_sigterm(tmp_path: Path) -> None:
    """launch.contain around a module whose child double-forks into its own session, ignoring SIGTERM: the
    daemon is re-parented to the wrapper, not to init, and is SIGKILLed after the grace; the wrapper returns only
    once it is gone."""
    (tmp_path / "daemonizer.py").write_text(DAEMON)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "SHARDKEEPER_LEFTOVER_GRACE_S": "1"}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "launch.contain", "daemonizer"], capture_output=True, text=True, env=env, timeout=60
    )
    took = time.monotonic() - t0
    pid = int(res.stdout.split()[0])
    assert res.returncode == 0, res.stderr
    assert f"pid {pid} (" in res.stderr and "launch.contain daemonizer" in res.stderr, res.stderr
    assert "SIGKILL after 1 s" in res.stderr, res.stderr
    assert f"pid(s) {pid} still running 1 s after SIGTERM: SIGKILL" in res.stderr, res.stderr
    assert not Path(f"/proc/{pid}").exists(), "the daemon outlived the wrapper"
    assert took < 30, took


def test_a_forked_child_never_holds_the_ranks_lock_and_a_holder_is_named(tmp_path: Path) -> None:
    """A rank's forked child closes its copy of .lock.ranks (trainer.lifetime): once the rank is gone, the run lock
    is taken at once although the child still runs. A process that does hold it (a fork from C, past Python's
    hooks) is named with its pid and command, with how to stop it."""
    from ckpt.guards.lock import RunLock
    from schemas.errors import RunLockedError

    code = (
        f"import os, sys, time; sys.path.insert(0, {str(ROOT)!r}); from ckpt.guards.lock import hold_ranks_lock; "
        "from trainer.lifetime import _not_in_forks; fd = hold_ranks_lock(sys.argv[1]); "
        "_not_in_forks(fd) if sys.argv[2] == 'python' else None; pid = os.fork()\n"
        "if pid == 0:\n    time.sleep(60)\nprint(pid, flush=True)"
    )
    for how in ("python", "unguarded"):
        run = tmp_path / how
        run.mkdir()
        rank = subprocess.Popen([sys.executable, "-c", code, str(run), how], stdout=subprocess.PIPE, text=True)
        child = int(rank.stdout.readline())  # the child keeps the pipe open: not read to its end
        rank.wait(timeout=60)
        rank.stdout.close()
        try:
            if how == "python":
                RunLock(run, ranks_wait_s=0.5).acquire().release()  # the rank has exited: nothing holds it
            else:
                with pytest.raises(RunLockedError) as e:
                    RunLock(run, ranks_wait_s=0.5).acquire()
                msg = str(e.value)
                assert f"pid {child}: started by a rank (" in msg and f"kill {child}; kill -9 {child}" in msg, msg
        finally:
            os.kill(child, signal.SIGKILL)


def test_a_sigkilled_launchers_stacks_folder_is_swept_by_the_next_launch() -> None:
    """The folder the ranks write their stacks to is removed when the launch ends; one a SIGKILLed launcher left
    behind (its pid gone) is removed by the next launch, a live launcher's is kept."""
    import tempfile

    from launch.local import STACKS_PREFIX, _stacks_dir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = Path(tempfile.gettempdir())
    dead, live = root / f"{STACKS_PREFIX}{gone.pid}-x", root / f"{STACKS_PREFIX}{os.getppid()}-x"
    dead.mkdir()
    live.mkdir()
    try:
        fresh = Path(_stacks_dir())
        assert fresh.is_dir() and not dead.exists() and live.is_dir()
        fresh.rmdir()
    finally:
        for d in (dead, live):
            if d.exists():
                d.rmdir()
