"""The performance section (activation checkpointing, torch.compile per block, AdamW implementation): same
losses as without it, a resume may switch it on or off and stays exact, parameter names, checkpoint keys and
export names unchanged, bad combinations refused in one line before any rank starts.

torch.compile with inductor on CPU compiles C++ for minutes on 2 cores: here compile runs with the
``aot_eager`` backend (dynamo tracing + AOTAutograd around the checkpointed block, no code generation);
inductor + fused AdamW + checkpointing are in tests/test_gpu.py.
"""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from ckpt.commit.layout import RunDir
from ckpt.commit.manifest import read_manifest
from schemas import ClusterTopology
from schemas.errors import ConfigError
from schemas.seam import SegmentReport
from shardkeeper.stages import plan_topology, prepare_run_dir, train_segment
from tests.harness import assert_bitwise, copy_run_until, metrics, new_run, spawn, tiny_spec
from trainer.segment import run_segment

END = 8
CUT = 5
AC = {"performance.activation_checkpointing": "true"}


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def ac_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 with activation checkpointing, 2 ranks, steps 0 -> 8 through the stage (preflight, lineage)."""
    run = tmp_path_factory.mktemp("ac") / "run"
    spec = tiny_spec(**AC)
    result = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), END)
    assert result.status == "completed", result.failure
    return run


# ------------------------------------------------------------------------------------------ same losses
def test_activation_checkpointing_gives_the_same_losses_and_checkpoint(
    ac_run: Path, tiny_run: Path, tmp_path: Path
) -> None:
    assert_bitwise(metrics(tiny_run), metrics(ac_run), range(1, CUT + 1))  # tiny_run: the same run without it
    a, b = read_manifest(ckpt(tiny_run, CUT)), read_manifest(ckpt(ac_run, CUT))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert not any("_checkpoint_wrapped_module" in t.name or "_orig_mod" in t.name for t in b.tensors)
    assert a.model_signature == b.model_signature and a.hf_model == b.hf_model
    assert a.fingerprint == b.fingerprint  # the same state, bit for bit
    assert b.run_spec.performance.activation_checkpointing and not a.run_spec.performance.activation_checkpointing

    from safetensors.torch import load_file

    from ckpt.export import export_checkpoint

    export_checkpoint(ckpt(tiny_run, CUT), tmp_path / "off")
    export_checkpoint(ckpt(ac_run, CUT), tmp_path / "on")
    off, on = load_file(tmp_path / "off" / "model.safetensors"), load_file(tmp_path / "on" / "model.safetensors")
    assert sorted(off) == sorted(on) and all(torch.equal(off[k], on[k]) for k in off)


def test_execution_options_are_recorded(ac_run: Path) -> None:
    report = SegmentReport.read(ac_run, 0)
    assert report is not None and report.execution == {
        "activation_checkpointing": 2,
        "compiled_blocks": 0,
        "compile": "off",
        "adamw_implementation": "foreach",
    }
    seg = [json.loads(x) for x in (ac_run / "lineage.jsonl").read_text().splitlines() if '"segment"' in x]
    assert seg[-1]["data"]["execution"]["activation_checkpointing"] == 2


# ------------------------------------------------------------------------------------------ resume
def test_resume_switching_the_options_off_is_exact(ac_run: Path, tmp_path: Path) -> None:
    """Saved with checkpointing + foreach AdamW, resumed without checkpointing + for-loop AdamW."""
    run = copy_run_until(ac_run, tmp_path / "run", CUT)
    prepare_run_dir(RunDir.at(run), tiny_spec(**{"performance.adamw_implementation": "for-loop"}))
    assert spawn(run_segment, 2, str(run), END, 1) == [0, 0]
    assert_bitwise(metrics(ac_run), metrics(run), range(CUT + 1, END + 1))
    assert SegmentReport.read(run, 1).execution["adamw_implementation"] == "for-loop"  # type: ignore[union-attr]


def test_compiled_checkpointed_blocks_give_the_same_losses(tiny_run: Path, tmp_path: Path) -> None:
    run = new_run(
        tmp_path / "run", tiny_spec(**AC, **{"performance.compile": "true", "performance.compile_backend": "aot_eager"})
    )
    assert spawn(run_segment, 2, str(run), 3, 0) == [0, 0]
    assert_bitwise(metrics(tiny_run), metrics(run), range(1, 4))
    assert SegmentReport.read(run, 0).execution["compiled_blocks"] == 2  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.skipif(find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_with_checkpointing_and_for_loop_adamw_gives_the_same_losses(
    ds_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    )
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    spec = tiny_spec(
        **AC,
        **{
            "backend": "deepspeed",
            "deepspeed.zero_stage": 2,
            "checkpoint.interval": 2,
            "performance.adamw_implementation": "for-loop",
        },
    )
    run = new_run(tmp_path / "run", spec)
    assert spawn(run_segment, 2, str(run), 2, 0, timeout=900) == [0, 0]
    assert_bitwise(metrics(ds_run), metrics(run), range(1, 3))
    a, b = read_manifest(ckpt(ds_run, 2)), read_manifest(ckpt(run, 2))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors] and a.fingerprint == b.fingerprint


# ------------------------------------------------------------------------------------------ in process
def _stepped(impl: str, flat: bool) -> list[torch.Tensor]:
    from trainer.optim import build_optimizer

    spec = tiny_spec(**{"performance.adamw_implementation": impl})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    if flat:  # DeepSpeed ZeRO hands AdamW one flat fp32 partition per group
        model = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))]
        )
    opt = build_optimizer(model, spec)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("flat", [False, True])
def test_adamw_implementations_agree(flat: bool) -> None:
    ref = _stepped("foreach", flat)
    assert all(torch.equal(a, b) for a, b in zip(ref, _stepped("for-loop", flat)))
    for a, b in zip(ref, _stepped("fused", flat)):
        assert ((a - b).abs() / a.abs().clamp_min(1e-30)).max() <= 1e-6


def test_block_options_keep_every_name() -> None:
    from ckpt.commit.state import tied_weights
    from trainer.model import block_modules, build_model
    from trainer.perf import apply_block_options

    spec = tiny_spec(
        **AC,
        **{
            "performance.compile": "true",
            "performance.compile_backend": "eager",
            "model.config.tie_word_embeddings": "true",
        },
    )
    plain, wrapped = build_model(spec), build_model(spec)
    d = apply_block_options(block_modules(wrapped), spec.performance)
    assert (d["activation_checkpointing"], d["compiled_blocks"]) == (2, 2)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    assert tied_weights(plain) == tied_weights(wrapped) and tied_weights(wrapped)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():  # evaluation runs the block's own forward (nothing to recompute)
        assert torch.equal(plain(input_ids=x, use_cache=False).logits, wrapped(input_ids=x, use_cache=False).logits)


# ------------------------------------------------------------------------------------------ config
def test_performance_options_may_change_between_segments(tmp_path: Path) -> None:
    run = new_run(tmp_path / "run", tiny_spec())
    spec = tiny_spec(**AC, **{"performance.adamw_implementation": "fused"})
    assert prepare_run_dir(RunDir.at(run), spec) == spec
    assert "activation_checkpointing: true" in RunDir.at(run).spec_path.read_text()


def _topo(device: str = "cpu") -> ClusterTopology:
    return ClusterTopology(procs_per_node=2, device_type=device)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sets", "expect"),
    [
        (
            {"backend": "deepspeed", "deepspeed.zero_stage": 3, "performance.compile": "true"},
            "performance.compile with deepspeed.zero_stage 3",
        ),
        (
            {
                "performance.compile": "true",
                "performance.compile_backend": "aot_eager",
                "performance.compile_mode": "max-autotune",
            },
            "performance.compile_mode 'max-autotune' is an inductor option",
        ),
        (
            {"performance.compile": "true", "performance.compile_backend": "no_such_backend"},
            "performance.compile_backend 'no_such_backend': not a torch.compile backend",
        ),
    ],
)
def test_bad_combinations_are_one_line(sets: dict, expect: str) -> None:
    from shardkeeper.preflight import check_performance

    with pytest.raises(ConfigError) as e:
        check_performance(tiny_spec(**sets), _topo())
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_missing_compiler_and_kernels_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config
    import torch.utils._foreach_utils as fu

    from shardkeeper.preflight import check_performance

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "no-such-g++"))
    with pytest.raises(ConfigError, match=r"needs a C\+\+ compiler .*no-such-g\+\+.*install g\+\+"):
        check_performance(tiny_spec(**{"performance.compile": "true"}), _topo())
    monkeypatch.setattr(fu, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    with pytest.raises(ConfigError, match="no fused AdamW kernel for cpu parameters; use foreach or for-loop"):
        check_performance(tiny_spec(**{"performance.adamw_implementation": "fused"}), _topo())
    check_performance(tiny_spec(**{"performance.adamw_implementation": "for-loop"}), _topo())


def test_unknown_values_are_one_line(tmp_path: Path) -> None:
    from shardkeeper.config import load_run_spec

    cfg = tmp_path / "c.yaml"
    cfg.write_text("performance:\n  adamw_implementation: apex\n")
    with pytest.raises(
        ConfigError,
        match=r"c.yaml: field performance.adamw_implementation: .*'foreach', 'fused' "
        r"or 'for-loop'",
    ):
        load_run_spec(cfg)
    cfg.write_text("performance:\n  activation_checkpoint: true\n")
    with pytest.raises(ConfigError, match="unknown key performance.activation_checkpoint; .*activation_checkpointing"):
        load_run_spec(cfg)


def test_memory_estimate_counts_checkpointed_activations() -> None:
    from transformers import AutoConfig

    from shardkeeper.preflight import estimate_memory

    cfg = AutoConfig.for_model(
        "llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, vocab_size=128256
    )
    spec = tiny_spec(**{"data.seq_len": 2048, "global_batch_size": 32})
    off = estimate_memory(spec, 8, 1_000_000, cfg)
    on = estimate_memory(tiny_spec(**AC, **{"data.seq_len": 2048, "global_batch_size": 32}), 8, 1_000_000, cfg)
    tokens, logits = 4 * 2048, 4 * 2048 * 128256 * 8
    assert off.activation_bytes == 16 * tokens * (8 * 2048 + 4 * 8192) * 4 + logits
    assert on.activation_bytes == tokens * (16 * 2048 + 8 * 2048 + 4 * 8192) * 4 + logits
