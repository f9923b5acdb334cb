"""The CLI end to end (real torchrun launches) and its one-line errors for bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.guards.lock import RunLock
from shardkeeper.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def one_error_line(capsys: pytest.CaptureFixture, argv: list[str], code: int) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two segments through `shardkeeper train`: 2 ranks to step 6, then 3 ranks to step 12."""
    run = tmp_path_factory.mktemp("cli") / "run"
    first = cli("train", "--config", TINY, "--run-dir", str(run), "--nproc", "2", "--until-step", "6")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[FSDPDiagnostics] fsdp_units=2" in first.stderr
    # the periodic progress line (first and last step at least): step, loss, throughput, ETA
    assert re.search(r"step 1/6 loss \d+\.\d+ [\d,]+ tokens/s ETA \d+m\d\ds", first.stderr), first.stderr[-2000:]
    assert re.search(r"step 6/6 loss \d+\.\d+ [\d,]+ tokens/s ETA 0m00s", first.stderr), first.stderr[-2000:]
    second = cli("train", "--config", TINY, "--run-dir", str(run), "--nproc", "3", "--until-step", "12")
    assert second.returncode == 0, second.stderr[-3000:]
    return run


def test_train_two_segments_at_different_world_sizes(cli_run: Path) -> None:
    rows = [json.loads(x) for x in (cli_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert {r["world_size"] for r in rows if r["step"] <= 6} == {2}
    assert {r["world_size"] for r in rows if r["step"] > 6} == {3}
    for r in rows:
        assert set(r) >= {"step", "loss", "grad_norm", "lr", "world_size", "tokens"}
    segs = [json.loads(x) for x in (cli_run / "segments.jsonl").read_text().splitlines()]
    ends = [s for s in segs if s["event"] == "end"]
    assert [(s["status"], s["start_step"], s["end_step"]) for s in ends] == [("completed", 0, 6), ("completed", 6, 12)]
    assert (cli_run / "checkpoints" / "step-00000012" / "manifest.json").exists()


def test_validate_deep_and_lineage(cli_run: Path) -> None:
    ok = cli("validate", str(cli_run / "checkpoints" / "step-00000012"), "--deep")
    assert ok.returncode == 0 and "valid (deep)" in ok.stdout
    lin = cli("lineage", str(cli_run), "--json")
    events = [json.loads(x) for x in lin.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("segment") == 2 and "resume" in kinds
    resume = next(e for e in events if e["kind"] == "resume")
    assert (resume["data"]["from_world_size"], resume["data"]["to_world_size"]) == (2, 3)


def test_status_and_lineage_read_at_80_columns(cli_run: Path, tmp_path: Path) -> None:
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "80"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
        )

    lin = run("lineage", str(cli_run))
    lines = lin.stdout.splitlines()
    assert lin.returncode == 0 and "…" not in lin.stdout, lin.stdout
    assert max(map(len, lines)) <= 80, lin.stdout
    assert lines[0].startswith(f"{cli_run.name}: ") and "latest step 12" in lin.stdout
    assert "from=2, to=3" in lin.stdout  # the resume at a new world size, readable
    states = json.loads(run("status", str(cli_run.parent), "--json").stdout)  # a root: every run under it
    assert [(Path(s["run_dir"]).name, s["last_status"], s["step"], s["world_size"]) for s in states] == [
        ("run", "completed", 12, 3)
    ]
    one = run("status", str(cli_run))
    assert one.returncode == 0 and "completed" in one.stdout and "step-00000012" in one.stdout
    empty = run("status", str(tmp_path))
    assert empty.returncode == 2 and len(empty.stderr.strip().splitlines()) == 1, empty.stderr
    assert "holds no run directory" in empty.stderr


def test_a_warning_piped_at_80_columns_is_one_line(cli_run: Path, tmp_path: Path) -> None:
    """Piped (a log file, grep, CI), a warning the CLI logs is one line however long, never wrapped at 80 columns,
    even where CI sets the variables that make Rich draw as on a terminal (FORCE_COLOR, TTY_COMPATIBLE)."""
    import shutil

    run = tmp_path / ("a-long-directory-name-" * 3 + "\x0bwith-a-vertical-tab") / "run"  # a line break for splitlines
    shutil.copytree(cli_run, run)
    victim = sorted((run / "checkpoints" / "step-00000012").glob("__0_*.distcp"))[0]
    os.truncate(victim, 100)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env |= {"SHARDKEEPER_DEVICE": "cpu", "FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "shardkeeper", "status", str(run)], capture_output=True, text=True, timeout=120, env=env
    )
    older = sorted(p.name for p in (run / "checkpoints").glob("step-????????"))[-2]
    assert r.returncode == 0 and older in r.stdout, r.stdout + r.stderr  # the newest valid one
    warned = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(warned) == 1, r.stderr
    shown = str(victim).replace("\x0b", "\\x0b")  # escaped: one line for a file, grep and str.splitlines
    assert "WARNING skipping invalid checkpoint step-00000012: " in warned[0] and shown in warned[0], warned
    assert "manifest says" in warned[0] and len(warned[0]) > 80


def test_main_run_again_in_one_process_follows_the_new_stderr_and_verbosity(cli_run: Path, tmp_path: Path) -> None:
    """``main`` called a second time in the same process (a notebook, a wrapper): its handler follows the stderr of
    that call (a terminal, then a plain stream) and ``--verbose`` takes effect; nothing is written twice."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    os.truncate(sorted((run / "checkpoints" / "step-00000012").glob("__0_*.distcp"))[0], 100)
    code = f"""
import io, logging, sys
from shardkeeper.cli import main
class Tty(io.StringIO):
    def isatty(self): return True
real, out = sys.stderr, []
for stream, argv in ((Tty(), ["status", {str(run)!r}]), (io.StringIO(), ["--verbose", "status", {str(run)!r}])):
    sys.stderr = stream
    rc = main(argv)
    sys.stderr = real
    out.append((rc, stream.getvalue(), logging.getLogger().level, len(logging.getLogger().handlers)))
import json; print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (rc1, err1, level1, n1), (rc2, err2, level2, n2) = json.loads(r.stdout.strip().splitlines()[-1])
    assert rc1 == rc2 == 0 and level1 == 20 and level2 == 10 and n1 == n2 == 1
    assert "skipping invalid checkpoint step-00000012" in " ".join(err1.split())  # Rich's layout on the terminal
    lines = [line for line in err2.splitlines() if "skipping invalid checkpoint" in line]
    assert len(lines) == 1 and " WARNING skipping invalid checkpoint step-00000012: " in lines[0], err2


def test_quick_validate_says_when_a_checkpoint_was_never_re_read(cli_run: Path, tmp_path: Path) -> None:
    """A preemption's checkpoint is verified by its next load, not at commit: until then a quick "valid" (sizes and
    structure only) must say its bytes were not re-read, even when one of them is flipped."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    ck = run / "checkpoints" / "step-00000012"
    ok = cli("validate", str(ck))
    assert ok.returncode == 0 and "valid (quick)" in ok.stdout and "not re-read" not in ok.stdout, ok.stdout
    (run / "verified" / "step-00000012.json").unlink()  # as a preemption leaves it
    victim = sorted(ck.glob("__0_*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    quick = cli("validate", str(ck))
    assert quick.returncode == 0 and "not re-read since its commit" in quick.stdout and "--deep" in quick.stdout
    deep = cli("validate", str(ck), "--deep")
    assert deep.returncode == 4 and victim.name in deep.stdout + deep.stderr


def test_validate_reports_partial_and_missing_file(
    cli_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    ck = tmp_path / "step-00000012"
    shutil.copytree(cli_run / "checkpoints" / "step-00000012", ck)
    victim = sorted(ck.glob("__2_*.distcp"))[0]
    victim.unlink()
    line = one_error_line(capsys, ["validate", str(ck)], 4)
    assert victim.name in line and "missing" in line
    partial = tmp_path / "step-00000013.partial"
    partial.mkdir()
    assert ".partial" in one_error_line(capsys, ["validate", str(partial)], 4)


def test_bad_config_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = str(tmp_path / "run")
    base = ["train", "--config", TINY, "--run-dir", run]
    line = one_error_line(capsys, [*base, "--set", "optim.lrr=1"], 2)
    assert "unknown key optim.lrr" in line and "lr" in line
    line = one_error_line(capsys, [*base, "--nproc", "5"], 2)
    assert "global_batch_size 12 is not divisible by 5" in line and "--nproc" in line
    line = one_error_line(capsys, [*base, "--nproc", "1000"], 2)
    assert "--nproc 1000" in line
    line = one_error_line(capsys, [*base, "--set", "optim.lr=fast"], 2)
    assert "optim.lr" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert "not valid YAML" in one_error_line(capsys, ["train", "--config", str(bad), "--run-dir", run], 2)
    line = one_error_line(capsys, ["train", "--config", str(tmp_path / "nope.yaml"), "--run-dir", run], 2)
    assert "no such config file" in line
    assert not (tmp_path / "run").exists()  # nothing was created for a bad request


def test_run_dir_of_another_model_and_locked_run_dir(cli_run: Path, capsys: pytest.CaptureFixture) -> None:
    before = (cli_run / "run.yaml").read_text()
    base = ["train", "--config", TINY, "--run-dir", str(cli_run), "--nproc", "2", "--until-step", "14"]
    line = one_error_line(capsys, [*base, "--set", "model.config.hidden_size=32"], 2)
    assert "holds another model" in line and "new --run-dir" in line
    line = one_error_line(capsys, [*base, "--set", "optim.weight_decay=0.5"], 2)  # optim.lr may change (MUTABLE_FIELDS)
    assert "different optim" in line
    assert (cli_run / "run.yaml").read_text() == before  # nothing overwritten
    with RunLock(cli_run):
        line = one_error_line(capsys, base, 3)
    assert "locked by pid" in line


def test_reshard_follows_the_runs_record_and_a_refused_restart_writes_nothing(
    cli_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """reshard checks the world size against the run's record (run.yaml), not the config that wrote the checkpoint:
    once a script trains the run (run.yaml names it) no batch rule of the config applies. --restart of a run with a
    valid checkpoint is refused before run.yaml is touched, even with a --set that could change it."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(cli_run / "checkpoints" / "step-00000012", run / "checkpoints" / "step-00000012")
    shutil.copy(cli_run / "run.yaml", run / "run.yaml")
    ckpt = str(run / "checkpoints" / "step-00000012")
    line = one_error_line(capsys, ["reshard", ckpt, "--world-size", "5"], 2)
    assert line == (
        "error: --world-size 5: global_batch_size 12 is not divisible by 5 ranks; choose --world-size "
        "among [1, 2, 3, 4, 6, 12] or change global_batch_size"
    )
    before = (run / "run.yaml").read_text()
    line = one_error_line(capsys, ["train", "--run-dir", str(run), "--restart", "--set", "checkpoint.interval=3"], 2)
    assert "--restart" in line and "valid checkpoint" in line and (run / "run.yaml").read_text() == before
    assert not (run / "segments.jsonl").exists()
    spec = yaml.safe_load(before)
    spec["script"] = {"path": str(ROOT / "examples" / "fsdp2_loop.py"), "args": []}  # a script continues the run
    (run / "run.yaml").write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    assert main(["reshard", ckpt, "--world-size", "5"]) == 0
    assert "dcp-load-time" in capsys.readouterr().out
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["data"]["to_world_size"]) for e in events] == [("reshard", 5)]


def test_checkpoint_of_another_architecture_is_refused(cli_run: Path, tmp_path: Path) -> None:
    """A checkpoint copied into a run of a different model: the ranks refuse it by signature."""
    import shutil

    run = tmp_path / "other"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(cli_run / "checkpoints" / "step-00000012", run / "checkpoints" / "step-00000012")
    res = cli(
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        "14",
        "--set",
        "model.config.intermediate_size=96",
    )
    assert res.returncode != 0
    assert "holds another model" in res.stderr


def test_sigterm_to_train_commits_and_exits_75_then_same_command_resumes(tmp_path: Path) -> None:
    import signal
    import time

    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        "100000",
    ]
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu"}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 180
    while time.time() < deadline and not (
        (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 7
    ):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]
    status = json.loads((run / ".segment-status.json").read_text())
    stop = status["end_step"]
    assert status["status"] == "preempted" and stop >= 7
    from ckpt.commit.manifest import read_manifest

    assert read_manifest(run / "checkpoints" / f"step-{stop:08d}").reason == "preempted"
    # the preempted segment's phases: SIGTERM seen, then the emergency checkpoint committed, then the report
    from schemas.seam import SegmentReport

    pre = SegmentReport.model_validate(status).times
    assert pre is not None and pre.origin == "launcher" and pre.first_step_s is not None
    assert pre.first_step_s < pre.stop_signal_s < pre.emergency_saved_s <= pre.closed_s
    assert 0 < pre.emergency_save_s < 120
    again = cli("train", "--config", TINY, "--run-dir", str(run), "--nproc", "2", "--until-step", str(stop + 2))
    assert again.returncode == 0, again.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == stop + 2 and rows[-1]["segment"] == 1
    # the resumed segment's start-up: every phase reached, in order, each taking time, timed from the launcher
    times = SegmentReport.read(run, 1).times
    phases = times.start_phases()
    assert list(phases) == ["ranks_started", "imports", "process_group", "model_built", "loaded", "first_step"]
    assert all(d > 0 for d in phases.values()), phases
    assert times.stop_signal_s is None and times.emergency_save_s is None
    assert f"first step after {times.first_step_s:.1f} s" in again.stderr
    ends = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines() if '"end"' in x]
    assert [e["times"]["first_step_s"] for e in ends] == [pre.first_step_s, times.first_step_s]
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    seg_events = [e for e in events if e["kind"] == "segment"]
    assert seg_events[0]["data"]["emergency_save_s"] == round(pre.emergency_save_s, 2)


def test_sigterm_in_the_first_moments_of_train_is_a_preemption_not_a_kill(tmp_path: Path) -> None:
    """A scheduler may preempt a job while `shardkeeper train` is still importing: the entry point remembers the
    signal before anything heavy is imported, so the segment ends 'preempted' (75), starts no rank and writes no
    checkpoint, instead of dying with 143."""
    import signal
    import time

    run = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        "4",
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SHARDKEEPER_DEVICE": "cpu"},
        cwd=ROOT,
    )
    time.sleep(0.4)  # the interpreter is up; typer, pydantic and the CLI take ~1 s more to import
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    assert "Traceback" not in out
    assert not list(run.glob("checkpoints/step-*")), "a checkpoint was written after a stop before the start"


@pytest.mark.parametrize("where", ["right after the check", "while the stacks folder is made"])
def test_a_stop_signal_between_the_early_check_and_the_launchers_handlers_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The early handler (launch.early) remembers a SIGTERM; the launcher looks once before it prepares the launch and
    again once its own handlers are in place, so a signal landing in between (right after the first look returned,
    or later while the launch is prepared) ends the launch 'stopped' with no torchrun started, instead of being
    remembered by nobody."""
    import signal

    import launch.early as early
    import launch.local as local
    from launch.base import LaunchRequest
    from schemas.run import ClusterTopology

    before = {s: signal.getsignal(s) for s in early.STOP_SIGNALS}
    monkeypatch.setattr(early, "pending_stop", [])
    monkeypatch.setattr(local, "_pending_stop", early.pending_stop)
    make_stacks = local._stacks_dir
    made: list[str] = []

    check = local.stopped_before_start

    def sigterm() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the early handler: the launcher's are not in place yet

    def stacks_then_sigterm() -> str:
        made.append(make_stacks())
        if where == "while the stacks folder is made":
            sigterm()
        return made[-1]

    def check_then_sigterm(*args: object) -> object:
        found = check(*args)  # type: ignore[arg-type]
        if where == "right after the check":
            sigterm()
        return found

    started: list[object] = []
    monkeypatch.setattr(local, "_stacks_dir", stacks_then_sigterm)
    monkeypatch.setattr(local, "stopped_before_start", check_then_sigterm)
    monkeypatch.setattr(local.subprocess, "Popen", lambda *a, **k: started.append(a) or pytest.fail("started"))
    try:
        early.install_early_stop_handlers()
        run = tmp_path / "run"
        run.mkdir()
        req = LaunchRequest(run_dir=run, until_step=4, segment=0, topology=ClusterTopology())
        out = local.LocalTorchrun().launch(req, lambda line: None)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
    assert (out.stop_signal, out.exit_code, out.tail) == (
        signal.SIGTERM,
        128 + signal.SIGTERM,
        ["stopped before the ranks started"],
    )
    assert not started and made and not Path(made[0]).exists()


def test_the_launcher_asks_torch_about_gpus_only_where_a_gpu_may_be_there() -> None:
    """On a host where nothing shows a GPU the device is chosen without importing torch (~1 s before every
    segment); where a device node shows one (here: a patched /dev listing) or CUDA_VISIBLE_DEVICES names one,
    torch.cuda decides (here: patched to say yes, so the answer can only come from it)."""
    code = (
        "import os, sys\n"
        "from shardkeeper.stages import _train as t\n"
        "os.environ.pop('SHARDKEEPER_DEVICE', None)\n"
        "print(t._gpu_may_be_there(), t._cuda_available(), 'torch' in sys.modules)\n"
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "real = os.listdir\n"
        "t.os.listdir = lambda p: ['nvidia0', *real(p)]\n"
        "print(t._gpu_may_be_there(), t._cuda_available())\n"
        "t.os.listdir = real\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n"
        "print(t._gpu_may_be_there(), t._cuda_available())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_VISIBLE_DEVICES")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    if first.startswith("True"):
        pytest.skip("this host shows a GPU")
    assert first == "False False False" and rest == ["True True", "True True"], r.stdout
