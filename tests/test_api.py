"""The public API for one's own loop (shardkeeper.Segment) through ``shardkeeper train --script``: a user's FSDP2
script resumes bitwise at the same world size and within 1e-6 across sizes (LR scheduler state restored), a
tracked StatefulDataLoader continues exactly, preemption commits and exits 75, the user's own exception shows
their traceback, and each misuse is one line with nothing committed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import ROOT, copy_run_until, metrics

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "fsdp2_loop.py"
MODES = ROOT / "tests" / "scripts" / "api_modes.py"


def sk(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKEEPER_PROGRESS_S": "0"}
    return subprocess.run([sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def committed(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-") and "." not in p.name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted 2-rank run to step 16, and the same stopped at 8 then resumed on 2 and on 1 rank."""
    base = tmp_path_factory.mktemp("api")
    out = {"full": base / "full", "half": base / "half"}
    for name, until in (("full", 16), ("half", 8)):
        r = sk("train", "--script", str(EXAMPLE), "--run-dir", str(out[name]), "--until-step", str(until), "--nproc",
               "2", "--set", "checkpoint.interval=4", "--", "--width", "32")
        assert r.returncode == 0, r.stderr[-3000:]
    for name, nproc in (("same", "2"), ("one", "1")):
        out[name] = copy_run_until(out["half"], base / name, 8)
        r = sk("train", "--run-dir", str(out[name]), "--until-step", "16", "--nproc", nproc)  # the run remembers its script
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_script_resume_is_bitwise_at_the_same_world_size_and_close_across_sizes(runs: dict[str, Path]) -> None:
    full, same, one = metrics(runs["full"]), metrics(runs["same"]), metrics(runs["one"])
    for s in range(9, 17):
        assert same[s]["loss"] == full[s]["loss"], f"step {s}: {same[s]['loss']!r} != {full[s]['loss']!r}"
        assert same[s]["lr"] == full[s]["lr"] == one[s]["lr"]  # the tracked StepLR continued, not restarted
        assert abs(one[s]["loss"] - full[s]["loss"]) <= 1e-6 * abs(full[s]["loss"]), s
    assert one[16]["world_size"] == 1 and same[16]["segment"] == 1
    assert committed(runs["full"])[-1] == "step-00000016"
    lineage = [json.loads(x) for x in (runs["one"] / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in lineage if e["kind"] == "resume"]
    assert resume and resume[-1]["data"]["from_world_size"] == 2 and resume[-1]["data"]["to_world_size"] == 1


def test_script_checkpoints_validate_deep_and_status_reads_them(runs: dict[str, Path]) -> None:
    ck = runs["one"] / "checkpoints" / "step-00000016"
    r = sk("validate", str(ck), "--deep")
    assert r.returncode == 0 and "valid (deep)" in r.stdout, r.stdout + r.stderr
    r = sk("status", str(runs["one"]), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["last_status"] == "completed"


def test_tracked_stateful_dataloader_continues_exactly_and_refuses_another_world_size(tmp_path: Path) -> None:
    full, half = tmp_path / "full", tmp_path / "half"
    for run, until in ((full, 10), (half, 5)):
        r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", str(until), "--nproc", "2",
               "--set", "checkpoint.interval=5", "--", "--loader")
        assert r.returncode == 0, r.stderr[-3000:]
    r = sk("train", "--run-dir", str(half), "--until-step", "10", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    ref, got = metrics(full), metrics(half)
    assert [got[s]["first"] for s in range(6, 11)] == [ref[s]["first"] for s in range(6, 11)]  # same batches
    assert [got[s]["loss"] for s in range(6, 11)] == [ref[s]["loss"] for s in range(6, 11)]
    # each rank's loader position differs: it cannot be split onto one rank; refused, and nothing set aside
    r = sk("train", "--run-dir", str(half), "--until-step", "12", "--nproc", "1")
    assert r.returncode != 0
    assert "tracked 'loader' held a different state on each of the 2 saving ranks" in r.stderr, r.stderr[-2000:]
    assert committed(half)[-1] == "step-00000010"
    assert not [p for p in (half / "checkpoints").iterdir() if ".invalid" in p.name]


def test_sigterm_commits_at_the_step_boundary_and_exits_75(tmp_path: Path) -> None:
    run = tmp_path / "pre"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the script's DataLoader has a worker process: the preemption signal reaches it too, and must not kill it
    proc = subprocess.Popen([sys.executable, "-m", "shardkeeper", "train", "--script", str(MODES), "--run-dir", str(run),
                             "--until-step", "1000", "--nproc", "2", "--", "--sleep", "0.2", "--loader", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "preempted" in err
    last = committed(run)[-1]
    manifest = json.loads((run / "checkpoints" / last / "manifest.json").read_text())
    assert manifest["reason"] == "preempted" and manifest["step"] == max(metrics(run))


def test_user_exception_shows_the_users_traceback_and_one_line(tmp_path: Path) -> None:
    r = sk("train", "--script", str(MODES), "--run-dir", str(tmp_path / "r"), "--until-step", "6", "--", "--mode",
           "raise", "--at", "3")
    assert r.returncode == 1
    assert 'api_modes.py", line' in r.stderr and "in explode" in r.stderr and "ValueError: boom at step 3" in r.stderr
    assert "trainer/api.py" not in r.stderr and "runpy" not in r.stderr  # their frames, not shardkeeper's
    assert "error: segment 0 failed" in r.stderr and "api_modes.py line" in r.stderr


@pytest.mark.parametrize("mode,expect", [
    ("no-steps", "returned without entering seg.steps()"),
    ("bad-track", "seg.track(counter=...): a object has no state_dict or load_state_dict()"),
    ("break", "left the `for step in seg.steps()` loop before its end"),
    ("twice", "seg.steps(): called twice; one segment runs one loop"),
    ("str-loss", "seg.log(loss=...): a str; loss must be a number"),
])
def test_api_misuse_is_one_line_and_commits_nothing_after_it(tmp_path: Path, mode: str, expect: str) -> None:
    run = tmp_path / "r"
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "6", "--", "--mode", mode)
    assert r.returncode in (1, 2) and "error: segment 0 failed" in r.stderr, r.stderr[-2000:]
    assert expect in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    # nothing is committed after the misuse ("twice" comes after a completed loop: its checkpoint stays)
    assert committed(run) == (["step-00000006"] if mode == "twice" else []) if (run / "checkpoints").exists() else True


@pytest.mark.parametrize("content,name,expect", [
    (None, "missing.py", "no such file"),
    ("print('hi')\n", "train.txt", "not a Python script (.py)"),
    ("def f(:\n", "bad.py", "line 1: SyntaxError"),
])
def test_bad_script_is_refused_before_launch_and_writes_nothing(tmp_path: Path, content: str | None, name: str,
                                                                expect: str) -> None:
    script = tmp_path / name
    if content is not None:
        script.write_text(content)
    r = sk("train", "--script", str(script), "--run-dir", str(tmp_path / "run"), "--until-step", "2")
    assert r.returncode == 2 and expect in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_segment_outside_a_segment_says_how_to_launch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHARDKEEPER_LAUNCH"}
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: sk.Segment(): not inside a shardkeeper segment")
    assert "shardkeeper train --script" in r.stderr and "Traceback" not in r.stderr


def test_a_script_logging_a_nan_loss_stops_without_committing_it(tmp_path: Path) -> None:
    run = tmp_path / "nan"
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "8", "--nproc", "2",
           "--set", "checkpoint.interval=2", "--", "--mode", "nan", "--at", "4")
    assert r.returncode == 65, r.stderr[-3000:]
    assert "non-finite loss at step 5" in r.stderr and "step-00000004 stays the latest checkpoint" in r.stderr
    assert committed(run) == ["step-00000002", "step-00000004"]
    assert json.loads(sk("status", str(run), "--json").stdout)[0]["last_status"] == "failed"


def test_a_nan_on_one_rank_the_step_after_a_stop_signal_is_not_committed_by_the_preemption(tmp_path: Path) -> None:
    """The per-step agreement runs a step behind: a SIGTERM on rank 0 at step 3 is acted on at the end of step 4,
    where rank 1 logged a NaN; the stop must agree on step 4's flags before its checkpoint: exit 65, not 75."""
    run = tmp_path / "term-nan"
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "8", "--nproc", "2",
           "--set", "checkpoint.interval=100", "--", "--mode", "term-then-nan", "--at", "3")
    assert r.returncode == 65, r.stderr[-3000:]
    assert "non-finite loss at step 4" in r.stderr, r.stderr[-3000:]
    assert committed(run) == [] if (run / "checkpoints").exists() else True


def test_code_after_the_loop_that_raises_fails_the_segment_and_keeps_its_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "after"
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "4", "--", "--mode", "after")
    assert r.returncode == 1 and "error: segment 0 failed" in r.stderr, r.stderr[-2000:]
    assert "ValueError: boom at step after the loop" in r.stderr and 'api_modes.py", line' in r.stderr
    assert committed(run) == ["step-00000004"]


@pytest.mark.parametrize("mode,code", [("nan-then-ok", 65), ("thread", 0)])
def test_a_nan_overwritten_in_its_step_still_stops_and_a_lingering_thread_does_not_hang(tmp_path: Path, mode: str,
                                                                                      code: int) -> None:
    run = tmp_path / mode
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "5", "--set", "checkpoint.interval=2",
           "--", "--mode", mode, "--at", "2", timeout=180)
    assert r.returncode == code, r.stderr[-2000:]
    assert committed(run)[-1] == ("step-00000002" if code == 65 else "step-00000005")


def test_a_failing_load_state_dict_of_the_users_object_quarantines_nothing(tmp_path: Path) -> None:
    """The checkpoint is fine, the user's load_state_dict is not: one line, exit non-zero, every checkpoint kept."""
    run = tmp_path / "badload"
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "4", "--set", "checkpoint.interval=2",
           "--", "--counter")
    assert r.returncode == 0, r.stderr[-2000:]
    r = sk("train", "--script", str(MODES), "--run-dir", str(run), "--until-step", "6", "--", "--counter", "--mode",
           "bad-load")
    assert r.returncode != 0 and "user bug in load_state_dict" in r.stderr, r.stderr[-2000:]
    assert committed(run) == ["step-00000002", "step-00000004"]
    assert not [p for p in (run / "checkpoints").iterdir() if ".invalid" in p.name]
