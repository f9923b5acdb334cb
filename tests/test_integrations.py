"""The integrations and examples, each launched as a user would: ``shardkeeper train --script`` (real torchrun, gloo,
2 CPU ranks, tiny transformers Llamas). Module-scoped runs serve several tests each (a launch costs 15-35 s); one
module fixture makes them, the chains below (no chain reads another's runs) three at a time:

- Hugging Face Trainer + DeepSpeed ZeRO-2 (examples/hf_trainer.py): an uninterrupted 2-rank run (the Trainer's
  save_steps and the run's interval both commit), a copy of it cut at step 14 resumed on 2 ranks (bitwise); a 2-rank run
  SIGTERMed mid-run (exit 75, the preemption checkpoint committed) and resumed on 1 rank through the universal
  conversion, whose losses continue the uninterrupted run's, then a segment past the Trainer's max_steps, which
  the ranks refuse before its first step (exit 2, the run unchanged);
- Accelerate + FSDP2 (examples/accelerate_fsdp.py): an uninterrupted 2-rank run, and copies of it cut at step 8
  resumed on 2 ranks (bitwise the same losses) and on 1 rank (DCP reshards; the same losses within rounding);
- the own DeepSpeed loop (examples/deepspeed_loop.py): 2 ranks, cut at step 10 and resumed on 1 rank;
- ``shardkeeper validate --deep`` and ``shardkeeper export`` on their checkpoints (export of a DeepSpeed and of a
  DCP checkpoint; the exported folder loads with ``from_pretrained``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import copy_run_until, metrics, outcome, side_by_side

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HF_MAX_STEPS = "200"  # the Trainer's schedule length: long enough that a SIGTERM lands mid-run


def sk(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def train(run: Path, until: int, nproc: int, *more: str) -> subprocess.CompletedProcess:
    out = sk("train", "--run-dir", str(run), "--until-step", str(until), "--nproc", str(nproc), *more)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def max_rel(ref: dict[int, dict], got: dict[int, dict], steps: range) -> float:
    return max(abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in steps)


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


# ------------------------------------------------------------------------------------ launched side by side
SIDE_BY_SIDE = 3  # chains at once: much of a launch is process start and imports


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every launch of the three module fixtures below, their chains ``SIDE_BY_SIDE`` at a time (no chain reads
    another's runs); what a chain raised is kept for its fixture to raise."""
    base = tmp_path_factory.mktemp("launched")
    chains = {
        "hf": _hf_uninterrupted_and_cut,
        "hf-preempted": _preempted_and_resumed,
        "acc": _acc_chain,
        "ds": _ds_chain,
    }
    for name in chains:
        (base / name).mkdir()
    return side_by_side([[(name, fn, base / name)] for name, fn in chains.items()], SIDE_BY_SIDE)


# ------------------------------------------------------------------------------------ Hugging Face Trainer
HF_SCRIPT = [
    "--script",
    str(EXAMPLES / "hf_trainer.py"),
    "--set",
    "backend=deepspeed",
    "--set",
    "checkpoint.interval=10",
    "--set",
    "checkpoint.keep_last=100",
]


@pytest.fixture(scope="module")
def hf_runs(launched: dict) -> dict:
    return {**outcome(launched, "hf"), **outcome(launched, "hf-preempted")}


def _hf_uninterrupted_and_cut(base: Path) -> dict:
    ref, same = (
        base / "ref",
        base / "same",
    )  # the Trainer's own save policy (save_steps=7) beside the run's interval (10)
    train(ref, 30, 2, *HF_SCRIPT, "--", "--deepspeed", "--max-steps", HF_MAX_STEPS, "--save-steps", "7")
    copy_run_until(ref, same, 14)
    train(same, 22, 2)
    return {"ref": ref, "same": same}


def _preempted_and_resumed(base: Path) -> dict:
    """A 2-rank run SIGTERMed once 4 steps are logged, then resumed on 1 rank to step 30."""
    run = base / "preempted"
    args = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--run-dir",
        str(run),
        "--until-step",
        HF_MAX_STEPS,
        "--nproc",
        "2",
        *HF_SCRIPT,
        "--",
        "--deepspeed",
        "--max-steps",
        HF_MAX_STEPS,
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "SHARDKEEPER_DEVICE": "cpu", "DS_ACCELERATOR": "cpu"},
    )
    rows = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (rows.exists() and len(rows.read_text().splitlines()) >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    status = json.loads((run / ".segment-status.json").read_text())
    preempted = {"rc": proc.returncode, "out": out, "status": status}
    stop = status["end_step"]
    assert stop < 24, f"the SIGTERM landed late (step {stop}); the resume below trains to step 30"
    resumed = train(run, 30, 1)
    status = sk("status", str(run), "--json").stdout
    beyond = sk("train", "--run-dir", str(run), "--until-step", str(int(HF_MAX_STEPS) + 1), "--nproc", "1")
    return {
        "run": run,
        "preempted": preempted,
        "resumed": resumed,
        "stop": stop,
        "beyond": beyond,
        "status": (status, sk("status", str(run), "--json").stdout),
    }


def test_hf_trainer_sigterm_commits_at_the_step_boundary_and_exits_75(hf_runs: dict) -> None:
    pre = hf_runs["preempted"]
    assert pre["rc"] == 75, pre["out"][-3000:]
    stop = hf_runs["stop"]
    assert pre["status"]["status"] == "preempted" and stop >= 4
    ckpt = hf_runs["run"] / "checkpoints" / f"step-{stop:08d}"
    m = manifest(ckpt)
    assert m["reason"] == "preempted" and m["format"] == "deepspeed" and m["topology"]["procs_per_node"] == 2
    # the Trainer's own checkpoint folders are never written: every save is a shardkeeper commit
    assert not list(hf_runs["run"].rglob("checkpoint-*")) and not list(hf_runs["ref"].rglob("checkpoint-*"))
    # the tracked Trainer counters and scheduler rode along in every rank's file
    assert {"rng_rank_00000.pt", "rng_rank_00001.pt"} <= {f["path"] for f in m["files"]}


def test_hf_trainer_until_step_past_max_steps_is_refused_and_leaves_the_run_as_it_was(hf_runs: dict) -> None:
    """What only the script knows (the Trainer's max_steps) is refused by the ranks before the first step: one line,
    exit 2, the segment recorded 'refused', the run's status and until_step unchanged."""
    r = hf_runs["beyond"]
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "refused before its first step" in errors[0], r.stderr[-3000:]
    assert f"beyond the Trainer's max_steps {HF_MAX_STEPS}" in errors[0]
    before, after = (json.loads(x)[0] for x in hf_runs["status"])
    assert after == before and (after["last_status"], after["last_until_step"]) == ("completed", 30)
    end = [json.loads(x) for x in (hf_runs["run"] / "segments.jsonl").read_text().splitlines()][-1]
    assert (end["status"], end["exit_code"], end["end_step"]) == ("refused", 2, 30)


def test_hf_trainer_saves_are_commits_and_resume_on_the_same_world_size_is_bitwise(hf_runs: dict) -> None:
    ckpts = hf_runs["ref"] / "checkpoints"
    assert sorted(int(p.name[5:]) for p in ckpts.glob("step-*")) == [7, 10, 14, 20, 21, 28, 30]
    assert {manifest(ckpts / f"step-{s:08d}")["reason"] for s in (7, 14, 21, 28)} == {"interval"}
    ref, got = metrics(hf_runs["ref"]), metrics(hf_runs["same"])
    assert sorted(got) == list(range(1, 23))
    # the Trainer's global_step, LR schedule, sampler position and RNG continue exactly: the same bits
    for s in range(15, 23):
        assert got[s]["segment"] == 1 and got[s]["loss"] == ref[s]["loss"] and got[s]["lr"] == ref[s]["lr"], s


def test_hf_trainer_resumes_on_another_world_size_and_continues_the_loss(hf_runs: dict) -> None:
    run, stop = hf_runs["run"], hf_runs["stop"]
    assert f"segment 1 completed: steps {stop} -> 30 on 1 ranks" in hf_runs["resumed"].stderr
    assert (run / "checkpoints" / f"step-{stop:08d}" / "universal").is_dir()  # ZeRO-2 of 2 ranks -> 1 rank
    ref, got = metrics(hf_runs["ref"]), metrics(run)
    assert sorted(got) == list(range(1, 31)) and {got[s]["world_size"] for s in range(stop + 1, 31)} == {1}
    for s in range(1, stop + 1):  # before the stop: the same 2-rank run, bit for bit
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["lr"] == ref[s]["lr"], s
    # after: the Trainer's global_step, LR schedule and sampler position continued exactly ...
    assert all(got[s]["lr"] == ref[s]["lr"] for s in range(stop + 1, 31))
    # ... and the math on 1 rank differs from 2 ranks' by float rounding only (gradient all-reduce order)
    assert max_rel(ref, got, range(stop + 1, 31)) < 1e-6, [
        (s, ref[s]["loss"], got[s]["loss"]) for s in range(stop + 1, 31)
    ]
    assert manifest(run / "checkpoints" / "step-00000030")["topology"]["procs_per_node"] == 1


def test_hf_trainer_checkpoints_validate_deep_and_export(hf_runs: dict, tmp_path: Path) -> None:
    ckpt = hf_runs["run"] / "checkpoints" / f"step-{hf_runs['stop']:08d}"
    out = sk("validate", "--deep", str(ckpt))
    assert out.returncode == 0 and "valid (deep)" in out.stdout, out.stdout + out.stderr[-2000:]
    out = sk("export", str(hf_runs["run"] / "checkpoints" / "step-00000030"), str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 2


# ------------------------------------------------------------------------------------ Accelerate FSDP2
@pytest.fixture(scope="module")
def acc_runs(launched: dict) -> dict:
    return outcome(launched, "acc")


def _acc_chain(base: Path) -> dict:
    ref = base / "ref"
    train(
        ref,
        16,
        2,
        "--script",
        str(EXAMPLES / "accelerate_fsdp.py"),
        "--set",
        "checkpoint.interval=4",
        "--set",
        "checkpoint.keep_last=100",
    )
    same = copy_run_until(ref, base / "same", 8)
    train(same, 16, 2)
    other = copy_run_until(ref, base / "other", 8)
    train(other, 16, 1)
    return {"ref": ref, "same": same, "other": other}


def test_accelerate_resume_on_the_same_world_size_is_bitwise(acc_runs: dict) -> None:
    ref, got = metrics(acc_runs["ref"]), metrics(acc_runs["same"])
    assert sorted(got) == list(range(1, 17))
    # steps 9-16 cross an epoch boundary (12 steps per epoch): the sampler's epoch and position continue
    for s in range(9, 17):
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["lr"] == ref[s]["lr"], (s, got[s], ref[s])
        assert got[s]["segment"] == 1


def test_accelerate_resume_on_another_world_size_has_no_spike(acc_runs: dict) -> None:
    ref, got = metrics(acc_runs["ref"]), metrics(acc_runs["other"])
    assert {got[s]["world_size"] for s in range(9, 17)} == {1}
    assert all(got[s]["lr"] == ref[s]["lr"] for s in range(9, 17))
    # the seed-000 question: the first steps after a sharded resume continue the loss (float rounding only)
    assert max_rel(ref, got, range(9, 17)) < 1e-6, [(s, ref[s]["loss"], got[s]["loss"]) for s in range(9, 17)]


def test_accelerate_checkpoints_validate_deep_and_export(acc_runs: dict, tmp_path: Path) -> None:
    from shardkeeper.stages import export_and_record, validate_checkpoint  # what the CLI runs, in-process (faster)

    ckpt = acc_runs["other"] / "checkpoints" / "step-00000016"
    assert manifest(ckpt)["format"] == "dcp" and manifest(ckpt)["hf_model"] is not None
    report = validate_checkpoint(acc_runs["ref"] / "checkpoints" / "step-00000008", deep=True)
    assert report.valid, report.errors
    export_and_record(ckpt, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "config.json").exists()


# ------------------------------------------------------------------------------------ own DeepSpeed loop
@pytest.fixture(scope="module")
def ds_runs(launched: dict) -> dict:
    return outcome(launched, "ds")


def _ds_chain(base: Path) -> dict:
    ref = base / "ref"
    train(
        ref,
        16,
        2,
        "--script",
        str(EXAMPLES / "deepspeed_loop.py"),
        "--set",
        "backend=deepspeed",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "checkpoint.keep_last=100",
    )
    other = copy_run_until(ref, base / "other", 10)
    resumed = train(other, 16, 1)
    return {"ref": ref, "other": other, "resumed": resumed}


def test_deepspeed_loop_resumes_2_to_1_rank_through_the_universal_conversion(ds_runs: dict) -> None:
    other = ds_runs["other"]
    assert (other / "checkpoints" / "step-00000010" / "universal").is_dir()
    assert manifest(other / "checkpoints" / "step-00000010")["topology"]["procs_per_node"] == 2
    assert manifest(other / "checkpoints" / "step-00000016")["topology"]["procs_per_node"] == 1
    events = [json.loads(x) for x in (other / "lineage.jsonl").read_text().splitlines()]
    assert "reshard:step-00000010:universal" in {e["id"] for e in events}  # the conversion, in lineage
    resume = [e for e in events if e["kind"] == "resume"]
    assert resume and resume[-1]["data"]["from_world_size"] == 2 and resume[-1]["data"]["to_world_size"] == 1
    ref, got = metrics(ds_runs["ref"]), metrics(other)
    assert max_rel(ref, got, range(11, 17)) < 1e-6, [(s, ref[s]["loss"], got[s]["loss"]) for s in range(11, 17)]


def test_deepspeed_loop_checkpoint_validates_deep(ds_runs: dict) -> None:
    from shardkeeper.stages import validate_checkpoint

    report = validate_checkpoint(ds_runs["other"] / "checkpoints" / "step-00000016", deep=True)
    assert report.valid, report.errors


# ------------------------------------------------------------------------------------ a replicated (DDP) model
def _train_replicated(run_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import shardkeeper as sk

    seg = sk.Segment(run_dir=run_dir, until_step=3)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # what the Trainer and Accelerate do on CPU ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seg.track(model=model, optimizer=opt)
    for step in seg.steps():
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))[seg.rank :: seg.world_size]
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach())


def test_a_replicated_model_checkpoint_fingerprints_one_copy(tmp_path: Path) -> None:
    """The Trainer and Accelerate replicate a model over CPU ranks (DDP): DCP saves one copy, and the manifest's
    fingerprint must count one copy too, or validate --deep (and a resume on another world size) refuses it."""
    from shardkeeper.stages import validate_checkpoint
    from tests.harness import new_run, spawn, tiny_spec

    run = new_run(tmp_path / "run", tiny_spec())
    spawn(_train_replicated, 2, str(run))
    report = validate_checkpoint(run / "checkpoints" / "step-00000003", deep=True)
    assert report.valid, report.errors
