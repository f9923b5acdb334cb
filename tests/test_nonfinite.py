"""A NaN/Inf loss or gradient norm is never applied nor committed (trainer.nonfinite), on 2 real gloo ranks.

How a non-finite step is made to happen at a known step: a tiny pretrained folder (infra.make_tiny_pretrained,
untied embeddings) whose embedding row of one token id is NaN (the loss is NaN wherever that token is an input)
or 3e38 (the loss stays finite, the gradient norm is NaN), trained on a token file in which that token appears only
in samples of the chosen steps (their windows are found with the run's own GlobalOrderLoader). A NaN row is what
preflight refuses, so those tests switch preflight's scan off, as if the weights changed after it ran. Plus the
realistic case of the issue: lr 1e6 through `shardkeeper train`.

Eight torchrun launches, made side by side by one module fixture (each test reads its own): FSDP2 lr 1e6 through
the CLI (gradient, step 2); FSDP2 NaN loss at the first step; FSDP2 skip_step (4 skipped, stopped at the 3rd in a
row), then resumed from its last good checkpoint with a higher max_skipped to completion; FSDP2 NaN weights the loss
has not met yet (the commit refuses them); DeepSpeed ZeRO-2 NaN loss at the first step; DeepSpeed skip_step mid-run,
stopped at the 2nd in a row while an async save of the step before commits, then resumed to completion.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import ROOT, metrics, outcome, side_by_side

FINETUNE = ROOT / "configs" / "tiny-finetune.yaml"
TINY = str(ROOT / "configs" / "tiny.yaml")
TOKEN = 7  # the poisoned embedding row
SEQ, BATCH, SEED = 32, 12, 1234


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infra.make_tiny_pretrained import make

    return make(tmp_path_factory.mktemp("base") / "tiny-base", "tiny", tied=False)


def _poisoned(base: Path, out: Path, value: float) -> Path:
    """A copy of ``base`` whose embedding row TOKEN is ``value``."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(base, out))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"][TOKEN] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _tokens(path: Path, vocab: int, bad_steps: list[int]) -> Path:
    """A token file without TOKEN except in the first sample of each 0-based step in ``bad_steps``."""
    from trainer.builtin.data import GlobalOrderLoader

    tokens = np.random.default_rng(0).integers(TOKEN + 1, vocab, size=1 << 16).astype(np.uint16)
    loader = GlobalOrderLoader(tokens, SEQ, SEED, BATCH)
    for s in bad_steps:
        tokens[loader.starts(s, 0, 1)[0] + 3] = TOKEN  # an input position of rank 0's first sample
    np.save(path, tokens)
    return path


def _spec(folder: Path, data: Path, *sets: str):
    from shardkeeper.config import load_run_spec

    return load_run_spec(
        FINETUNE,
        [
            f"model.pretrained={folder}",
            "data.source=tokens",
            f"data.path={data}",
            f"data.seq_len={SEQ}",
            f"global_batch_size={BATCH}",
            f"seed={SEED}",
            "checkpoint.interval=1",
            "checkpoint.keep_last=100",
            *sets,
        ],
    )


def _train(spec, run: Path, until: int):
    from shardkeeper.stages import plan_topology, train_segment

    lines: list[str] = []
    res = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), until, sink=lines.append)
    return res, lines


NO_SCAN = "nan-base"  # the folders whose NaN is meant for the ranks: preflight's scan (tested below) skips them


def _no_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight's scan switched off for the folders named NO_SCAN, as if their weights changed after it ran; every
    other folder is scanned as always (the 3e38 ones pass it)."""
    import shardkeeper.preflight

    scan = shardkeeper.preflight.check_finite_weights
    monkeypatch.setattr(
        shardkeeper.preflight,
        "check_finite_weights",
        lambda source, tensors: None if Path(source).name == NO_SCAN else scan(source, tensors),
    )


def _vocab(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def _committed(run: Path) -> list[int]:
    """Steps of the committed checkpoints; each one validates and its fingerprint is finite."""
    from ckpt.validate.checks import validate

    steps = []
    for ck in sorted((run / "checkpoints").glob("step-????????")):
        assert validate(ck).valid, validate(ck).errors
        fp = json.loads((ck / "manifest.json").read_text())["fingerprint"]
        values = [*fp["model"].values(), *fp["optim"].values(), fp["optim_step"]]
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in values), ck
        steps.append(int(ck.name[5:]))
    return steps


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "lineage.jsonl").read_text().splitlines()) if e["kind"] == kind]


def _failed(res, step: int, what: str, resume: int) -> None:
    from schemas.seam import EXIT_NONFINITE

    assert res.status == "failed" and res.exit_code == EXIT_NONFINITE == 65, res
    assert res.failure.startswith(f"non-finite {what} at step {step} "), res.failure
    assert "\n" not in res.failure and "optim.lr" in res.failure and "pretrained weights" in res.failure
    if resume:
        assert (
            f"step-{resume:08d} stays the latest checkpoint" in res.failure
            and f"resume from step {resume}" in res.failure
        )
    else:
        assert "no checkpoint yet" in res.failure
    assert res.end_step == resume


# ------------------------------------------------------------------------------------------------ launched
SIDE_BY_SIDE = 3  # launches at once: much of a launch is process start and imports, one core each


def _lr_1e6_cli(run: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHARDKEEPER_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "shardkeeper"]
    p = subprocess.run(
        [
            *cmd,
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(run),
            "--nproc",
            "2",
            "--until-step",
            "6",
            "--set",
            "optim.lr=1e6",
            "--set",
            "checkpoint.interval=1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    st = subprocess.run([*cmd, "status", str(run), "--json"], capture_output=True, text=True, env=env, timeout=120)
    return {"run": run, "train": p, "status": st}


def _nan_loss_first(where: Path, base: Path, *sets: str) -> dict:
    folder = _poisoned(base, where / NO_SCAN, float("nan"))
    data = _tokens(where / "tokens.npy", _vocab(folder), [0])
    res, _ = _train(_spec(folder, data, *sets), where / "run", 4)
    return {"run": where / "run", "res": res}


def _skip_step(where: Path, base: Path) -> dict:
    folder = _poisoned(base, where / "big-base", 3e38)  # finite: preflight passes it
    data = _tokens(where / "tokens.npy", _vocab(folder), [2, 4, 6, 7, 8])
    run = where / "run"
    first, _ = _train(_spec(folder, data, "optim.on_nonfinite=skip_step", "optim.max_skipped=2"), run, 12)
    shutil.copytree(run, where / "after-first")  # the run as the stop left it, for the test to read
    res, lines = _train(_spec(folder, data, "optim.on_nonfinite=skip_step", "optim.max_skipped=5"), run, 11)
    return {"run": run, "after_first": where / "after-first", "first": first, "res": res, "lines": lines}


def _nan_weights(where: Path, base: Path) -> dict:
    folder = _poisoned(base, where / NO_SCAN, float("nan"))
    data = _tokens(where / "tokens.npy", _vocab(folder), [5])
    res, _ = _train(_spec(folder, data), where / "run", 8)
    return {"run": where / "run", "res": res}


DS_SKIP = ("backend=deepspeed", "deepspeed.zero_stage=2", "optim.on_nonfinite=skip_step", "checkpoint.async_save=true")


def _ds_skip_step(where: Path, base: Path) -> dict:
    folder = _poisoned(base, where / "big-base", 3e38)
    data = _tokens(where / "tokens.npy", _vocab(folder), [1, 3, 4])
    run = where / "run"
    first, _ = _train(_spec(folder, data, *DS_SKIP, "optim.max_skipped=1"), run, 8)
    shutil.copytree(run, where / "after-first")
    res, lines = _train(_spec(folder, data, *DS_SKIP, "optim.max_skipped=2"), run, 7)
    return {"run": run, "after_first": where / "after-first", "first": first, "res": res, "lines": lines}


@pytest.fixture(scope="module")
def launched(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The eight launches, ``SIDE_BY_SIDE`` at a time; each test below reads its own. What one raised is kept for its
    test to raise."""
    monkeypatch = pytest.MonkeyPatch()
    _no_scan(monkeypatch)
    jobs = {
        "cli": (_lr_1e6_cli,),
        "nan-first": (_nan_loss_first, base),
        "skip": (_skip_step, base),
        "ds-skip": (_ds_skip_step, base),
        "nan-weights": (_nan_weights, base),
        "ds-nan-first": (_nan_loss_first, base, "backend=deepspeed", "deepspeed.zero_stage=2"),
    }
    try:
        return side_by_side(
            [
                [(name, fn, tmp_path_factory.mktemp(name) / ("run" if name == "cli" else ""), *args)]
                for name, (fn, *args) in jobs.items()
            ],
            SIDE_BY_SIDE,
        )
    finally:
        monkeypatch.undo()


# ------------------------------------------------------------------------------------------------ FSDP2
def test_lr_1e6_through_the_cli_fails_with_one_line_and_keeps_the_last_good_checkpoint(launched: dict) -> None:
    """The issue's case: lr 1e6 used to commit NaN checkpoints, reject them all and end "completed ... checkpoint
    None", exit 0. Now: exit 65 at the first non-finite step, one error line, status failed, nothing after step 1."""
    from ckpt.commit.layout import RunDir
    from schemas.errors import RunDirError
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import prepare_run_dir

    got = outcome(launched, "cli")
    run, p, st = got["run"], got["train"], got["status"]
    assert p.returncode == 65, p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = errors[0]
    assert "segment 0 failed: steps 0 -> 1" in line and "non-finite gradient norm at step 2" in line, line
    assert "optim.lr 1e+06" in line and "resume from step 1" in line and "bad data" in line
    assert _committed(run) == [1]
    assert [r["step"] for r in metrics(run).values()] == [1]  # no row for the step that was not taken
    (event,) = _events(run, "nonfinite")
    assert event["step"] == 2 and event["data"]["what"] == "gradient norm" and event["data"]["resume_step"] == 1
    end = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()][-1]
    assert end["status"] == "failed" and end["exit_code"] == 65
    assert st.returncode == 0 and json.loads(st.stdout)[0]["last_status"] == "failed", st.stdout + st.stderr
    # the fix the line names is accepted on resume (lower optim.lr, or the skip policy); other optim fields are not
    for ok in ("optim.lr=1e-4", "optim.on_nonfinite=skip_step", "optim.max_skipped=2"):
        prepare_run_dir(RunDir.at(run), load_run_spec(TINY, ["checkpoint.interval=1", ok]))
    with pytest.raises(RunDirError, match="different optim"):
        prepare_run_dir(RunDir.at(run), load_run_spec(TINY, ["checkpoint.interval=1", "optim.weight_decay=0.5"]))


def test_nan_loss_at_the_first_step_commits_nothing(launched: dict) -> None:
    got = outcome(launched, "nan-first")
    run, res = got["run"], got["res"]
    _failed(res, 1, "loss", 0)
    assert res.checkpoint is None and not list((run / "checkpoints").glob("step-*"))
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    (event,) = _events(run, "nonfinite")
    assert event["step"] == 1 and event["data"]["loss"] == "nan"


def test_skip_step_counts_skips_and_stops_after_max_skipped_in_a_row_then_resumes(launched: dict) -> None:
    """Gradient NaN (loss finite) at steps 3, 5, 7, 8, 9 (1-based), max_skipped 2: 3, 5, 7, 8 skipped, 9 stops; the
    last good checkpoint (step 8) loads and a resume with max_skipped 5 skips 9 and completes."""
    got = outcome(launched, "skip")
    run, stopped = got["run"], got["after_first"]  # stopped: a copy of the run made before the resume
    res = got["first"]
    _failed(res, 9, "gradient norm", 8)
    assert "3 non-finite steps in a row (optim.max_skipped 2)" in res.failure
    assert _committed(stopped) == list(range(1, 9))
    rows = metrics(stopped)
    assert sorted(s for s, r in rows.items() if r.get("skipped")) == [3, 5, 7, 8]
    assert all(math.isfinite(rows[s]["loss"]) and not math.isfinite(rows[s]["grad_norm"]) for s in (3, 5, 7, 8))
    assert all(math.isfinite(rows[s]["grad_norm"]) for s in (1, 2, 4, 6))
    (event,) = _events(stopped, "nonfinite")
    assert event["step"] == 9 and event["data"]["skipped"] == [3, 5, 7, 8] and event["data"]["in_a_row"] == 3

    res, lines = got["res"], got["lines"]
    assert res.status == "completed" and res.exit_code == 0 and res.start_step == 8 and res.end_step == 11, (
        res,
        lines[-10:],
    )
    assert res.note and "skipped 1 non-finite step(s)" in res.note and res.note.endswith(": 9"), res.note
    assert _committed(run) == list(range(1, 12))
    rows = metrics(run)
    assert rows[9].get("skipped") and not rows[10].get("skipped") and math.isfinite(rows[11]["loss"])


def test_nan_weights_that_the_loss_has_not_met_yet_are_never_committed(launched: dict) -> None:
    """A NaN in the state with a finite loss (the NaN row is not used before step 6): the save of step 1 refuses to
    commit it (its fingerprint is NaN) instead of writing a checkpoint no load would accept."""
    got = outcome(launched, "nan-weights")
    run, res = got["run"], got["res"]
    assert res.status == "failed" and res.exit_code != 0 and res.checkpoint is None
    assert "non-finite state at step 1: the norm of model.model.embed_tokens.weight is NaN/Inf" in res.failure, (
        res.failure
    )
    assert "nothing was committed" in res.failure and not list((run / "checkpoints").glob("step-*"))


# ------------------------------------------------------------------------------------------------ DeepSpeed
def test_deepspeed_nan_loss_at_the_first_step_commits_nothing(launched: dict) -> None:
    got = outcome(launched, "ds-nan-first")
    run, res = got["run"], got["res"]
    _failed(res, 1, "loss", 0)
    assert not list((run / "checkpoints").glob("step-*"))


def test_deepspeed_skip_step_mid_run_stops_in_a_row_with_an_async_save_in_flight_then_resumes(launched: dict) -> None:
    """Gradient NaN at steps 2, 4 and 5 (1-based): DeepSpeed's engine drops those updates; max_skipped 1 skips 2 and 4
    and stops at 5 (2 in a row), while the async save of step 4 commits; step 4 loads and training goes on."""
    got = outcome(launched, "ds-skip")
    run, stopped = got["run"], got["after_first"]  # stopped: a copy of the run made before the resume
    res = got["first"]
    _failed(res, 5, "gradient norm", 4)
    assert "2 non-finite steps in a row (optim.max_skipped 1)" in res.failure
    assert _committed(stopped) == [1, 2, 3, 4]
    rows = metrics(stopped)
    assert sorted(s for s, r in rows.items() if r.get("skipped")) == [2, 4] and sorted(rows) == [1, 2, 3, 4]
    res, lines = got["res"], got["lines"]
    assert res.status == "completed" and res.start_step == 4 and res.end_step == 7, (res, lines[-10:])
    assert res.note and res.note.endswith(": 5"), res.note
    rows = metrics(run)
    assert rows[5]["skipped"] is True and [rows[s].get("skipped") for s in (6, 7)] == [None, None]
    assert all(math.isfinite(rows[s]["loss"]) and math.isfinite(rows[s]["grad_norm"]) for s in (6, 7))
    assert _committed(run) == list(range(1, 8))


# ------------------------------------------------------------------------------------------------ no launch
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_preflight_refuses_pretrained_weights_with_nan_or_inf_naming_tensor_and_file(
    base: Path, tmp_path: Path, value: float
) -> None:
    from schemas.errors import ConfigError
    from shardkeeper.preflight import preflight
    from shardkeeper.stages import plan_topology

    folder = _poisoned(base, tmp_path / "bad-base", value)
    data = _tokens(tmp_path / "tokens.npy", _vocab(folder), [])
    spec = _spec(folder, data)
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        preflight(spec, plan_topology(spec, 2, device="cpu"), run)
    line = str(e.value)
    assert "model.embed_tokens.weight" in line and str(folder / "model.safetensors") in line, line
    assert f"({value} at element {TOKEN * 64}" in line and "\n" not in line, line
    assert not run.exists()
    preflight(_spec(base, data), plan_topology(spec, 2, device="cpu"), run)  # the clean folder passes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_first_nonfinite_finds_the_first_bad_element_across_pieces(tmp_path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    from ckpt.pretrained import first_nonfinite, tensor_index

    t = torch.randn(1000).to(getattr(torch, dtype))
    save_file({"a": torch.ones(3), "b": t.clone(), "ids": torch.arange(5)}, str(tmp_path / "ok.safetensors"))
    t[777], t[901] = float("-inf"), float("nan")
    save_file({"a": torch.ones(3), "b": t, "ids": torch.arange(5)}, str(tmp_path / "bad.safetensors"))
    for piece in (64, 1 << 20):  # pieces of 64 bytes: the bad element is in a later piece
        assert first_nonfinite(tensor_index([tmp_path / "ok.safetensors"]).values(), piece) is None
        st, at, value = first_nonfinite(tensor_index([tmp_path / "bad.safetensors"]).values(), piece)
        assert (st.name, at, value) == ("b", 777, float("-inf"))


def test_guard_policy_without_ranks() -> None:
    from schemas import OptimSpec
    from trainer.nonfinite import NonFiniteGuard, NonFiniteStep

    stop = NonFiniteGuard(OptimSpec())
    assert stop.check(1, 2.0, 1.0) is False and stop.row() == {} and stop.note() is None
    with pytest.raises(NonFiniteStep) as e:
        stop.check(2, 2.0, float("inf"))
    assert (e.value.step, e.value.what, e.value.exit_code, str(e.value)) == (
        2,
        "gradient norm",
        65,
        "non-finite gradient norm at step 2",
    )
    skip = NonFiniteGuard(OptimSpec(on_nonfinite="skip_step", max_skipped=2))
    assert skip.check(1, float("nan"), 1.0) and skip.row() == {"skipped": True}
    assert skip.check(2, 1.0, 1.0, dropped=True)  # the backend dropped it: a gradient verdict
    assert not skip.check(3, 1.0, 1.0) and skip.row() == {}
    assert skip.check(4, 1.0, float("nan")) and skip.check(5, 1.0, float("nan"))
    with pytest.raises(NonFiniteStep, match="loss at step 6") as e:
        skip.check(6, float("inf"), 1.0)
    assert e.value.in_a_row == 3 and skip.skipped == [1, 2, 4, 5]
    assert skip.note() == "skipped 4 non-finite step(s) (optim.on_nonfinite skip_step): 1, 2, 4, 5"
    from ckpt.commit.fingerprint import first_nonfinite
    from schemas import Fingerprint

    fp = Fingerprint(model={"a": 1.0, "b": float("nan")}, optim={"a.exp_avg": 1.0}, optim_step=3.0)
    assert first_nonfinite(fp) == "model.b" and first_nonfinite(fp.model_copy(update={"model": {"b": 2.0}})) is None
    with pytest.raises(NonFiniteStep):  # applied already: can only stop, whatever the policy
        NonFiniteGuard(OptimSpec(on_nonfinite="skip_step")).check(1, float("nan"), 1.0, applied=True)
    with pytest.raises(NonFiniteStep):
        NonFiniteGuard(OptimSpec(on_nonfinite="skip_step", max_skipped=0)).check(1, float("nan"), 1.0)


def test_optim_fields_are_strict() -> None:
    from pydantic import ValidationError

    from schemas import OptimSpec

    assert (OptimSpec().on_nonfinite, OptimSpec().max_skipped) == ("stop", 5)
    for bad in (
        {"on_nonfinite": "skip"},
        {"max_skipped": -1},
        {"max_skipped": "3"},
        {"max_skipped": 2.0},
        {"max_skipped": True},
    ):
        with pytest.raises(ValidationError):
            OptimSpec(**bad)
    for name in ("on_nonfinite", "max_skipped"):
        assert OptimSpec.model_fields[name].description


def test_the_controller_reports_the_ranks_failure_with_its_exit_code(tmp_path: Path) -> None:
    """torchrun exits 1 whatever the rank's code: the segment's result takes the ranks' report (failed, its line,
    EXIT_NONFINITE); a completed report's note (the skipped steps) reaches the result."""
    from ckpt.commit.layout import RunDir
    from launch.base import LaunchOutcome
    from schemas import ClusterTopology
    from schemas.seam import SegmentReport
    from shardkeeper.stages._train import _segment_result

    topo = ClusterTopology(procs_per_node=2)
    rd = RunDir.at(tmp_path)
    line = "non-finite loss at step 4 (loss nan, gradient norm inf); ..."
    SegmentReport(
        segment=0, status="failed", start_step=0, end_step=3, world_size=2, topology=topo, note=line, exit_code=65
    ).write(tmp_path)
    res = _segment_result(rd, 0, 0, topo, LaunchOutcome(exit_code=1, timed_out=False, tail=["x"], seconds=1.0))
    assert (res.status, res.exit_code, res.failure, res.note) == ("failed", 65, line, None)
    SegmentReport(
        segment=1,
        status="completed",
        start_step=3,
        end_step=6,
        world_size=2,
        topology=topo,
        note="skipped 1 non-finite step(s) (optim.on_nonfinite skip_step): 5",
    ).write(tmp_path)
    res = _segment_result(rd, 1, 3, topo, LaunchOutcome(exit_code=0, timed_out=False, tail=[], seconds=1.0))
    assert (res.status, res.exit_code, res.note) == (
        "completed",
        0,
        "skipped 1 non-finite step(s) (optim.on_nonfinite skip_step): 5",
    )
    # a failure without a report (a crash) keeps torchrun's code and the rank's error line
    SegmentReport.clear(tmp_path)
    res = _segment_result(
        rd,
        2,
        3,
        topo,
        LaunchOutcome(exit_code=1, timed_out=False, seconds=1.0, tail=["shardkeeper-error: rank 0: boom; fix it"]),
    )
    assert (res.status, res.exit_code) == ("failed", 1) and "boom" in (res.failure or "")
