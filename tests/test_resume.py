"""Exact and elastic resume on real multi-process gloo groups (FSDP2 on CPU).

One uninterrupted 2-rank reference run to step 29 (END) is shared by the module; each resumed run is
compared with it step by step: bitwise at the same world size, within 1e-6 relative across sizes.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import time
from pathlib import Path

import pytest

from ckpt.commit.manifest import read_manifest
from ckpt.validate.checks import validate
from tests.harness import assert_bitwise, copy_run_until, max_rel, metrics, new_run, spawn, tiny_spec
from trainer.segment import run_segment

END = 29  # room after the memory-tier crash test's latest crash point (20) for its two resumed segments
CUT = 5


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = new_run(tmp_path_factory.mktemp("ref") / "run", tiny_spec())
    assert spawn(run_segment, 2, str(run), END, 0) == [0, 0]
    return run


@pytest.fixture(scope="module")
def base4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = new_run(tmp_path_factory.mktemp("base4") / "run", tiny_spec())
    assert spawn(run_segment, 4, str(run), CUT, 0) == [0] * 4
    return run


def test_same_world_size_resume_is_bitwise(reference: Path, tmp_path: Path) -> None:
    run = copy_run_until(reference, tmp_path / "run", CUT)
    assert spawn(run_segment, 2, str(run), END, 1) == [0, 0]
    got, ref = metrics(run), metrics(reference)
    assert [got[s]["segment"] for s in range(CUT + 1, END + 1)] == [1] * (END - CUT)
    assert_bitwise(ref, got, range(CUT + 1, END + 1))
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["kind"] == "resume"][-1]
    assert resume["parent"] == f"checkpoint:step-{CUT:08d}" and resume["data"]["to_world_size"] == 2


def _legacy_fingerprint_segment(run: str, until: int, segment: int) -> int:
    """A segment of the previous release: its checkpoints carry the plain float64 vector_norm fingerprint."""
    import ckpt.commit.fingerprint as fp

    ls, mk = fp.local_sum_squares, fp.make_fingerprint
    fp.local_sum_squares = lambda named, method=None, known=None: ls(named, fp.LEGACY_METHOD)
    fp.make_fingerprint = lambda m, o, s, method=None: mk(m, o, s, fp.LEGACY_METHOD)
    return run_segment(run, until, segment)


def test_checkpoint_with_the_previous_fingerprint_method_resumes_bitwise(reference: Path, tmp_path: Path) -> None:
    """A load recomputes the fingerprint by the checkpoint's own method, so checkpoints written before the
    blocked method still pass the exact same-world-size check (and resume bitwise); new saves use the new one."""
    run = new_run(tmp_path / "run", tiny_spec())
    assert spawn(_legacy_fingerprint_segment, 2, str(run), CUT, 0) == [0, 0]
    assert read_manifest(run / "checkpoints" / f"step-{CUT:08d}").fingerprint.method == "l2-per-tensor-f64"
    assert spawn(run_segment, 2, str(run), CUT + 5, 1) == [0, 0]
    assert_bitwise(metrics(reference), metrics(run), range(1, CUT + 6))
    assert read_manifest(run / "checkpoints" / f"step-{CUT + 5:08d}").fingerprint.method == "l2-per-tensor-f64-blocked"


def test_a_fingerprint_recomputed_by_other_arithmetic_warns_and_resumes_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    """A manifest whose fingerprint.method names other arithmetic than the one that recorded the norms (edited, or
    norms that another torch release sums in another order): equal within 1e-9, not bit for bit -- the
    checkpoint is loaded (its bytes passed their checksums), never set aside, and the resume is bitwise."""
    run = copy_run_until(reference, tmp_path / "run", CUT)
    mpath = run / "checkpoints" / f"step-{CUT:08d}" / "manifest.json"
    raw = json.loads(mpath.read_text())
    assert raw["fingerprint"]["method"] == "l2-per-tensor-f64-blocked"
    raw["fingerprint"]["method"] = "l2-per-tensor-f64"
    mpath.write_text(json.dumps(raw))
    assert spawn(run_segment, 2, str(run), CUT + 5, 1) == [0, 0]
    assert not list((run / "checkpoints").glob("*.invalid-*"))
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    assert [e for e in events if e["kind"] == "resume"][-1]["parent"] == f"checkpoint:step-{CUT:08d}"
    assert_bitwise(metrics(reference), metrics(run), range(CUT + 1, CUT + 6))


@pytest.mark.parametrize(("start", "to"), [(4, 2), (4, 3), (2, 4)])
def test_world_size_change_resume_within_1e6(reference: Path, base4: Path, tmp_path: Path, start: int, to: int) -> None:
    src = base4 if start == 4 else reference
    run = copy_run_until(src, tmp_path / "run", CUT)
    until = CUT + 20  # twenty steps at the new size (END is sized for the memory-tier crash test's segments)
    assert spawn(run_segment, to, str(run), until, 1) == [0] * to
    got, ref = metrics(run), metrics(reference)
    assert all(got[s]["world_size"] == to for s in range(CUT + 1, until + 1))
    rel = max_rel(ref, got, range(CUT + 1, until + 1))
    assert rel <= 1e-6, f"{start}->{to}: max relative loss difference {rel:.3e}"
    assert read_manifest(run / "checkpoints" / f"step-{until:08d}").topology.world_size == to


def test_async_save_commits_and_resumes_exactly(reference: Path, tmp_path: Path) -> None:
    spec = tiny_spec(**{"checkpoint.async_save": "true"})
    run = new_run(tmp_path / "async", spec)
    assert spawn(run_segment, 2, str(run), 15, 0) == [0, 0]
    ref = metrics(reference)
    assert_bitwise(ref, metrics(run), range(1, 16))  # background saves do not perturb training
    for step in (5, 10, 15):
        man = read_manifest(run / "checkpoints" / f"step-{step:08d}")
        assert man.async_save == (step != 15) and validate(run / "checkpoints" / f"step-{step:08d}", deep=True).valid
    shutil.rmtree(run / "checkpoints" / "step-00000015")
    shutil.rmtree(run / "checkpoints" / "step-00000010")
    assert spawn(run_segment, 2, str(run), 20, 1) == [0, 0]
    assert_bitwise(ref, metrics(run), range(6, 21))


def _kill_rank_after(run: Path, step: int, rank: int):
    def on_start(procs: list) -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            m = run / "metrics.jsonl"
            if m.exists() and sum(1 for _ in m.open()) >= step:
                os.kill(procs[rank].pid, signal.SIGTERM)
                return
            time.sleep(0.02)
        raise AssertionError("training never reached the step to preempt at")

    return on_start


def test_sigterm_on_one_rank_commits_then_resumes_exactly(reference: Path, tmp_path: Path) -> None:
    run = new_run(tmp_path / "run", tiny_spec(**{"checkpoint.keep_last": 2, "checkpoint.interval": 4}))
    codes = spawn(run_segment, 2, str(run), 400, 0, on_start=_kill_rank_after(run, 7, rank=1))
    assert codes == [75, 75]
    status = json.loads((run / ".segment-status.json").read_text())
    stop = status["end_step"]
    assert status["status"] == "preempted" and 7 <= stop < 400
    times = status["times"]  # no launcher here: timed from the earlier rank's process start
    assert times["origin"] == "ranks" and 0 <= times["ranks_started_s"] < times["first_step_s"]
    assert times["first_step_s"] < times["stop_signal_s"] < times["emergency_saved_s"] <= times["closed_s"]
    man = read_manifest(run / "checkpoints" / f"step-{stop:08d}")
    assert man.reason == "preempted" and validate(run / "checkpoints" / f"step-{stop:08d}", deep=True).valid
    assert spawn(run_segment, 2, str(run), END, 1) == [0, 0]
    assert_bitwise(metrics(reference), metrics(run), range(stop + 1, END + 1))
    # retention: keep_last=2 over steps 4, 8, ..., stop, END -> only the two newest remain
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(kept) == 2 and kept[-1] == f"step-{END:08d}"


def test_partial_and_corrupted_checkpoints_are_never_loaded(reference: Path, tmp_path: Path) -> None:
    run = copy_run_until(reference, tmp_path / "run", 20)
    # an abandoned save that never committed, newer than everything else
    partial = run / "checkpoints" / "step-00000099.partial"
    shutil.copytree(run / "checkpoints" / "step-00000020", partial)
    # step 20: flip one byte in a shard (same size, so only the checksum can tell)
    shard = sorted((run / "checkpoints" / "step-00000020").glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert validate(run / "checkpoints" / "step-00000020").valid  # sizes still match
    deep = validate(run / "checkpoints" / "step-00000020", deep=True)
    assert not deep.valid and shard.name in deep.errors[0] and "checksum" in deep.errors[0]
    # step 15: truncated shard
    shard15 = sorted((run / "checkpoints" / "step-00000015").glob("__0_*.distcp"))[0]
    shard15.write_bytes(shard15.read_bytes()[:-10])
    assert not validate(run / "checkpoints" / "step-00000015").valid
    lines = [ln for ln in (run / "metrics.jsonl").read_text().splitlines() if json.loads(ln)["step"] <= 10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert spawn(run_segment, 2, str(run), END, 1) == [0, 0]
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    assert [e for e in events if e["kind"] == "resume"][-1]["parent"] == "checkpoint:step-00000010"
    assert_bitwise(metrics(reference), metrics(run), range(11, END + 1))


def test_fingerprint_mismatch_is_never_trained_on(reference: Path, tmp_path: Path) -> None:
    run = copy_run_until(reference, tmp_path / "run", 10)
    mpath = run / "checkpoints" / "step-00000010" / "manifest.json"
    raw = json.loads(mpath.read_text())
    key = sorted(raw["fingerprint"]["optim"])[0]
    raw["fingerprint"]["optim"][key] *= 1.001  # what a dropped/misplaced optimizer shard looks like
    mpath.write_text(json.dumps(raw))
    assert spawn(run_segment, 2, str(run), 12, 1) == [0, 0]
    # the load refused it: moved aside, and the run resumed from the previous checkpoint exactly
    assert len(list((run / "checkpoints").glob("step-00000010.invalid-*"))) == 1
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    assert [e for e in events if e["kind"] == "resume"][-1]["parent"] == "checkpoint:step-00000005"
    assert_bitwise(metrics(reference), metrics(run), range(6, 13))


def test_rank_side_refuses_checkpoint_of_another_architecture(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step-00000010", run / "checkpoints" / "step-00000010")
    other = tiny_spec(**{"model.config.intermediate_size": 96})
    (run / "run.yaml").write_text(json.dumps(other.model_dump(mode="json")))  # bypasses the CLI's own check
    # the first tensor that differs, in the manifest's order, with both shapes (ckpt.commit.identity)
    with pytest.raises(
        RuntimeError,
        match=r"ModelMismatch: \S+/step-00000010: holds another model than this run's: "
        r"model\.layers\.0\.mlp\.down_proj\.weight is \[64, 128\] float32 in the checkpoint, "
        r"\[64, 96\] float32 in this run's model; ",
    ):
        spawn(run_segment, 2, str(run), 12, 0)
    assert not (run / "metrics.jsonl").exists()


def test_bf16_compute_same_world_size_resume_is_bitwise(tmp_path: Path) -> None:
    spec = tiny_spec(**{"precision.compute": "bf16"})
    ref = new_run(tmp_path / "ref", spec)
    assert spawn(run_segment, 2, str(ref), 12, 0) == [0, 0]
    run = copy_run_until(ref, tmp_path / "run", CUT)
    assert spawn(run_segment, 2, str(run), 12, 1) == [0, 0]
    assert_bitwise(metrics(ref), metrics(run), range(CUT + 1, 13))
    man = read_manifest(run / "checkpoints" / "step-00000012")
    assert (man.dtype_policy.master, man.dtype_policy.compute) == ("float32", "bfloat16")
    assert all(t.dtype == "float32" for t in man.tensors)  # master weights and moments stay fp32


def _staging_buffers() -> int:
    """On each rank: cpu_buffers of a real FSDP2 model + AdamW state dict (uneven shards of 5 rows on 2 ranks);
    the staged copy equals the state, shares no storage, and keeps every DTensor's placements and shape."""
    import torch
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trainer.checkpointer.dcp_backend import cpu_buffers
    from trainer.dist import init_distributed

    env = init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 5))
    fully_shard(model, mesh=env.mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": torch.tensor(7)}
    staged = _copy_state_dict(sd, cpu_buffers(sd, pin_memory=False))
    n = 0

    def same(a, b) -> None:
        nonlocal n
        if isinstance(a, DTensor):
            assert isinstance(b, DTensor) and a.placements == b.placements and a.shape == b.shape
            a, b = a.to_local(), b.to_local()
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and (a.numel() == 0 or a.data_ptr() != b.data_ptr())
            n += 1
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, list):
            for x, y in zip(a, b, strict=True):
                same(x, y)
        else:
            assert a == b

    same(sd, staged)
    dist.destroy_process_group()
    return n


def test_async_staging_buffers_copy_the_whole_state():
    """The async save's CPU buffers (allocated without torch's deep copy) receive exactly the saved state."""
    counts = spawn(_staging_buffers, 2)
    assert counts[0] == counts[1] and counts[0] >= 4 + 2 * 4 + 1  # 4 params, 2 moments each (+ steps), counter


def _fresh_run_staging(run_dir: str) -> list[bool]:
    """warm_up of a fresh run stages nothing (AdamW has no state yet) and stages right after the first step."""
    import torch

    from ckpt.commit.layout import RunDir
    from tests.harness import tiny_spec
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = tiny_spec(**{"checkpoint.async_save": "true"})
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    ck = DCPCheckpointer(RunDir.at(run_dir), spec, model, opt, env, segment=0)
    ck.warm_up(TrainState())
    seen = [ck._staged is None]
    model(input_ids=torch.randint(0, 64, (1, 8))).logits.float().mean().backward()
    opt.step()
    seen += [ck._staged is not None, ck._first_step_hook is None, int(next(iter(opt.state.values()))["step"]) == 1]
    ck.close()
    torch.distributed.destroy_process_group()
    return seen


def test_fresh_run_stages_after_its_first_step(tmp_path):
    """The first async save of a fresh run finds its staging buffers ready (allocated after step 1)."""
    assert spawn(_fresh_run_staging, 2, str(tmp_path)) == [[True, True, True, True]] * 2


def _crash_after_snapshot(mem: Path, steps: range, killed: list[int], storage_every: int):
    """SIGKILL rank 1 as soon as a memory snapshot of one of ``steps`` that storage has not (not a multiple of
    ``storage_every``) is committed (the node stays up); rank 0 dies on the broken group (or is killed 20 s later,
    as torchrun would)."""

    def on_start(procs: list) -> None:
        deadline = time.time() + 180
        while time.time() < deadline:
            done = [
                s
                for s in steps
                if s % storage_every and (mem / "checkpoints" / f"step-{s:08d}" / "manifest.json").is_file()
            ]
            if done:
                os.kill(procs[1].pid, signal.SIGKILL)
                killed.append(done[0])
                procs[0].join(timeout=20)
                if procs[0].is_alive():
                    os.kill(procs[0].pid, signal.SIGKILL)
                return
            if not any(p.is_alive() for p in procs):  # nothing more can come: say so now, not after 180 s
                raise AssertionError(
                    f"no memory snapshot of steps {list(steps)}: the ranks ended first (exit codes "
                    f"{[p.exitcode for p in procs]})"
                )
            time.sleep(0.005)
        raise AssertionError(f"no memory snapshot of steps {list(steps)} within 180 s")

    return on_start


def test_memory_tier_rank_crash_resumes_from_memory_exactly(reference: Path, tmp_path: Path, capfd) -> None:
    """Memory snapshots every K=4 steps, storage every 7. A rank SIGKILLed after the first snapshot storage has not
    (step s = 8, 12, 16 or 20; one due while a save is still being written is skipped): the launcher persists it after
    validating it (a tampered copy is refused), the next segment resumes from memory (tier 'memory' in lineage), bitwise
    like the uninterrupted reference, having lost <= K steps. A tampered snapshot at a later crash point is never
    loaded: one line, storage used, training bitwise."""
    from ckpt.commit.layout import RunDir
    from ckpt.memtier.persist import persist_newer
    from ckpt.validate.checks import latest_valid
    from shardkeeper.stages import run_state
    from tasks.dashboard import checkpoints_now

    # Storage every 7 (not 5): a snapshot due while the previous save is still being written is skipped, and on a
    # busy machine the saves of 5, 10 and 15 could swallow every snapshot the crash can wait for (8, 12, 16).
    k, every, mem = 4, 7, tmp_path / "shm"
    spec = tiny_spec(
        **{
            "checkpoint.memory_interval": k,
            "checkpoint.memory_dir": str(mem),
            "checkpoint.interval": every,
            "checkpoint.background_nice": 0,
        }
    )  # the writes keep up with the tiny model on a busy machine
    run = new_run(tmp_path / "run", spec)
    rd = RunDir.at(run)
    killed: list[int] = []
    # rank 1 never reports: it was killed. Both ranks are gone when on_start returns (rank 0 joined or killed), so
    # whatever rank 0 reported is already queued: a short wait for the reports is enough.
    with pytest.raises(queue.Empty):
        spawn(
            run_segment,
            2,
            str(run),
            400,
            0,
            timeout=2,
            on_start=_crash_after_snapshot(mem, range(6, 24), killed, every),
        )
    s = killed[0]
    stored = every * (s // every)
    snap = mem / "checkpoints" / f"step-{s:08d}"
    assert latest_valid(rd)[1].step == stored and validate(snap, deep=True).valid
    state = run_state(run)  # status: the newest valid checkpoint is the snapshot, in memory
    assert (state.step, state.tier, state.checkpoint) == (s, "memory", str(snap))
    assert {(r["step"], r["tier"]) for r in checkpoints_now(run, [])} >= {(stored, "storage"), (s, "memory")}
    lost = max(metrics(run)) - s
    assert 0 <= lost <= k, f"{lost} steps trained after the newest snapshot"
    assert_bitwise(metrics(reference), metrics(run), range(1, max(metrics(run)) + 1))  # snapshots perturb nothing
    # The launcher's side: a tampered snapshot is never persisted (one line), the pristine one is.
    shutil.copytree(snap, tmp_path / "pristine")
    shard = sorted(snap.glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    final, problem = persist_newer(spec, rd)  # an older snapshot newer than storage, if one is kept, goes instead
    assert len(problem) == 1 and "not persisted" in problem[0] and "checksum" in problem[0]
    assert f"set aside as step-{s:08d}.invalid-" in problem[0] and "\n" not in problem[0] and not snap.exists()
    assert final is None or stored < int(final.name[5:]) < s
    assert latest_valid(rd)[1].step == (int(final.name[5:]) if final else stored)
    shutil.copytree(tmp_path / "pristine", snap)
    final, problem = persist_newer(spec, rd)
    assert problem == [] and final == rd.checkpoint(s) and validate(final, deep=True).valid
    assert run_state(run).tier == "storage"
    # The next segment on this node: from memory (same step in both tiers: memory wins, storage is not read).
    until = s + 4
    assert spawn(run_segment, 2, str(run), until, 1) == [0, 0]
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "memory" and resume["parent"] == f"checkpoint:step-{s:08d}@memory"
    persisted = [e for e in events if e["id"] == f"checkpoint:step-{s:08d}"][-1]
    assert persisted["data"]["tier"] == "storage" and persisted["data"]["persisted_from"] == "memory"
    assert {e["data"]["tier"] for e in events if e["kind"] == "checkpoint"} == {"memory", "storage"}
    assert_bitwise(metrics(reference), metrics(run), range(s + 1, until + 1))
    kept = sorted(p.name for p in (mem / "checkpoints").iterdir())
    # the newest one or two snapshots (the older one may be retired as the next snapshot's stage), nothing else
    assert (
        1 <= len(kept) <= 2
        and kept[-1] == f"step-{until:08d}"
        and all(k.startswith("step-") and "." not in k for k in kept)
    ), kept
    assert validate(rd.checkpoint(until), deep=True).valid  # persisted from memory at the end
    # A tampered snapshot (as new as storage's newest): never loaded, one line, storage's checkpoint used.
    shard = sorted((mem / "checkpoints" / f"step-{until:08d}").glob("__0_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    assert spawn(run_segment, 2, str(run), until + 2, 2) == [0, 0]
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "memory snapshot" in ln and "not used" in ln]
    assert len(said) == 1 and "checksum" in said[0] and "resuming from storage" in said[0], err[-3000:]
    events = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["kind"] == "resume"][-1]
    assert resume["data"]["tier"] == "storage" and resume["parent"] == f"checkpoint:step-{until:08d}"
    assert_bitwise(metrics(reference), metrics(run), range(until + 1, until + 3))
