"""A checkpoint's identity is its state: any kind of run whose model has a checkpoint's tensor names, shapes and dtypes
continues it, whoever wrote it (ckpt.commit.identity); what it lacks because another kind of run wrote it starts at its
step (trainer.extras); the Hugging Face Trainer's ``train(resume_from_checkpoint=PATH)`` imports another tool's
checkpoint into the run (trainer.api.adopt); tracking differs between ranks is refused before anything is saved; the
manifest records the dtypes the live model uses (trainer.precision).

The runs are in-process ranks (tests.harness.spawn) of tests/scripts/llama_loop.py, a user's own loop over the tiny
Llama of configs/tiny.yaml, continuing the session's built-in trainer run (``tiny_run``), and of a Hugging Face
Trainer continuing a plain Trainer's ``checkpoint-3``.
"""

from __future__ import annotations

import json
import runpy
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from ckpt.commit import identity
from ckpt.commit.manifest import read_manifest
from schemas import TensorEntry
from tests.harness import ROOT, spawn

LOOP = ROOT / "tests" / "scripts" / "llama_loop.py"


def entries(*rows: tuple[str, list[int], str]) -> list[TensorEntry]:
    return [TensorEntry(name=n, shape=s, dtype=d) for n, s, d in rows]


def tiny_llama(*, tied: bool = False) -> torch.nn.Module:
    """The model of configs/tiny.yaml, as a user's script builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ units
def test_names_are_compared_without_the_wrappers_prefixes() -> None:
    name = "module._orig_mod.layers.0._checkpoint_wrapped_module.mlp.weight"
    assert identity.canonical(name) == "layers.0.mlp.weight"
    assert identity.canonical("module.module.w") == "w" and identity.canonical("module") == "module"
    assert identity.canonical("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"
    here = identity.model_tensors(
        entries(
            ("model.module.a", [2, 3], "float32"),
            ("model.b", [4], "float32"),
            ("optim.state.b.exp_avg", [4], "float32"),
        )
    )
    assert here == {"a": ((2, 3), "float32"), "b": ((4,), "float32")}
    assert identity.renames(["_orig_mod.a", "b"], ["a", "b"]) == {"_orig_mod.a": "a"}


def test_the_first_difference_names_the_tensor_and_both_sides() -> None:
    ckpt = identity.model_tensors(entries(("model.a", [2, 3], "float32"), ("model.b", [4], "float32")))
    same = identity.model_tensors(entries(("model.module.b", [4], "float32"), ("model.a", [2, 3], "float32")))
    assert identity.first_difference(same, ckpt) is None  # order and wrapper prefixes do not matter
    shape = identity.model_tensors(entries(("model.a", [2, 5], "float32"), ("model.b", [4], "float32")))
    assert (
        identity.first_difference(shape, ckpt)
        == "a is [2, 3] float32 in the checkpoint, [2, 5] float32 in this run's model"
    )
    dtype = identity.model_tensors(entries(("model.a", [2, 3], "float32"), ("model.b", [4], "bfloat16")))
    assert (
        identity.first_difference(dtype, ckpt) == "b is [4] float32 in the checkpoint, [4] bfloat16 in this run's model"
    )
    fewer = identity.model_tensors(entries(("model.a", [2, 3], "float32")))
    assert identity.first_difference(fewer, ckpt) == "b [4] float32 is in the checkpoint but not in this run's model"
    assert identity.first_difference(ckpt, fewer) == "b [4] float32 is in this run's model but not in the checkpoint"
    assert (
        identity.tie_difference({"lm_head.weight": "embed.weight"}, {})
        == "lm_head.weight is tied to embed.weight in this run's model, not in the checkpoint"
    )


def test_signature_is_the_same_for_both_backends_and_every_kind_of_run() -> None:
    """DCP holds both names of a tied pair, DeepSpeed the source's only; neither the wrappers' prefixes nor the
    order enter. Another shape or dtype is another signature."""
    tied = {"lm_head.weight": "embed.weight"}
    dcp = entries(
        ("model.embed.weight", [8, 4], "float32"),
        ("model.lm_head.weight", [8, 4], "float32"),
        ("model.norm.weight", [4], "float32"),
        ("optim.state.norm.weight.exp_avg", [4], "float32"),
    )
    ds = entries(("model.module.norm.weight", [4], "float32"), ("model.embed.weight", [8, 4], "float32"))
    assert identity.signature(dcp, tied) == identity.signature(ds, tied)
    assert identity.signature(dcp, tied) != identity.signature(
        entries(("model.embed.weight", [8, 4], "float32"), ("model.norm.weight", [4], "bfloat16")), tied
    )


def test_a_fast_forwarded_scheduler_has_the_lr_of_a_run_that_stepped_from_0() -> None:
    """Chainable (StepLR: each LR from the last) and closed-form (LambdaLR) schedulers, after a load wrote another
    run's LR into the optimizer's groups: the LR of step N, bit for bit."""
    from trainer.extras import start_at

    def make(kind: str) -> torch.optim.lr_scheduler.LRScheduler:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        if kind == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    for kind in ("step", "lambda"):
        ran, fresh = make(kind), make(kind)
        for _ in range(10):
            ran.optimizer.step()
            ran.step()
        fresh.optimizer.param_groups[0]["lr"] = 3e-3  # what a load of another run's groups leaves there
        assert start_at(fresh, 10).startswith("fast-forwarded to step 10")
        assert fresh.get_last_lr() == ran.get_last_lr()
        assert fresh.optimizer.param_groups[0]["lr"] == ran.get_last_lr()[0]
        assert fresh.last_epoch == 10


def test_a_plain_module_records_its_own_dtypes() -> None:
    from trainer.precision import module_policy

    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert module_policy(model).model_dump() == {"master": "bfloat16", "compute": "bfloat16", "reduce": "bfloat16"}


# ------------------------------------------------------------------------------------------ a script continues
def _loop(argv: list[str], run_dir: str, until: int) -> dict:
    return runpy.run_path(str(LOOP))["main"](argv, run_dir, until)


def as_script_run(run: Path) -> None:
    """Make ``run`` a run that tests/scripts/llama_loop.py trains (what ``train --script`` writes into run.yaml)."""
    from ckpt.commit.fsutil import load_yaml
    from schemas import RunSpec, ScriptSpec
    from shardkeeper.config import dump_run_spec

    spec = RunSpec.model_validate(load_yaml((run / "run.yaml").read_text()))
    (run / "run.yaml").write_text(dump_run_spec(spec.model_copy(update={"script": ScriptSpec(path=str(LOOP))})))


def lineage(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]


def error_of(call: object) -> str:
    with pytest.raises(RuntimeError) as e:
        call()  # type: ignore[operator]
    return str(e.value)


def test_a_script_continues_the_built_in_trainers_checkpoint_with_its_own_settings(
    tiny_run: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """The built-in trainer's step 5 (a manifest whose model_signature predates the inventory's, as old
    checkpoints' do) continued by a user's FSDP2 script with a bf16 MixedPrecisionPolicy: it loads; the script's
    scheduler is fast-forwarded, its other object starts fresh, one line says so; the optimizer keeps the
    script's settings; the new manifest records bf16 compute and the same signature as a checkpoint of the built-in
    trainer. The same script then tracking an object its own checkpoint lacks is refused, as before."""
    run = shutil.copytree(tiny_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    as_script_run(run)
    built_in = read_manifest(run / "checkpoints" / "step-00000005")
    raw = json.loads((run / "checkpoints" / "step-00000005" / "manifest.json").read_text())
    raw["model_signature"] = "0" * 64  # another digest than the inventory's: never compared
    (run / "checkpoints" / "step-00000005" / "manifest.json").write_text(json.dumps(raw))
    capfd.readouterr()
    out = spawn(_loop, 1, ["--bf16", "--scheduler", "--extra", "counter", "--lr", "5e-3", "--wd", "0"], str(run), 6)
    err = capfd.readouterr().err
    assert (
        "step-00000005 was written by the built-in trainer; tracked objects it holds no state of: 'scheduler' "
        "fast-forwarded to step 5 (lr 0.005), 'counter' starts fresh"
    ) in err, err
    # the built-in trainer's groups (two, lr 3e-3, weight decay 0.1) did not come with the state
    assert out == [{"lr": 5e-3, "weight_decay": 0.0, "groups": 1, "step": 6}]
    own = read_manifest(run / "checkpoints" / "step-00000006")
    assert own.dtype_policy.model_dump() == {"master": "float32", "compute": "bfloat16", "reduce": "float32"}
    assert built_in.dtype_policy.compute == "float32" and own.model_signature == built_in.model_signature
    assert own.run_spec.script is not None and own.parent == "step-00000005"
    line = error_of(lambda: spawn(_loop, 1, ["--bf16", "--scheduler", "--extra", "counter", "late"], str(run), 7))
    assert "step-00000006: holds no state of tracked 'late' (it holds: counter, scheduler)" in line
    assert not (run / "checkpoints" / "step-00000007").exists()


def test_another_dtype_is_refused_naming_the_tensor_and_nothing_is_written(tiny_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(tiny_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    as_script_run(run)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    line = error_of(lambda: spawn(_loop, 1, ["--plain-bf16"], str(run), 6))
    assert (
        "step-00000005: holds another model than this run's: lm_head.weight is [256, 64] float32 in the "
        "checkpoint, [256, 64] bfloat16 in this run's model; resume with the model that wrote it"
    ) in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # left in place, nothing committed


@pytest.mark.skipif(find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_deepspeed_script_continues_the_built_in_deepspeed_trainers_checkpoint(
    ds_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The built-in trainer's ZeRO-2 checkpoint (two AdamW groups: decay and no decay) continued by a user's
    DeepSpeed loop with one group and bf16 on, on the same 2 ranks: DeepSpeed's flat partitions follow the groups,
    so another kind of run's checkpoint loads through the universal layout (each parameter on its own, converted
    once and recorded in lineage); the script keeps its own settings; the manifest records the engine's bf16."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run = shutil.copytree(ds_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    as_script_run(run)
    out = spawn(_loop, 2, ["--deepspeed", "--bf16", "--scheduler"], str(run), 3, timeout=900)
    assert out == [{"lr": 1e-2, "weight_decay": 0.1, "groups": 1, "step": 3}] * 2
    assert (run / "checkpoints" / "step-00000002" / "universal").is_dir()
    assert "reshard:step-00000002:universal" in {e["id"] for e in lineage(run)}
    own, built_in = (read_manifest(run / "checkpoints" / f"step-{s:08d}") for s in (3, 2))
    assert own.model_signature == built_in.model_signature and own.format == "deepspeed"
    assert own.dtype_policy.model_dump() == {"master": "float32", "compute": "bfloat16", "reduce": "bfloat16"}
    assert built_in.dtype_policy.compute == "float32"


def _accelerate(run_dir: str, until: int) -> tuple[float, float]:
    """An Accelerate script (a DDP-prepared model on CPU ranks, OneCycleLR stepped once per optimizer step) whose
    run's checkpoint another kind of run wrote; returns its learning rate at the end and a scheduler's that ran
    every step from 0."""
    from accelerate import Accelerator

    import shardkeeper as sk
    from shardkeeper.integrations import accelerate as sk_accelerate

    seg = sk.Segment(run_dir=run_dir, until_step=until)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=20, pct_start=0.25)

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, opt, sched = accelerator.prepare(model, opt, schedule(opt))
    sk_accelerate.track(seg, accelerator, model=model, optimizer=opt, scheduler=sched)
    g = torch.Generator().manual_seed(5)
    for _ in seg.steps():
        x = torch.randint(0, 256, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        seg.log(loss=float(loss))
    ran = schedule(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3))
    for _ in range(until):
        ran.optimizer.step()
        ran.step()
    return sched.get_last_lr()[0], ran.get_last_lr()[0]


@pytest.mark.skipif(find_spec("accelerate") is None, reason="accelerate is not installed")
def test_an_accelerate_script_continues_the_built_in_trainers_checkpoint(tiny_run: Path, tmp_path: Path) -> None:
    """The Accelerate adapter on 2 ranks (DDP, which track unwraps) continues the built-in trainer's step 5: its
    OneCycleLR ends at the learning rate of a schedule that ran from step 0."""
    run = shutil.copytree(tiny_run, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    as_script_run(run)
    (got, want), _ = spawn(_accelerate, 2, str(run), 7)
    assert got == want
    assert read_manifest(run / "checkpoints" / "step-00000007").run_spec.script is not None


def _write_tied_dcp(out: str) -> None:
    """A plain dcp.save of a tied model and its AdamW after 2 steps (the state dict holds both tied names, the
    optimizer one state)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo")
    model = tiny_llama(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in torch.randint(0, 256, (2, 2, 16), generator=torch.Generator().manual_seed(3)):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    dist.destroy_process_group()


def test_an_imported_tied_model_holds_both_names_and_a_script_continues_it(tmp_path: Path) -> None:
    """FSDP2 loads both names of a tied pair (lm_head.weight, model.embed_tokens.weight): an import of a tied
    model writes both, so the run's own script continues it (and the signatures agree)."""
    from shardkeeper.cli import main

    spawn(_write_tied_dcp, 1, str(tmp_path / "src"))
    run = tmp_path / "run"
    assert (
        main(
            [
                "import",
                str(tmp_path / "src"),
                "--config",
                str(ROOT / "configs" / "tiny.yaml"),
                "--run-dir",
                str(run),
                "--set",
                "model.config.tie_word_embeddings=true",
            ]
        )
        == 0
    )
    imported = read_manifest(run / "checkpoints" / "step-00000002")
    names = {t.name for t in imported.tensors}
    assert {"model.lm_head.weight", "model.model.embed_tokens.weight"} <= names
    assert "optim.state.lm_head.weight.exp_avg" not in names
    assert spawn(_loop, 1, ["--tied"], str(run), 3)[0]["step"] == 3
    assert read_manifest(run / "checkpoints" / "step-00000003").model_signature == imported.model_signature


def _diverging(run_dir: str) -> None:
    """Rank 1 tracks one object more than rank 0."""
    import shardkeeper as sk

    seg = sk.Segment(run_dir=run_dir, until_step=2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"sched": torch.optim.lr_scheduler.StepLR(opt, 1)} if seg.rank == 1 else {}
    seg.track(model=model, optimizer=opt, **extra)
    for _ in seg.steps():
        model(torch.ones(2, 4)).sum().backward()
        opt.step()


def test_tracking_other_objects_on_another_rank_is_refused_before_anything_is_saved(tmp_path: Path) -> None:
    from tests.harness import new_run, tiny_spec

    run = new_run(tmp_path / "run", tiny_spec())
    line = error_of(lambda: spawn(_diverging, 2, str(run)))
    for rank in (0, 1):
        assert (
            f"rank {rank}: UsageError: seg.track(): rank 0 tracks {{model, optimizer}}, rank 1 tracks "
            "{model, optimizer, sched}; track the same objects on every rank"
        ) in line
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------ Hugging Face Trainer
needs_accelerate = pytest.mark.skipif(find_spec("accelerate") is None, reason="the Trainer needs accelerate")
HF_STEPS = 6


def hf_rows(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in (torch.randint(0, 256, (16,), generator=g) for _ in range(n))]


def hf_args(out: Path, **more: object):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(out),
        max_steps=HF_STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        save_strategy="no",
    )
    return TrainingArguments(**{**kw, **more})


@pytest.fixture(scope="module")
def hf_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain Trainer (no shardkeeper) to step 6, linear LR decay, saving checkpoint-3 and checkpoint-6; every
    step's loss in losses.json."""
    if find_spec("accelerate") is None:
        pytest.skip("the Trainer needs accelerate")
    from transformers import Trainer

    out = tmp_path_factory.mktemp("hf") / "out"
    losses: list[float] = []

    class Recording(Trainer):
        def training_step(self, *args: object, **kwargs: object) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            return loss

    trainer = Recording(
        model=tiny_llama(), args=hf_args(out, save_strategy="steps", save_steps=3), train_dataset=hf_rows()
    )
    trainer.train()
    (out / "losses.json").write_text(json.dumps(losses))
    return out


def _hf_resume(run_dir: str, path: str, until: int, per_device: int) -> int:
    import shardkeeper as sk
    from shardkeeper.integrations.transformers import Trainer

    seg = sk.Segment(run_dir=run_dir, until_step=until)
    args = hf_args(Path(run_dir) / "scratch", per_device_train_batch_size=per_device)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=hf_rows(), segment=seg)
    trainer.train(resume_from_checkpoint=path)
    return trainer.state.global_step


def _hf_refusals(run_dir: str, paths: list[str]) -> list[str]:
    """``train(resume_from_checkpoint=...)`` with each path in turn, one segment each; the line of each refusal."""
    import shardkeeper as sk
    from schemas.errors import ShardkeeperError
    from shardkeeper.integrations.transformers import Trainer

    env, lines = None, []
    for path in paths:
        seg = sk.Segment(run_dir=run_dir, until_step=HF_STEPS, _env=env)
        env = seg.env
        trainer = Trainer(
            model=tiny_llama(), args=hf_args(Path(run_dir) / "scratch"), train_dataset=hf_rows(), segment=seg
        )
        try:
            trainer.train(resume_from_checkpoint=path)
            lines.append(f"ran to step {trainer.state.global_step}")
        except ShardkeeperError as e:
            lines.append(f"{type(e).__name__}: {e}")
    return lines


@needs_accelerate
def test_hf_trainer_resume_from_another_tools_checkpoint_imports_it_and_continues(hf_ref: Path, tmp_path: Path) -> None:
    """``Trainer.train(resume_from_checkpoint="out/checkpoint-3")`` of a plain Trainer's run, in a new run: imported
    into the run inside the segment (described by the live model and optimizer), then resumed; the LR schedule
    and the counters start at step 3. Steps 4-6 are the plain Trainer's bit for bit on its world size (1 rank), and
    within float rounding on 2 ranks (the same global batch)."""
    from tests.harness import new_run, tiny_spec

    ref = json.loads((hf_ref / "losses.json").read_text())
    for world in (1, 2):
        run = new_run(tmp_path / f"run{world}", tiny_spec())
        out = spawn(_hf_resume, world, str(run), str(hf_ref / "checkpoint-3"), HF_STEPS, 2 // world)
        assert out == [HF_STEPS] * world
        rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        assert sorted(rows) == [4, 5, 6]
        for s in (4, 5, 6):
            if world == 1:
                assert rows[s]["loss"] == ref[s - 1], (s, rows[s]["loss"], ref[s - 1])
            else:
                assert abs(rows[s]["loss"] - ref[s - 1]) / ref[s - 1] < 1e-6, (s, rows[s]["loss"], ref[s - 1])
        events = [(e["kind"], e["id"], e["parent"]) for e in lineage(run)]
        assert events[:2] == [
            ("imported", "import:step-00000003", None),
            ("checkpoint", "checkpoint:step-00000003", "import:step-00000003"),
        ]
        imported = read_manifest(run / "checkpoints" / "step-00000003")
        assert (imported.reason, imported.samples, imported.format) == ("converted", 6, "dcp")  # 3 steps of 2 samples


@needs_accelerate
def test_hf_trainer_resume_from_checkpoint_leads_somewhere_in_every_case(
    hf_ref: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A path that is not there, and another run's checkpoint, are refused in one line that says what works; a run
    that already has checkpoints resumes its newest (one line says the path was not imported); a checkpoint of the
    run itself resumes the run's newest valid one (said when it is not the one given)."""
    from tests.harness import new_run, tiny_spec

    run = new_run(tmp_path / "run", tiny_spec())
    assert spawn(_hf_resume, 1, str(run), str(hf_ref / "checkpoint-3"), HF_STEPS, 2) == [HF_STEPS]
    other = new_run(tmp_path / "other", tiny_spec())
    shutil.copytree(run / "checkpoints" / "step-00000006", other / "checkpoints" / "step-00000006")
    capfd.readouterr()
    paths = [
        tmp_path / "nope",
        other / "checkpoints" / "step-00000006",
        hf_ref / "checkpoint-6",
        run / "checkpoints" / "step-00000003",
    ]
    lines = spawn(_hf_refusals, 1, str(run), [str(p) for p in paths])[0]
    err = capfd.readouterr().err
    assert lines[0] == (
        f"UsageError: Trainer.train(resume_from_checkpoint)='{tmp_path / 'nope'}': no such file or "
        "directory; pass another tool's checkpoint folder (e.g. out/checkpoint-500), or leave it out "
        "to resume the run's newest valid checkpoint"
    )
    assert lines[1].startswith("UsageError: ")
    assert f"continue that run with shardkeeper train --run-dir {other}" in lines[1]
    assert lines[2:] == ["ran to step 6", "ran to step 6"]
    assert (
        f"'{hf_ref / 'checkpoint-6'}': not imported, the run already has checkpoints; resuming from its newest "
        "valid one (step-00000006)"
    ) in err
    assert "is a checkpoint of this run: resuming from the run's newest valid checkpoint (step-00000006)" in err
    assert [e["kind"] for e in lineage(run)].count("imported") == 1
