"""Export stage: a real 2-rank checkpoint (trained once per module) -> from_pretrained folder.

Run: /work/venv/bin/pytest tests/test_export.py -q
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from ckpt import export as ex
from ckpt.commit.hashing import hash_file
from ckpt.commit.manifest import read_manifest, write_manifest
from ckpt.export import export_checkpoint
from ckpt.formats.dcp.reader import DCPTensorReader, read_metadata
from schemas import FileEntry, RunSpec, TensorEntry
from schemas.errors import CheckpointError, ExportError
from tests.harness import spawn
from trainer.segment import run_segment

ROOT = Path(__file__).resolve().parents[1]
STEP_DIR = "step-00000010"


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained 10 steps on 2 gloo ranks; its final committed checkpoint."""
    run_dir = tmp_path_factory.mktemp("run")
    spec = RunSpec.model_validate(yaml.safe_load((ROOT / "configs/tiny.yaml").read_text()))
    (run_dir / "run.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert spawn(run_segment, 2, str(run_dir), 10, 0) == [0, 0]
    path = run_dir / "checkpoints" / STEP_DIR
    assert (path / "manifest.json").is_file()
    return path


@pytest.fixture(scope="module")
def fp32_export(ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("exports") / "fp32"
    return out, export_checkpoint(ckpt, out)


def copy_ckpt(ckpt: Path, dest: Path) -> Path:
    shutil.copytree(ckpt, dest)
    return dest


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def reference_model(ckpt: Path) -> torch.nn.Module:
    """A fresh transformers model of the run's config with the checkpoint's weights read through DCP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = read_manifest(ckpt).run_spec.model
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.model_type, **spec.config))
    with DCPTensorReader(ckpt) as reader:
        sd = {k.removeprefix("model."): reader.read(k) for k in reader.tensor_keys() if k.startswith("model.")}
    model.load_state_dict(sd, strict=True)
    return model.eval()


def assert_nothing_left(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary folder left behind"


# ----------------------------------------------------------------------------------------- round trip
def test_round_trip_logits(ckpt: Path, fp32_export) -> None:
    from transformers import AutoModelForCausalLM

    out, res = fp32_export
    assert res.num_shards == 1 and sorted(res.files) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert {name: sha256(out / name) for name in res.files} == res.files
    names = set(tensors_of(out))
    assert not any("exp_avg" in n or n.startswith(("optim", "model.model.")) for n in names)
    assert res.num_tensors == len(names) and res.total_bytes == sum(t.nbytes for t in tensors_of(out).values())

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ref = reference_model(ckpt)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]


def test_multi_shard_index(ckpt: Path, fp32_export, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    single, _ = fp32_export
    out = tmp_path / "sharded"
    limit = 50_000  # the 256x64 fp32 embeddings (65,536 bytes) are larger: each goes alone in its own shard
    with caplog.at_level(logging.WARNING, logger="ckpt.export"):
        res = export_checkpoint(ckpt, out, max_shard_size=limit)
    assert "model.embed_tokens.weight is 65536 bytes" in caplog.text
    index = json.loads((out / ex.INDEX_FILE).read_text())
    shard_names = ex.shard_file_names(res.num_shards)
    assert res.num_shards > 3 and sorted(set(index["weight_map"].values())) == shard_names
    expected = tensors_of(single)
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == res.total_bytes == sum(t.nbytes for t in expected.values())
    for name in shard_names:
        with safe_open(str(out / name), framework="pt") as st:
            keys = list(st.keys())
            assert all(index["weight_map"][k] == name for k in keys)
            data = sum(st.get_tensor(k).nbytes for k in keys)
        assert data <= limit or len(keys) == 1
    assert set(res.files) == set(shard_names) | {ex.INDEX_FILE, "config.json", "generation_config.json", "README.md"}
    got = tensors_of(out)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters()) > 0


def test_bf16_export(ckpt: Path, fp32_export, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single, _ = fp32_export
    res = export_checkpoint(ckpt, tmp_path / "bf16", dtype="bf16")
    assert res.dtype == "bfloat16"
    got, ref = tensors_of(tmp_path / "bf16"), tensors_of(single)
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


def test_byte_reproducible(ckpt: Path, fp32_export, tmp_path: Path) -> None:
    first, res1 = fp32_export
    res2 = export_checkpoint(ckpt, tmp_path / "again", progress=True)  # the bar changes no byte
    assert res1.files == res2.files
    assert {p.name: sha256(p) for p in first.iterdir()} == {p.name: sha256(p) for p in (tmp_path / "again").iterdir()}
    a = export_checkpoint(ckpt, tmp_path / "a", dtype="bfloat16", max_shard_size="100KB")
    b = export_checkpoint(ckpt, tmp_path / "b", dtype="bfloat16", max_shard_size=100_000)
    assert a.files == b.files and a.num_shards > 1


def test_assembled_path_matches_streamed(
    ckpt: Path, fp32_export, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk layouts that are not row blocks are assembled per tensor: the bytes must be the same."""
    _, res = fp32_export
    monkeypatch.setattr(ex.ExportTensor, "rowwise", lambda self: False)
    assert export_checkpoint(ckpt, tmp_path / "assembled").files == res.files


# ------------------------------------------------------------------------------ tied, prefixed, strided
def synthetic_checkpoint(
    base: Path,
    dest: Path,
    *,
    tie: bool,
    lm_head_equal: bool = True,
    extra: bool = False,
    inventory_ok: bool = True,
    record: bool = False,
) -> tuple[Path, dict]:
    """A single-process DCP checkpoint of a tied-embedding model whose keys carry torch.compile / DDP
    prefixes and one weight stored column-major, with a manifest adapted from ``base``; with ``record``
    its manifest holds the model's hf_model record (the export needs no transformers), else none."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model import hf_model_record

    manifest = read_manifest(base)
    config = {**manifest.run_spec.model.config, "tie_word_embeddings": tie}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config))
    hf_model = hf_model_record(model) if record else None
    sd = model.state_dict()
    sd = {k: v.clone() for k, v in sd.items()}
    if not lm_head_equal:
        sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    w = sd["model.layers.0.mlp.up_proj.weight"]
    sd["model.layers.0.mlp.up_proj.weight"] = w.t().contiguous().t()  # same values, column-major storage
    if extra:  # a tensor the transformers model does not have
        sd["model.extra_scale"] = torch.ones(3)
    # DDP's "module." in front of everything, torch.compile's "_orig_mod." inside each block
    keyed = {"module." + re.sub(r"(layers\.\d+\.)", r"\1_orig_mod.", k): v for k, v in sd.items()}
    dcp.save({"model": keyed, "trainer": {"step": torch.tensor(1)}}, checkpoint_id=dest)
    files = [
        FileEntry(path=p.name, size=hash_file(p)[0], xxh3_128=hash_file(p)[1])
        for p in sorted(dest.iterdir())
        if p.is_file()
    ]
    inventory = [
        TensorEntry(name=f"model.{k}", shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."))
        for k, v in sorted(keyed.items())
    ][: None if inventory_ok else -1]
    spec = manifest.run_spec.model_copy(update={"model": manifest.run_spec.model.model_copy(update={"config": config})})
    one_rank = manifest.topology.model_copy(update={"nodes": 1, "procs_per_node": 1})  # one process saved it
    write_manifest(
        dest,
        manifest.model_copy(
            update={
                "step": 1,
                "topology": one_rank,
                "files": files,
                "run_spec": spec,
                "tensors": inventory,
                "hf_model": hf_model,
            }
        ),
    )
    return dest, sd


def test_tied_and_prefixed_keys(ckpt: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src, sd = synthetic_checkpoint(ckpt, tmp_path / "step-00000001", tie=True)
    out = tmp_path / "export"
    res = export_checkpoint(src, out)
    got = tensors_of(out)
    assert "lm_head.weight" not in got and set(got) == set(sd) - {"lm_head.weight"}
    assert all(torch.equal(got[k], sd[k]) for k in got)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])
    # the same checkpoint with the hf_model record: the ties come from it, and every byte is the same
    src, _ = synthetic_checkpoint(ckpt, tmp_path / "recorded" / "step-00000001", tie=True, record=True)
    assert read_manifest(src).hf_model.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert export_checkpoint(src, tmp_path / "export-recorded").files == res.files


@pytest.mark.parametrize("record", [False, True])
def test_tied_but_different_is_refused(ckpt: Path, tmp_path: Path, record: bool) -> None:
    src, _ = synthetic_checkpoint(ckpt, tmp_path / "step-00000001", tie=True, lm_head_equal=False, record=record)
    with pytest.raises(ExportError, match="lm_head.weight differs from model.embed_tokens.weight"):
        export_checkpoint(src, tmp_path / "export")
    assert_nothing_left(tmp_path / "export")


def test_tensor_unknown_to_the_model_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """Declared untied, the copy starts before transformers has described the model; the check against
    the model still runs before the commit, and a refusal leaves nothing behind."""
    src, _ = synthetic_checkpoint(ckpt, tmp_path / "step-00000001", tie=False, extra=True)
    with pytest.raises(ExportError, match="unexpected tensors model.extra_scale"):
        export_checkpoint(src, tmp_path / "export")
    assert_nothing_left(tmp_path / "export")


def test_inventory_mismatch_is_refused(ckpt: Path, tmp_path: Path) -> None:
    src, _ = synthetic_checkpoint(ckpt, tmp_path / "step-00000001", tie=False, inventory_ok=False)
    missing = "holds model.module.model.norm.weight, which the manifest.s tensor inventory does not record"
    with pytest.raises(CheckpointError, match=missing):
        export_checkpoint(src, tmp_path / "export")
    assert_nothing_left(tmp_path / "export")


# ------------------------------------------------------------------------------ the hf_model record
def without_record(ckpt: Path, dest: Path) -> Path:
    """A copy of ``ckpt`` whose manifest has no hf_model record, as checkpoints written before it."""
    src = copy_ckpt(ckpt, dest)
    write_manifest(src, read_manifest(src).model_copy(update={"hf_model": None}))
    return src


def test_manifest_records_the_model(ckpt: Path) -> None:
    import transformers

    rec = read_manifest(ckpt).hf_model
    assert rec is not None and rec.transformers_version == transformers.__version__
    assert rec.config["architectures"] == ["LlamaForCausalLM"] and rec.config["model_type"] == "llama"
    assert rec.config["hidden_size"] == 64 and rec.tied == {} and rec.generation_config is not None
    raw = json.loads((ckpt / "manifest.json").read_text())
    assert raw["hf_model"]["config"] == rec.config  # plain JSON in the manifest


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recorded_config_json_is_the_transformers_one(ckpt: Path, dtype: str) -> None:
    """config.json and generation_config.json from the record are those transformers writes for the
    model that run_spec.model builds, byte for byte."""
    manifest = read_manifest(ckpt)
    recorded = ex.model_from_record(ckpt, manifest, dtype)
    built = ex.describe_model(ckpt, manifest, dtype)
    assert recorded is not None and recorded.shapes is None and built.shapes is not None
    assert recorded.config_json == built.config_json and json.loads(recorded.config_json)["dtype"] == dtype
    assert recorded.generation_json == built.generation_json
    assert (recorded.architecture, recorded.tied) == (built.architecture, built.tied)


def test_export_without_a_record_uses_transformers_and_writes_the_same_bytes(
    ckpt: Path, fp32_export, tmp_path: Path
) -> None:
    _, res = fp32_export
    old = without_record(ckpt, tmp_path / STEP_DIR)
    assert read_manifest(old).hf_model is None
    assert export_checkpoint(old, tmp_path / "out").files == res.files
    assert (ckpt / "manifest.json").read_text() != (old / "manifest.json").read_text()


def test_export_with_a_record_does_not_import_transformers(ckpt: Path, fp32_export, tmp_path: Path) -> None:
    """In a fresh interpreter: the recorded checkpoint exports (same bytes) without importing transformers;
    the same checkpoint without its record does import it, to build the model."""
    import subprocess
    import sys

    _, res = fp32_export
    old = without_record(ckpt, tmp_path / STEP_DIR)
    script = (
        "import json, sys\n"
        "from ckpt.export import export_checkpoint\n"
        "a = export_checkpoint(sys.argv[1], sys.argv[2]).files\n"
        "before = 'transformers' in sys.modules\n"
        "b = export_checkpoint(sys.argv[3], sys.argv[4], dtype='bfloat16').files\n"
        "print(json.dumps({'a': a, 'before': before, 'after': 'transformers' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(ckpt), str(tmp_path / "recorded"), str(old), str(tmp_path / "old")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"a": res.files, "before": False, "after": True}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("architectures", None, "hf_model.config.architectures is None"),
        ("model_type", "gpt2", "hf_model.config.model_type is 'gpt2' but run_spec.model.model_type is 'llama'"),
    ],
)
def test_inconsistent_record_is_refused(ckpt: Path, tmp_path: Path, field: str, value: object, message: str) -> None:
    src = copy_ckpt(ckpt, tmp_path / STEP_DIR)
    manifest = read_manifest(src)
    rec = manifest.hf_model.model_copy(update={"config": {**manifest.hf_model.config, field: value}})
    write_manifest(src, manifest.model_copy(update={"hf_model": rec}))
    with pytest.raises(CheckpointError, match=re.escape(message)) as err:
        export_checkpoint(src, tmp_path / "out")
    assert "manifest.json" in str(err.value) and "\n" not in str(err.value)
    assert_nothing_left(tmp_path / "out")


# ------------------------------------------------------------------------------------------- refusals
def test_refuses_partial_dir(ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(ckpt, tmp_path / f"{STEP_DIR}.partial")
    with pytest.raises(CheckpointError, match=r"\.partial directory"):
        export_checkpoint(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def test_refuses_missing_shard(ckpt: Path, tmp_path: Path) -> None:
    src = copy_ckpt(ckpt, tmp_path / STEP_DIR)
    (src / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: listed in the manifest but missing"):
        export_checkpoint(src, tmp_path / "out")
    assert_nothing_left(tmp_path / "out")


def _model_chunk(src: Path) -> tuple[Path, int, int]:
    md = read_metadata(src)
    idx, info = next((i, v) for i, v in md.storage_data.items() if i.fqn == "model.model.embed_tokens.weight")
    return src / info.relative_path, info.offset, info.length


@pytest.mark.parametrize(
    "where, message", [("data", "checksum mismatch against the manifest"), ("record", "not a readable tensor record")]
)
def test_refuses_corrupted_shard(ckpt: Path, tmp_path: Path, where: str, message: str) -> None:
    """A flipped model byte is refused before the commit: the save recorded no CRC-32 for it (torch's CRC is off
    for shardkeeper's DCP saves), so the export checks the file against the manifest's xxh3-128."""
    from ckpt.formats.pickle.torchzip import TorchZip

    src = copy_ckpt(ckpt, tmp_path / STEP_DIR)
    path, offset, length = _model_chunk(src)
    with open(path, "rb") as f, TorchZip(f.fileno(), offset, length, str(path)) as zf:
        assert not any(info.CRC for info in zf.entries.values()), "the save recorded CRC-32s"
    pos = offset + length // 2 if where == "data" else offset  # the middle of the storage bytes / the zip signature
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0xFF
    path.write_bytes(raw)  # same size: quick validation passes, the copy must notice
    with pytest.raises(CheckpointError, match=message) as err:
        export_checkpoint(src, tmp_path / "out")
    assert path.name in str(err.value) and "\n" not in str(err.value)
    assert_nothing_left(tmp_path / "out")


def test_refuses_existing_out_dir_unless_overwrite(ckpt: Path, fp32_export, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ExportError, match="already exists; pass overwrite=True"):
        export_checkpoint(ckpt, out)
    assert (out / "stale.txt").exists()
    res = export_checkpoint(ckpt, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(res.files) and res.files == fp32_export[1].files
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_bad_options(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="dtype 'int8' is not supported; use one of float32, bfloat16, float16"):
        export_checkpoint(ckpt, tmp_path / "out", dtype="int8")
    with pytest.raises(ExportError, match="max_shard_size '5 parsecs' is not a size"):
        export_checkpoint(ckpt, tmp_path / "out", max_shard_size="5 parsecs")
    with pytest.raises(ExportError, match="inside the checkpoint"):
        export_checkpoint(ckpt, ckpt / "export")
    assert_nothing_left(tmp_path / "out")
    assert not (ckpt / "export").exists()


def test_parse_size_and_plan() -> None:
    assert ex.parse_size("5GB") == 5 * 10**9 and ex.parse_size("2GiB") == 2 << 30 and ex.parse_size(123) == 123
    assert ex.plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 2)], 8) == [["a", "b"], ["c"], ["d"]]
    assert ex.shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_stream_crc_reads_gaps_and_rechecks_out_of_order(tmp_path: Path) -> None:
    """The CRC of a ZeRO partition computed from the pieces the copy reads: bytes between pieces
    (ZeRO-3 padding) and after the last are read to complete it; an entry read out of order is checked
    whole at the end; a flipped byte anywhere, read by the copy or not, is refused."""
    import os
    import zlib

    data = bytes(range(256)) * 64
    path = tmp_path / "part.bin"
    path.write_bytes(b"head" + data + b"tail")
    pool = ex.BufferPool(1, 4096)
    fd = os.open(path, os.O_RDONLY)
    try:

        def run(pieces: list[tuple[int, int]], crc: int = zlib.crc32(data)) -> None:
            entry = ex.Entry(path, fd, 4, len(data), crc, "storage 0 (a partition)")
            check = ex.StreamCrc([entry])
            for start, length in pieces:
                check(fd, 4 + start, memoryview(data)[start : start + length])
            check.finish(pool)

        run([(0, 1000), (1000, 3000), (5000, 100), (9000, 7000)])  # gaps and a tail
        run([(5000, 100), (0, 1000)])  # out of order
        run([])  # nothing read by the copy
        with pytest.raises(CheckpointError, match=r"part\.bin: CRC-32 mismatch in storage 0 \(a partition\)"):
            run([(0, 1000), (5000, 100)], crc=zlib.crc32(data) ^ 1)  # what the copy read differs
        os.pwrite(fd_rw := os.open(path, os.O_WRONLY), b"\xff", 4 + 4000)  # in a gap the copy skips
        os.close(fd_rw)
        with pytest.raises(CheckpointError, match="CRC-32 mismatch"):
            run([(0, 1000), (1000, 3000), (5000, 100)])
    finally:
        os.close(fd)


def test_export_stage_with_a_relative_out_dir_records_an_absolute_uri(
    ckpt: Path, fp32_export, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shardkeeper export CKPT exports/x` from the run directory: same bytes, lineage URI absolute."""
    from ckpt.commit.lineage import read_events
    from shardkeeper.stages import export_and_record as export_stage

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt.parent.parent / "run.yaml", run / "run.yaml")
    copy_ckpt(ckpt, run / "checkpoints" / ckpt.name)
    monkeypatch.chdir(run)
    export_stage(Path("checkpoints") / ckpt.name, "exports/x")
    out, _ = fp32_export
    assert sha256(run / "exports" / "x" / "model.safetensors") == sha256(out / "model.safetensors")
    (event,) = [e for e in read_events(run) if e.kind == "export"]
    assert event.uri == (run / "exports" / "x").resolve().as_uri()


@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
def test_an_export_of_a_memory_snapshot_recycled_while_read_fails_as_retired(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deep: bool
) -> None:
    """The older of two memory snapshots is exported while training runs: its files are opened and hashed (quick)
    or validated (deep), then the next snapshot recycles it and overwrites its files in place (one model byte
    differs, the layout is the same). The export must not commit the next snapshot's bytes under this step: it
    fails in one line, as retired, and leaves no folder."""
    from ckpt.commit.layout import RunDir
    from ckpt.formats.dcp import direct_io as dio
    from ckpt.memtier import recycle as memtier_recycle
    from ckpt.memtier import tier as memtier
    from schemas.errors import CheckpointRetired

    mem, run = RunDir(tmp_path / "shm"), RunDir.at(tmp_path / "run")
    run.root.mkdir()
    lock = memtier.TierLock(mem)
    assert memtier.claim(mem, run, lock) is None
    old = mem.checkpoints / "step-00000010"
    shutil.copytree(ckpt, old)
    shutil.copytree(ckpt, mem.checkpoints / "step-00000012")
    chunk, offset, length = _model_chunk(old)
    real = ex.write_shards

    def next_snapshot_meanwhile(*a, **k):  # noqa: ANN002, ANN003
        bin_ = memtier_recycle.recycle(mem, 14, run)  # the node leader, before the snapshot of step 14
        assert bin_ is not None and memtier_recycle.recycle_dir(mem, 14) == bin_
        partial = mem.partial(14)
        partial.mkdir()
        fs = dio.HashingDirectFileSystem(direct=False, reuse=bin_)
        for f in sorted(bin_.glob("__*.distcp")):
            raw = bytearray(f.read_bytes())
            if f.name == chunk.name:
                raw[offset + length // 2] ^= 0xFF
            with fs.create_stream(partial / f.name, "wb") as s:
                s.write(bytes(raw))
        return real(*a, **k)

    monkeypatch.setattr(ex, "write_shards", next_snapshot_meanwhile)
    out = tmp_path / "out"
    with pytest.raises(CheckpointRetired) as e:
        export_checkpoint(old, out, deep=deep)
    assert "retired" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    lock.release()


def test_export_of_dot_from_inside_the_checkpoint_names_it(
    ckpt: Path, fp32_export, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shardkeeper export . OUT`` typed inside the checkpoint folder: the same bytes as by its full path."""
    first, _ = fp32_export
    monkeypatch.chdir(ckpt)
    res = export_checkpoint(".", tmp_path / "dot")
    assert res.files == fp32_export[1].files
    assert {p.name: sha256(p) for p in first.iterdir()} == {p.name: sha256(p) for p in (tmp_path / "dot").iterdir()}


def test_export_of_dot_from_a_removed_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``export .`` typed in a folder removed since (a retired checkpoint's): one line naming the fix."""
    gone = tmp_path / "step-00000005"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(
        CheckpointError, match=r"^\.: the current directory no longer exists .*give the checkpoint's full path$"
    ):
        export_checkpoint(".", tmp_path / "out")
