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
from functools import partial
from pathlib import Path

import pytest

from tests.harness import ROOT, copy_run_until, metrics, outcome, side_by_side

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "fsdp2_loop.py"
MODES = ROOT / "tests" / "scripts" / "api_modes.py"


def sk(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKEEPER_PROGRESS_S": "0"}
    return subprocess.run(
        [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


SIDE_BY_SIDE = 2  # launches at once: two cores here; 2 measured faster than 3 or 4 (most of a launch is imports)


def committed(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-") and "." not in p.name)


MISUSE = {
    "no-steps": "returned without entering seg.steps()",
    "bad-track": "seg.track(counter=...): a object has no state_dict or load_state_dict()",
    "break": "left the `for step in seg.steps()` loop before its end",
    "twice": "seg.steps(): called twice; one segment runs one loop",
    "str-loss": "seg.log(loss=...): a str; loss must be a number",
}
REFUSED_MISUSE = {"bad-track"}  # raised before the first step: the segment is refused, not failed
BAD_SCRIPTS = {  # name: (content, the one line's reason)
    "missing.py": (None, "no such file"),
    "train.txt": ("print('hi')\n", "not a Python script (.py)"),
    "bad.py": ("def f(:\n", "line 1: SyntaxError"),
}


def preempted(run: Path) -> subprocess.CompletedProcess:
    """A 2-rank run to step 1000 SIGTERMed mid-run, once 3 steps are logged."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the script's DataLoader has a worker process: the preemption signal reaches it too, and must not kill it
    args = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--script",
        str(MODES),
        "--run-dir",
        str(run),
        "--until-step",
        "1000",
        "--nproc",
        "2",
        "--",
        "--sleep",
        "0.2",
        "--loader",
        "--workers",
        "1",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    rows = run / "metrics.jsonl"
    deadline = time.monotonic() + 120  # mid-run: a few steps logged (the worker is up), far from step 1000
    while time.monotonic() < deadline and not (rows.exists() and len(rows.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def outside_a_segment(cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SHARDKEEPER_LAUNCH"}
    return subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def modes(run: Path, until: int, *more: str) -> tuple:
    """``shardkeeper train --script api_modes.py`` arguments: ``more`` before ``--`` are options, after it the
    script's."""
    cut = more.index("--") if "--" in more else len(more)
    return (
        "train",
        "--script",
        str(MODES),
        "--run-dir",
        str(run),
        "--until-step",
        str(until),
        *more[:cut],
        "--",
        *more[cut + 1 :],
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run the tests below read, launched side by side:

    - ``full``: one uninterrupted 2-rank run of examples/fsdp2_loop.py to step 16, then ``validate --deep`` of its
      last checkpoint; ``same``/``one``: copies of it cut at step 8 resumed on 2 and on 1 rank, then
      ``validate --deep`` and ``status`` on ``one``, then a segment of ``one`` the ranks refuse (``bad-track``) and
      ``status`` again;
    - ``loader-*``: the tracked StatefulDataLoader, 2 ranks to step 10, a copy cut at step 5 resumed to 10, then
      refused on 1 rank;
    - one single-rank run per misuse mode, the user's exception (``raise``, ``after``), ``nan-then-ok``, ``thread``,
      the 2-rank ``nan`` (then ``status``) and ``term-then-nan``, ``counter`` then ``bad-load`` resumed from it;
    - ``sigterm``: a 2-rank run (a DataLoader worker, 0.2 s a step) SIGTERMed once 3 steps are logged;
    - each bad script (refused before launch) and the example run outside a segment.
    """
    base = tmp_path_factory.mktemp("api")
    runs = {name: base / name for name in ("full", "same", "one", "loader-full", "loader-half", "badload")}

    def cut(src: str, step: int, *dsts: str) -> None:
        for d in dsts:
            copy_run_until(runs[src], runs[d], step)

    def script(name: str) -> None:
        content = BAD_SCRIPTS[name][0]
        (base / "scripts").mkdir(exist_ok=True)
        if content is not None:
            (base / "scripts" / name).write_text(content)

    chains: list[list[tuple]] = [
        [
            (
                "full",
                sk,
                "train",
                "--script",
                str(EXAMPLE),
                "--run-dir",
                str(runs["full"]),
                "--until-step",
                "16",
                "--nproc",
                "2",
                "--set",
                "checkpoint.interval=4",
                "--",
                "--width",
                "32",
            ),
            (None, cut, "full", 8, "same", "one"),
            # 2 ranks: the last layer's 1-element bias leaves rank 1 an empty shard, whose record must read back
            ("validate-2", sk, "validate", str(runs["full"] / "checkpoints" / "step-00000016"), "--deep"),
            ("same", sk, "train", "--run-dir", str(runs["same"]), "--until-step", "16", "--nproc", "2"),  # the run
            (
                "one",
                sk,
                "train",
                "--run-dir",
                str(runs["one"]),
                "--until-step",
                "16",
                "--nproc",
                "1",
            ),  # remembers its script
            ("validate", sk, "validate", str(runs["one"] / "checkpoints" / "step-00000016"), "--deep"),
            ("status", sk, "status", str(runs["one"]), "--json"),
            (
                "refused",
                sk,
                *modes(runs["one"], 20, "--", "--mode", "bad-track"),
            ),  # refused by the ranks: nothing moves
            ("refused-status", sk, "status", str(runs["one"]), "--json"),
        ],
        [
            (
                "loader-full",
                sk,
                *modes(runs["loader-full"], 10, "--nproc", "2", "--set", "checkpoint.interval=5", "--", "--loader"),
            ),
            (None, cut, "loader-full", 5, "loader-half"),
            ("loader-half", sk, "train", "--run-dir", str(runs["loader-half"]), "--until-step", "10", "--nproc", "2"),
            (
                "loader-refused",
                sk,
                "train",
                "--run-dir",
                str(runs["loader-half"]),
                "--until-step",
                "12",
                "--nproc",
                "1",
            ),
        ],
        [("sigterm", preempted, base / "pre")],
        [
            ("counter", sk, *modes(runs["badload"], 4, "--set", "checkpoint.interval=2", "--", "--counter")),
            ("bad-load", sk, *modes(runs["badload"], 6, "--", "--counter", "--mode", "bad-load")),
        ],
        [
            (
                "nan",
                sk,
                *modes(
                    base / "nan",
                    8,
                    "--nproc",
                    "2",
                    "--set",
                    "checkpoint.interval=2",
                    "--",
                    "--mode",
                    "nan",
                    "--at",
                    "4",
                ),
            ),
            ("nan-status", sk, "status", str(base / "nan"), "--json"),
        ],
        [
            (
                "term-then-nan",
                sk,
                *modes(
                    base / "term-then-nan",
                    8,
                    "--nproc",
                    "2",
                    "--set",
                    "checkpoint.interval=100",
                    "--",
                    "--mode",
                    "term-then-nan",
                    "--at",
                    "3",
                ),
            )
        ],
        [("raise", sk, *modes(base / "raise", 6, "--", "--mode", "raise", "--at", "3"))],
        [("after", sk, *modes(base / "after", 4, "--", "--mode", "after", "--atexit-noise"))],
        *[
            [
                (
                    mode,
                    partial(sk, timeout=180),
                    *modes(
                        base / mode,
                        5,
                        "--set",
                        "checkpoint.interval=2",
                        "--",
                        "--mode",
                        mode,
                        "--at",
                        "2",
                        "--atexit-file",
                        str(base / f"{mode}.atexit"),
                        *(["--atexit-noise"] if mode == "thread" else []),
                    ),
                )
            ]
            for mode in ("nan-then-ok", "thread")
        ],
        *[[(mode, sk, *modes(base / mode, 6, "--", "--mode", mode))] for mode in MISUSE],
        [("outside", outside_a_segment, base)],
        *[
            [
                (None, script, name),
                (
                    name,
                    sk,
                    "train",
                    "--script",
                    str(base / "scripts" / name),
                    "--run-dir",
                    str(base / f"run-{name}"),
                    "--until-step",
                    "2",
                ),
            ]
            for name in BAD_SCRIPTS
        ],
    ]
    return {"base": base, "runs": runs, **side_by_side(chains, SIDE_BY_SIDE)}


def test_script_resume_is_bitwise_at_the_same_world_size_and_close_across_sizes(launched: dict) -> None:
    runs = launched["runs"]
    for name in ("full", "same", "one"):
        r = outcome(launched, name)
        assert r.returncode == 0, r.stderr[-3000:]
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


def test_script_checkpoints_validate_deep_and_status_reads_them(launched: dict) -> None:
    for key in ("validate", "validate-2"):  # saved on 1 rank, and on 2 ranks (with empty shards)
        r = outcome(launched, key)
        assert r.returncode == 0 and "valid (deep)" in r.stdout, r.stdout + r.stderr
    r = outcome(launched, "status")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["last_status"] == "completed"


def test_tracked_stateful_dataloader_continues_exactly_and_refuses_another_world_size(launched: dict) -> None:
    full, half = launched["runs"]["loader-full"], launched["runs"]["loader-half"]
    for key in ("loader-full", "loader-half"):
        r = outcome(launched, key)
        assert r.returncode == 0, r.stderr[-3000:]
    ref, new = metrics(full), metrics(half)
    assert [new[s]["first"] for s in range(6, 11)] == [ref[s]["first"] for s in range(6, 11)]  # same batches
    assert [new[s]["loss"] for s in range(6, 11)] == [ref[s]["loss"] for s in range(6, 11)]
    # each rank's loader position differs: it cannot be split onto one rank; refused, and nothing set aside
    r = outcome(launched, "loader-refused")
    assert r.returncode != 0
    assert "tracked 'loader' held a different state on each of the 2 saving ranks" in r.stderr, r.stderr[-2000:]
    assert committed(half)[-1] == "step-00000010"
    assert not [p for p in (half / "checkpoints").iterdir() if ".invalid" in p.name]


def test_sigterm_commits_at_the_step_boundary_and_exits_75(launched: dict) -> None:
    run, proc = launched["base"] / "pre", outcome(launched, "sigterm")
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "preempted" in proc.stderr
    last = committed(run)[-1]
    manifest = json.loads((run / "checkpoints" / last / "manifest.json").read_text())
    assert manifest["reason"] == "preempted" and manifest["step"] == max(metrics(run))


def test_user_exception_shows_the_users_traceback_and_one_line(launched: dict) -> None:
    r = outcome(launched, "raise")
    assert r.returncode == 1
    assert 'api_modes.py", line' in r.stderr and "in explode" in r.stderr and "ValueError: boom at step 3" in r.stderr
    assert "trainer/api/segment.py" not in r.stderr and "runpy" not in r.stderr  # their frames, not shardkeeper's
    assert "error: segment 0 failed" in r.stderr and "api_modes.py line" in r.stderr
    # an error of the rank's own is never restarted in place (checkpoint.restarts): it would fail again; the agent's
    # note saying so is shown only with -v (the failure line above already names the cause)
    assert "restarting the ranks in place" not in r.stderr and r.stderr.count("in explode") == 1, r.stderr[-2000:]
    assert "not restarted in place" not in r.stderr
    end = [json.loads(x) for x in (launched["base"] / "raise" / "segments.jsonl").read_text().splitlines()][-1]
    assert end["status"] == "failed" and end["restarts"] == 0 and end["restart_causes"] == []


@pytest.mark.parametrize("mode", list(MISUSE))
def test_api_misuse_is_one_line_and_commits_nothing_after_it(launched: dict, mode: str) -> None:
    """A misuse raised before the first step (a UsageError: bad input) ends the segment refused, exit 2; one after
    steps were trained, or a script that never trains, fails it (exit 1)."""
    run, expect = launched["base"] / mode, MISUSE[mode]
    r = outcome(launched, mode)
    ended = "refused before its first step" if mode in REFUSED_MISUSE else "failed"
    assert r.returncode == (2 if mode in REFUSED_MISUSE else 1), r.stderr[-2000:]
    assert f"error: segment 0 {ended}" in r.stderr, r.stderr[-2000:]
    assert expect in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    # nothing is committed after the misuse ("twice" comes after a completed loop: its checkpoint stays)
    assert committed(run) == (["step-00000006"] if mode == "twice" else []) if (run / "checkpoints").exists() else True


def test_a_segment_the_ranks_refuse_leaves_the_run_as_it_was(launched: dict) -> None:
    """A script refusing its input before the first step (here seg.track of an object without state_dict, as an HF
    Trainer refuses --until-step past its max_steps): one line, exit 2, recorded as 'refused' in segments.jsonl;
    status, the until_step a resume trains to and run.yaml (its script) stay what the last segment left."""
    run, r = launched["runs"]["one"], outcome(launched, "refused")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "segment 2 refused before its first step" in lines[0] and "seg.track(counter" in lines[0]
    before, after = (json.loads(outcome(launched, key).stdout)[0] for key in ("status", "refused-status"))
    assert after == before and (after["last_status"], after["last_until_step"], after["step"]) == ("completed", 16, 16)
    end = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()][-1]
    assert (end["event"], end["status"], end["exit_code"], end["end_step"]) == ("end", "refused", 2, 16)
    assert str(EXAMPLE) in (run / "run.yaml").read_text() and str(MODES) not in (run / "run.yaml").read_text()
    assert committed(run)[-1] == "step-00000016"


@pytest.mark.parametrize("name", list(BAD_SCRIPTS))
def test_bad_script_is_refused_before_launch_and_writes_nothing(launched: dict, name: str) -> None:
    r, expect = outcome(launched, name), BAD_SCRIPTS[name][1]
    assert r.returncode == 2 and expect in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (launched["base"] / f"run-{name}").exists()


def test_segment_outside_a_segment_says_how_to_launch(launched: dict) -> None:
    r = outcome(launched, "outside")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: sk.Segment(): not inside a shardkeeper segment")
    assert "shardkeeper train --script" in r.stderr and "Traceback" not in r.stderr


def test_a_script_logging_a_nan_loss_stops_without_committing_it(launched: dict) -> None:
    run, r = launched["base"] / "nan", outcome(launched, "nan")
    assert r.returncode == 65, r.stderr[-3000:]
    assert "non-finite loss at step 5" in r.stderr and "step-00000004 stays the latest checkpoint" in r.stderr
    assert committed(run) == ["step-00000002", "step-00000004"]
    assert json.loads(outcome(launched, "nan-status").stdout)[0]["last_status"] == "failed"


def test_a_nan_on_one_rank_the_step_after_a_stop_signal_is_not_committed_by_the_preemption(launched: dict) -> None:
    """The per-step agreement runs a step behind: a SIGTERM on rank 0 at step 3 is acted on at the end of step 4,
    where rank 1 logged a NaN; the stop must agree on step 4's flags before its checkpoint: exit 65, not 75."""
    run, r = launched["base"] / "term-then-nan", outcome(launched, "term-then-nan")
    assert r.returncode == 65, r.stderr[-3000:]
    assert "non-finite loss at step 4" in r.stderr, r.stderr[-3000:]
    assert committed(run) == [] if (run / "checkpoints").exists() else True


def test_code_after_the_loop_that_raises_fails_the_segment_and_keeps_its_checkpoint(launched: dict) -> None:
    run, r = launched["base"] / "after", outcome(launched, "after")
    assert r.returncode == 1 and "error: segment 0 failed" in r.stderr, r.stderr[-2000:]
    assert "ValueError: boom at step after the loop" in r.stderr and 'api_modes.py", line' in r.stderr
    # an atexit handler printed 80 lines after the rank's failure line and closed stdout: the one line still names
    # the failure (the rank writes it again after its handlers)
    error = next(line for line in r.stderr.splitlines() if line.startswith("error: segment 0 failed"))
    assert "ValueError: boom at step after the loop" in error, error
    assert committed(run) == ["step-00000004"]


@pytest.mark.parametrize("mode,code", [("nan-then-ok", 65), ("thread", 0)])
def test_a_nan_overwritten_in_its_step_still_stops_and_a_lingering_thread_does_not_hang(
    launched: dict, mode: str, code: int
) -> None:
    run, r = launched["base"] / mode, outcome(launched, mode)  # launched with a 180 s timeout: a hang raises here
    assert r.returncode == code, r.stderr[-2000:]
    assert committed(run)[-1] == ("step-00000002" if code == 65 else "step-00000005")
    # the script's atexit handlers ran, after a failure too; one that never returns is abandoned
    assert (launched["base"] / f"{mode}.atexit.0").read_text() == "ran"
    assert ("atexit handlers did not finish within" in r.stderr) == (mode == "thread"), r.stderr[-2000:]


def test_a_failing_load_state_dict_of_the_users_object_quarantines_nothing(launched: dict) -> None:
    """The checkpoint is fine, the user's load_state_dict is not: one line, exit non-zero, every checkpoint kept."""
    run = launched["runs"]["badload"]
    r = outcome(launched, "counter")
    assert r.returncode == 0, r.stderr[-2000:]
    r = outcome(launched, "bad-load")
    assert r.returncode != 0 and "user bug in load_state_dict" in r.stderr, r.stderr[-2000:]
    assert committed(run) == ["step-00000002", "step-00000004"]
    assert not [p for p in (run / "checkpoints").iterdir() if ".invalid" in p.name]
