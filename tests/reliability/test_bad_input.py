"""Every bad input is one clear line, a non-zero exit, no traceback, and nothing written.

Table-driven: each CLI case runs ``shardkeeper.cli.main(argv)`` in-process against a fresh workspace
(config files, token files, a manifest-only checkpoint, an export folder written by the case's setup)
and checks the exit code, that stderr is exactly one ``error:`` line naming the field or file, and
that the workspace tree (paths, sizes, mtimes) is unchanged: a refused ``train`` creates no run
directory and no run.yaml. Flow requests go through the flows' own validation entry (no server).
One case launches torchrun: a failure that genuinely happens on the ranks reaches the user as one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from shardkeeper.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
TINY_TEXT = Path(TINY).read_text()
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


# ----------------------------------------------------------------------------------------- workspace
def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime: what 'nothing written' is checked against."""
    out = {".": (root.stat().st_mtime_ns, 0)}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size if p.is_file() else 0)
    return out


def tiny_with(tmp: Path, name: str, old: str, new: str) -> str:
    assert old in TINY_TEXT, old
    path = tmp / name
    path.write_text(TINY_TEXT.replace(old, new))
    return str(path)


def tokens_config(tmp: Path, name: str, token_path: Path, dtype: str = "uint16") -> str:
    return tiny_with(tmp, name, "  source: synthetic\n", f"  source: tokens\n  path: {token_path}\n  dtype: {dtype}\n")


def fake_checkpoint(tmp: Path) -> Path:
    """A manifest-only DCP checkpoint of the tiny run (global batch 12): enough for reshard/convert refusals."""
    from schemas import CheckpointManifest, ClusterTopology, DtypePolicy, Fingerprint
    from shardkeeper.config import load_run_spec

    ck = tmp / "run" / "checkpoints" / "step-00000005"
    ck.mkdir(parents=True)
    m = CheckpointManifest(
        format="dcp",
        run_name="tiny",
        step=5,
        tokens=0,
        samples=60,
        segment=0,
        reason="end",
        created_at="2026-01-01T00:00:00Z",
        files=[],
        tensors=[],
        model_signature="0" * 64,
        topology=ClusterTopology(procs_per_node=2),
        dtype_policy=DtypePolicy(compute="float32", reduce="float32"),
        code_version="test",
        fingerprint=Fingerprint(method="l2-per-tensor-f64", model={}, optim={}, optim_step=5.0),
        run_spec=load_run_spec(TINY),
    )
    (ck / "manifest.json").write_text(m.model_dump_json())
    (tmp / "run" / "run.yaml").write_text(TINY_TEXT)
    return ck


def export_folder(tmp: Path) -> Path:
    out = tmp / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    return out


# -------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Path], list[str]]
    names: Callable[[Path], str]  # what the line must mention (the field or the file)
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None


def C(id: str, argv: Callable[[Path], list[str]], names: str | Callable[[Path], str], code: int = 2, **kw) -> Case:  # noqa: A002
    return Case(id, argv, names if callable(names) else (lambda _t, n=names: n), code, **kw)


def train(*extra: str, config: str | Callable[[Path], str] = TINY) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        cfg = config(tmp) if callable(config) else config
        return ["train", "--config", cfg, "--run-dir", str(tmp / "new-run"), *extra]

    return build


def tokens_bad(kind: str) -> Callable[[Path], str]:
    """A tiny config reading a real token file that is wrong in one way."""

    def make(tmp: Path) -> str:
        good = (np.arange(20000) % 250).astype(np.uint16)
        p, dtype = tmp / "tokens.bin", "uint16"
        if kind == "missing":
            p = tmp / "nope.bin"
        elif kind == "directory":
            p = tmp / "tokdir.bin"
            p.mkdir()
        elif kind == "odd":
            p.write_bytes(good.tobytes() + b"\x01")
        elif kind == "vocab":
            bad = good.copy()
            bad[12345] = 300
            bad.tofile(p)
        elif kind == "few":
            good[:100].tofile(p)
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "uint32_size":
            p.write_bytes(good.tobytes()[:-2])
            dtype = "uint32"
        elif kind in ("npy_float", "npy_2d", "npy_negative", "npy_garbage"):
            p = tmp / "tokens.npy"
            if kind == "npy_float":
                np.save(p, good.astype(np.float32))
            elif kind == "npy_2d":
                np.save(p, good.astype(np.int32).reshape(100, 200))
            elif kind == "npy_negative":
                arr = good.astype(np.int32)
                arr[7] = -1
                np.save(p, arr)
            else:
                p.write_bytes(b"not a numpy file at all" * 10)
        return tokens_config(tmp, f"cfg-{kind}.yaml", p, dtype)

    return make


def yaml_file(name: str, text: str | bytes) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        p = tmp / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
        return str(p)

    return make


def tiny_edit(name: str, old: str, new: str) -> Callable[[Path], str]:
    return lambda tmp: tiny_with(tmp, name, old, new)


def ck(*extra: str, cmd: str = "reshard") -> Callable[[Path], list[str]]:
    """The command on a manifest-only checkpoint; OUT stands for a folder in the workspace."""
    return lambda tmp: [cmd, str(fake_checkpoint(tmp)), *(str(tmp / "out") if a == "OUT" else a for a in extra)]


def touch(tmp: Path, name: str) -> str:
    (tmp / name).write_text("x")
    return str(tmp / name)


def fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "fifo.yaml")  # reading it would block forever
    return str(tmp / "fifo.yaml")


CLI_CASES: list[Case] = [
    # --- found by an attack on the first version of this table
    C("train-config-fifo", train(config=fifo), "not a regular file"),
    C("train-run-dir-empty", lambda t: ["train", "--config", TINY, "--run-dir", ""], "--run-dir ''"),
    C(
        "train-run-dir-inside-checkpoint",
        lambda t: ["train", "--config", TINY, "--run-dir", str(fake_checkpoint(t) / "run")],
        "lies inside the checkpoint",
    ),
    C("train-lr-inf", train("--set", "optim.lr=.inf"), "optim.lr"),
    C("train-seed-too-large", train("--set", "seed=99999999999999999999999"), "seed"),
    # --- typer usage errors (all commands)
    C("train-nproc-abc", train("--nproc", "abc"), "--nproc"),
    C("train-unknown-option", train("--bogus"), "--bogus"),
    C("train-missing-config", lambda t: ["train", "--run-dir", str(t / "r")], "--config"),
    C("train-missing-run-dir", lambda t: ["train", "--config", TINY], "--run-dir"),
    C("train-until-step-abc", train("--until-step", "ten"), "--until-step"),
    C("train-timeout-abc", train("--timeout", "soon"), "--timeout"),
    C("unknown-command", lambda t: ["trian", "--config", TINY], "trian"),
    C("unknown-top-option", lambda t: ["--colour", "train"], "--colour"),
    C("validate-no-argument", lambda t: ["validate"], "'ckpt_dir'"),
    C("validate-extra-argument", lambda t: ["validate", "a", "b"], "b"),
    C("reshard-world-size-abc", lambda t: ["reshard", str(t), "--world-size", "abc"], "--world-size"),
    C("reshard-missing-world-size", lambda t: ["reshard", str(t)], "--world-size"),
    C("convert-missing-to", lambda t: ["convert", str(t), str(t / "out")], "--to"),
    C(
        "convert-zero-stage-abc",
        lambda t: ["convert", str(t), str(t / "o"), "--to", "deepspeed", "--zero-stage", "x"],
        "--zero-stage",
    ),
    C("export-missing-out-dir", lambda t: ["export", str(t)], "'out_dir'"),
    C("export-overwrite-takes-no-value", lambda t: ["export", str(t), str(t / "o"), "--overwrite=yes"], "--overwrite"),
    C("publish-no-argument", lambda t: ["publish"], "'export_dir'"),
    C("lineage-no-argument", lambda t: ["lineage"], "'run_dir'"),
    C("lineage-unknown-option", lambda t: ["lineage", str(t), "--yaml"], "--yaml"),
    # --- train: values the stage refuses before anything is written
    C("train-until-step-zero", train("--until-step", "0"), "--until-step 0"),
    C("train-timeout-negative", train("--timeout", "-5"), "--timeout -5"),
    C("train-timeout-zero", train("--timeout", "0"), "--timeout 0"),
    C("train-nproc-zero", train("--nproc", "0"), "--nproc 0"),
    C("train-nproc-negative", train("--nproc", "-2"), "--nproc -2"),
    C("train-nproc-not-dividing", train("--nproc", "5"), "global_batch_size 12 is not divisible by 5"),
    C("train-nproc-too-many", train("--nproc", "1000"), "--nproc 1000"),
    C("train-device-unknown", train("--device", "gpu"), "--device 'gpu'"),
    C(
        "train-device-cuda-without-gpu",
        train("--device", "cuda"),
        "--device cuda",
        skip="a GPU is here" if HAS_CUDA else None,
    ),
    C("train-run-dir-is-file", lambda t: ["train", "--config", TINY, "--run-dir", touch(t, "a-file")], "a-file"),
    C(
        "train-run-dir-under-file",
        lambda t: ["train", "--config", TINY, "--run-dir", touch(t, "f") + "/run"],
        "is a file",
    ),
    # --- config files
    C("config-is-directory", train(config=lambda t: str(t)), "is a directory"),
    C("config-missing", train(config=lambda t: str(t / "nope.yaml")), "nope.yaml"),
    C("config-bad-yaml", train(config=yaml_file("bad.yaml", "model: [unclosed\n")), "bad.yaml"),
    C("config-not-a-mapping", train(config=yaml_file("list.yaml", "- a\n- b\n")), "list.yaml"),
    C("config-not-text", train(config=yaml_file("bin.yaml", b"\xff\xfe\x00\x81binary")), "bin.yaml"),
    C("config-unknown-top-key", train(config=yaml_file("k.yaml", "globl_batch_size: 4\n")), "globl_batch_size"),
    C(
        "config-model-key-typo",
        train(config=tiny_edit("typo.yaml", "hidden_size: 64", "hiden_size: 64")),
        "model.config.hiden_size",
    ),
    C(
        "config-seq-len-over-positions",
        train(config=tiny_edit("seq.yaml", "seq_len: 32", "seq_len: 512")),
        "data.seq_len 512",
    ),
    C(
        "config-model-type-unknown",
        train(config=tiny_edit("mt.yaml", "model_type: llama", "model_type: lama")),
        "model.model_type 'lama'",
    ),
    C(
        "config-model-type-not-causal",
        train(config=yaml_file("vit.yaml", "model:\n  model_type: vit\n")),
        "model.model_type 'vit'",
    ),
    C(
        "config-heads-not-dividing",
        train(config=tiny_edit("h.yaml", "num_attention_heads: 4", "num_attention_heads: 5")),
        "model.config",
    ),
    C("config-vocab-zero", train(config=tiny_edit("v.yaml", "vocab_size: 256", "vocab_size: 0")), "vocab_size"),
    C(
        "config-global-batch-zero",
        train(config=tiny_edit("gb.yaml", "global_batch_size: 12", "global_batch_size: 0")),
        "global_batch_size",
    ),
    C(
        "config-micro-batch-not-dividing",
        train(config=yaml_file("mb.yaml", TINY_TEXT + "micro_batch_size: 5\n")),
        "micro_batch_size 5",
    ),
    C("config-backend-unknown", train(config=tiny_edit("be.yaml", "backend: fsdp2", "backend: megatron")), "backend"),
    C(
        "config-tokens-without-path",
        train(config=tiny_edit("tp.yaml", "source: synthetic", "source: tokens")),
        "data.path",
    ),
    C(
        "config-zero-stage-5",
        train(config=yaml_file("z.yaml", TINY_TEXT + "deepspeed:\n  zero_stage: 5\n")),
        "deepspeed.zero_stage",
    ),
    C(
        "config-synthetic-too-few-samples",
        train(
            config=tiny_edit(
                "few.yaml", "seq_len: 32\n  synthetic_tokens: 65536", "seq_len: 100\n  synthetic_tokens: 1100"
            )
        ),
        "data.synthetic_tokens 1100",
    ),
    C("config-empty-memory-refusal", train(config=yaml_file("empty.yaml", "{}\n")), "6.74B parameters"),
    # --- --set overrides
    C("set-no-equals", train("--set", "optim.lr"), "optim.lr"),
    C("set-empty-key", train("--set", "=3"), "--set '=3'"),
    C("set-empty-segment", train("--set", "optim..lr=1"), "optim..lr"),
    C("set-unknown-key", train("--set", "optim.lrr=1"), "optim.lrr"),
    C("set-bad-value", train("--set", "optim.lr=fast"), "optim.lr"),
    C("set-through-a-value", train("--set", "name.x=1"), "name"),
    C("set-bad-yaml-value", train("--set", "name=[unclosed"), "name=[unclosed"),
    C("set-model-key-typo", train("--set", "model.config.hiden_size=64"), "model.config.hiden_size"),
    C("set-seq-len-over-positions", train("--set", "data.seq_len=4096"), "data.seq_len 4096"),
    C("set-keep-last-zero", train("--set", "checkpoint.keep_last=0"), "checkpoint.keep_last"),
    C("set-min-lr-ratio-two", train("--set", "schedule.min_lr_ratio=2"), "schedule.min_lr_ratio"),
    C("set-betas-out-of-range", train("--set", "optim.betas=[0.9,1.5]"), "optim.betas"),
    C("set-grad-clip-negative", train("--set", "optim.grad_clip=-1"), "optim.grad_clip"),
    C("set-blank-token-path", train("--set", "data.source=tokens", "--set", "data.path=' '"), "data.path"),
    # --- token files (real files)
    C("tokens-missing", train(config=tokens_bad("missing")), lambda t: str(t / "nope.bin")),
    C("tokens-path-is-directory", train(config=tokens_bad("directory")), lambda t: str(t / "tokdir.bin")),
    C("tokens-odd-length-uint16", train(config=tokens_bad("odd")), lambda t: str(t / "tokens.bin")),
    C("tokens-size-not-uint32", train(config=tokens_bad("uint32_size")), lambda t: str(t / "tokens.bin")),
    C(
        "tokens-id-over-vocab",
        train(config=tokens_bad("vocab")),
        lambda t: f"{t / 'tokens.bin'}: token id 300 at position 12345",
    ),
    C("tokens-too-few", train(config=tokens_bad("few")), lambda t: f"{t / 'tokens.bin'}: 100 tokens"),
    C("tokens-empty", train(config=tokens_bad("empty")), lambda t: str(t / "tokens.bin")),
    C("tokens-npy-float", train(config=tokens_bad("npy_float")), lambda t: f"{t / 'tokens.npy'}: holds float32"),
    C("tokens-npy-2d", train(config=tokens_bad("npy_2d")), lambda t: str(t / "tokens.npy")),
    C("tokens-npy-negative-id", train(config=tokens_bad("npy_negative")), lambda t: f"{t / 'tokens.npy'}: token id -1"),
    C("tokens-npy-garbage", train(config=tokens_bad("npy_garbage")), lambda t: str(t / "tokens.npy")),
    # --- environment
    C("env-device-unknown", train(), "SHARDKEEPER_DEVICE='tpu'", env={"SHARDKEEPER_DEVICE": "tpu"}),
    C(
        "env-device-cuda-without-gpu",
        train(),
        "SHARDKEEPER_DEVICE=cuda" if not HAS_CUDA else "",
        env={"SHARDKEEPER_DEVICE": "cuda"},
        skip="a GPU is here" if HAS_CUDA else None,
    ),
    C("env-omp-threads-abc", train(), "OMP_NUM_THREADS='abc'", env={"OMP_NUM_THREADS": "abc"}),
    C("env-omp-threads-zero", train(), "OMP_NUM_THREADS='0'", env={"OMP_NUM_THREADS": "0"}),
    # --- the other commands
    C("validate-missing-dir", lambda t: ["validate", str(t / "step-00000001")], "step-00000001", code=4),
    C("validate-a-file", lambda t: ["validate", touch(t, "step-00000002")], "step-00000002", code=4),
    C("reshard-world-size-zero", ck("--world-size", "0"), "--world-size 0"),
    C("reshard-dcp-world-size-not-dividing", ck("--world-size", "5"), "global_batch_size 12 is not divisible by 5"),
    C(
        "reshard-missing-checkpoint",
        lambda t: ["reshard", str(t / "step-00000009"), "--world-size", "2"],
        "step-00000009",
        code=4,
    ),
    C("convert-zero-stage-5", ck("OUT", "--to", "deepspeed", "--zero-stage", "5", cmd="convert"), "--zero-stage 5"),
    C("convert-to-unknown", ck("OUT", "--to", "megatron", cmd="convert"), "--to 'megatron'"),
    C(
        "convert-already-that-format",
        lambda t: ["convert", str(fake_checkpoint(t)), str(t / "o"), "--to", "dcp"],
        "already a dcp checkpoint",
    ),
    C("export-bad-dtype", ck("OUT", "--dtype", "int8", cmd="export"), "dtype 'int8'"),
    C("export-bad-max-shard-size", ck("OUT", "--max-shard-size", "huge", cmd="export"), "max_shard_size 'huge'"),
    C("export-out-dir-exists", lambda t: ["export", str(fake_checkpoint(t)), str(t / "run")], "already exists"),
    C("convert-zero-stage-0", ck("OUT", "--to", "deepspeed", "--zero-stage", "0", cmd="convert"), "--zero-stage 0"),
    C(
        "export-missing-checkpoint",
        lambda t: ["export", str(t / "step-00000003"), str(t / "out")],
        "step-00000003",
        code=4,
    ),
    C("publish-no-target", lambda t: ["publish", str(export_folder(t))], "--repo-id"),
    C(
        "publish-two-targets",
        lambda t: ["publish", str(export_folder(t)), "--repo-id", "a/b", "--target", "file:///x"],
        "--target",
    ),
    C("publish-missing-folder", lambda t: ["publish", str(t / "gone"), "--repo-id", "a/b"], lambda t: str(t / "gone")),
    C(
        "publish-folder-is-file",
        lambda t: ["publish", touch(t, "exp"), "--target", "file:///x"],
        lambda t: str(t / "exp"),
    ),
    C("lineage-not-a-run", lambda t: ["lineage", str(t)], "not a run directory"),
    C("lineage-a-file", lambda t: ["lineage", touch(t, "lin")], lambda t: str(t / "lin")),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_writes_nothing(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if case.skip:
        pytest.skip(case.skip)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.chdir(ws)  # a relative or empty path that slipped through would land in ws, and be seen
    argv = case.argv(ws)
    capsys.readouterr()
    before = snapshot(ws)
    specs_before = set(ws.rglob("run.yaml"))
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == case.code, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert case.names(ws) in lines[0], lines[0]
    assert snapshot(ws) == before, "the refused command wrote into the workspace"
    if argv[0] == "train":  # a refused train creates neither the run directory nor run.yaml
        assert not (ws / "new-run").exists() and set(ws.rglob("run.yaml")) == specs_before


# ------------------------------------------------------------------------------------- flow requests
@dataclass(frozen=True)
class ReqCase:
    id: str
    model: str  # "train" | "resume"
    raw: Callable[[Path], dict]
    names: str
    parse_only: bool = False  # refused by the request model itself


def treq(**kw) -> Callable[[Path], dict]:
    def build(tmp: Path) -> dict:
        base = {"config": TINY, "run_dir": str(tmp / "run"), "segments": [{"nproc": 2, "until_step": 4}]}
        return {**base, **{k: (v(tmp) if callable(v) else v) for k, v in kw.items()}}

    return build


REQUEST_CASES: list[ReqCase] = [
    ReqCase("segments-nproc-zero", "train", treq(segments=[{"nproc": 0, "until_step": 4}]), "segments.0.nproc", True),
    ReqCase("segments-empty", "train", treq(segments=[]), "segments", True),
    ReqCase(
        "segments-not-increasing",
        "train",
        treq(segments=[{"nproc": 2, "until_step": 8}, {"nproc": 3, "until_step": 2}]),
        "strictly increasing",
        True,
    ),
    ReqCase("unknown-field", "train", treq(segmentz=[]), "segmentz", True),
    ReqCase("config-and-spec", "train", treq(spec={}), "exactly one of config", True),
    ReqCase("blank-run-dir", "train", treq(run_dir="  "), "run_dir", True),
    ReqCase("bad-override", "train", treq(overrides=["optim.lr"]), "overrides", True),
    ReqCase("bad-max-shard-size", "train", treq(max_shard_size="big"), "max_shard_size", True),
    ReqCase("bad-export-dtype", "train", treq(export_dtype="int8"), "export_dtype", True),
    ReqCase("config-relative-missing", "train", treq(config="configs/nope.yaml"), "relative to the parameter base_dir"),
    ReqCase(
        "config-absolute-missing", "train", treq(config=lambda t: str(t / "nope.yaml")), "nope.yaml: does not exist"
    ),
    ReqCase("config-is-directory", "train", treq(config=lambda t: str(t)), "is not a folder"),
    ReqCase("override-unknown-key", "train", treq(overrides=["optim.lrr=1"]), "optim.lrr"),
    ReqCase(
        "segment-nproc-not-dividing",
        "train",
        treq(segments=[{"nproc": 2, "until_step": 4}, {"nproc": 5, "until_step": 8}]),
        "segments[1].nproc",
    ),
    ReqCase("run-dir-is-file", "train", treq(run_dir=lambda t: touch(t, "rd")), "rd: run directory is a file"),
    ReqCase(
        "inline-spec-typo",
        "train",
        treq(config=None, spec={"model": {"model_type": "llama", "config": {"hiden_size": 8}}}),
        "model.config.hiden_size",
    ),
    ReqCase("inline-spec-empty-memory", "train", treq(config=None, spec={}), "6.74B parameters"),
    ReqCase(
        "override-missing-token-file",
        "train",
        treq(overrides=lambda t: ["data.source=tokens", f"data.path={t / 'none.bin'}"]),
        "none.bin",
    ),
    ReqCase("export-dir-is-file", "train", treq(export_dir=lambda t: touch(t, "ex")), "export_dir"),
    ReqCase("resume-nothing-to-scan", "resume", lambda t: {"nproc": 2}, "give roots", True),
    ReqCase("resume-nproc-zero", "resume", lambda t: {"roots": [str(t)], "nproc": 0}, "nproc", True),
    ReqCase("resume-root-missing", "resume", lambda t: {"roots": [str(t / "runs")], "nproc": 2}, "roots[0]"),
    ReqCase(
        "resume-root-relative-missing",
        "resume",
        lambda t: {"roots": ["no/such/runs"], "nproc": 2},
        "relative to the parameter base_dir",
    ),
    ReqCase("resume-root-is-file", "resume", lambda t: {"roots": [touch(t, "rootfile")], "nproc": 2}, "is a file"),
    ReqCase("resume-run-dir-missing", "resume", lambda t: {"run_dirs": [str(t / "gone")], "nproc": 2}, "run_dirs[0]"),
]


@pytest.mark.parametrize("case", REQUEST_CASES, ids=[c.id for c in REQUEST_CASES])
def test_flow_request_is_refused_in_one_line_before_anything_runs(case: ReqCase, tmp_path: Path) -> None:
    """The flows' validation entry (what train_and_export / resume run before any task), without a server."""
    from flows.common import RequestError, check_resume_request, check_train_request, parse_request
    from schemas.errors import ShardkeeperError
    from schemas.requests import ResumeRequest, TrainExportRequest

    ws = tmp_path / "ws"
    ws.mkdir()
    raw = case.raw(ws)
    before = snapshot(ws)
    model = TrainExportRequest if case.model == "train" else ResumeRequest
    with pytest.raises((RequestError, ShardkeeperError)) as info:
        request = parse_request(model, raw).resolved()  # as the flows do: relative paths against base_dir
        assert not case.parse_only, "the request model accepted it"
        (check_train_request if case.model == "train" else check_resume_request)(request)
    msg = str(info.value)
    assert isinstance(info.value, RequestError) == case.parse_only
    assert "\n" not in msg and msg.strip() and "Traceback" not in msg
    assert case.names in msg, msg
    assert snapshot(ws) == before


@pytest.mark.slow
def test_flow_state_carries_the_one_line(prefect_server: object, tmp_path: Path) -> None:
    """Through Prefect itself: the failed flow run's state message is that one line; nothing was written."""
    from prefect.states import State

    from flows.train_and_export import train_and_export

    run = tmp_path / "never"
    state: State = train_and_export(
        config=TINY,
        run_dir=str(run),
        overrides=["model.config.hiden_size=8"],
        segments=[{"nproc": 2, "until_step": 2}],
        return_state=True,
    )
    assert state.is_failed()
    assert "model.config.hiden_size" in (state.message or "") and "\n" not in (state.message or "")
    assert not run.exists()


# ------------------------------------------------------------------------------- single behaviours
def test_empty_config_is_refused_by_memory_estimate_quickly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The default Llama (6.7B) is refused with the numbers, in well under 2 s once imports are warm."""
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    argv = ["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]
    main(argv)  # warm: transformers' llama modules are imported once per process
    capsys.readouterr()
    t0 = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - t0
    line = capsys.readouterr().err.strip()
    assert code == 2 and seconds < 2.0, seconds
    assert "6.74B parameters" in line and "GiB per rank" in line and "GiB is available" in line
    assert "16 B (4 master + 4 grad + 8 AdamW)" in line and "SHARDKEEPER_MEMORY_CHECK=0" in line
    assert not (tmp_path / "run").exists()


def test_configs_in_use_pass_preflight(tmp_path: Path) -> None:
    """configs/tiny.yaml at 1-4 ranks and the benchmarks' 271M model at 2 ranks are not refused."""
    from schemas import RunSpec
    from shardkeeper.config import load_run_spec
    from shardkeeper.preflight import preflight
    from shardkeeper.stages import plan_topology

    spec = load_run_spec(TINY)
    for n in (1, 2, 3, 4):
        preflight(spec, plan_topology(spec, n, device="cpu"), tmp_path / "run")
    bench = RunSpec.model_validate(
        {
            "global_batch_size": 2,
            "data": {"seq_len": 32, "synthetic_tokens": 4096},
            "model": {
                "model_type": "llama",
                "config": {
                    "vocab_size": 32000,
                    "hidden_size": 1024,
                    "intermediate_size": 2816,
                    "num_hidden_layers": 16,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 16,
                    "max_position_embeddings": 128,
                },
            },
        }
    )
    preflight(bench, plan_topology(bench, 2, device="cpu"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_memory_estimate_formula() -> None:
    from shardkeeper.config import check_model_config, load_run_spec
    from shardkeeper.preflight import estimate_memory

    spec = load_run_spec(TINY)
    cfg = check_model_config(spec)
    est = estimate_memory(spec, 2, 1_000_000, cfg)
    assert est.state_bytes == 1_000_000 * 16 / 2 and est.build_bytes == 4_000_000
    ds1 = spec.model_copy(
        update={"backend": "deepspeed", "deepspeed": spec.deepspeed.model_copy(update={"zero_stage": 1})}
    )
    assert estimate_memory(ds1, 2, 1_000_000, cfg).state_bytes == 1_000_000 * (8 + 8 / 2)


def test_internal_error_is_one_line_and_traceback_only_with_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardkeeper.stages as stages

    def boom(*_a: object, **_k: object) -> None:
        raise TypeError("unexpected")

    monkeypatch.setattr(stages, "validate_checkpoint", boom)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["validate", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "this is a bug" in err and "Traceback" not in err
    log = tmp_path / "cache" / "shardkeeper" / "last-error.log"
    assert str(log) in err and "TypeError: unexpected" in log.read_text()
    assert main(["-v", "validate", str(tmp_path)]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_failing_rank_lines_prefers_the_ranks_one_line_cause() -> None:
    from launch import failing_rank_lines
    from schemas.seam import RANK_ERROR_PREFIX

    tail = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "RuntimeError: boom",
        f"{RANK_ERROR_PREFIX} rank 1: RuntimeError: boom; see the rank's traceback",
        f"{RANK_ERROR_PREFIX} rank 0: RuntimeError: connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]
    assert failing_rank_lines(tail) == (
        "rank 1: RuntimeError: boom; see the rank's traceback; rank 0 then failed: connection closed by peer"
    )
    # a rank killed by a signal prints nothing: torchrun's failure line is turned into one sentence naming it
    killed = [
        "E1127 16:58:28.185000 3911 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) "
        "local_rank: 1 (pid: 3943) of binary: /usr/bin/python"
    ]
    assert failing_rank_lines(killed).startswith("local rank 1 (pid 3943) was killed by SIGKILL and torchrun stopped")
    assert "was killed" not in failing_rank_lines([killed[0].replace("exitcode: -9", "exitcode: 1")])


def _cli(
    args: list[str], env: dict[str, str] | None = None, exe: list[str] | None = None
) -> subprocess.CompletedProcess:
    full = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [*(exe or [sys.executable, "-m", "shardkeeper"]), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=full,
        cwd=ROOT,
    )


def test_real_entry_points_route_through_main(tmp_path: Path) -> None:
    """`python -m shardkeeper` and the `shardkeeper` console script: usage errors are one line, exit 2."""
    res = _cli(["train", "--config", TINY, "--run-dir", str(tmp_path / "r"), "--nproc", "abc"])
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "--nproc" in res.stderr, res.stderr
    script = shutil.which("shardkeeper", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the console script is not installed in this environment")
    res = _cli(["reshard", str(tmp_path), "--world-size", "0", "--bogus"], exe=[script])
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and "--bogus" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------- one real launch
@pytest.mark.slow
def test_failure_on_the_ranks_reaches_the_user_as_one_line(tmp_path: Path) -> None:
    """4 heads over 3 key/value heads: transformers builds the model, every rank fails in the first
    forward. The user sees the ranks' progress log, then one error line with the cause; no traceback
    (the ranks' tracebacks are streamed only with -v)."""
    run = tmp_path / "run"
    args = [
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        "2",
        "--set",
        "model.config.num_key_value_heads=3",
    ]
    res = _cli(args)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert errors == [lines[-1]], lines
    assert "segment 0 failed" in lines[-1] and "RuntimeError: The size of tensor a (4) must match" in lines[-1]
    assert all("[rank" in ln for ln in lines[:-1]), lines  # only the ranks' progress log before it
    end = [json.loads(x) for x in (run / "segments.jsonl").read_text().splitlines()][-1]
    assert end["status"] == "failed" and "RuntimeError" in end["failure"] and "\n" not in end["failure"]


DEPLOY_CASES = [
    (["--config", "nope.yaml", "--run-dir", "r", "--segments", "2:10"], "--config"),
    (["--config", TINY, "--run-dir", "r", "--segments", "5:10"], "not divisible by 5 ranks"),
    (["--config", TINY, "--run-dir", "r", "--segments", "2:10,2:5"], "strictly increasing"),
    (["--config", TINY, "--run-dir", "r", "--segments", "2:10", "--max-shard-size", "big"], "max_shard_size"),
    (["--config", TINY, "--run-dir", "r", "--segments", "2:10", "--set", "optim.lrr=1"], "optim.lrr"),
]


@pytest.mark.parametrize("argv,names", DEPLOY_CASES, ids=[n for _, n in DEPLOY_CASES])
def test_deploy_refuses_in_one_line_before_registering(
    argv: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m infra.deploy` checks the config and arguments before it talks to any server."""
    from infra.deploy import main as deploy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing there: it must not get that far
    assert deploy(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err and names in err, err
    assert "no Prefect server" not in err and not (tmp_path / "r").exists()


def test_deploy_refuses_an_override_that_would_not_reach_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deploy-time --set reaches the run or is refused at deploy time, in one line naming the key: a change an
    existing run cannot take (its run.yaml would keep its global batch and the first segment fail), a key a script
    run never reads (it would be recorded and change nothing). Nothing is written, no server is asked."""
    from infra.deploy import main as deploy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing there: it must not get that far
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.yaml").write_text(TINY_TEXT)
    before = snapshot(tmp_path)
    script = str(ROOT / "examples" / "fsdp2_loop.py")
    for argv, names in (
        (
            ["--config", TINY, "--run-dir", "r", "--segments", "2:10", "--set", "global_batch_size=6"],
            "the run was started with a different global_batch_size (12 there, 6 now)",
        ),
        (
            ["--script", script, "--run-dir", "new", "--segments", "2:10,3:20", "--set", "global_batch_size=12"],
            "--set global_batch_size: a script run (fsdp2_loop.py) never reads it",
        ),
    ):
        capsys.readouterr()
        assert deploy(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and names in err, err
    assert snapshot(tmp_path) == before
