"""``shardkeeper import``: checkpoints written by other tools become committed checkpoints of a run.

The sources are real and made once per module: a DeepSpeed ZeRO-2 checkpoint of a tiny LlamaForCausalLM written by
a plain ``engine.save_checkpoint`` on 2 CPU ranks (steps 2 and 3), the three DCP layouts (plain ``dcp.save``,
torchtitan's ``step-N/``, Accelerate's FSDP folders) from one FSDP2 launch on 2 ranks, and a Hugging Face
``Trainer`` checkpoint (when accelerate is installed). The DeepSpeed user skips the JIT build of DeepSpeed's CPU
shm op (~2 min of g++ on a fresh machine; it serves inference all-reduce only and changes no byte of a checkpoint),
as shardkeeper's own CPU ranks do (trainer.deepspeed.shm).

Imported checkpoints are continued by the user's own scripts (tests/scripts/llama_loop.py: FSDP2 on 3 ranks,
DeepSpeed on 2; a Hugging Face Trainer on DeepSpeed importing from inside its segment on 3), the losses compared
with the DeepSpeed source run's own steps 4-6.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from ckpt.commit.manifest import read_manifest
from ckpt.formats.dcp.reader import DCPTensorReader
from ckpt.validate.checks import validate
from shardkeeper.cli import main
from tests.harness import spawn

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
MODEL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
needs_deepspeed = pytest.mark.skipif(find_spec("deepspeed") is None, reason="deepspeed is not installed")


def tiny_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **MODEL), dtype=torch.float32)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, MODEL["vocab_size"], (2, 16), generator=g) for _ in range(n)]


# ------------------------------------------------------------------------------------------ sources (rank side)
def _write_zero(out: str, stage: int) -> None:
    """A plain DeepSpeed user: one AdamW group, ZeRO-``stage``, engine.save_checkpoint after steps 2 and 3, on to
    step 6 (every step's loss in ``losses.json``: the uninterrupted run a continuation is compared with)."""
    import torch.distributed as dist

    from trainer.deepspeed.shm import skip_shm_op

    skip_shm_op()  # before deepspeed is imported: its CPU comm backend would build the op in initialize
    import deepspeed

    dist.init_process_group("gloo")
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for step, x in enumerate(batches(6), start=1):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if step in (2, 3):
            engine.save_checkpoint(out)
    if dist.get_rank() == 0:
        model.config.save_pretrained(out)
        (Path(out) / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def _write_dcp_layouts(out: str) -> None:
    """An FSDP2 user saving the same state three ways (plain, torchtitan, Accelerate), plus a full reference."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in batches(3):
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    root = Path(out)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=root / "plain")
    _, flat = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save(
        {**msd, "optimizer": flat, "lr_scheduler": {"last_epoch": 3}, "train_state": {"step": torch.tensor(3)}},
        checkpoint_id=root / "titan" / "step-3",
    )
    dcp.save({"model": msd}, checkpoint_id=root / "accelerate" / "pytorch_model_fsdp_0")
    dcp.save({"optimizer": osd}, checkpoint_id=root / "accelerate" / "optimizer_0")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fmsd, fosd = get_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        torch.save({"model": fmsd, "optim": fosd["state"]}, root / "reference.pt")
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def _env():
    mp = pytest.MonkeyPatch()
    mp.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    )
    mp.setenv("DS_ACCELERATOR", "cpu")
    mp.setenv("SHARDKEEPER_DEVICE", "cpu")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def zero2_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    out = tmp_path_factory.mktemp("zero2") / "ds"
    spawn(_write_zero, 2, str(out), 2, timeout=900)
    assert (out / "latest").read_text().strip() == "global_step3"
    return out


@pytest.fixture(scope="module")
def dcp_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp")
    spawn(_write_dcp_layouts, 2, str(out), timeout=600)
    return out


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed (the Trainer needs it): pip install -e '.[dev]'")
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("hf") / "out"
    data = [{"input_ids": x[0], "labels": x[0]} for x in batches(6)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=3,
        save_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    Trainer(model=tiny_model(), args=args, train_dataset=data).train()
    return out


@pytest.fixture(scope="module")
def z2_imported(zero2_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("imported") / "run"
    assert main(["import", str(zero2_src), "--config", TINY, "--run-dir", str(run)]) == 0
    return run


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]


def error_line(capsys: pytest.CaptureFixture, argv: list[str], code: int) -> str:
    capsys.readouterr()
    assert main(argv) == code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, err
    return err[0]


def imported(reader: DCPTensorReader) -> dict[str, torch.Tensor]:
    return {k: reader.read(k) for k in reader.tensor_keys() if k.startswith(("model.", "optim.state."))}


# ------------------------------------------------------------------------------------------ DeepSpeed
@needs_deepspeed
def test_zero2_import_into_fsdp2_holds_what_ds_to_universal_extracts(
    zero2_src: Path, z2_imported: Path, tmp_path: Path
) -> None:
    """Weights, both AdamW moments and the step of every parameter equal DeepSpeed's own extraction
    (ds_to_universal --inject_missing_state) bit for bit; the checkpoint is committed, verified, in lineage."""
    universal = tmp_path / "universal"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(zero2_src / "global_step3"),
            "--output_folder",
            str(universal),
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    man = read_manifest(ckpt(z2_imported, 3))
    assert (man.format, man.reason, man.step, man.run_spec.backend, man.topology.world_size) == (
        "dcp",
        "converted",
        3,
        "fsdp2",
        1,
    )
    assert validate(ckpt(z2_imported, 3), deep=True).valid
    with DCPTensorReader(ckpt(z2_imported, 3)) as reader:
        got = imported(reader)
        steps = {k for k in reader.tensor_keys() if k.endswith(".step")}
        assert {float(reader.read(k)) for k in steps} == {3.0}
    params = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    assert len(params) == len(man.tensors) // 3 and params
    for name in params:
        for key, ours in (
            ("fp32", f"model.{name}"),
            ("exp_avg", f"optim.state.{name}.exp_avg"),
            ("exp_avg_sq", f"optim.state.{name}.exp_avg_sq"),
        ):
            ref = torch.load(universal / "zero" / name / f"{key}.pt", weights_only=True)["param"]
            assert torch.equal(got[ours], ref), f"{ours} differs from ds_to_universal's {key}"
        assert float(torch.load(universal / "zero" / name / "step.pt", weights_only=True)) == 3.0
    kinds = [(e["kind"], e["id"], e["parent"]) for e in events(z2_imported)]
    assert kinds == [
        ("imported", "import:step-00000003", None),
        ("checkpoint", "checkpoint:step-00000003", "import:step-00000003"),
    ]
    event = events(z2_imported)[0]
    assert event["data"]["layout"] == "deepspeed" and event["uri"] == (zero2_src / "global_step3").resolve().as_uri()
    assert (z2_imported / "run.yaml").is_file()


@needs_deepspeed
def test_imported_zero2_checkpoint_trains_on_at_three_ranks_and_exports(
    zero2_src: Path, z2_imported: Path, tmp_path: Path
) -> None:
    """Source at 2 ranks, resumed at 3 by `shardkeeper train` (the model signature matches what the trainer
    computes), loss finite, a checkpoint committed; reshard and export work on the imported checkpoint."""
    from safetensors.torch import load_file

    from ckpt.formats.deepspeed.zero import ZeroShards

    run = shutil.copytree(z2_imported, tmp_path / "run")
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(run),
            "--nproc",
            "3",
            "--until-step",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world_size"]) for r in rows] == [(4, 3), (5, 3)] and all(
        math.isfinite(r["loss"]) for r in rows
    )
    assert validate(ckpt(run, 5), deep=True).valid
    resume = [e for e in events(run) if e["kind"] == "resume"][-1]
    assert (resume["parent"], resume["data"]["from_world_size"], resume["data"]["to_world_size"]) == (
        "checkpoint:step-00000003",
        1,
        3,
    )
    assert main(["reshard", str(ckpt(run, 3)), "--world-size", "2"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(ckpt(run, 3)), str(out)]) == 0
    got = load_file(out / "model.safetensors")
    with ZeroShards(zero2_src / "global_step3") as shards:
        assert sorted(got) == sorted(s.name for s in shards.slots)
        assert all(torch.equal(got[s.name], shards.read(s, "fp32")) for s in shards.slots)


@needs_deepspeed
def test_zero2_import_into_the_deepspeed_backend_trains_on_one_rank(
    zero2_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The import's printed continuation keeps every --set (the backend among them) and the run dir, and runs as
    printed: the run trains on from the imported step to the end of its schedule."""
    import shlex

    run = tmp_path / "my run"  # a space: the printed command quotes it
    capsys.readouterr()
    assert (
        main(
            [
                "import",
                str(zero2_src),
                "--config",
                TINY,
                "--run-dir",
                str(run),
                "--set",
                "backend=deepspeed",
                "--step",
                "2",
                "--set",
                "schedule.total_steps=5",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.split("continue with: ", 1)[1].strip()
    argv = shlex.split(printed)
    assert argv[:4] == ["shardkeeper", "train", "--config", TINY] and argv[-2:] == ["--until-step", "5"]
    assert "--set backend=deepspeed --set schedule.total_steps=5" in printed
    assert argv[argv.index("--run-dir") + 1] == str(run)
    man = read_manifest(ckpt(run, 2))
    assert (man.format, man.run_spec.backend, man.step) == ("deepspeed", "deepspeed", 2)
    assert validate(ckpt(run, 2), deep=True).valid and validate(ckpt(run, 2) / "universal", deep=True).valid
    done = subprocess.run(
        [sys.executable, "-m", "shardkeeper", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4, 5] and all(math.isfinite(r["loss"]) for r in rows)
    assert read_manifest(ckpt(run, 5)).format == "deepspeed" and validate(ckpt(run, 5), deep=True).valid


LOOP = ROOT / "tests" / "scripts" / "llama_loop.py"  # a user's own loop over the same model, FSDP2 or DeepSpeed


def _loop(argv: list[str], run_dir: str, until: int) -> dict:
    """tests/scripts/llama_loop.py on this rank, in-process (tests.harness.spawn)."""
    import runpy

    return runpy.run_path(str(LOOP))["main"](argv, run_dir, until)


def _continues(ref: list[float], run: Path, world: int) -> None:
    """Steps 4-6 of ``run`` (continued from the imported step 3 on ``world`` ranks) are the uninterrupted source
    run's within float rounding: the same weights, moments, optimizer step and settings."""
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [4, 5, 6] and {r["world_size"] for r in rows.values()} == {world}
    worst = max(abs(rows[s]["loss"] - ref[s - 1]) / ref[s - 1] for s in (4, 5, 6))
    assert worst < 1e-6, [(s, ref[s - 1], rows[s]["loss"]) for s in (4, 5, 6)]


@needs_deepspeed
def test_own_fsdp2_script_continues_an_imported_zero2_checkpoint_on_3_ranks(
    zero2_src: Path, z2_imported: Path, tmp_path: Path
) -> None:
    """``shardkeeper import`` with a config, then ``shardkeeper train --script`` with the user's own FSDP2 loop over
    the same model, on 3 ranks (the source: 2): the checkpoint's identity is its tensors, not the config (a script
    of another model is refused before the load: exit 2, segment 'refused', the run as it was). The loss
    continues the DeepSpeed run's within 1e-6 because the script trains with its own optimizer settings (one group,
    lr 1e-2), not the config's the import recorded (two groups, lr 3e-3); the tracked objects the import lacks start
    at its step, one line says so."""
    run = shutil.copytree(z2_imported, tmp_path / "run")
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200"}
    # another model first (a wider MLP): refused before the load, exit 2, the run as it was
    before = (sorted(p.name for p in (run / "checkpoints").rglob("*")), (run / "run.yaml").read_text())
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--script",
            str(LOOP),
            "--run-dir",
            str(run),
            "--nproc",
            "1",
            "--until-step",
            "6",
            "--",
            "--intermediate",
            "96",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "segment 0 refused before its first step" in refused.stderr
    assert (
        "holds another model than this run's: model.layers.0.mlp.gate_proj.weight is [128, 64] float32 in the "
        "checkpoint, [96, 64] float32 in this run's model"
    ) in refused.stderr
    assert not (run / "metrics.jsonl").exists()
    assert (sorted(p.name for p in (run / "checkpoints").rglob("*")), (run / "run.yaml").read_text()) == before
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--script",
            str(LOOP),
            "--run-dir",
            str(run),
            "--nproc",
            "3",
            "--until-step",
            "6",
            "--",
            "--scheduler",
            "--extra",
            "extra",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "step-00000003 was imported from another tool's checkpoint; tracked objects it holds no state of: "
        "'scheduler' fast-forwarded to step 3 (lr 0.01), 'extra' starts fresh"
    ) in done.stderr
    _continues(json.loads((zero2_src / "losses.json").read_text()), run, 3)
    imported, own = read_manifest(ckpt(run, 3)), read_manifest(ckpt(run, 6))
    assert own.run_spec.script is not None and own.model_signature == imported.model_signature
    assert (own.dtype_policy.compute, own.dtype_policy.reduce) == ("float32", "float32")


@needs_deepspeed
def test_own_deepspeed_script_continues_an_imported_zero2_checkpoint(zero2_src: Path, tmp_path: Path) -> None:
    """The same with backend deepspeed: the import writes DeepSpeed's universal layout, the user's own ZeRO-2 loop
    loads it on 2 ranks and continues the source run within 1e-6."""
    run = tmp_path / "run"
    assert main(["import", str(zero2_src), "--config", TINY, "--run-dir", str(run), "--set", "backend=deepspeed"]) == 0
    out = spawn(_loop, 2, ["--deepspeed"], str(run), 6, timeout=900)
    assert [(o["step"], o["groups"], o["lr"], o["weight_decay"]) for o in out] == [(6, 1, 1e-2, 0.1)] * 2
    _continues(json.loads((zero2_src / "losses.json").read_text()), run, 2)
    man = read_manifest(ckpt(run, 6))
    assert man.format == "deepspeed" and man.model_signature == read_manifest(ckpt(run, 3)).model_signature


def _hf_trainer_on_deepspeed(run_dir: str, src: str) -> int:
    """A Hugging Face Trainer script on DeepSpeed ZeRO-2 (the seed path's) that starts from ``src`` with
    ``trainer.train(resume_from_checkpoint=src)``, to step 5 of a 10-step linear schedule."""
    from trainer.deepspeed.shm import skip_shm_op

    skip_shm_op()
    from transformers import TrainingArguments

    import shardkeeper as sk
    from shardkeeper.integrations.transformers import Trainer

    seg = sk.Segment(run_dir=run_dir, until_step=5)
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    args = TrainingArguments(
        output_dir=str(Path(run_dir) / "scratch"),
        max_steps=10,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_strategy="no",
        deepspeed=ds,
    )
    rows = [{"input_ids": x[0], "labels": x[0]} for x in batches(24)]
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=rows, segment=seg)
    trainer.train(resume_from_checkpoint=src)
    return trainer.state.global_step


@needs_deepspeed
def test_hf_trainer_on_deepspeed_imports_a_zero2_checkpoint_from_inside_the_segment(
    zero2_src: Path, tmp_path: Path
) -> None:
    """The seed path without a config: a Trainer + DeepSpeed script on 3 ranks given another tool's ZeRO-2
    checkpoint of 2 ranks: rank 0 imports it into the new run (DeepSpeed's universal layout, described by the live
    engine's groups), every rank resumes it, the LR schedule and global_step continue at its step."""
    from tests.harness import new_run, tiny_spec

    run = new_run(tmp_path / "run", tiny_spec(backend="deepspeed"))
    assert spawn(_hf_trainer_on_deepspeed, 3, str(run), str(zero2_src), timeout=900) == [5, 5, 5]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the linear schedule of a 10-step run after steps 4 and 5 (the scheduler fast-forwarded to step 3)
    assert [(r["step"], r["lr"], r["world_size"]) for r in rows] == [(4, 0.006, 3), (5, 0.005, 3)]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert [(e["kind"], e["id"]) for e in events(run)][:2] == [
        ("imported", "import:step-00000003"),
        ("checkpoint", "checkpoint:step-00000003"),
    ]
    man = read_manifest(ckpt(run, 3))
    assert (man.format, man.reason, man.samples) == ("deepspeed", "converted", 18)  # 3 steps of 3 x 2 samples
    assert read_manifest(ckpt(run, 5)).model_signature == man.model_signature


@needs_deepspeed
def test_zero3_checkpoint_imports_the_weights_zero_to_fp32_gathers(tmp_path: Path) -> None:
    """ZeRO-3 partitions (each parameter split over the ranks, padded): the weights equal DeepSpeed's own
    zero_to_fp32, the moments pass the fingerprint check of validate --deep."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = tmp_path / "ds"
    spawn(_write_zero, 2, str(src), 3, timeout=900)
    run = tmp_path / "run"
    assert main(["import", str(src), "--config", TINY, "--run-dir", str(run)]) == 0
    assert validate(ckpt(run, 3), deep=True).valid
    ref = get_fp32_state_dict_from_zero_checkpoint(str(src))
    with DCPTensorReader(ckpt(run, 3)) as reader:
        got = imported(reader)
    assert sorted(ref) == sorted(k[6:] for k in got if k.startswith("model."))
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in ref.items())


@needs_deepspeed
def test_hf_trainer_deepspeed_output_folder_picks_the_step_asked(
    zero2_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An HF Trainer output folder (checkpoint-N/ holding latest + global_stepN/): the newest by default, --step N
    picks another, a step not there lists those that are."""
    out = tmp_path / "trainer-out"
    for n in (2, 3):
        inner = out / f"checkpoint-{n}"
        inner.mkdir(parents=True)
        (inner / "latest").write_text(f"global_step{n}")
        (inner / f"global_step{n}").symlink_to(zero2_src / f"global_step{n}")
        (inner / "trainer_state.json").write_text(json.dumps({"global_step": n}))
    assert main(["import", str(out), "--config", TINY, "--run-dir", str(tmp_path / "a")]) == 0
    assert [p.name for p in (tmp_path / "a" / "checkpoints").iterdir()] == ["step-00000003"]
    assert main(["import", str(out), "--config", TINY, "--run-dir", str(tmp_path / "b"), "--step", "2"]) == 0
    assert read_manifest(ckpt(tmp_path / "b", 2)).step == 2
    line = error_line(
        capsys, ["import", str(out), "--config", TINY, "--run-dir", str(tmp_path / "c"), "--step", "7"], 4
    )
    assert "no checkpoint of step 7; present: 2, 3" in line and not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------------ DCP layouts
@pytest.mark.parametrize("layout,sub", [("dcp", "plain"), ("torchtitan", "titan"), ("accelerate-fsdp", "accelerate")])
def test_dcp_layout_imports_weights_moments_and_step(dcp_src: Path, tmp_path: Path, layout: str, sub: str) -> None:
    ref = torch.load(dcp_src / "reference.pt", weights_only=True)
    run = tmp_path / "run"
    assert main(["import", str(dcp_src / sub), "--config", TINY, "--run-dir", str(run)]) == 0
    assert validate(ckpt(run, 3), deep=True).valid
    assert [e["data"].get("layout") for e in events(run)][0] == layout
    with DCPTensorReader(ckpt(run, 3)) as reader:
        got = imported(reader)
        assert sorted(k[6:] for k in got if k.startswith("model.")) == sorted(ref["model"])
        for name, w in ref["model"].items():
            assert torch.equal(got[f"model.{name}"], w), name
            for m in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f"optim.state.{name}.{m}"], ref["optim"][name][m]), f"{name}.{m}"
            assert float(reader.read(f"optim.state.{name}.step")) == float(ref["optim"][name]["step"]) == 3.0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP's writer thread saw it first
def test_truncated_dcp_record_is_refused_and_leaves_no_run_dir(
    dcp_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = shutil.copytree(dcp_src / "plain", tmp_path / "plain")
    data = sorted(src.glob("*.distcp"))[-1]
    os.truncate(data, data.stat().st_size // 2)
    run = tmp_path / "run"
    line = error_line(capsys, ["import", str(src), "--config", TINY, "--run-dir", str(run)], 4)
    assert data.name in line and "truncated" in line
    assert not run.exists()


# ------------------------------------------------------------------------------------------ HF Trainer
@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_hf_trainer_checkpoint_imports_through_its_decay_groups(
    hf_src: Path, tmp_path: Path, weights_file: str
) -> None:
    """model.safetensors (or the .bin of save_safetensors=False) + optimizer.pt (positions over the Trainer's decay /
    no-decay groups) + trainer_state.json."""
    from collections import OrderedDict

    from safetensors.torch import load_file

    src = hf_src / "checkpoint-3"
    weights = load_file(src / "model.safetensors")
    if weights_file == "pytorch_model.bin":  # what the Trainer writes with save_safetensors=False
        src = shutil.copytree(src, tmp_path / "checkpoint-3")
        (src / "model.safetensors").unlink()
        torch.save(OrderedDict(weights), src / "pytorch_model.bin")
        hf_src = tmp_path
    osd = torch.load(src / "optimizer.pt", weights_only=True)
    names = [n for n, _ in tiny_model().named_parameters()]
    order = [n for n in names if "norm" not in n] + [n for n in names if "norm" in n]  # the Trainer's groups
    assert [len(g["params"]) for g in osd["param_groups"]] == [
        sum("norm" not in n for n in names),
        sum("norm" in n for n in names),
    ]
    run = tmp_path / "run"
    assert main(["import", str(hf_src), "--config", TINY, "--run-dir", str(run)]) == 0
    man = read_manifest(ckpt(run, 3))
    assert man.step == 3 and validate(ckpt(run, 3), deep=True).valid
    with DCPTensorReader(ckpt(run, 3)) as reader:
        got = imported(reader)
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    for i, name in zip(ids, order):
        assert torch.equal(got[f"model.{name}"], weights[name]), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"optim.state.{name}.{m}"], osd["state"][i][m]), f"{name}.{m}"


def test_hostile_optimizer_pickle_is_refused_unrun(hf_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    src = shutil.copytree(hf_src / "checkpoint-3", tmp_path / "checkpoint-3")
    sd = torch.load(src / "optimizer.pt", weights_only=True)
    sd["param_groups"][0]["hook"] = Boom()
    torch.save(sd, src / "optimizer.pt", pickle_module=pickle)
    run = tmp_path / "run"
    line = error_line(capsys, ["import", str(src), "--config", TINY, "--run-dir", str(run)], 4)
    assert "refused to unpickle" in line and "optimizer.pt" in line and "system" in line
    assert not (tmp_path / "pwned").exists() and not run.exists()


# ------------------------------------------------------------------------------------------ bad input
def test_unknown_layout_lists_the_layouts_understood(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.npz").write_bytes(b"\0" * 16)
    line = error_line(capsys, ["import", str(src), "--config", TINY, "--run-dir", str(tmp_path / "run")], 4)
    assert "not a checkpoint layout" in line and all(
        k in line for k in ("deepspeed:", "hf-trainer:", "torchtitan:", "accelerate-fsdp:", "dcp:")
    )
    line = error_line(
        capsys, ["import", str(tmp_path / "nope"), "--config", TINY, "--run-dir", str(tmp_path / "run")], 4
    )
    assert "no such file or directory" in line
    assert not (tmp_path / "run").exists()


@needs_deepspeed
def test_checkpoint_of_another_model_names_the_first_tensor_and_both_shapes(
    zero2_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    line = error_line(
        capsys,
        [
            "import",
            str(zero2_src),
            "--config",
            TINY,
            "--run-dir",
            str(run),
            "--set",
            "model.config.intermediate_size=96",
        ],
        4,
    )
    assert "model.layers.0.mlp.gate_proj.weight as [128, 64], the config's model has [96, 64]" in line
    assert not run.exists()


@needs_deepspeed
def test_run_dir_with_checkpoints_is_refused(z2_imported: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = shutil.copytree(z2_imported, tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    line = error_line(capsys, ["import", str(z2_imported), "--config", TINY, "--run-dir", str(run)], 2)
    assert "already holds checkpoints (step-00000003)" in line
    assert sorted(p.name for p in run.rglob("*")) == before


@needs_deepspeed
@pytest.mark.parametrize("damage", ["truncated", "bit-flip"])
def test_damaged_zero_partition_is_refused_before_anything_is_written(
    zero2_src: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    from ckpt.formats.deepspeed.zero import ZeroShards

    src = shutil.copytree(zero2_src / "global_step3", tmp_path / "global_step3")
    path = src / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    else:
        with ZeroShards(src) as shards:
            offset, length, _ = shards.files[1].storage_entry(shards.flat(1, 0, "exp_avg").key)
        raw = bytearray(path.read_bytes())
        raw[offset + length // 2] ^= 0x10
        path.write_bytes(raw)
    run = tmp_path / "run"
    line = error_line(capsys, ["import", str(src), "--config", TINY, "--run-dir", str(run)], 4)
    assert path.name in line and ("CRC-32 mismatch" in line if damage == "bit-flip" else "torch.save zip" in line)
    assert not run.exists()
