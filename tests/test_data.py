"""Real data (data.source: dataset): tokenized once into a content-keyed cache, chat samples with the loss on
assistant tokens only, held-out evaluation that does not depend on the world size, bad input refused before
any rank starts. In-process unit tests for the pipeline, one spawn pair for evaluation, and one short
training run on a jsonl dataset that resumes at another world size (and is refused on changed data)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from schemas import RunSpec
from schemas.errors import ConfigError
from tests.harness import make_text_rows, make_tokenizer, spawn, write_jsonl

MODEL = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "where did the cat sit"},
    {"role": "assistant", "content": "on a mat"},
    {"role": "user", "content": "and the rain"},
    {"role": "assistant", "content": "it fell over quiet hills"},
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with a tokenizer, a text dataset (train/validation jsonl), a chat dataset, and its own data cache."""
    root = tmp_path_factory.mktemp("data")
    rows = make_text_rows(400)
    make_tokenizer(root / "tok", [r["text"] for r in rows] + [m["content"] for m in CONVERSATION])
    write_jsonl(root / "text" / "train.jsonl", rows[:350])
    write_jsonl(root / "text" / "validation.jsonl", rows[350:])
    chats = [{"messages": CONVERSATION}] + [
        {"messages": [{"role": "user", "content": r["text"][:40]}, {"role": "assistant", "content": r["text"][40:]}]}
        for r in rows[:60]
    ]
    write_jsonl(root / "chat.jsonl", chats)
    old = os.environ.get("SHARDKEEPER_DATA_CACHE")
    os.environ["SHARDKEEPER_DATA_CACHE"] = str(root / "cache")
    yield root
    if old is None:
        os.environ.pop("SHARDKEEPER_DATA_CACHE", None)
    else:
        os.environ["SHARDKEEPER_DATA_CACHE"] = old


def spec_for(world: Path, *, eval_: bool = True, **data: object) -> RunSpec:
    raw = {
        "name": "data-test",
        "seed": 7,
        "global_batch_size": 4,
        "model": {"model_type": "llama", "config": MODEL},
        "data": {
            "source": "dataset",
            "dataset": str(world / "text"),
            "tokenizer": str(world / "tok"),
            "seq_len": 16,
            **data,
        },
        "checkpoint": {"interval": 2},
        "schedule": {"warmup_steps": 1, "total_steps": 20},
    }
    if eval_:
        raw["eval"] = {"interval": 2, "batches": 2, "split": "validation"}
    return RunSpec.model_validate(raw)


# ------------------------------------------------------------------------------------------ cache and key
def test_text_tokenized_once_into_a_content_keyed_cache(world: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from schemas import data_change
    from trainer.builtin.prepare import prepare_split

    spec = spec_for(world)
    first = prepare_split(spec, "train", vocab_size=320)
    tok = AutoTokenizer.from_pretrained(str(world / "tok"))
    rows = [json.loads(line) for line in (world / "text" / "train.jsonl").read_text().splitlines()]
    expect = [i for r in rows for i in [*tok(r["text"])["input_ids"], tok.eos_token_id]]
    got = np.memmap(first.path, dtype=first.dtype, mode="r")
    assert got.tolist() == expect and first.tokens == len(expect) and first.rows == 350 and not first.cached
    again = prepare_split(spec, "train", vocab_size=320)
    assert again.cached and again.key == first.key and again.path == first.path

    # the data changes -> another key, and the difference is named
    changed = tmp_path / "text"
    shutil.copytree(world / "text", changed)
    with open(changed / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": 999, "text": "one more row"}) + "\n")
    other = prepare_split(spec_for(world, dataset=str(changed)), "train", vocab_size=320)
    assert other.key != first.key
    assert "dataset's files changed" in (data_change(first.record(), other.record()) or "")

    # the tokenizer changes (same vocabulary size, other merges) -> another key, named
    make_tokenizer(tmp_path / "tok2", [r["text"][::-1] for r in rows])
    retok = prepare_split(spec_for(world, tokenizer=str(tmp_path / "tok2")), "train", vocab_size=320)
    assert retok.key != first.key
    assert "tokenizer's files changed" in (data_change(first.record(), retok.record()) or "")

    # a setting that decides the tokens -> another key
    no_eos = prepare_split(spec_for(world, append_eos=False), "train", vocab_size=320)
    assert no_eos.key != first.key and no_eos.tokens == first.tokens - 350
    assert "append_eos" in (data_change(first.record(), no_eos.record()) or "")


def test_parallel_tokenization_matches_one_process(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.builtin import prepare

    spec = spec_for(world, eval_=False)
    monkeypatch.setattr(prepare, "ROWS_PER_WORKER", 100)  # 350 rows -> 2 worker processes on 2 CPUs
    monkeypatch.setenv("SHARDKEEPER_DATA_CACHE", str(tmp_path / "c2"))
    two = prepare.prepare_split(spec, "train", num_proc=2)
    monkeypatch.setenv("SHARDKEEPER_DATA_CACHE", str(tmp_path / "c1"))
    one = prepare.prepare_split(spec, "train", num_proc=1)
    assert two.key == one.key
    assert Path(two.path).read_bytes() == Path(one.path).read_bytes()


# ------------------------------------------------------------------------------------------ sample order
def test_sample_order_is_a_function_of_seed_and_step() -> None:
    from trainer.builtin.data import GlobalOrderLoader

    tokens = np.arange(5000, dtype=np.uint16)
    mask = (np.arange(5000) % 3 != 0).astype(np.uint8)

    def union(loader: GlobalOrderLoader, step: int, world: int) -> list[list[int]]:
        rows = []
        for rank in range(world):
            for inputs, labels in loader.rank_batches(step, rank, world, None):
                rows += [[*i, *lab] for i, lab in zip(inputs.tolist(), labels.tolist())]
        return rows

    a = GlobalOrderLoader(tokens, 16, seed=3, global_batch=12, mask=mask)
    for step in (0, 5, 40):  # step 40 is past the first epoch (312 windows / 12 per step)
        ref = union(a, step, 1)
        fresh = GlobalOrderLoader(tokens, 16, seed=3, global_batch=12, mask=mask)  # no history: straight to the step
        assert union(fresh, step, 2) == ref and union(fresh, step, 3) == ref and union(a, step, 4) == ref
        assert a.targets(step) == sum(int(x != -100) for r in ref for x in r[16:])
    other = GlobalOrderLoader(tokens, 16, seed=4, global_batch=12, mask=mask)
    assert union(other, 0, 1) != union(a, 0, 1)


# ------------------------------------------------------------------------------------------ chat
def test_chat_mask_covers_exactly_the_assistant_turns(world: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.builtin.data import GlobalOrderLoader, open_prepared
    from trainer.builtin.prepare import chat_sample, prepare_split

    tok = AutoTokenizer.from_pretrained(str(world / "tok"))
    ids, mask = chat_sample(tok, CONVERSATION)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION, tokenize=False)
    targets = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(targets) == "on a mat<|end|>\nit fell over quiet hills<|end|>\n"
    # every other token -- system, user turns, role markers, the generation prompt -- is not a target
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == (
        "<s><|system|>be brief<|end|>\n<|user|>where did the cat sit<|end|>\n<|assistant|>"
        "<|user|>and the rain<|end|>\n<|assistant|>"
    )

    spec = spec_for(world, eval_=False, dataset=str(world / "chat.jsonl"), format="chat")
    prep = prepare_split(spec, "train", vocab_size=320)
    tokens, stored = open_prepared(prep)
    assert stored is not None and tokens[: len(ids)].tolist() == ids and stored[: len(ids)].tolist() == mask
    assert prep.targets == int(np.asarray(stored).sum()) < prep.tokens
    # the loader's labels: -100 wherever the *predicted* token is not an assistant token
    loader = GlobalOrderLoader(np.asarray(tokens), len(ids) - 1, seed=0, global_batch=1, mask=np.asarray(stored))
    from trainer.builtin.data import _rows

    inputs, labels = _rows(loader.tokens, loader.mask, [0], len(ids) - 1)
    assert inputs[0].tolist() == ids[:-1]
    assert labels[0].tolist() == [t if m else -100 for t, m in zip(ids[1:], mask[1:])]


# ------------------------------------------------------------------------------------------ bad input
def _bad(world: Path, tmp_path: Path, case: str) -> tuple[RunSpec, str]:
    if case == "missing column":
        return spec_for(world, text_column="body"), "no column 'body' (columns: id, text); set data.text_column"
    if case == "empty split":
        write_jsonl(tmp_path / "empty" / "train.jsonl", make_text_rows(20))
        (tmp_path / "empty" / "validation.jsonl").write_text("")
        return spec_for(world, dataset=str(tmp_path / "empty")), "validation"
    if case == "empty eval slice":
        spec = spec_for(world)
        return (
            spec.model_copy(update={"eval": spec.eval.model_copy(update={"split": "validation[:0]"})}),  # type: ignore[union-attr]
            "eval.split 'validation[:0]': selects 0 rows of",
        )
    if case == "eval smaller than its batches":
        write_jsonl(tmp_path / "small" / "train.jsonl", make_text_rows(60))
        write_jsonl(tmp_path / "small" / "validation.jsonl", make_text_rows(1, words=20))  # < 8 samples of 16
        return (
            spec_for(world, dataset=str(tmp_path / "small")),
            "but eval.batches 2 x 4 samples need 8 (the same samples would be scored again); set eval.batch",
        )
    if case == "unknown split":
        return spec_for(world, split="dev"), "data.split 'dev'"
    if case == "chat without assistant":
        rows = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "hello?"}]}]
        write_jsonl(tmp_path / "noasst.jsonl", rows)
        return (
            spec_for(world, eval_=False, dataset=str(tmp_path / "noasst.jsonl"), format="chat"),
            "line 2: a conversation without an assistant turn (roles: user)",
        )  # 1-based, as editors count
    if case == "tokenizer larger than embeddings":
        small = {**MODEL, "vocab_size": 256}
        spec = spec_for(world)
        return (
            spec.model_copy(update={"model": spec.model.model_copy(update={"config": small})}),
            "the tokenizer has 300 tokens but the model's embeddings hold 256 (model.config.vocab_size)",
        )
    if case == "no such dataset":
        return spec_for(world, dataset=str(tmp_path / "nope.jsonl")), "nope.jsonl: no such file or folder"
    if case == "hub id offline":
        return spec_for(
            world, eval_=False, dataset="someone/some-dataset"
        ), "'someone/some-dataset': not a local file or folder, and the Hugging Face Hub cannot provide it"
    raise AssertionError(case)


BAD = [
    "missing column",
    "empty split",
    "empty eval slice",
    "eval smaller than its batches",
    "unknown split",
    "chat without assistant",
    "tokenizer larger than embeddings",
    "no such dataset",
    "hub id offline",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_rank(world: Path, tmp_path: Path, case: str) -> None:
    from shardkeeper.stages import plan_topology, train_segment

    if case == "hub id offline" and os.environ.get("HF_HUB_OFFLINE") not in (None, "0"):
        pytest.skip("HF_HUB_OFFLINE is set: the id would be looked up in the local cache")
    spec, words = _bad(world, tmp_path, case)
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train_segment(spec, run, plan_topology(spec, 2, device="cpu"), 2)
    msg = str(err.value)
    assert words in msg and "\n" not in msg and "; " in msg, msg
    assert not run.exists()  # nothing written, no rank started


def test_the_training_data_key_does_not_cover_the_eval_split(world: Path, tmp_path: Path) -> None:
    """Eval may change between segments: editing validation.jsonl of a dataset folder changes the eval split's key
    only, so a resume is not refused; editing train.jsonl still is."""
    from schemas.data import data_change
    from trainer.builtin.prepare import prepare_data

    data = shutil.copytree(world / "text", tmp_path / "text")
    spec = spec_for(world, dataset=str(data))
    before = prepare_data(spec, progress=False)
    with open(data / "validation.jsonl", "a") as f:
        f.write(json.dumps({"id": 999, "text": "one more held-out row"}) + "\n")
    after = prepare_data(spec, progress=False)
    assert before is not None and after is not None and before.eval is not None and after.eval is not None
    assert after.train.key == before.train.key and after.eval.key != before.eval.key
    assert data_change(before.record(), after.record()) is None
    # a checkpoint recorded under the earlier rule (every file of the folder hashed) still resumes
    legacy = before.record().model_copy(update={"key": after.train.compat_keys[0], "compat_keys": []})
    assert len(after.train.compat_keys) == 1 and data_change(legacy, after.record()) is None
    with open(data / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": 1000, "text": "one more training row"}) + "\n")
    changed = prepare_data(spec, progress=False)
    assert changed is not None and "the dataset's files changed" in (
        data_change(before.record(), changed.record()) or ""
    )


def test_token_ids_beyond_the_vocabulary_are_refused(world: Path) -> None:
    from trainer.builtin.prepare import check_vocab, prepare_split

    prep = prepare_split(spec_for(world), "train", vocab_size=320)
    # a tokenizer whose ids exceed its own length (holes in the vocabulary): the ids are checked too
    odd = prep.model_copy(update={"vocab_size": 200, "max_id": 290})
    with pytest.raises(
        ConfigError, match=r"token id 290 is outside the model's vocabulary \(model.config.vocab_size 250\)"
    ):
        check_vocab(odd, 250, "data.tokenizer")


# ------------------------------------------------------------------------------------------ evaluation
def _eval_on_ranks(run_spec: dict, prepared: dict) -> dict:
    """Two ranks: the tiny model built and sharded as a segment does, then Trainer.evaluate over both; and on
    rank 0 alone (a one-rank group) the same weights unsharded, evaluated as by a one-rank segment."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from schemas import PreparedSplit, RunSpec
    from trainer.builtin.data import HeldOutLoader, open_prepared
    from trainer.builtin.loop import Trainer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model

    spec = RunSpec.model_validate(run_spec)
    env = init_distributed(None)
    alone = dist.new_group([0])
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    tokens, mask = open_prepared(PreparedSplit.model_validate(prepared))
    loader = HeldOutLoader(tokens, spec.data.seq_len, spec.eval_batch(), mask=mask)
    out = {"two": Trainer.evaluate(SimpleNamespace(spec=spec, eval_loader=loader, env=env, model=model))}  # type: ignore[arg-type]
    if env.rank == 0:
        one_env = SimpleNamespace(rank=0, world_size=1, device=env.device, ctrl_group=alone)
        out["one"] = Trainer.evaluate(
            SimpleNamespace(
                spec=spec,
                eval_loader=loader,
                env=one_env,  # type: ignore[arg-type]
                model=build_model(spec),
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_eval_loss_is_the_same_at_one_and_two_ranks(world: Path) -> None:
    from trainer.builtin.prepare import prepare_data

    spec = spec_for(world)
    spec = spec.model_copy(update={"eval": spec.eval.model_copy(update={"batches": 3})})  # type: ignore[union-attr]
    prepared = prepare_data(spec, vocab_size=320)
    assert prepared is not None and prepared.eval is not None
    ranks = spawn(_eval_on_ranks, 2, spec.model_dump(mode="json"), prepared.eval.model_dump(mode="json"))
    one, two = ranks[0]["one"], ranks[0]["two"]
    assert ranks[1]["two"] == two
    assert one["eval_tokens"] == two["eval_tokens"] == 3 * 4 * 16
    assert abs(one["eval_loss"] - two["eval_loss"]) <= 1e-6, (one, two)
    assert 4.0 < one["eval_loss"] < 7.0 and abs(one["eval_ppl"] - np.exp(one["eval_loss"])) < 1e-6 * one["eval_ppl"]


# ------------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_train_on_jsonl_resumes_and_refuses_changed_data(world: Path, tmp_path: Path) -> None:
    from ckpt.commit.lineage import read_events
    from ckpt.commit.manifest import read_manifest
    from shardkeeper.stages import plan_topology, train_segment

    data = tmp_path / "text"
    shutil.copytree(world / "text", data)
    spec = spec_for(world, dataset=str(data))
    run = tmp_path / "run"
    first = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), 4)
    assert first.status == "completed", first.failure
    manifest = read_manifest(run / "checkpoints" / "step-00000004")
    assert manifest.data is not None and manifest.data.dataset == str(data) and manifest.data.eval_key

    second = train_segment(spec, run, plan_topology(spec, 1, device="cpu"), 6)
    assert second.status == "completed" and second.start_step == 4, second.failure
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6]
    assert {r["world_size"] for r in rows if r["step"] > 4} == {1}
    evals = [e for e in read_events(run) if e.kind == "eval"]
    assert [e.step for e in evals] == [2, 4, 6] and evals[-1].data["eval_loss"] == rows[-1]["eval_loss"]

    # the same config, but the dataset's file changed under it: refused before anything is written
    with open(data / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": 1000, "text": "a row that was not there"}) + "\n")
    before = (run / "segments.jsonl").read_text()
    with pytest.raises(
        ConfigError,
        match=r"step-00000006: the run was trained on other data: the dataset's files "
        r"changed \(data.dataset .*text: sha256 \w+ at save, \w+ now\); resume with",
    ):
        train_segment(spec, run, plan_topology(spec, 1, device="cpu"), 8)
    assert (run / "segments.jsonl").read_text() == before

    from tasks.render import eval_by_step, loss_curve_png, read_metrics

    assert list(eval_by_step(read_metrics(run))) == [2, 4, 6]
    assert loss_curve_png(run, tmp_path / "loss.png") is not None


@pytest.mark.slow
def test_deepspeed_chat_with_eval_matches_fsdp2_and_resumes_exactly(world: Path, tmp_path: Path) -> None:
    """The same chat config (assistant-only loss) with an eval section under FSDP2 and DeepSpeed ZeRO-2 at 2 ranks:
    training and held-out losses agree within 1e-6 (the backends reduce in another order); the DeepSpeed run
    resumed from step 2 is bitwise the uninterrupted one, eval losses included. Three launches."""
    from shardkeeper.stages import plan_topology, train_segment
    from tests.harness import assert_bitwise, copy_run_until, max_rel, metrics

    spec = spec_for(world, dataset=str(world / "chat.jsonl"), format="chat", split="train[:80%]")
    spec = spec.model_copy(update={"eval": spec.eval.model_copy(update={"split": "train[80%:]"})})  # type: ignore[union-attr]
    ds_spec = spec.model_copy(update={"backend": "deepspeed"})
    runs = {"fsdp2": tmp_path / "fsdp2", "deepspeed": tmp_path / "ds"}
    for name, s in (("fsdp2", spec), ("deepspeed", ds_spec)):
        res = train_segment(s, runs[name], plan_topology(s, 2, device="cpu"), 4)
        assert res.status == "completed", (name, res.failure)
    fsdp, ds = metrics(runs["fsdp2"]), metrics(runs["deepspeed"])
    assert [s for s in sorted(ds) if "eval_loss" in ds[s]] == [2, 4]
    assert max_rel(fsdp, ds, range(1, 5)) <= 1e-6
    assert max_rel(fsdp, ds, range(2, 5, 2), key="eval_loss") <= 1e-6, (fsdp, ds)

    resumed = copy_run_until(runs["deepspeed"], tmp_path / "ds-resumed", 2)
    res = train_segment(ds_spec, resumed, plan_topology(ds_spec, 2, device="cpu"), 4)
    assert res.status == "completed" and res.start_step == 2, res.failure
    again = metrics(resumed)
    assert_bitwise(ds, again, range(3, 5))
    assert again[4]["eval_loss"] == ds[4]["eval_loss"]
