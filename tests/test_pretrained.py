"""Fine-tuning from pretrained weights (model.pretrained): a local save_pretrained folder made by
infra.make_tiny_pretrained (tied embeddings, weights in 4 safetensors shards, BPE tokenizer with a chat template,
a generation config), trained on 2 real gloo ranks through shardkeeper.stages.

Eight torchrun launches in all: lr 1e-12 for 3 steps then export (the pretrained tensors come back, the export
loads with from_pretrained + AutoTokenizer and carries the card metadata); a real fine-tune to step 6, resumed
from step 3 at 2 ranks (bitwise) and at 3 ranks (<= 1e-6) after the base model's weight files were deleted (a
resume never reads them); DeepSpeed ZeRO-2 with lr 1e-12; ZeRO-3 with lr 1e-12 (first-step loss = FSDP2's) and a
ZeRO-3 resume from step 3 (bitwise). Bad input: one line, nothing written, no launch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.harness import ROOT, assert_bitwise, copy_run_until, max_rel, metrics

FINETUNE = ROOT / "configs" / "tiny-finetune.yaml"
HUB_ID = "test-org/tiny-base"


def _make_base(out: Path, **kw: object) -> Path:
    from infra.make_tiny_pretrained import make

    return make(out, "tiny", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained folder: tied embeddings, 4 weight shards + index, tokenizer, generation config."""
    return _make_base(tmp_path_factory.mktemp("base") / "tiny-base", tied=True, shard_size="100KB")


def _spec(base: Path, *sets: str):
    from shardkeeper.config import load_run_spec

    return load_run_spec(
        FINETUNE,
        [
            f"model.pretrained={base}",
            f"model.base_model_id={HUB_ID}",
            "checkpoint.keep_last=100",
            "checkpoint.interval=3",
            *sets,
        ],
    )


def _train(spec, run: Path, nproc: int, until: int):
    from shardkeeper.stages import plan_topology, train_segment

    lines: list[str] = []
    res = train_segment(spec, run, plan_topology(spec, nproc, device="cpu"), until, sink=lines.append)
    assert res.status == "completed", (res.failure, lines[-20:])
    return lines


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def fsdp_lr0(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """FSDP2, lr 1e-12, 3 steps at 2 ranks (shared: its first-step loss is the ZeRO-3 test's reference)."""
    run = tmp_path_factory.mktemp("fsdp-lr0") / "run"
    return run, _train(_spec(base, "optim.lr=1e-12"), run, 2, 3)


@pytest.mark.slow
def test_lr_zero_returns_the_pretrained_tensors_and_a_usable_export(
    base: Path, fsdp_lr0: tuple[Path, list[str]]
) -> None:
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpt.commit.manifest import read_manifest
    from ckpt.publish import load_export, model_card
    from shardkeeper.stages import export_and_record

    run, lines = fsdp_lr0
    assert any("loaded this rank's shards" in ln for ln in lines)
    ckpt = run / "checkpoints" / "step-00000003"

    # the manifest records the base model: source, the card's hub id, sha256 of every weight file
    rec = read_manifest(ckpt).base_model
    assert rec is not None and rec.source == str(base) and rec.hub_id == HUB_ID and rec.revision is None
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) == 4 and sorted(rec.weights) == shards
    for name, digest in rec.weights.items():
        assert hashlib.sha256((base / name).read_bytes()).hexdigest() == digest
    assert rec.weights_bytes == sum((base / n).stat().st_size for n in shards)
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(rec.files)

    # lr 1e-12 for 3 steps: the export returns the pretrained tensors (tied lm_head not written, as save_pretrained)
    out = run / "exports" / "step-00000003"
    export_and_record(ckpt, out)
    want, got = _tensors(base), _tensors(out)
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-7, diff

    # what people load: weights, tokenizer (with its chat template), the base model's generation config
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (base / "generation_config.json").read_text()
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied again
    assert len(tok) <= model.config.vocab_size and model.generation_config.temperature == 0.7
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "the model"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|user|>the model<|end|><|assistant|>"

    # the card: a fine-tune of its base model, in the export's README.md and in the Hub card publish writes
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert meta["base_model"] == HUB_ID and meta["base_model_relation"] == "finetune"
    card = model_card(load_export(out), "me/tiny-ft")
    hub_meta = ModelCard(card).data.to_dict()
    assert hub_meta["base_model"] == HUB_ID and hub_meta["base_model_relation"] == "finetune"
    assert f"| base model | {HUB_ID} |" in card and "| tokens | 1,152 |" in card and "| step | 3 |" in card


@pytest.mark.slow
def test_resume_exact_without_the_pretrained_weights(base: Path, tmp_path: Path) -> None:
    from ckpt.commit.manifest import read_manifest

    own = Path(shutil.copytree(base, tmp_path / "base-copy"))
    spec = _spec(own, "optim.lr=3e-3")
    ref = tmp_path / "ref"
    _train(spec, ref, 2, 6)
    first = read_manifest(ref / "checkpoints" / "step-00000003").base_model
    same = copy_run_until(ref, tmp_path / "same", 3)
    other = copy_run_until(ref, tmp_path / "other", 3)
    for f in own.glob("*.safetensors"):  # a resume loads the checkpoint; the base weights are never read again
        f.unlink()
    lines = _train(spec, same, 2, 6)
    assert not any("loaded this rank's shards" in ln for ln in lines)
    assert_bitwise(metrics(ref), metrics(same), range(4, 7))
    _train(spec, other, 3, 6)
    assert max_rel(metrics(ref), metrics(other), range(4, 7)) <= 1e-6
    for run in (same, other):  # the base model stays recorded in every later checkpoint
        assert read_manifest(run / "checkpoints" / "step-00000006").base_model == first


@pytest.mark.slow
def test_deepspeed_zero2_starts_from_the_pretrained_weights(base: Path, tmp_path: Path) -> None:
    """ZeRO-2 keeps every parameter whole: the weights are read into them and the fp32 masters refreshed."""
    from ckpt.commit.manifest import read_manifest
    from shardkeeper.stages import export_and_record

    run = tmp_path / "ds"
    _train(_spec(base, "optim.lr=1e-12", "backend=deepspeed", "deepspeed.zero_stage=2"), run, 2, 2)
    ckpt = run / "checkpoints" / "step-00000002"
    assert read_manifest(ckpt).base_model.source == str(base)
    export_and_record(ckpt, run / "export")
    want, got = _tensors(base), _tensors(run / "export")
    assert sorted(got) == sorted(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-7


@pytest.mark.slow
def test_deepspeed_zero3_reads_each_rank_partition_and_resumes_exactly(
    base: Path, fsdp_lr0: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """ZeRO-3 built under zero.Init, each rank's partitions read from the files (trainer.deepspeed._zero3): lr 1e-12
    then export gives the pretrained tensors back (tied pair included); the first-step loss is FSDP2's from
    the same folder; a resume from step 3 at 2 ranks is bitwise."""
    from shardkeeper.stages import export_and_record

    zero3 = ("backend=deepspeed", "deepspeed.zero_stage=3")
    lr0 = tmp_path / "lr0"
    lines = _train(_spec(base, "optim.lr=1e-12", *zero3), lr0, 2, 2)
    assert any("loaded this rank's shards" in ln for ln in lines)
    export_and_record(lr0 / "checkpoints" / "step-00000002", lr0 / "export")
    want, got = _tensors(base), _tensors(lr0 / "export")
    assert sorted(got) == sorted(want) and "lm_head.weight" not in got
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-7
    first = metrics(fsdp_lr0[0])[1]["loss"]
    assert abs(metrics(lr0)[1]["loss"] - first) <= 1e-6 * abs(first), (metrics(lr0)[1]["loss"], first)

    spec = _spec(base, "optim.lr=3e-3", *zero3)
    ref = tmp_path / "ref"
    _train(spec, ref, 2, 6)
    resumed = copy_run_until(ref, tmp_path / "resumed", 3)
    lines = _train(spec, resumed, 2, 6)
    assert not any("loaded this rank's shards" in ln for ln in lines)  # the checkpoint, not the base weights
    assert_bitwise(metrics(ref), metrics(resumed), range(4, 7))
    assert metrics(ref)[6]["loss"] != metrics(ref)[1]["loss"]  # it trained


# ------------------------------------------------------------------------------------------------ bad input
def _refused(spec, run: Path) -> str:
    """preflight's one line; nothing written."""
    from schemas.errors import ShardkeeperError
    from shardkeeper.preflight import preflight
    from shardkeeper.stages import plan_topology

    with pytest.raises(ShardkeeperError) as e:
        preflight(spec, plan_topology(spec, 2, device="cpu"), run)
    assert not run.exists()
    line = str(e.value)
    assert "\n" not in line
    return line


def test_a_tied_pair_stored_twice_with_different_values_is_refused(base: Path, tmp_path: Path) -> None:
    """config.json ties lm_head to the embeddings but the files hold both, with different values: one parameter
    cannot be both (transformers unties or ties depending on its version), so preflight refuses; equal copies pass."""
    from safetensors.torch import save_file

    from shardkeeper.preflight import preflight
    from shardkeeper.stages import plan_topology

    tensors = _tensors(base)
    assert "lm_head.weight" not in tensors  # save_pretrained kept one of the tied pair
    for name, head in (
        ("differ", -tensors["model.embed_tokens.weight"]),
        ("equal", tensors["model.embed_tokens.weight"]),
    ):
        folder = Path(shutil.copytree(base, tmp_path / name))
        for f in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
            f.unlink()
        save_file(
            {**tensors, "lm_head.weight": head.clone()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
        )
        run = tmp_path / f"run-{name}"
        if name == "differ":
            line = _refused(_spec(folder), run)
            assert (
                "ties lm_head.weight to model.embed_tokens.weight" in line or "ties model.embed_tokens.weight" in line
            )
            assert "different values" in line and "tie_word_embeddings" in line
        else:
            spec = _spec(folder)
            preflight(spec, plan_topology(spec, 2, device="cpu"), run)


def test_bad_pretrained_input_is_one_line(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas.errors import ConfigError
    from shardkeeper.config import load_run_spec

    run = tmp_path / "run"
    # no config.json
    no_cfg = Path(shutil.copytree(base, tmp_path / "no-config"))
    (no_cfg / "config.json").unlink()
    line = _refused(_spec(no_cfg), run)
    assert "config.json is missing" in line and str(no_cfg) in line
    # no weights; only .bin weights
    no_w = Path(shutil.copytree(base, tmp_path / "no-weights"))
    for f in [*no_w.glob("*.safetensors"), no_w / "model.safetensors.index.json"]:
        f.unlink()
    assert "holds no model weights" in _refused(_spec(no_w), run)
    (no_w / "pytorch_model.bin").write_bytes(b"x")
    assert "convert them to safetensors" in _refused(_spec(no_w), run)
    # an index naming a missing shard
    torn = Path(shutil.copytree(base, tmp_path / "torn"))
    (torn / "model-00002-of-00004.safetensors").unlink()
    line = _refused(_spec(torn), run)
    assert "model-00002-of-00004.safetensors" in line and "missing" in line
    # config.json and weights of different models
    other = Path(shutil.copytree(base, tmp_path / "other"))
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    line = _refused(_spec(other), run)
    assert "mlp" in line and "[96, 64]" in line and "disagree" in line
    # a tokenizer larger than the embeddings
    big = Path(shutil.copytree(base, tmp_path / "big-tok"))
    from infra.make_tiny_pretrained import make_tokenizer

    make_tokenizer(600).save_pretrained(big)
    line = _refused(_spec(big), run)
    assert "tokenizer.json" in line and "vocab_size 320" in line and "resize" in line
    # an architecture override, a revision on a local folder, a model type that disagrees
    with pytest.raises(ConfigError) as e:
        _spec(base, "model.config.hidden_size=32")
    assert "model.config.hidden_size cannot override" in str(e.value)
    assert "only applies to a Hub id" in _refused(_spec(base, "model.revision=main"), run)
    assert "says 'llama'" in _refused(_spec(base, "model.model_type=qwen2"), run)
    # a Hub id that is not in the (empty) cache while offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    spec = load_run_spec(FINETUNE, ["model.pretrained=nobody/not-cached"])
    from shardkeeper.stages import fetch_pretrained

    fetch_pretrained(spec)  # offline: no download attempted; preflight says what to do
    line = _refused(spec, run)
    assert "nobody/not-cached" in line and "not in the Hugging Face cache" in line and "hf download" in line


def test_relative_paths_in_a_config_resolve_against_its_folder(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """model.pretrained / data.dataset / data.tokenizer written relative in a config file: against the file's
    folder, from another working directory, in the CLI (prepare-data really reads them) and in the flow's
    load_spec task; --set values against the working directory; a Hub id stays one."""
    import yaml

    from shardkeeper.cli import main
    from shardkeeper.config import load_run_spec
    from tasks.stage_tasks import load_spec
    from tests.harness import make_text_rows, write_jsonl

    proj = tmp_path / "proj"
    shutil.copytree(base, proj / "models" / "base")
    write_jsonl(proj / "data" / "train.jsonl", make_text_rows(30))
    raw = yaml.safe_load(FINETUNE.read_text())
    raw["model"]["pretrained"] = "../models/base"
    raw["data"] = {"source": "dataset", "dataset": "../data", "tokenizer": "../models/base", "seq_len": 16}
    cfg = proj / "configs" / "ft.yaml"
    cfg.parent.mkdir()
    cfg.write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tok").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("SHARDKEEPER_DATA_CACHE", str(tmp_path / "cache"))

    assert main(["prepare-data", "--config", str(cfg), "--num-proc", "1"]) == 0
    assert "train [train]:" in capsys.readouterr().out
    spec = load_spec.fn(config=str(cfg))  # what the train-and-export flow calls
    assert (spec.model.pretrained, spec.data.dataset, spec.data.tokenizer) == (
        str(proj / "models" / "base"),
        str(proj / "data"),
        str(proj / "models" / "base"),
    )
    assert spec.model.model_type == "llama"  # read from the folder the relative path names

    assert load_run_spec(cfg, ["data.tokenizer=tok"]).data.tokenizer == str(elsewhere / "tok")
    raw["model"]["pretrained"] = "meta-llama/Llama-3.2-1B"
    raw["model"]["model_type"] = "llama"
    cfg.write_text(yaml.safe_dump(raw))
    assert load_run_spec(cfg).model.pretrained == "meta-llama/Llama-3.2-1B"


def test_config_paths_do_not_depend_on_the_working_directory_and_follow_symlinked_folders(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub-id-looking model.pretrained that is not beside the config stays a Hub id in every working directory
    (not a folder of that name in the cwd); '..' after a symlinked folder goes where open() goes (the link
    target's parent), not to the folder that textually precedes the link."""
    import yaml

    from shardkeeper.config import load_run_spec

    raw = yaml.safe_load(FINETUNE.read_text())
    raw["model"]["pretrained"], raw["model"]["model_type"] = "runs/tiny-base", "llama"
    real = tmp_path / "real" / "sub"
    real.mkdir(parents=True)
    (real / "ft.yaml").write_text(yaml.safe_dump(raw))
    cwd = tmp_path / "cwd"
    shutil.copytree(base, cwd / "runs" / "tiny-base")
    monkeypatch.chdir(cwd)
    assert load_run_spec(real / "ft.yaml").model.pretrained == "runs/tiny-base"
    monkeypatch.chdir(tmp_path)
    assert load_run_spec(real / "ft.yaml").model.pretrained == "runs/tiny-base"

    shutil.copytree(base, tmp_path / "real" / "tiny-base")
    raw["model"]["pretrained"] = "../tiny-base"
    (real / "ft.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    expected = os.path.realpath(tmp_path / "real" / "tiny-base")
    assert load_run_spec(tmp_path / "link" / "ft.yaml").model.pretrained == expected
    assert load_run_spec(real / "ft.yaml").model.pretrained == expected

    # a flow's overrides: relative to its base_dir parameter, not to the worker's working directory
    from tasks.stage_tasks import load_spec

    shutil.copytree(base, tmp_path / "flowbase" / "models" / "b")
    monkeypatch.chdir(cwd)
    spec = load_spec.fn(
        config=str(real / "ft.yaml"), overrides=["model.pretrained=models/b"], base_dir=str(tmp_path / "flowbase")
    )
    assert spec.model.pretrained == str(tmp_path / "flowbase" / "models" / "b")


def test_read_elements_reads_a_flattened_range_with_and_without_a_cast(base: Path) -> None:
    """What a ZeRO-3 partition needs: elements [start, start + count) of the row-major tensor, any alignment."""
    import torch

    from ckpt.pretrained import read_elements, tensor_index, weight_files

    index = tensor_index(weight_files(base, str(base)))
    st = index["model.embed_tokens.weight"]
    full = _tensors(base)["model.embed_tokens.weight"].reshape(-1)
    for start, count in ((0, 7), (13, 101), (full.numel() - 5, 5), (3, 0)):
        out = torch.empty(count, dtype=torch.float32)
        read_elements(st, start, count, out)
        assert torch.equal(out, full[start : start + count])
        cast = torch.empty(count, dtype=torch.float64)
        read_elements(st, start, count, cast)
        assert torch.equal(cast, full[start : start + count].double())
    with pytest.raises(ValueError):
        read_elements(st, full.numel() - 2, 3, torch.empty(3))


def test_an_unshardable_architecture_is_refused() -> None:
    import torch

    from shardkeeper.preflight import check_shardable

    spec = _spec(Path("/nonexistent"))
    with pytest.raises(Exception) as e:
        check_shardable(spec, torch.nn.Linear(2, 2))
    assert "no decoder blocks FSDP2 can shard" in str(e.value) and "backend deepspeed" in str(e.value)


def test_pretrained_tokenizer_path_hook(base: Path) -> None:
    """The data path's default tokenizer: the pretrained folder; none for a run from random weights."""
    from ckpt.pretrained import pretrained_tokenizer_path
    from tests.harness import tiny_spec

    assert pretrained_tokenizer_path(_spec(base)) == base
    assert pretrained_tokenizer_path(tiny_spec()) is None
