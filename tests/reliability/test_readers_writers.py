"""Readers beside a writer (DESIGN.md, Trust): a reader never fails because a writer committed, retired or
quarantined a checkpoint beside it; a vanished checkpoint is "retired", never "corrupted", never recorded
invalid in lineage; two exports into one folder lose nothing silently; a publish verifies what it copied; a
lock probe never makes a writer fail.

Every reader runs against a LIVE writer (tests/reliability/livewriter.py: a thread that commits copies of
real checkpoints and retires them as retention does, or quarantines them), in bounded loops; the moments that a
loop may or may not hit are also forced once each, deterministically. One torchrun launch for the module (2
ranks, 3 steps, a checkpoint every step: the writer's templates).

    .venv/bin/python -m pytest tests/reliability/test_readers_writers.py -q
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ckpt.commit.lineage import read_events
from ckpt.guards.lock import RunLock
from ckpt.validate.checks import validate
from schemas.errors import CheckpointError, CheckpointRetired, ExportError, PublishError, RunLockedError
from shardkeeper import stages
from tests.reliability.livewriter import LiveWriter, new_live_run, templates_of

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TIME_BOUND_S = 25.0  # every loop stops after this long, whatever its count


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, steps 0 -> 3, a checkpoint every step (all kept). Read-only: the writer copies from it."""
    from shardkeeper.config import load_run_spec

    spec = load_run_spec(ROOT / "configs" / "tiny.yaml", ["checkpoint.interval=1", "checkpoint.keep_last=10"])
    run = tmp_path_factory.mktemp("readers") / "source"
    res = stages.train_segment(spec, run, stages.plan_topology(spec, 2, device="cpu"), STEPS)
    assert res.status == "completed", res.failure
    assert sorted(templates_of(run)) == [1, 2, 3]
    return run


@pytest.fixture
def live_run(source_run: Path, tmp_path: Path) -> Path:
    return new_live_run(source_run, tmp_path / "runs" / "live")


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _retire(path: Path) -> None:
    """What retention does to a checkpoint."""
    trash = path.with_name(path.name + ".deleting")
    os.rename(path, trash)
    shutil.rmtree(trash)


# ------------------------------------------------------------------------------------------ in-process readers
def test_readers_beside_a_live_writer(source_run: Path, live_run: Path, tmp_path: Path) -> None:
    """Hundreds of status / scan / lineage / validate (quick and deep) calls and some exports while the writer
    commits and retires: no exception, every verdict valid or retired, status consistent, no lineage verdict on
    a vanished checkpoint, every completed export recorded."""
    rng = random.Random(0)
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    exports_done = 0
    t0 = time.monotonic()
    with LiveWriter(live_run, templates_of(source_run), keep=2, quarantine_every=4, pause_s=0.01) as writer:
        for i in range(300):
            if time.monotonic() - t0 > TIME_BOUND_S:
                break
            try:
                st = stages.run_state(live_run)
                if st.checkpoint is None or Path(st.checkpoint).name != f"step-{st.step:08d}" or st.world_size != 2:
                    failures.append(f"inconsistent run state {st}")
                (scanned,) = stages.scan_runs(str(live_run.parent), [])
                if scanned.step not in (1, 2, 3):
                    failures.append(f"scan found step {scanned.step}")
                read_events(live_run)
                path = _ckpt(live_run, rng.randint(1, STEPS))
                deep = i % 10 == 0
                report = stages.validate_checkpoint(path, deep=deep)
                kind = "deep" if deep else "quick"
                if report.valid:
                    outcomes[f"{kind} valid"] += 1
                elif report.retired and "retired" in report.errors[0]:
                    outcomes[f"{kind} retired"] += 1
                else:
                    failures.append(f"{kind} verdict on {path.name}: {report.errors}")
                if i % 15 == 0:
                    try:
                        stages.export_and_record(path, tmp_path / "exports" / f"e{i}")
                        exports_done += 1
                        outcomes["export ok"] += 1
                    except CheckpointRetired as e:
                        assert "retired" in str(e) and "\n" not in str(e)
                        outcomes["export retired"] += 1
            except Exception as e:  # noqa: BLE001 - every one is a failure of the rule
                failures.append(f"{type(e).__name__}: {e}")
    assert not failures, f"{len(failures)} failures, first: {failures[:3]} (outcomes {dict(outcomes)})"
    assert writer.retired + writer.quarantined >= 10, "the writer barely ran: the test proved nothing"
    assert outcomes["quick valid"] > 0, outcomes
    # the writer stopped: a deep validation of a checkpoint that stays is recorded, valid
    st = stages.run_state(live_run)
    assert st.checkpoint is not None and stages.validate_checkpoint(st.checkpoint, deep=True).valid
    events = read_events(live_run)
    verdicts = [e for e in events if e.kind == "validate"]
    assert verdicts and verdicts[-1].step == st.step
    assert all(e.data["valid"] for e in verdicts), [e for e in verdicts if not e.data["valid"]][:2]
    assert sum(e.kind == "export" for e in events) == exports_done


def test_status_lineage_validate_export_cli_beside_a_live_writer(
    source_run: Path, live_run: Path, tmp_path: Path
) -> None:
    """The same through the CLI (a few subprocesses): one line and exit 4 for a retired checkpoint, exit 0
    otherwise; never a traceback, an internal error, "corrupted" or a path/permission message."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    calls = [["status", str(live_run)], ["status", str(live_run.parent)], ["lineage", str(live_run)]]
    calls += [["validate", str(_ckpt(live_run, 2))]]
    calls += [["validate", "--deep", str(_ckpt(live_run, 2))], ["export", str(_ckpt(live_run, 3)), str(tmp_path / "x")]]
    results = []
    with LiveWriter(live_run, templates_of(source_run), keep=2, pause_s=0.005):
        for args in calls:
            p = subprocess.run(
                [sys.executable, "-m", "shardkeeper", *args],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
                timeout=120,
            )
            results.append((args, p))
    for args, p in results:
        err = p.stderr
        assert "Traceback" not in err and "internal error" not in err, (args, err[-2000:])
        assert "corrupted" not in err and "check the path" not in err and "incomplete" not in err, (args, err)
        if args[0] in ("status", "lineage"):
            assert p.returncode == 0, (args, err)
        else:
            assert p.returncode == 0 or (
                p.returncode == 4 and "retired" in err and len(err.strip().splitlines()) == 1
            ), (args, p.returncode, err)


# ------------------------------------------------------------------------------------------ forced moments
def test_validate_deep_of_a_checkpoint_retired_mid_read(
    source_run: Path, live_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpt.validate.checks as v

    writer = LiveWriter(live_run, templates_of(source_run))
    path = writer.commit(2)
    real = v.hash_files

    def retire_then_hash(paths, threads=2):  # type: ignore[no-untyped-def]
        _retire(path)
        return real(paths, threads=threads)

    monkeypatch.setattr(v, "hash_files", retire_then_hash)
    report = stages.validate_checkpoint(path, deep=True)
    assert report.retired and not report.valid and "retired" in report.errors[0], report
    assert "corrupted" not in report.errors[0] and f"shardkeeper status {live_run}" in report.errors[0]
    # gone before the call: still retired (lineage knows it was a checkpoint), and recorded nowhere
    report = stages.validate_checkpoint(path, deep=True)
    assert report.retired, report
    assert not [e for e in read_events(live_run) if e.kind == "validate"]
    # a path that never was a checkpoint is not "retired"
    assert "no such checkpoint directory" in validate(_ckpt(live_run, 77)).errors[0]


def test_validate_of_a_checkpoint_recommitted_at_the_same_step_mid_read(
    source_run: Path, live_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retired and committed again at the same step while read (a new directory, maybe the old inode number):
    what was read is not vouched for; the fresh one validates."""
    import ckpt.validate.checks as v

    writer = LiveWriter(live_run, templates_of(source_run))
    path = writer.commit(1)
    real = v._check_sizes
    done = []

    def swap_then_check(ckpt_dir, files, path_error=None):  # type: ignore[no-untyped-def]
        if not done:  # the directory being read goes; a new commit of step 1 (with a stray file) takes its place
            done.append(1)
            _retire(path)
            shutil.copytree(source_run / "checkpoints" / "step-00000001", path)
            (path / "stray").write_text("x")
        return real(ckpt_dir, files, path_error)

    monkeypatch.setattr(v, "_check_sizes", swap_then_check)
    v.forget_known()
    report = validate(path)
    assert report.retired, report
    (path / "stray").unlink()
    assert validate(path).valid


def test_export_of_a_checkpoint_retired_mid_export(
    source_run: Path, live_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retired after its files were opened: the export completes and is recorded with its step. Retired before:
    CheckpointRetired, one line, nothing left in the output's folder."""
    import ckpt.export as ex

    writer = LiveWriter(live_run, templates_of(source_run))
    real = ex.COLLECTORS["dcp"]

    def collect_then_retire(ckpt_dir, manifest, stack, out_dtype):  # type: ignore[no-untyped-def]
        found = real(ckpt_dir, manifest, stack, out_dtype)
        _retire(ckpt_dir)
        return found

    monkeypatch.setitem(ex.COLLECTORS, "dcp", collect_then_retire)
    path = writer.commit(3)
    res = stages.export_and_record(path, tmp_path / "out" / "a")
    assert res.step == 3 and not path.exists() and (tmp_path / "out" / "a" / "model.safetensors").is_file()
    (event,) = [e for e in read_events(live_run) if e.kind == "export"]
    assert event.step == 3 and event.parent == "checkpoint:step-00000003"

    def retire_then_collect(ckpt_dir, manifest, stack, out_dtype):  # type: ignore[no-untyped-def]
        _retire(ckpt_dir)
        return real(ckpt_dir, manifest, stack, out_dtype)

    monkeypatch.setitem(ex.COLLECTORS, "dcp", retire_then_collect)
    path = writer.commit(2)
    with pytest.raises(CheckpointRetired, match="retired") as info:
        stages.export_and_record(path, tmp_path / "out" / "b")
    assert "corrupted" not in str(info.value) and "incomplete" not in str(info.value)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a"]
    with pytest.raises(CheckpointRetired):  # retired before the call
        stages.export_and_record(path, tmp_path / "out" / "c")


def test_export_of_a_step_committed_after_the_export_looked_then_retired_mid_read(
    source_run: Path, live_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing at the path when the export looked (not yet committed, or retired), a commit there before it read,
    retired before the tensors were read: CheckpointRetired, never "incomplete" (the export watched no directory)."""
    import ckpt.export as ex

    writer = LiveWriter(live_run, templates_of(source_run))
    real_check, real_collect = ex.check_checkpoint, ex.COLLECTORS["dcp"]

    def commit_then_check(ckpt_dir, deep):  # type: ignore[no-untyped-def]
        writer.commit(3)
        return real_check(ckpt_dir, deep)

    def retire_then_collect(ckpt_dir, manifest, stack, out_dtype):  # type: ignore[no-untyped-def]
        _retire(ckpt_dir)
        return real_collect(ckpt_dir, manifest, stack, out_dtype)

    monkeypatch.setattr(ex, "check_checkpoint", commit_then_check)
    monkeypatch.setitem(ex.COLLECTORS, "dcp", retire_then_collect)
    path = _ckpt(live_run, 3)
    with pytest.raises(CheckpointRetired, match="retired") as info:
        stages.export_and_record(path, tmp_path / "out" / "a")
    assert "incomplete" not in str(info.value) and "corrupted" not in str(info.value)
    with pytest.raises(CheckpointRetired, match="no longer there: retired"):  # retired before it looked
        stages.export_and_record(path, tmp_path / "out" / "b")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    # something at the path that is not a directory it can open is the user's error, never "retired"
    monkeypatch.undo()
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError) as info:
        stages.export_and_record(path, tmp_path / "out" / "c")
    assert not isinstance(info.value, CheckpointRetired) and "retired" not in str(info.value), info.value
    report = validate(path)
    assert not report.valid and not report.retired and "retired" not in report.errors[0], report
    with pytest.raises(CheckpointError) as info:
        stages.reshard(path, 1)
    assert not isinstance(info.value, CheckpointRetired) and "retired" not in str(info.value), info.value


def test_convert_of_a_checkpoint_retired_mid_read(
    source_run: Path, live_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.registry import get_format

    writer = LiveWriter(live_run, templates_of(source_run))
    path = writer.commit(1)
    fmt = get_format("deepspeed")
    real = fmt.convert_from

    def retire_then_convert(src_dir, target, *, zero_stage=None):  # type: ignore[no-untyped-def]
        _retire(src_dir)
        return real(src_dir, target, zero_stage=zero_stage)

    monkeypatch.setattr(fmt, "convert_from", retire_then_convert)
    out = tmp_path / "converted-run"
    with pytest.raises(CheckpointRetired, match="retired") as info:
        stages.convert_checkpoint(path, "deepspeed", out)
    assert "exp_avg" not in str(info.value) and "optimizer" not in str(info.value)
    assert not out.exists(), sorted(out.rglob("*"))
    step_out = tmp_path / "elsewhere" / "step-00000001"
    with pytest.raises(CheckpointRetired):  # retired before the call
        stages.convert_checkpoint(path, "deepspeed", step_out)
    assert not step_out.parent.exists()
    with pytest.raises(CheckpointRetired):
        stages.reshard(path, 1)


# ------------------------------------------------------------------------------------------ two writers of a folder
def test_two_exports_into_one_folder(source_run: Path, tmp_path: Path) -> None:
    """Started together without --overwrite: one completes, the other fails with one line; the folder is the
    winner's, whole."""
    src = source_run / "checkpoints" / "step-00000003"
    out = tmp_path / "exports" / "same"
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def one(dtype: str) -> None:
        barrier.wait()
        try:
            results[dtype] = stages.export_and_record(src, out, dtype=dtype)
        except ExportError as e:
            results[dtype] = e

    threads = [threading.Thread(target=one, args=(d,)) for d in ("float32", "bfloat16")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = [r for r in results.values() if isinstance(r, ExportError)]
    wins = [r for r in results.values() if not isinstance(r, ExportError)]
    assert len(errors) == 1 and len(wins) == 1, results
    assert "already exists" in str(errors[0]) and "\n" not in str(errors[0])
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == wins[0].dtype  # type: ignore[attr-defined]
    assert sorted(p.name for p in out.parent.iterdir()) == ["same"]  # no temp folder left


def test_commit_never_replaces_without_overwrite(tmp_path: Path) -> None:
    """The race both exports pass the 'already exists' check of: the second commit fails, the first stays."""
    from ckpt.export._commit import commit_folder, temp_dir_for

    out = tmp_path / "out"
    first, second = temp_dir_for(out), temp_dir_for(out)
    (first / "who").write_text("first")
    (second / "who").write_text("second")
    commit_folder(first, out)
    with pytest.raises(ExportError, match="already exists"):
        commit_folder(second, out)
    assert (out / "who").read_text() == "first"
    commit_folder(second, out, overwrite=True)
    assert (out / "who").read_text() == "second"


# ------------------------------------------------------------------------------------------ publish vs re-export
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_publish_refuses_an_export_rewritten_while_copied(
    source_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckpt.publish.fsspec_target as ft
    from ckpt.publish import publish

    src = source_run / "checkpoints" / "step-00000003"
    folder = tmp_path / "exports" / "step-00000003"
    stages.export_and_record(src, folder, dtype="float32")
    real = ft.load_export

    def plan_then_reexport(export_dir):  # type: ignore[no-untyped-def]
        planned = real(export_dir)
        stages.export_and_record(src, folder, dtype="bfloat16", overwrite=True)
        return planned

    monkeypatch.setattr(ft, "load_export", plan_then_reexport)
    target = tmp_path / "published"
    target.mkdir()
    with pytest.raises(PublishError, match="changed while being published") as info:
        publish(folder, target.as_uri())
    assert "\n" not in str(info.value)
    assert list(target.iterdir()) == []  # no stage, nothing claiming to be whole
    monkeypatch.setattr(ft, "load_export", real)
    publish(folder, target.as_uri())
    _assert_marker_matches(target / folder.name)


def _assert_marker_matches(dest: Path) -> None:
    marker = json.loads((dest / "shardkeeper.json").read_text())
    for rel, entry in marker["files"].items():
        assert _sha(dest / rel) == entry["sha256"] and (dest / rel).stat().st_size == entry["size"], rel


def test_publish_beside_a_live_reexport(source_run: Path, tmp_path: Path) -> None:
    """Publishes to file:// while another thread re-exports the folder (bf16 / fp32 in turn): each publish is
    refused or lands a marker whose every checksum is the file's."""
    from ckpt.publish import publish

    src = source_run / "checkpoints" / "step-00000003"
    folder = tmp_path / "exports" / "step-00000003"
    stages.export_and_record(src, folder)
    stop = threading.Event()
    rewrites = []

    def reexport() -> None:
        while not stop.is_set():
            stages.export_and_record(src, folder, dtype=("bfloat16", "float32")[len(rewrites) % 2], overwrite=True)
            rewrites.append(1)

    th = threading.Thread(target=reexport, daemon=True)
    th.start()
    outcomes: Counter[str] = Counter()
    t0 = time.monotonic()
    try:
        for i in range(15):
            if time.monotonic() - t0 > TIME_BOUND_S:
                break
            target = tmp_path / "pub" / str(i)
            target.mkdir(parents=True)
            try:
                publish(folder, target.as_uri())
            except PublishError as e:
                assert "\n" not in str(e)
                assert not (target / folder.name / "shardkeeper.json").exists()
                outcomes["refused"] += 1
            else:
                _assert_marker_matches(target / folder.name)
                outcomes["published"] += 1
    finally:
        stop.set()
        th.join(60)
    assert len(rewrites) >= 2 and sum(outcomes.values()) >= 3, (len(rewrites), outcomes)


# ------------------------------------------------------------------------------------------ lock probes
def _probe_until(run_dir: str, stop_at: float, ready) -> None:  # type: ignore[no-untyped-def]
    ready.set()
    while time.time() < stop_at:
        RunLock(run_dir).is_locked()


def test_lock_probes_never_fail_a_writer(tmp_path: Path) -> None:
    """500 acquire/release cycles while a thread and a process probe is_locked() in a loop, nothing else
    holding the run: no acquire fails."""
    run = str(tmp_path / "run")
    os.makedirs(run)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_probe_until, args=(run, time.time() + 60, ready), daemon=True)
    proc.start()
    stop = threading.Event()
    probes = []

    def probe() -> None:
        while not stop.is_set():
            probes.append(RunLock(run).is_locked())

    th = threading.Thread(target=probe, daemon=True)
    try:
        assert ready.wait(60)
        th.start()
        failed = []
        t0 = time.monotonic()
        for _ in range(500):
            if time.monotonic() - t0 > TIME_BOUND_S * 2:
                break
            try:
                with RunLock(run, ranks_wait_s=10):
                    pass
            except RunLockedError as e:
                failed.append(str(e))
    finally:
        stop.set()
        proc.terminate()
        proc.join(10)
    assert not failed, f"{len(failed)} acquires failed beside probes: {failed[0]}"
    assert len(probes) > 100
    # a real holder still fails the next writer at once, and the probe sees it
    with RunLock(run):
        t = time.monotonic()
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(run).acquire()
        assert time.monotonic() - t < 1.0
        assert RunLock(run).is_locked()
    assert not RunLock(run).is_locked()


def test_a_lock_probe_never_hangs_on_a_planted_fifo_or_link(tmp_path: Path) -> None:
    """``status`` probes RUN_DIR/.lock and .lock.ranks: a FIFO or a link to one planted there is no lock, and the
    probe answers at once instead of blocking in open()."""
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run)
    os.mkfifo(lock.ranks_path)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "fifo", lock.path)
    t = time.monotonic()
    assert not lock.is_locked()
    assert time.monotonic() - t < 1.0
