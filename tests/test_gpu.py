"""CUDA + NCCL: the same resume guarantees on GPUs. Skipped without CUDA; run them on a GPU node."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.harness import copy_run_until, metrics, new_run, spawn, tiny_spec
from trainer.segment import run_segment

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")]


def _world() -> int:
    return min(2, torch.cuda.device_count())


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_cuda_same_world_size_resume_is_bitwise(tmp_path: Path, compute: str) -> None:
    world = _world()
    spec = tiny_spec(**{"precision.compute": compute})
    ref = new_run(tmp_path / "ref", spec)
    assert spawn(run_segment, world, str(ref), 15, 0, device="cuda") == [0] * world
    run = copy_run_until(ref, tmp_path / "run", 5)
    assert spawn(run_segment, world, str(run), 15, 1, device="cuda") == [0] * world
    a, b = metrics(ref), metrics(run)
    for s in range(6, 16):
        assert a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"], f"step {s}"


def test_cuda_async_save_commits(tmp_path: Path) -> None:
    world = _world()
    run = new_run(tmp_path / "run", tiny_spec(**{"checkpoint.async_save": "true"}))
    assert spawn(run_segment, world, str(run), 12, 0, device="cuda") == [0] * world
    from ckpt.validate.checks import validate

    assert validate(run / "checkpoints" / "step-00000010", deep=True).valid


def test_cuda_checkpointing_compile_and_fused_adamw_train_and_resume_exactly(tmp_path: Path) -> None:
    """The performance options together on one GPU (inductor writes Triton kernels): a resume is bitwise."""
    spec = tiny_spec(
        **{
            "performance.activation_checkpointing": "true",
            "performance.compile": "true",
            "performance.adamw_implementation": "fused",
        }
    )
    ref = new_run(tmp_path / "ref", spec)
    assert spawn(run_segment, 1, str(ref), 10, 0, device="cuda", timeout=900) == [0]
    run = copy_run_until(ref, tmp_path / "run", 5)
    assert spawn(run_segment, 1, str(run), 10, 1, device="cuda", timeout=900) == [0]
    a, b = metrics(ref), metrics(run)
    assert all(math.isfinite(a[s]["loss"]) for s in range(1, 11))
    for s in range(6, 11):
        assert a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"], f"step {s}"
    from schemas.seam import SegmentReport

    assert SegmentReport.read(run, 1).execution == {  # type: ignore[union-attr]
        "activation_checkpointing": 2,
        "compiled_blocks": 2,
        "compile": "inductor/default",
        "adamw_implementation": "fused",
    }


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_deepspeed_resume_is_bitwise_and_async_saves_commit(tmp_path: Path, stage: int) -> None:
    """DeepSpeed ZeRO on CUDA + NCCL: async saves (staged from GPU memory) commit valid checkpoints, and a resume
    from one continues bitwise."""
    world = _world()
    spec = tiny_spec(
        **{
            "backend": "deepspeed",
            "deepspeed.zero_stage": stage,
            "checkpoint.interval": 4,
            "checkpoint.async_save": "true",
        }
    )
    ref = new_run(tmp_path / "ref", spec)
    assert spawn(run_segment, world, str(ref), 8, 0, device="cuda", timeout=900) == [0] * world
    from ckpt.validate.checks import validate

    for step in (4, 8):
        assert validate(ref / "checkpoints" / f"step-{step:08d}", deep=True).valid, step
    run = copy_run_until(ref, tmp_path / "run", 4)
    assert spawn(run_segment, world, str(run), 8, 1, device="cuda", timeout=900) == [0] * world
    a, b = metrics(ref), metrics(run)
    for s in range(5, 9):
        assert a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"], f"step {s}"


def test_cuda_own_script_through_the_api_resumes_bitwise(tmp_path: Path) -> None:
    """A user's FSDP2 script (examples/fsdp2_loop.py) through shardkeeper train --script on CUDA + NCCL: stopped at 8
    and resumed, the losses of steps 9..16 equal an uninterrupted run's bit for bit."""
    import os
    import subprocess
    import sys

    from tests.harness import ROOT

    def train(run: Path, until: int) -> None:
        args = ["--run-dir", str(run), "--until-step", str(until), "--nproc", str(_world()), "--device", "cuda"]
        if not (run / "run.yaml").exists():
            args = ["--script", str(ROOT / "examples" / "fsdp2_loop.py"), *args, "--set", "checkpoint.interval=4"]
        r = subprocess.run(
            [sys.executable, "-m", "shardkeeper", "train", *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert r.returncode == 0, r.stderr[-3000:]

    train(tmp_path / "full", 16)
    train(tmp_path / "half", 8)
    train(tmp_path / "half", 16)
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "half")
    assert [resumed[s]["loss"] for s in range(9, 17)] == [full[s]["loss"] for s in range(9, 17)]
    assert resumed[16]["segment"] == 1
