"""Resume falls back past a checkpoint that fails to load, never restarts silently, and restarts on request.

Real torchrun launches through ``shardkeeper.stages.train_segment`` (2 CPU ranks, tiny model), four in
this module: an uninterrupted reference run (checkpoints at 2, 4, 6), a run whose step 4 passes the file
checks but fails at load, a run whose every checkpoint fails at load, and the ``--restart`` of that run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckpt.commit.manifest import read_manifest
from ckpt.formats.dcp.reader import DCPTensorReader
from ckpt.validate.checks import validate
from schemas import RunSpec
from schemas.errors import CheckpointError, ConfigError
from shardkeeper.cli import main
from shardkeeper.config import load_run_spec
from shardkeeper.stages import plan_topology, train_segment
from tests.reliability import corrupt as c

ROOT = Path(__file__).resolve().parents[2]
END = 6


def spec() -> RunSpec:
    return load_run_spec(ROOT / "configs" / "tiny.yaml", ["checkpoint.interval=2", "checkpoint.keep_last=100"])


def train(run: Path, until: int, **kw: object):
    s = spec()
    return train_segment(s, run, plan_topology(s, 2, device="cpu"), until, **kw)


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def by_step(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in rows(path)}


def copy_until(src: Path, dst: Path, step: int) -> Path:
    shutil.copytree(src, dst)
    for d in (dst / "checkpoints").iterdir():
        if int(d.name[5:13]) > step:
            shutil.rmtree(d)
    (dst / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows(dst / "metrics.jsonl") if r["step"] <= step)
    )
    return dst


def assert_same_state(a: Path, b: Path) -> None:
    """Two checkpoints hold bitwise the same tensors (model, optimizer, counters, RNG) and fingerprint."""
    assert read_manifest(a).fingerprint == read_manifest(b).fingerprint
    with DCPTensorReader(a) as ra, DCPTensorReader(b) as rb:
        keys = ra.tensor_keys()
        assert sorted(keys) == sorted(rb.tensor_keys())
        for k in keys:
            assert torch.equal(ra.read(k), rb.read(k)), k


def events(run: Path) -> list[dict]:
    return rows(run / "lineage.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    res = train(run, END)
    assert res.status == "completed", res.failure
    return run


def test_checkpoint_failing_at_load_is_quarantined_and_resume_falls_back_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    run = copy_until(reference, tmp_path / "run", 4)
    c.scale_fingerprint(ckpt(run, 4))  # passes the quick check and every checksum; the load's check fails
    assert validate(ckpt(run, 4)).valid
    res = train(run, END)
    assert res.status == "completed", res.failure
    aside = list((run / "checkpoints").glob("step-00000004.invalid-*"))
    assert len(aside) == 1
    quarantined = [e for e in events(run) if e["data"].get("action") == "quarantined"]
    assert len(quarantined) == 1 and "FingerprintMismatch" in quarantined[0]["data"]["errors"][0]
    assert [e for e in events(run) if e["kind"] == "resume"][-1]["parent"] == "checkpoint:step-00000002"
    ref, got = by_step(reference / "metrics.jsonl"), by_step(run / "metrics.jsonl")
    for s in range(3, END + 1):
        assert (got[s]["loss"], got[s]["grad_norm"]) == (ref[s]["loss"], ref[s]["grad_norm"]), s
    assert_same_state(ckpt(reference, END), ckpt(run, END))
    # verification records: the checkpoint resumed from (hashed by the load) and the re-read new ones
    assert json.loads((run / "verified" / "step-00000002.json").read_text())["how"] == "load"
    assert json.loads((run / "verified" / f"step-{END:08d}.json").read_text())["how"] == "reread"


def test_all_invalid_is_refused_on_both_sides_and_restart_starts_over(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # controller side: every checkpoint fails the quick check -> refused before any launch, one line
    torn = copy_until(reference, tmp_path / "torn", 4)
    for step in (2, 4):
        c.truncate(sorted(ckpt(torn, step).glob("__0_*.distcp"))[0])
    before = {p: (torn / p).read_bytes() for p in ("metrics.jsonl", "segments.jsonl", "lineage.jsonl")}
    argv = [
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.yaml"),
        "--run-dir",
        str(torn),
        "--nproc",
        "2",
        "--until-step",
        str(END),
        "--device",
        "cpu",
        "--set",
        "checkpoint.interval=2",
        "--set",
        "checkpoint.keep_last=100",
    ]
    assert main(argv) == CheckpointError.exit_code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "--restart" in err[0], err
    assert "step-00000004" in err[0] and "step-00000002" in err[0] and "truncated" in err[0]
    assert all((torn / p).read_bytes() == b for p, b in before.items())

    # rank side: the checkpoints pass the file checks, every load fails -> quarantined, refused, no step trained
    run = copy_until(reference, tmp_path / "run", 4)
    for step in (2, 4):
        c.scale_fingerprint(ckpt(run, step))
    metrics_before = (run / "metrics.jsonl").read_bytes()
    res = train(run, END)
    assert res.status == "failed" and res.exit_code != 0
    assert "no checkpoint could be loaded" in (res.failure or "") and "--restart" in (res.failure or "")
    assert (run / "metrics.jsonl").read_bytes() == metrics_before
    assert (
        not list((run / "checkpoints").glob("step-????????"))
        and len(list((run / "checkpoints").glob("*.invalid-*"))) == 2
    )
    # ... and the controller now refuses too: the quarantined checkpoints mean the run had progressed
    with pytest.raises(CheckpointError, match="no valid checkpoint.*failed to load.*--restart"):
        train(run, END)

    # --restart: sets them aside for good, rotates metrics.jsonl, starts from 0 exactly like a new run
    res = train(run, 2, restart=True)
    assert res.status == "completed" and res.start_step == 0, res.failure
    assert (run / "metrics.before-restart-2.jsonl").read_bytes() == metrics_before
    ref, got = by_step(reference / "metrics.jsonl"), by_step(run / "metrics.jsonl")
    assert sorted(got) == [1, 2] and all(got[s]["loss"] == ref[s]["loss"] for s in (1, 2))
    assert_same_state(ckpt(reference, 2), ckpt(run, 2))
    restart = [r for r in rows(run / "segments.jsonl") if r["event"] == "restart"]
    assert len(restart) == 1 and len(restart[0]["quarantined"]) == 2
    assert any(e["id"] == "restart:segment-2" for e in events(run))
    # with a valid checkpoint, --restart is refused (it never throws good checkpoints away)
    with pytest.raises(ConfigError, match="--restart.*valid checkpoint"):
        train(run, 4, restart=True)
