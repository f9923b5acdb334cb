"""The memory tier (unit level, no launch): preflight refuses in one line, nothing written, a memory dir that
cannot hold three snapshots of every rank, that is read-only, missing, a file or relative, or that is, contains or lies
inside a run directory. Whose snapshots they are: the claim never empties a directory that is not a memory tier,
a new run at a deleted run's path never adopts its snapshots, a live run's dir is not claimed by another, and a
lost or full memory tier turns off mid-segment with storage checkpoints written the normal way (two gloo ranks in
processes). Snapshots, crash, resume from memory and a tampered snapshot are exercised by
tests/test_resume.py::test_memory_tier_rank_crash_resumes_from_memory_exactly."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ckpt.commit.layout import RunDir
from ckpt.memtier import persist as memtier_persist
from ckpt.memtier import recycle as memtier_recycle
from ckpt.memtier import tier as memtier
from schemas.errors import ConfigError
from shardkeeper.preflight import check_memory_tier, preflight
from shardkeeper.stages._train import plan_topology
from tests.harness import tiny_spec

ROOT_CWD = Path.cwd()


def _spec(mem: Path, **more: object):
    return tiny_spec(**{"checkpoint.memory_interval": 5, "checkpoint.memory_dir": str(mem), **more})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_memory_tier_that_does_not_fit_is_refused_with_how_to_size_it(tmp_path: Path) -> None:
    mem = tmp_path / "shm" / "run"
    spec = _spec(mem)
    topo = plan_topology(spec, 2)
    preflight(spec, topo, tmp_path / "run")  # the tiny model's two snapshots fit: accepted, nothing written
    assert not mem.exists() and not (tmp_path / "shm").exists()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    # three snapshots (two kept, one in flight) x 1.3 overhead of 12 B/param over 2 ranks x 2 ranks on the node:
    # 3 x 1.3 x 12 B x params = free space at params = free / 46.8
    params = int(free / 46.8 * 1.1)
    with pytest.raises(ConfigError) as e:
        check_memory_tier(spec, topo, tmp_path / "run", params)
    msg = _one_line(e)
    assert msg.startswith(
        "checkpoint.memory_dir: three memory snapshots (two kept, one being written) of 2 rank(s) need"
    )
    assert "--shm-size=" in msg and "memory_interval" in msg and str(tmp_path) in msg
    assert not mem.exists() and not (tmp_path / "shm").exists()
    check_memory_tier(spec, topo, tmp_path / "run", int(free / 46.8 * 0.9))  # just under: fits


def test_read_only_missing_or_file_memory_dir_is_refused_and_nothing_written(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount is what refuses it
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
            ).returncode
            == 0
        )
        if not mounted:
            pytest.skip("running as root without the right to mount a read-only tmpfs")
    else:
        ro.chmod(0o555)
    try:
        spec = _spec(ro / "snapshots")
        with pytest.raises(ConfigError) as e:
            preflight(spec, plan_topology(spec, 2), tmp_path / "run")
        msg = _one_line(e)
        assert msg.startswith(f"checkpoint.memory_dir: {ro} is missing or read-only") and "--shm-size" in msg
        assert not (ro / "snapshots").exists() and not (tmp_path / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        ro.chmod(0o755)
    (tmp_path / "file").write_text("x")
    spec = _spec(tmp_path / "file" / "snapshots")
    with pytest.raises(ConfigError) as e:
        preflight(spec, plan_topology(spec, 2), tmp_path / "run")
    assert "is not a directory" in _one_line(e)
    spec = _spec(tmp_path / "m", backend="deepspeed")
    with pytest.raises(ConfigError) as e:
        check_memory_tier(spec, plan_topology(spec, 2), tmp_path / "run", 10)
    assert "fsdp2 backend only" in _one_line(e)
    spec = tiny_spec(**{"checkpoint.memory_interval": 5, "checkpoint.memory_dir": "shm/run"})  # a manifest may hold it
    with pytest.raises(ConfigError) as e:  # each rank would resolve it in its own working directory
        preflight(spec, plan_topology(spec, 2), tmp_path / "run")
    assert "checkpoint.memory_dir 'shm/run': a relative path" in _one_line(e) and "/dev/shm/" in str(e.value)
    assert not (tmp_path / "run").exists() and not (ROOT_CWD / "shm").exists()


# ------------------------------------------------------------------------------------- whose memory dir it is
def _run(path: Path) -> RunDir:
    path.mkdir(parents=True, exist_ok=True)
    return RunDir.at(path)


def _snapshot(mem: RunDir, step: int) -> Path:
    d = mem.checkpoint(step)
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    return d


def test_memory_dir_at_or_around_a_run_directory_is_refused_and_nothing_touched(tmp_path: Path) -> None:
    other = tmp_path / "other-run"
    _snapshot(RunDir(other), 10)  # another run's storage checkpoint
    (other / "run.yaml").write_text("name: other\n")
    before = sorted(str(p) for p in other.rglob("*"))
    me = tmp_path / "me"
    for mem, why in [
        (other, "is or lies inside the run directory"),
        (other / "shm", "is or lies inside the run directory"),
        (tmp_path, "contains"),
        (me, "this run's --run-dir"),
        (me / "shm", "this run's --run-dir"),
    ]:
        spec = _spec(mem)
        with pytest.raises(ConfigError) as e:
            preflight(spec, plan_topology(spec, 2), me)
        msg = _one_line(e)
        assert msg.startswith("checkpoint.memory_dir: ") and why in msg and "directory of its own" in msg, msg
    assert sorted(str(p) for p in other.rglob("*")) == before and not me.exists()
    run_yaml_less = tmp_path / "ckpts-only"  # checkpoints/step-* alone make a run directory too
    _snapshot(RunDir(run_yaml_less), 5)
    spec = _spec(run_yaml_less)
    with pytest.raises(ConfigError):
        preflight(spec, plan_topology(spec, 2), me)


def test_claim_never_empties_a_directory_that_is_not_a_memory_tier(tmp_path: Path) -> None:
    foreign = tmp_path / "data"
    kept = _snapshot(RunDir(foreign), 3)
    (foreign / "notes.txt").write_text("mine")
    rd = _run(tmp_path / "run")
    lock = memtier.TierLock(RunDir(foreign))
    problem = memtier.claim(RunDir(foreign), rd, lock)
    assert problem is not None and "not a memory tier" in problem and "\n" not in problem
    assert kept.is_dir() and (foreign / "notes.txt").read_text() == "mine"
    assert not (foreign / memtier.OWNER_NAME).exists() and not (foreign / memtier.LOCK_NAME).exists()
    assert memtier.claim(RunDir(tmp_path / "fresh"), rd, memtier.TierLock(RunDir(tmp_path / "fresh"))) is None


def test_a_new_run_at_a_deleted_runs_path_never_adopts_its_snapshots(tmp_path: Path) -> None:
    mem, path = RunDir(tmp_path / "shm"), tmp_path / "run"
    spec = _spec(mem.root)
    old = _run(path)
    lock = memtier.TierLock(mem)
    assert memtier.claim(mem, old, lock) is None
    snap = _snapshot(mem, 40)
    assert memtier.owner_problem(mem, old) is None and memtier_persist.newest_snapshot(mem, old)[0] == snap
    lock.release()
    shutil.rmtree(path)  # rm -rf RUN; a new run at the same path
    new = _run(path)
    assert memtier.identity(new) is None
    problem = memtier.owner_problem(mem, new)
    assert problem is not None and "earlier run" in problem
    final, why = memtier_persist.persist_newer(spec, new)  # the launcher never persists the old run's snapshot
    assert final is None and len(why) == 1 and "not persisted" in why[0] and not new.committed()
    lock = memtier.TierLock(mem)
    assert memtier.claim(mem, new, lock) is None  # the tier dir is re-claimed: the old snapshots are gone
    assert not snap.exists() and memtier.owner_problem(mem, new) is None
    lock.release()


def test_a_second_run_cannot_claim_a_memory_dir_a_live_run_holds(tmp_path: Path) -> None:
    mem = RunDir(tmp_path / "shm")
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    lock_a, lock_b = memtier.TierLock(mem), memtier.TierLock(mem)
    assert memtier.claim(mem, a, lock_a) is None
    snap = _snapshot(mem, 7)
    problem = memtier.claim(mem, b, lock_b)
    assert problem is not None and "in use by another live run" in problem and "\n" not in problem
    assert snap.is_dir() and memtier.owner_problem(mem, a) is None  # A's tier untouched
    lock_a.release()  # A's segment was killed: its snapshot of step 7 is the only copy (A's storage has none)
    problem = memtier.claim(mem, b, lock_b)
    assert problem is not None and "only copy" in problem and "\n" not in problem and lock_b.fd is None
    assert snap.is_dir() and memtier.owner_problem(mem, a) is None  # A's tier untouched, resumable
    _snapshot(a, 7)  # A's resume persisted it: B may take the dir; A's commit-time check then sees it lost
    assert memtier.claim(mem, b, lock_b) is None and not snap.exists()
    lost = memtier.still_owner(mem, a)
    assert lost is not None and lost.startswith("memory tier lost: ") and "\n" not in lost
    assert memtier.still_owner(mem, b) is None
    lock_b.release()


# ------------------------------------------------------------------------------------- rank side (2 gloo ranks)
def _tier_goes_off(tmp: str) -> list[object]:
    """Three ways the memory tier turns off mid-segment, each with the storage checkpoint written the normal way:
    tier.json taken by another run before a commit, a non-empty foreign memory_dir, a full tmpfs (ENOSPC)."""
    import errno

    import torch.distributed as dist

    from ckpt.validate.checks import validate
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    root = Path(tmp)
    spec0 = tiny_spec()
    model = build_model(spec0)
    shard_model(model, env.mesh, spec0)
    opt = build_optimizer(model, spec0)

    def ck(name: str, mem: Path) -> DCPCheckpointer:
        spec = tiny_spec(**{"checkpoint.memory_interval": 2, "checkpoint.memory_dir": str(mem)})
        return DCPCheckpointer(RunDir.at(root / name), spec, model, opt, env, segment=0)

    def stored(c: DCPCheckpointer, step: int) -> bool:
        return validate(c.run_dir.checkpoint(step), deep=True).valid

    for name in "abc":  # run directories exist before a segment starts
        (root / name).mkdir(exist_ok=True)
    seen: list[object] = []
    a = ck("a", root / "shm")
    a.save(TrainState(step=2), reason="interval", blocking=True, tier=memtier.MEMORY)
    seen.append((root / "shm" / "checkpoints" / "step-00000002" / "manifest.json").is_file())
    if env.is_rank0:  # another run took tier.json while A writes (e.g. claimed while A's lock was not held)
        (root / "shm" / memtier.OWNER_NAME).write_text('{"run_dir": "/elsewhere", "id": "other"}')
    dist.barrier()
    a.save(TrainState(step=4), reason="interval", blocking=True)
    a.save(TrainState(step=6), reason="interval", blocking=True, tier=memtier.MEMORY)  # off: nothing
    seen += [
        a.memory is None,
        stored(a, 4),
        sorted(p.name for p in (root / "shm" / "checkpoints").iterdir()),
        (root / "a" / "checkpoints" / "step-00000006").exists(),
    ]
    (root / "data").mkdir(exist_ok=True)
    if env.is_rank0:
        (root / "data" / "keep.txt").write_text("mine")
    dist.barrier()
    b = ck("b", root / "data")
    b.save(TrainState(step=2), reason="interval", blocking=True)
    seen += [b.memory is None, stored(b, 2), sorted(p.name for p in (root / "data").iterdir())]
    c = ck("c", root / "shm-c")
    write = c.write

    def full(snapshot, ts, partial):  # noqa: ANN001 - what the DCP writer's agreement raises on ENOSPC
        if partial.parent == root / "shm-c" / "checkpoints":
            c.abort_save(
                partial,
                c.save_problem(OSError(errno.ENOSPC, "No space left on device", str(partial / "x")), partial),
                env.ckpt_group,
            )
        return write(snapshot, ts, partial)

    c.write = full  # type: ignore[method-assign]
    c.save(TrainState(step=2), reason="interval", blocking=True)
    seen += [c.memory is None, stored(c, 2), list((root / "shm-c" / "checkpoints").iterdir())]
    for x in (a, b, c):
        x.close()
    dist.destroy_process_group()
    return seen


def test_memory_tier_off_mid_segment_storage_checkpoints_go_the_normal_way(tmp_path: Path) -> None:
    from tests.harness import spawn

    want = [True, True, True, ["step-00000002"], False, True, True, ["keep.txt"], True, True, []]
    assert spawn(_tier_goes_off, 2, str(tmp_path)) == [want] * 2


def _claimed(tmp_path: Path) -> tuple[RunDir, RunDir]:
    mem, run = RunDir(tmp_path / "shm"), _run(tmp_path / "run")
    lock = memtier.TierLock(mem)
    assert memtier.claim(mem, run, lock) is None
    lock.release()
    return mem, run


def test_recycle_retires_only_the_oldest_of_two_before_the_step_and_retention_clears_what_was_not_taken(
    tmp_path: Path,
) -> None:
    """Before the snapshot of step S is written, the oldest of two committed snapshots before S is renamed to
    step-OLD.recycle-S (no manifest: never a snapshot again), the one every writer of S finds; one snapshot before S
    alone is never recycled, nor one at or after S (a newer one the run could not use stays; the newest usable one
    stays whole); a stale recycle dir goes at the next recycle, a used one at the next retention."""
    from ckpt.validate.checks import latest_valid

    mem, run = _claimed(tmp_path)
    _snapshot(mem, 2)
    assert memtier_recycle.recycle(mem, 4, run) is None and memtier_recycle.recycle_dir(mem, 4) is None
    _snapshot(mem, 4)
    (mem.checkpoint(2) / "__0_0.distcp").write_bytes(b"pages")
    bin_ = memtier_recycle.recycle(mem, 6, run)
    assert bin_ == mem.checkpoints / "step-00000002.recycle-00000006" and memtier_recycle.recycle_dir(mem, 6) == bin_
    assert memtier_recycle.recycle_dir(mem, 8) is None  # another step's writers take nothing
    assert not (bin_ / "manifest.json").exists() and (bin_ / "__0_0.distcp").read_bytes() == b"pages"
    assert [p.name for p in mem.committed()] == ["step-00000004"] and latest_valid(mem) is None  # {} is no manifest
    assert memtier_recycle.recycle(mem, 6, run) is None and not bin_.exists()  # stale: removed; one left: not recycled
    _snapshot(mem, 20)  # a newer snapshot this segment cannot use (another world size): left alone
    assert memtier_recycle.recycle(mem, 6, run) is None and mem.checkpoint(4).is_dir() and mem.checkpoint(20).is_dir()
    _snapshot(mem, 6)
    bin_ = memtier_recycle.recycle(mem, 8, run)
    assert bin_ is not None and bin_.name.startswith("step-00000004.") and mem.checkpoint(6).is_dir()
    _snapshot(mem, 8)  # the new snapshot committed: retention keeps the newest two and clears the recycle dir
    memtier.retain(mem)
    assert sorted(p.name for p in mem.checkpoints.iterdir()) == ["step-00000008", "step-00000020"]


def test_recycle_never_hands_writers_a_symlink_nor_touches_a_dir_another_run_owns(tmp_path: Path) -> None:
    """A symlink named like a recycle dir (to a storage checkpoint of the same user) is removed, never followed:
    the writers find nothing to take over and the storage checkpoint's bytes stay. A memory dir that another run
    claimed meanwhile is not recycled: its snapshots stay."""
    import ckpt.formats.dcp.direct_io as dio

    mem, run = _claimed(tmp_path)
    for step in (2, 4):
        (_snapshot(mem, step) / "__0_0.distcp").write_bytes(b"old pages" * 100)
    victim = tmp_path / "run" / "checkpoints" / "step-00000100"
    victim.mkdir(parents=True)
    (victim / "__0_0.distcp").write_bytes(b"precious" * 100)
    for name in ("step-99999999.recycle-00000006", "step-00000001.recycle-00000006"):
        (mem.checkpoints / name).symlink_to(victim, target_is_directory=True)
    bin_ = memtier_recycle.recycle(mem, 6, run)
    (mem.checkpoints / "step-00000003.recycle-00000006").symlink_to(victim, target_is_directory=True)  # planted after
    assert memtier_recycle.recycle_dir(mem, 6) is None  # two candidates: none is trusted
    assert (victim / "__0_0.distcp").read_bytes() == b"precious" * 100 and bin_ is not None
    partial = mem.partial(6)
    partial.mkdir()
    fs = dio.HashingDirectFileSystem(direct=False, reuse=mem.checkpoints / "step-00000003.recycle-00000006")
    with fs.create_stream(partial / "__0_0.distcp", "wb") as s:
        s.write(b"new snapshot")
    assert (victim / "__0_0.distcp").read_bytes() == b"precious" * 100  # a symlinked reuse dir is never used
    assert (partial / "__0_0.distcp").read_bytes() == b"new snapshot"
    other = _run(tmp_path / "other")
    (mem.root / memtier.OWNER_NAME).write_text('{"run_dir": "%s", "id": "x"}' % other.root)  # noqa: UP031
    assert memtier_recycle.recycle(mem, 8, run) is None and mem.checkpoint(4).is_dir()


def test_validate_of_a_recycled_snapshot_says_retired(tmp_path: Path) -> None:
    from ckpt.validate.checks import validate

    mem, run = _claimed(tmp_path)
    _snapshot(mem, 2)
    _snapshot(mem, 4)
    assert memtier_recycle.recycle(mem, 6, run) is not None
    report = validate(mem.checkpoint(2))
    assert report.retired, report.errors


def _memory_and_fresh(root: Path) -> tuple:
    """In a spawned rank: the tiny model sharded over the process group, a checkpointer with a memory tier (snapshots
    in ``root/shm``) and one writing the same state ordinarily to storage (``root/fresh``)."""
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = tiny_spec(**{"checkpoint.memory_interval": 2, "checkpoint.memory_dir": str(root / "shm")})
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    (root / "run").mkdir(exist_ok=True)
    (root / "fresh").mkdir(exist_ok=True)
    mem_ck = DCPCheckpointer(RunDir.at(root / "run"), spec, model, opt, env, segment=0)
    fresh = DCPCheckpointer(RunDir.at(root / "fresh"), tiny_spec(), model, opt, env, segment=0)
    return env, model, mem_ck, fresh


def _snapshot_both(root: Path, rank: int, mem_ck: object, fresh: object, step: int) -> tuple[bool, bool, Path]:
    """A memory snapshot (async, as in training) and a storage checkpoint of the same state: whether the snapshot was
    staged in its files, whether this rank's files are byte for byte the storage checkpoint's and the snapshot is
    deep-valid, and the snapshot's dir."""
    from ckpt.validate.checks import validate
    from trainer.checkpointer.core import TrainState

    mem_ck.save(TrainState(step=step), reason="interval", tier=memtier.MEMORY)  # type: ignore[attr-defined]
    mem_ck.wait()  # type: ignore[attr-defined]
    fresh.save(TrainState(step=step), reason="interval", blocking=True)  # type: ignore[attr-defined]
    snap = root / "shm" / "checkpoints" / f"step-{step:08d}"
    mine = sorted(snap.glob(f"__{rank}_*.distcp"))
    theirs = sorted((root / "fresh" / "checkpoints" / f"step-{step:08d}").glob(f"__{rank}_*.distcp"))
    same = [f.read_bytes() for f in mine] == [f.read_bytes() for f in theirs] and validate(snap, deep=True).valid
    return mem_ck.last_phases.get("staged") == 1.0, same, snap  # type: ignore[attr-defined]


def _snapshots_reuse_pages(tmp: str) -> list[object]:
    """Memory snapshots at steps 2..10 of a changing state: from the second on, staged straight into their files
    (ckpt.memtier.stage); from the third on, each rank's data files are those of the snapshot two before (same
    inodes); each snapshot's bytes equal the same state's storage checkpoint written into fresh files by dcp.save;
    the older of two snapshots is retired as the next one's stage right after a commit, so once the checkpointer is
    closed the newest snapshot stays, with no recycle or stage dir left."""
    import torch
    import torch.distributed as dist

    from ckpt.validate.checks import validate
    from trainer.checkpointer.core import TrainState

    root = Path(tmp)
    env, model, mem_ck, fresh = _memory_and_fresh(root)
    inodes: dict[int, int] = {}
    same_bytes, staged = [], []
    for step in range(2, 12, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        mem_ck.save(TrainState(step=step), reason="interval", tier=memtier.MEMORY)  # async, like training
        mem_ck.wait()
        staged.append(mem_ck.last_phases.get("staged") == 1.0)
        fresh.save(TrainState(step=step), reason="interval", blocking=True)
        snap = root / "shm" / "checkpoints" / f"step-{step:08d}"
        mine = sorted(snap.glob(f"__{env.rank}_*.distcp"))
        inodes[step] = mine[0].stat().st_ino
        theirs = sorted((root / "fresh" / "checkpoints" / f"step-{step:08d}").glob(f"__{env.rank}_*.distcp"))
        same_bytes.append(
            [f.read_bytes() for f in mine] == [f.read_bytes() for f in theirs] and validate(snap, deep=True).valid
        )
    mem_ck.close()
    fresh.close()
    dist.barrier()
    left = sorted(p.name for p in (root / "shm" / "checkpoints").iterdir())
    dist.destroy_process_group()
    return [same_bytes, staged, [inodes[s] == inodes[s - 4] for s in (6, 8, 10)], inodes[2] != inodes[4], left]


def test_memory_snapshots_overwrite_the_retired_snapshots_pages_with_exactly_the_new_bytes(tmp_path: Path) -> None:
    from tests.harness import spawn

    want = [[True] * 5, [False] + [True] * 4, [True] * 3, True, ["step-00000010"]]
    assert spawn(_snapshots_reuse_pages, 2, str(tmp_path)) == [want] * 2


def _a_stage_refused_on_one_rank(tmp: str) -> list[object]:
    """Snapshots at steps 2..8; at step 6 rank 1's stage refuses its byte items (as when a pickled value changed
    size): every rank writes that snapshot the ordinary way (agreed), its bytes those of dcp.save, and the next
    snapshot is staged again."""
    import torch
    import torch.distributed as dist

    from ckpt.memtier import stage as dcp_stage

    root = Path(tmp)
    env, model, mem_ck, fresh = _memory_and_fresh(root)
    real = dcp_stage.StageFiles.blob_bytes
    out = []
    for step in range(2, 10, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        refuse = step == 6 and env.rank == 1
        dcp_stage.StageFiles.blob_bytes = (lambda self, staged: None) if refuse else real  # type: ignore[method-assign]
        out.append(_snapshot_both(root, env.rank, mem_ck, fresh, step)[:2])
    dcp_stage.StageFiles.blob_bytes = real  # type: ignore[method-assign]
    mem_ck.close()
    fresh.close()
    dist.destroy_process_group()
    return out


def test_a_stage_refused_on_one_rank_writes_that_snapshot_the_ordinary_way_on_every_rank(tmp_path: Path) -> None:
    from tests.harness import spawn

    want = [(False, True), (True, True), (False, True), (True, True)]
    assert spawn(_a_stage_refused_on_one_rank, 2, str(tmp_path)) == [want] * 2


def _deleted_but_mapped(mem: Path) -> int:
    """Bytes this process still maps of files already removed from ``mem`` (their tmpfs pages stay allocated)."""
    seen, total = set(), 0
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip().endswith("(deleted)") and str(mem) in parts[5]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if (parts[5], parts[4]) not in seen:
                seen.add((parts[5], parts[4]))
                total += hi - lo
    return total


def _blocking_snapshots_between_staged_ones(tmp: str) -> list[object]:
    """Snapshots 2, 4 (async: 4 staged), 6, 8, 10 (blocking, as a segment's last save or the API's), 12 (async):
    no blocking save lays a stage out; no file retention removed stays mapped; the stage laid out after 4 survives
    the blocking saves' retention and takes snapshot 12; every snapshot valid; nothing of the stage left at close."""
    import torch
    import torch.distributed as dist

    from ckpt.validate.checks import validate
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    root = Path(tmp)
    mem = root / "shm"
    spec = tiny_spec(**{"checkpoint.memory_interval": 2, "checkpoint.memory_dir": str(mem)})
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    (root / "run").mkdir(exist_ok=True)
    ck = DCPCheckpointer(RunDir.at(root / "run"), spec, model, opt, env, segment=0)
    rows = []
    for step, blocking in ((2, None), (4, None), (6, True), (8, True), (10, True), (12, None)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        ck.save(TrainState(step=step), reason="interval", tier=memtier.MEMORY, blocking=blocking)
        ck.wait()
        dist.barrier()
        snap = mem / "checkpoints" / f"step-{step:08d}"
        rows.append((ck.last_phases.get("staged") == 1.0, _deleted_but_mapped(mem), validate(snap, deep=True).valid))
        dist.barrier()
    ck.close()
    dist.barrier()
    left = sorted(p.name for p in (mem / "checkpoints").iterdir())
    dist.destroy_process_group()
    return [rows, left[-1], [n for n in left if "." in n]]


def test_blocking_snapshots_between_staged_ones_pin_no_removed_file_and_keep_the_stage(tmp_path: Path) -> None:
    from tests.harness import spawn

    staged = [False, True, False, False, False, True]
    want = [[(s, 0, True) for s in staged], "step-00000012", []]
    assert spawn(_blocking_snapshots_between_staged_ones, 2, str(tmp_path)) == [want] * 2


class _Tracked:
    """A tracked object (``seg.track``) whose state grows at step 6 on rank 1 only."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step = rank, 0

    def state_dict(self) -> dict:
        import torch

        n = 3 if (self.rank == 1 and self.step >= 6) else 2
        return {"step": self.step, "v": torch.arange(n, dtype=torch.float32) * self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def _tracked_objects_staged(tmp: str) -> list[object]:
    """A tracked object's packed state is staged with the rest; at step 6 it grows on rank 1 only: that snapshot is
    written the ordinary way on every rank (agreed), the template is made again, and step 8 is staged again (its
    laid-out files' first bytes zeroed by someone meanwhile). Every snapshot is byte for byte dcp.save's (same
    state, same tracked object) and gives the object's state back."""
    import torch
    import torch.distributed as dist

    from ckpt.formats.packed import unpack

    root = Path(tmp)
    env, model, mem_ck, fresh = _memory_and_fresh(root)
    tracked = _Tracked(env.rank)
    mem_ck.extra = fresh.extra = {"sched": tracked}
    out = []
    for step in range(2, 10, 2):
        tracked.step = step
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        if step == 8:  # someone scribbles over the laid-out files' headers meanwhile: not what gets hashed
            for f in (root / "shm" / "checkpoints").glob(f"*.recycle-next/__{env.rank}_*.distcp"):
                with open(f, "r+b") as fh:
                    fh.write(b"\0" * 64)
        staged, same, snap = _snapshot_both(root, env.rank, mem_ck, fresh, step)
        back = unpack(mem_ck.read_extras(snap, env.rank)["sched"], "sched")
        out.append((staged, same, back["step"] == step and torch.equal(back["v"], tracked.state_dict()["v"])))
    mem_ck.close()
    fresh.close()
    dist.destroy_process_group()
    return out


def test_tracked_objects_are_staged_with_the_state_and_a_size_change_is_written_the_ordinary_way(
    tmp_path: Path,
) -> None:
    from tests.harness import spawn

    want = [(False, True, True), (True, True, True), (False, True, True), (True, True, True)]
    assert spawn(_tracked_objects_staged, 2, str(tmp_path)) == [want] * 2


# ------------------------------------------------------------------ a snapshot vanished or changed before its persist
def _persist_edges(tmp: str) -> list[object]:
    """Storage checkpoints persisted from a memory snapshot that another process deleted or changed: right after its
    commit (blocking save: deleted; async save: a byte changed), and mid-copy (blocking save: deleted while the
    ranks copy). Each time nothing is committed from the snapshot, one warning on rank 0, the segment goes on, and
    the storage checkpoint is written from the live state (at once, or at the next save for an async one), byte for
    byte what an ordinary save of that state writes. A changed snapshot is never persisted."""
    import logging

    import torch
    import torch.distributed as dist

    from ckpt.validate.checks import validate
    from trainer.checkpointer import saver
    from trainer.checkpointer.core import TrainState

    root = Path(tmp)
    env, model, ck, fresh = _memory_and_fresh(root)
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    logging.getLogger("shardkeeper.checkpoint").addHandler(Said())
    snaps = root / "shm" / "checkpoints"
    before: dict[int, object] = {}
    real_persist, real_copy = ck.saver._persist, saver.copy_file

    def persist(ts, reason, t0, async_save):  # noqa: ANN001 - what happens between a snapshot's commit and its persist
        act = before.pop(ts.step, None)
        if act is not None:
            if env.is_rank0:
                act(snaps / f"step-{ts.step:08d}")  # type: ignore[operator]
            dist.barrier(group=env.ckpt_group)
        return real_persist(ts, reason, t0, async_save)

    def flip(snap: Path) -> None:
        shard = sorted(snap.glob("__1_*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    ck.saver._persist = persist  # type: ignore[method-assign]

    def advance(step: int) -> TrainState:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        return TrainState(step=step)

    def same_as_fresh(step: int) -> bool:
        fresh.save(TrainState(step=step), reason="interval", blocking=True)
        mine = sorted(ck.run_dir.checkpoint(step).glob(f"__{env.rank}_*.distcp"))
        theirs = sorted(fresh.run_dir.checkpoint(step).glob(f"__{env.rank}_*.distcp"))
        return (
            bool(mine)
            and [f.read_bytes() for f in mine] == [f.read_bytes() for f in theirs]
            and validate(ck.run_dir.checkpoint(step), deep=True).valid
        )

    out: list[object] = []
    ck.save(advance(2), reason="interval", tier=memtier.MEMORY)  # async: the next snapshots are staged in files
    ck.wait()
    before[4] = shutil.rmtree  # deleted right after its commit; a blocking save: written from the live state now
    ck.save(advance(4), reason="interval", blocking=True)
    out += [len(said), same_as_fresh(4)]
    ck.save(advance(6), reason="interval", tier=memtier.MEMORY)
    before[8] = flip  # a byte changed right after its commit; an async save: owed to the next save
    ck.save(advance(8), reason="interval")
    ck.wait()
    out += [len(said), ck.run_dir.checkpoint(8).exists(), (snaps / "step-00000008").is_dir()]
    ck.save(advance(10), reason="interval", tier=memtier.MEMORY)  # the owed storage checkpoint, instead of a snapshot
    out += [same_as_fresh(10), (snaps / "step-00000010").exists()]

    def copy_vanishing(src: Path, dst: Path):  # noqa: ANN202 - rank 1 finds the snapshot gone while the ranks copy
        if env.rank == 1:
            shutil.rmtree(src.parent, ignore_errors=True)
        return real_copy(src, dst)

    saver.copy_file = copy_vanishing  # type: ignore[assignment]
    ck.save(advance(12), reason="interval", blocking=True)
    saver.copy_file = real_copy  # type: ignore[assignment]
    out += [same_as_fresh(12), sorted(p.name for p in ck.run_dir.checkpoints.iterdir())]
    ck.close()
    fresh.close()
    if env.is_rank0:
        out += [said]
    dist.destroy_process_group()
    return out


def test_a_snapshot_gone_or_changed_before_its_persist_writes_storage_from_the_live_state(tmp_path: Path) -> None:
    from tests.harness import spawn

    stored = ["step-00000004", "step-00000010", "step-00000012"]
    rank0, rank1 = spawn(_persist_edges, 2, str(tmp_path))
    # written at once / owed after the async persist failed (no storage at 8, the changed snapshot left as it is) /
    # written instead of the snapshot of step 10 / written at once after the snapshot vanished mid-copy
    assert rank1 == [0, True, 0, False, True, True, False, True, stored]
    assert rank0[:-1] == [1, True, 2, False, True, True, False, True, stored]
    said = rank0[-1]
    assert len(said) == 3 and all("\n" not in s and "not persisted from its memory snapshot" in s for s in said)
    assert "step-00000004/" in said[0] and "gone from memory" in said[0] and said[0].endswith("live state instead")
    assert "__1_0.distcp: differs from its snapshot's manifest" in said[1] and "at the next save" in said[1]
    assert "step-00000012/" in said[2] and "gone from memory" in said[2]


# --------------------------------------------------------- between segments: memory dirs the run no longer uses
def _crashed(tmp_path: Path, name: str = "run", **more: object):
    """A run whose ranks died right after the snapshot of step 6, before its persist: storage holds step 4 (the
    snapshot of step 4, persisted), the memory dir ``tmp_path/shm-NAME`` step 6. Returns (spec, run dir, memory
    dir)."""
    from tests.harness import new_run, spawn
    from trainer.segment import run_segment

    mem = tmp_path / f"shm-{name}"
    spec = tiny_spec(
        **{"checkpoint.memory_interval": 2, "checkpoint.memory_dir": str(mem), "checkpoint.interval": 4, **more}
    )
    run = new_run(tmp_path / name, spec)
    assert spawn(run_segment, 2, str(run), 6, 0) == [0, 0]
    rd = RunDir.at(run)
    shutil.rmtree(rd.checkpoint(6))  # the end's storage checkpoint, as if the ranks died before persisting it
    assert (mem / "checkpoints" / "step-00000006").is_dir() and [p.name for p in rd.committed()] == ["step-00000004"]
    return spec, rd, mem


def _tier(spec, **update: object):  # noqa: ANN001, ANN202 - the same run's spec with other memory-tier settings
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update=update)})


def test_between_segments_persists_a_memory_dir_the_run_left_then_removes_it_and_says_what_it_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher before a segment: the snapshot newer than storage in the memory dir an earlier segment used is
    persisted (deep-validated) when the memory tier is off now or set to another dir, and that dir removed; a
    snapshot whose persist fails (a reader's own error) is kept and named in one line with how to use it; an
    older run's id file and a snapshot without a run id are this run's. Then one real `shardkeeper train` with
    the memory tier off resumes from the persisted step, its launcher lines shown without -v."""
    import sys

    from ckpt.commit.manifest import read_manifest
    from ckpt.validate import checks as validate_mod
    from ckpt.validate.checks import latest_valid
    from tests.harness import ROOT

    spec, rd, mem = _crashed(tmp_path)
    saved = tmp_path / "saved"
    shutil.copytree(rd.root, saved / "run")
    shutil.copytree(mem, saved / "shm")
    mine = memtier.identity(rd)
    assert mine and len(mine) == 32 and memtier.recorded_roots(rd) == [mem]

    def restore() -> None:
        for src, dst in ((saved / "run", rd.root), (saved / "shm", mem)):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)

    def lines(s) -> list[str]:  # noqa: ANN001
        out = memtier_persist.between_segments(s, rd)
        assert all("\n" not in ln for ln in out)
        return out

    for now, where in ((None, "the memory tier is off"), (str(tmp_path / "shm-2"), f"now {tmp_path / 'shm-2'}")):
        said = lines(_tier(spec, memory_interval=None if now is None else 2, memory_dir=now))
        assert said == [
            f"persisted the memory snapshot step-00000006 to storage: {rd.checkpoint(6)}",
            f"removed the memory tier {mem}: no longer this run's checkpoint.memory_dir ({where}); storage "
            "holds its steps",
        ]
        assert validate_mod.validate(rd.checkpoint(6), deep=True).valid
        assert read_manifest(rd.checkpoint(6)).run_id == mine
        assert not mem.exists() and memtier.recorded_roots(rd) == [] and not (tmp_path / "shm-2").exists()
        assert lines(_tier(spec, memory_interval=None)) == []
        restore()

    real = validate_mod.validate

    def reader_fails(path, *, deep=False):  # noqa: ANN001, ANN202 - the zero-element record read of a broken reader
        if deep:
            raise TypeError("cannot modify read-only memory")
        return real(path, deep=deep)

    monkeypatch.setattr(validate_mod, "validate", reader_fails)
    snap = mem / "checkpoints" / "step-00000006"
    why = (
        f"warning: memory snapshot {snap} not persisted: its deep validation failed (TypeError: cannot modify "
        "read-only memory); it is kept ({}); storage's step-00000004 is the resume point"
    )
    assert lines(spec) == [
        why.format("a segment at world size 2 with this memory tier resumes from it if it passes every check")
    ]
    assert lines(_tier(spec, memory_interval=None)) == [
        why.format(
            "to try it, run a segment at world size 2 with checkpoint.memory_interval set and "
            f"checkpoint.memory_dir {mem} "
            "(the ranks load it only if it passes every check)"
        )
    ]
    assert snap.is_dir() and memtier.recorded_roots(rd) == [mem] and latest_valid(rd)[1].step == 4
    monkeypatch.setattr(validate_mod, "validate", real)

    # A byte changed in the snapshot: never usable, set aside; the dir the run left is removed all the same.
    shard = sorted(snap.glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    said = lines(_tier(spec, memory_interval=None))
    assert len(said) == 2 and said[0].startswith(f"warning: memory snapshot {snap} not persisted: {shard}: checksum ")
    assert "; set aside as step-00000006.invalid-" in said[0] and said[0].endswith(
        "storage's step-00000004 is the resume point"
    )
    assert said[1].startswith(f"removed the memory tier {mem}") and not mem.exists() and latest_valid(rd)[1].step == 4
    restore()
    (tmp_path / "alias").symlink_to(mem)  # the same memory dir by another path: the segment's own, never removed
    assert lines(_tier(spec, memory_dir=str(tmp_path / "alias")))[0].startswith("persisted the memory snapshot")
    assert (mem / "checkpoints" / "step-00000006").is_dir() and memtier.recorded_roots(rd) == [mem]
    restore()

    # An older run: its id where earlier versions kept it, a snapshot without a run id: both this run's.
    os.rename(rd.root / memtier.ID_NAME, rd.root / memtier.LEGACY_ID_NAME)
    raw = (snap / "manifest.json").read_text()
    (snap / "manifest.json").write_text(raw.replace(f'"run_id": "{mine}"', '"run_id": null'))
    assert read_manifest(snap).run_id is None
    assert lines(spec)[0].startswith("persisted the memory snapshot step-00000006")
    assert memtier.identity(rd) == mine and not (rd.root / memtier.ID_NAME).exists()

    restore()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--run-dir",
            str(rd.root),
            "--nproc",
            "2",
            "--until-step",
            "8",
            "--set",
            "checkpoint.memory_interval=null",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200"},
        cwd=ROOT,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert f"shardkeeper: persisted the memory snapshot step-00000006 to storage: {rd.checkpoint(6)}" in out
    assert f"shardkeeper: removed the memory tier {mem}" in out and "steps 6 -> 8" in out and not mem.exists()


def test_another_runs_snapshot_copied_into_the_memory_dir_is_never_persisted_nor_resumed(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Run B has A's name (another directory, another learning rate); its snapshot of step 8 copied into A's memory
    dir: the launcher sets it aside in one line and persists A's own step 6; copied in again, A's ranks refuse it
    in one line and resume from step 6."""
    import json

    from tests.harness import spawn
    from trainer.segment import run_segment

    spec, rd, mem = _crashed(tmp_path)
    _, other, other_mem = _crashed(tmp_path, "other", **{"optim.lr": 5e-3})
    assert spawn(run_segment, 2, str(other.root), 8, 1) == [0, 0]
    theirs = other_mem / "checkpoints" / "step-00000008"
    copied = mem / "checkpoints" / "step-00000008"
    shutil.copytree(theirs, copied)
    said = memtier_persist.between_segments(spec, rd)
    assert len(said) == 2 and said[1].startswith("persisted the memory snapshot step-00000006"), said
    assert said[0].startswith(
        f"warning: memory snapshot {copied} refused: written by another run (run id "
        f"{memtier.identity(other)}; this run's is {memtier.identity(rd)}); set aside as "
        "step-00000008.invalid-"
    ) and said[0].endswith(", never persisted nor resumed")
    assert not copied.exists() and not rd.checkpoint(8).exists()
    shutil.copytree(theirs, copied)  # copied in again once the launcher looked: the ranks refuse it too
    capfd.readouterr()
    assert spawn(run_segment, 2, str(rd.root), 10, 1) == [0, 0]
    refused = [ln for ln in capfd.readouterr().err.splitlines() if "step-00000008 not used" in ln]
    assert len(refused) == 1 and "(written by another run (run id " in refused[0], refused
    events = [json.loads(x) for x in (rd.root / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["kind"] == "resume"][-1]
    assert resume["step"] == 6 and resume["parent"].startswith("checkpoint:step-00000006")
    assert copied.is_dir()  # left where it is: never loaded
