"""Fast tests of what makes validation and retention cheap at scale (bench/scale_bench.py), and that the
cheap paths never accept a checkpoint that changed since it passed:

* ``ckpt.validate.checks`` remembers a quick pass for the exact bytes of manifest.json and ``.metadata`` (SHA-256);
  every directory-dependent check still runs each time;
* ``ckpt.validate.retention.plan`` validates lazily and decides exactly what ``plan_retention`` decides over every
  checkpoint's validity.

The checkpoints are small synthetic DCP ones written the way the scale bench writes them: real files, a real
``.metadata`` (torch's own Metadata, pickled as DCP does) and a real manifest.
"""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt.commit.layout import RunDir
from ckpt.validate import checks as V
from ckpt.validate import retention
from ckpt.validate.retention import plan, plan_retention
from tests.reliability.hostile import plant_metadata

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 4


def write_checkpoint(ckpt: Path, ranks: int, step: int, files_per_rank: int = 2) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckpt.commit.hashing import hash_file
    from ckpt.commit.manifest import write_manifest
    from schemas import ClusterTopology
    from schemas.checkpoint import CheckpointManifest, DtypePolicy, FileEntry, Fingerprint, TensorEntry
    from shardkeeper.config import load_run_spec

    ckpt.mkdir(parents=True)
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    files = []
    for r in range(ranks):
        for i in range(files_per_rank):
            name, fname = f"model.block{r}.w{i}", f"__{r}_{i}.distcp"
            (ckpt / fname).write_bytes(bytes(4 * CHUNK))
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([CHUNK]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([CHUNK]))],
            )
            storage[MetadataIndex(fqn=name, offset=torch.Size([0]), index=0)] = _StorageInfo(
                relative_path=fname, offset=0, length=4 * CHUNK
            )
            size, digest = hash_file(ckpt / fname)
            files.append(FileEntry(path=fname, size=size, xxh3_128=digest, rank=r))
    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage)))
    size, digest = hash_file(ckpt / ".metadata")
    files.append(FileEntry(path=".metadata", size=size, xxh3_128=digest))
    manifest = CheckpointManifest(
        format="dcp",
        run_name="scale",
        step=step,
        tokens=step,
        samples=step,
        segment=0,
        reason="interval",
        created_at=datetime.now(UTC).isoformat(),
        files=files,
        tensors=[TensorEntry(name=n, shape=[CHUNK], dtype="float32") for n in state],
        model_signature="0" * 64,
        topology=ClusterTopology(nodes=1, procs_per_node=ranks),
        dtype_policy=DtypePolicy(compute="float32", reduce="float32"),
        code_version="test",
        fingerprint=Fingerprint(model={}, optim={}, optim_step=float(step)),
        run_spec=load_run_spec(ROOT / "configs" / "tiny.yaml"),
    )
    write_manifest(ckpt, manifest)


@pytest.fixture()
def run(tmp_path: Path) -> Iterator[RunDir]:
    V.forget_known()
    rd = RunDir.at(tmp_path / "run")
    for step in (10, 20, 30):
        write_checkpoint(rd.checkpoint(step), ranks=3, step=step)
    yield rd
    V.forget_known()


@pytest.fixture()
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every parse of a .metadata (the expensive, allow-list part of a quick validation), by directory."""
    from ckpt.formats.dcp import _metadata as dcp_metadata

    seen: list[Path] = []
    real = dcp_metadata.read_layout

    def counting(ckpt_dir: Any, data: bytes | None = None, file_sizes: Any = None) -> Any:
        seen.append(Path(ckpt_dir))
        return real(ckpt_dir, data, file_sizes)

    monkeypatch.setattr("ckpt.formats.dcp.format.read_layout", counting)
    return seen


# ----------------------------------------------------------------------------------------- remembered passes
def test_a_pass_is_remembered_and_directory_checks_still_run(run: RunDir, parses: list[Path]) -> None:
    ckpt = run.checkpoint(30)
    assert V.validate(ckpt).valid and parses == [ckpt]
    assert V.validate(ckpt).valid and parses == [ckpt]  # not parsed again
    # every directory-dependent check runs on the remembered path too
    victim = ckpt / "__1_0.distcp"
    victim.write_bytes(bytes(4 * CHUNK - 1))
    report = V.validate(ckpt)
    assert not report.valid and "__1_0.distcp: 15 bytes, manifest says 16" in report.errors[0]
    victim.write_bytes(bytes(4 * CHUNK))
    assert V.validate(ckpt).valid
    (ckpt / "stray.bin").write_bytes(b"x")
    assert "stray.bin: file not listed in the manifest" in V.validate(ckpt).errors[0]
    (ckpt / "stray.bin").unlink()
    victim.unlink()
    os.symlink(ckpt.parent / "step-00000020" / "__1_0.distcp", victim)
    assert "__1_0.distcp: is a symlink" in V.validate(ckpt).errors[0]
    victim.unlink()
    assert "__1_0.distcp: listed in the manifest but missing" in V.validate(ckpt).errors[0]
    victim.mkdir()
    assert "__1_0.distcp: is not a regular file" in V.validate(ckpt).errors[0]
    victim.rmdir()
    victim.write_bytes(bytes(4 * CHUNK))
    moved = run.checkpoints / "step-00000031"
    ckpt.rename(moved)  # a checkpoint renamed to another step: its manifest belongs elsewhere
    assert "says step 30 inside step-00000031" in V.validate(moved).errors[0]
    moved.rename(ckpt)
    assert V.validate(ckpt).valid and parses == [ckpt]


def test_changed_metadata_or_manifest_is_parsed_again(run: RunDir, parses: list[Path], tmp_path: Path) -> None:
    ckpt = run.checkpoint(30)
    assert V.validate(ckpt).valid
    # .metadata of another checkpoint (references other files), sizes and checksums made to match
    other = tmp_path / "other"
    write_checkpoint(other, ranks=2, step=30)
    plant_metadata(ckpt, (other / ".metadata").read_bytes())
    report = V.validate(ckpt)
    assert not report.valid and "listed in the manifest but not referenced by .metadata" in report.errors[0]
    assert len(parses) == 2
    # a hostile .metadata after a remembered pass: parsed (and refused), never vouched for
    V.forget_known()
    write_checkpoint(tmp_path / "fresh", ranks=3, step=30)
    for f in (tmp_path / "fresh").iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    assert V.validate(ckpt).valid
    sentinel = tmp_path / "SENTINEL"
    evil = (
        b"\x80\x04\x8c\x02os\x8c\x06system\x93(\x8c"
        + bytes([6 + len(str(sentinel))])
        + f"touch {sentinel}".encode()
        + b"tR."
    )
    plant_metadata(ckpt, evil)
    report = V.validate(ckpt)
    assert not report.valid and "refused to unpickle" in report.errors[0] and not sentinel.exists()
    # the manifest edited (rehashed, same files): parsed again
    V.forget_known()
    for f in (tmp_path / "fresh").iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    assert V.validate(ckpt).valid
    n = len(parses)
    raw = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text(raw.replace('"code_version": "test"', '"code_version": "test2"'))
    assert V.validate(ckpt).valid and len(parses) == n + 1


def test_manifest_that_lies_about_sizes_is_not_remembered(run: RunDir, parses: list[Path]) -> None:
    """A failing validation remembers nothing: fixing the files is seen, breaking them again too."""
    ckpt = run.checkpoint(30)
    (ckpt / "__0_0.distcp").write_bytes(b"short")
    assert not V.validate(ckpt).valid and not V.validate(ckpt).valid
    assert V._KNOWN == {}
    (ckpt / "__0_0.distcp").write_bytes(bytes(4 * CHUNK))
    assert V.validate(ckpt).valid


def test_the_commits_check_is_remembered_for_the_manifest_it_writes(tmp_path: Path, parses: list[Path]) -> None:
    """check_staged (rank 0, before the rename) parses .metadata once; the validation right after the commit
    (retention, the post-commit re-read) does not parse it again -- unless a byte changed."""
    from ckpt.commit.manifest import read_manifest, write_manifest

    V.forget_known()
    rd = RunDir.at(tmp_path / "run")
    write_checkpoint(rd.checkpoint(40), ranks=2, step=40)
    manifest = read_manifest(rd.checkpoint(40))
    partial = rd.checkpoints / "step-00000040.partial"
    rd.checkpoint(40).rename(partial)
    (partial / "manifest.json").unlink()
    V.forget_known()
    assert V.check_staged(partial, manifest) == [] and len(parses) == 1
    write_manifest(partial, manifest)
    partial.rename(rd.checkpoint(40))
    assert V.validate(rd.checkpoint(40)).valid and len(parses) == 1
    (rd.checkpoint(40) / "__1_1.distcp").write_bytes(b"")
    assert not V.validate(rd.checkpoint(40)).valid
    (rd.checkpoint(40) / "__1_1.distcp").write_bytes(bytes(4 * CHUNK))
    raw = (rd.checkpoint(40) / ".metadata").read_bytes()
    (rd.checkpoint(40) / ".metadata").write_bytes(raw[:-1] + b"\x00")  # same size, other bytes: parsed again
    assert not V.validate(rd.checkpoint(40)).valid and len(parses) == 2


def test_deep_never_uses_a_remembered_pass(run: RunDir) -> None:
    ckpt = run.checkpoint(30)
    assert V.validate(ckpt).valid
    path = ckpt / "__2_1.distcp"
    path.write_bytes(b"\x01" * (4 * CHUNK))  # same size, other bytes
    assert V.validate(ckpt).valid  # quick checks sizes only, as always
    report = V.validate(ckpt, deep=True)
    assert not report.valid and "checksum" in report.errors[0]


def test_remembered_passes_are_bounded(run: RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(V, "_KNOWN_MAX_FILES", 10)  # one checkpoint holds 7 files
    for step in (10, 20, 30):  # same file names and sizes: one shared list
        assert V.validate(run.checkpoint(step)).valid
    assert len(V._KNOWN) == 3 and len({id(k.files) for k in V._KNOWN.values()}) == 1
    rd = RunDir.at(tmp_path / "other")
    write_checkpoint(rd.checkpoint(40), ranks=2, step=40)  # another list: over the bound, the oldest go
    assert V.validate(rd.checkpoint(40)).valid
    assert [k.step for k in V._KNOWN.values()] == [40]


def test_fifo_manifest_is_not_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    os.mkfifo(ckpt / "manifest.json")
    report = V.validate(ckpt)  # would block forever if the fifo were opened for a blocking read
    assert not report.valid


# ----------------------------------------------------------------------------------------- retention
@pytest.mark.parametrize("seed", range(300))
def test_lazy_plan_equals_plan_retention(seed: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(1, 60), rng.randint(1, 9)))
    valid = {s for s in steps if rng.random() < 0.7}
    verified = {s for s in steps if rng.random() < 0.4}
    keep_last = rng.randint(1, 4)
    keep_every = rng.choice([None, 0, 2, 5, 10])
    rd = RunDir.at(tmp_path / "run")
    for s in steps:
        rd.checkpoint(s).mkdir(parents=True)
        (rd.checkpoint(s) / "manifest.json").write_text("{}")
    calls: list[int] = []

    class Report:
        def __init__(self, ok: bool) -> None:
            self.valid = ok

    def fake_validate(p: Path) -> Report:
        calls.append(int(p.name[5:]))
        return Report(int(p.name[5:]) in valid)

    monkeypatch.setattr(retention, "validate", fake_validate)
    monkeypatch.setattr(retention, "is_verified", lambda _rd, p: int(p.name[5:]) in verified)
    got = plan(rd, keep_last=keep_last, keep_every=keep_every)
    vv = verified & valid
    protect = {max(vv)} if vv else set(valid)
    expect = plan_retention(steps, valid, keep_last=keep_last, keep_every=keep_every, protect=protect)
    assert got.doomed == expect, (steps, valid, verified, keep_last, keep_every)
    assert got.newest_valid == (max(valid) if valid else None)
    assert len(calls) == len(set(calls))  # each checkpoint validated at most once


def test_plan_reads_only_what_decides(run: RunDir, parses: list[Path]) -> None:
    """As the trainer calls it after a commit: the older checkpoints verified, the newest not yet. The oldest goes
    whatever its state, so it is not read; the two kept ones are parsed once and remembered."""
    for step in (10, 20):
        V.record_verified(run, run.checkpoint(step), how="reread", bytes_read=0)
    parses.clear()
    assert plan(run, keep_last=2, keep_every=None).doomed == {10}
    assert sorted(p.name for p in parses) == ["step-00000020", "step-00000030"]
    assert plan(run, keep_last=2, keep_every=None).doomed == {10} and len(parses) == 2
    # a kept checkpoint that broke since is seen by the next plan (sizes are re-checked every time)
    (run.checkpoint(20) / "__0_0.distcp").write_bytes(b"")
    decided = plan(run, keep_last=2, keep_every=None)
    assert decided.validity[20] is False and decided.protected == 10 and decided.doomed == {20}
    assert retention.apply_retention(run, keep_last=2, keep_every=None) == [run.checkpoint(20)]
    assert [p.name for p in run.committed()] == ["step-00000010", "step-00000030"]


def test_nothing_verified_validates_everything(run: RunDir, parses: list[Path]) -> None:
    assert plan(run, keep_last=1, keep_every=None).doomed == set()
    assert len(parses) == 3
