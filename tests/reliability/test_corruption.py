"""Every way a checkpoint can be torn, foreign or mislabelled is refused with one line naming the file.

Each case starts from a COPY of a real committed checkpoint (the session's 2-rank DCP ``tiny_run``, and a
module-scoped 2-rank DeepSpeed ZeRO-2 run: one torchrun-like launch each), applies one corruption, and
checks ``validate`` (quick), ``validate --deep`` and the export stage. Quick-detectable damage must be
refused by all three; damage only the bytes or the stored state reveal (a flipped bit of the right size,
an edited checksum or fingerprint) passes the quick check, is refused by ``--deep``, and by the export
when it reads those bytes (model tensors) or is asked to check them (``deep=True``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt.validate.checks import validate
from schemas.errors import ShardkeeperError
from shardkeeper.stages import export_and_record
from tests.reliability import corrupt as c

TINY_STEP = "step-00000005"
DS_STEP = "step-00000002"


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Path, Path], None]  # (checkpoint copy, scratch dir outside it)
    quick: bool | None  # refused by the quick check (False: only by --deep; None: either, e.g. a flip in
    # .metadata, which the quick check parses, may or may not break the parse)
    needle: str  # cause, in the first error line
    names: str  # file or directory name the line must carry
    export: str = "stage"  # "stage": the export stage refuses; "deep": ckpt.export with deep=True refuses


def _set_manifest(**fields: object) -> Callable[[Path, Path], None]:
    return lambda d, _: c.edit_manifest(d, lambda raw: raw.update(fields))


def _add_path(path: str) -> Callable[[Path, Path], None]:
    return lambda d, _: c.edit_manifest(d, lambda raw: raw["files"].append({**raw["files"][0], "path": path}))


def _edit_entry(name: str, **fields: object) -> Callable[[Path, Path], None]:
    return lambda d, _: c.edit_manifest(d, lambda raw: c.entry(raw, name).update(fields))


def _foreign_inventory(d: Path, _: Path) -> None:
    """A manifest of another architecture (wider MLP) beside these files."""

    def change(raw: dict) -> None:
        raw["run_spec"]["model"]["config"]["intermediate_size"] = 96
        raw["model_signature"] = "0" * 64
        for t in raw["tensors"]:
            if "mlp" in t["name"]:
                t["shape"] = [96 if s == 128 else s for s in t["shape"]]

    c.edit_manifest(d, change)


def _flip_model(d: Path, _: Path) -> None:
    c.flip_byte(*c.model_item_offset(d))


def _symlink_dir(d: Path, scratch: Path) -> None:
    """A manifest path whose parent folder is a symlink to a folder outside the checkpoint."""
    outside = scratch / "outside-zero" / "w"
    outside.mkdir(parents=True)
    (outside / "fp32.pt").write_bytes(b"x" * 8)
    os.symlink(scratch / "outside-zero", d / "zero")
    c.edit_manifest(
        d,
        lambda raw: raw["files"].append(
            {"path": "zero/w/fp32.pt", "size": 8, "xxh3_128": c.hash_file(outside / "fp32.pt")[1], "rank": 0}
        ),
    )


def _state_step(d: Path, _: Path) -> None:
    state = json.loads((d / "shardkeeper_state.json").read_text())
    state["step"] = 7
    (d / "shardkeeper_state.json").write_text(json.dumps(state))
    c.rehash(d)


def _rank_file_gone(d: Path, _: Path) -> None:
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (d / name).unlink()
    c.edit_manifest(d, lambda raw: raw.update(files=[e for e in raw["files"] if e["path"] != name]))


EMBED = "model.model.embed_tokens.weight"  # [256, 64]: two chunks of [128, 64] (2 ranks), at rows 0 and 128


def _metadata(change: Callable[[object], None]) -> Callable[[Path, Path], None]:
    return lambda d, _: c.edit_metadata(d, change)


def _record_past_end(md: object) -> None:
    info = c.record_of(md, EMBED, 1)
    info.length += 10_000_000


def _records_share_bytes(md: object) -> None:
    moved, target = c.record_of(md, EMBED, 1), c.record_of(md, EMBED, 0)
    moved.relative_path, moved.offset = target.relative_path, target.offset + 1


DCP_CASES = [
    # extents the layout check proves before any tensor is read (ckpt.formats.dcp._metadata.check_extents)
    Case(
        "chunks-overlap",
        _metadata(lambda md: c.move_chunk(md, EMBED, 1, offsets=(0, 0))),
        True,
        f"tensor {EMBED} [256, 64]: the chunks at [0, 0] of [128, 64] and at [0, 0] of [128, 64] overlap",
        ".metadata",
    ),
    Case(
        "chunks-gap",
        _metadata(lambda md: c.move_chunk(md, EMBED, 0, sizes=(100, 64))),
        True,
        "no chunk holds element [100, 0]",
        ".metadata",
    ),
    Case(
        "chunk-out-of-bounds",
        _metadata(lambda md: c.move_chunk(md, EMBED, 1, offsets=(200, 0))),
        True,
        "at [200, 0] of [128, 64], which reaches past the tensor",
        ".metadata",
    ),
    Case("record-past-file", _metadata(_record_past_end), True, "the checkpoint is truncated or crafted", ".metadata"),
    Case("records-share-bytes", _metadata(_records_share_bytes), True, "share bytes", ".metadata"),
    Case("bitflip-data", _flip_model, False, "checksum", ".distcp"),
    Case("bitflip-metadata", lambda d, _: c.flip_byte(d / ".metadata"), None, "", ".metadata", export="deep"),
    Case("truncated", lambda d, _: c.truncate(d / "__0_0.distcp"), True, "truncated", "__0_0.distcp"),
    Case("missing-file", lambda d, _: (d / "__1_1.distcp").unlink(), True, "missing", "__1_1.distcp"),
    Case("extra-file", lambda d, _: (d / "stray.bin").write_bytes(b"x"), True, "not listed", "stray.bin"),
    Case("extra-manifest-entry", _add_path("__3_0.distcp"), True, "", "__3_0.distcp"),
    Case("manifest-size", _edit_entry("__0_1.distcp", size=1), True, "manifest says 1", "__0_1.distcp"),
    Case(
        "manifest-checksum",
        _edit_entry("__0_1.distcp", xxh3_128="0" * 32),
        False,
        "checksum",
        "__0_1.distcp",
        export="deep",
    ),
    Case("manifest-step", _set_manifest(step=25), True, "says step 25", TINY_STEP),
    Case(
        "manifest-topology",
        lambda d, _: c.edit_manifest(d, lambda r: r["topology"].update(procs_per_node=1)),
        True,
        "world size 1",
        "__1_",
    ),
    Case("path-dotdot", _add_path("../x"), True, "not a plain relative path", "manifest.json"),
    Case("path-absolute", _add_path("/etc/passwd"), True, "not a plain relative path", "manifest.json"),
    Case(
        "invalid-json",
        lambda d, _: (d / "manifest.json").write_text("{not json"),
        True,
        "unreadable JSON",
        "manifest.json",
    ),
    Case(
        "symlinked-shard",
        lambda d, s: c.symlink_outside(d / "__1_0.distcp", s / "outside"),
        True,
        "symlink",
        "__1_0.distcp",
    ),
    Case("foreign-architecture", _foreign_inventory, True, "another architecture", ".metadata"),
    # found by the fuzzer (tests/reliability/test_fuzz.py): an inventory missing a tensor, bytes that are not UTF-8
    Case(
        "inventory-omits-a-tensor",
        lambda d, _: c.edit_manifest(d, lambda raw: raw["tensors"].pop(-1)),
        True,
        "which the manifest's tensor inventory does not record",
        ".metadata",
    ),
    Case(
        "manifest-not-utf8",
        lambda d, _: c.prepend(d / "manifest.json", b"\xff"),
        True,
        "unreadable JSON",
        "manifest.json",
    ),
    Case(
        "fingerprint",
        lambda d, _: c.scale_fingerprint(d, "model"),
        False,
        "fingerprint mismatch",
        TINY_STEP,
        export="deep",
    ),
]

DS_CASES = [
    Case(
        "bitflip-optim-pt",
        lambda d, _: c.flip_byte(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        False,
        "checksum",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        export="deep",
    ),  # maybe in a moment, not read
    Case(
        "bitflip-model-pt",
        lambda d, _: c.flip_byte(d / "mp_rank_00_model_states.pt"),
        False,
        "checksum",
        "mp_rank_00_model_states.pt",
        export="deep",
    ),
    Case(
        "truncated-pt",
        lambda d, _: c.truncate(d / "mp_rank_00_model_states.pt"),
        True,
        "truncated",
        "mp_rank_00_model_states.pt",
    ),
    Case("missing-rank-file", _rank_file_gone, True, "missing the optimizer file of rank 1", DS_STEP),
    Case("manifest-step", _set_manifest(step=9), True, "says step 9", DS_STEP),
    Case("state-file-step", _state_step, True, "step 7", "shardkeeper_state.json"),
    Case(
        "manifest-topology",
        lambda d, _: c.edit_manifest(d, lambda r: r["topology"].update(procs_per_node=3)),
        True,
        "world_size 2",
        "shardkeeper_state.json",
    ),
    Case("path-dotdot", _add_path("zero/../../x.pt"), True, "not a plain relative path", "manifest.json"),
    Case("symlinked-dir", _symlink_dir, True, "symlink", "zero"),
    Case(
        "fingerprint",
        lambda d, _: c.scale_fingerprint(d, "optim"),
        False,
        "fingerprint mismatch",
        DS_STEP,
        export="deep",
    ),
]


def _one_line(msg: str) -> str:
    assert "\n" not in msg and msg.strip(), repr(msg)
    return msg


def _check(case: Case, src: Path, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "checkpoints" / src.name
    shutil.copytree(src, ckpt_dir)
    case.mutate(ckpt_dir, tmp_path)
    quick, deep = validate(ckpt_dir), validate(ckpt_dir, deep=True)
    if case.quick is not None:
        assert quick.valid is not case.quick, quick.errors
    assert not deep.valid
    for report in ([quick] if not quick.valid else []) + [deep]:
        line = _one_line(report.errors[0])
        assert case.needle in line and case.names in line, line
    out = tmp_path / "export"
    if case.export == "stage":
        with pytest.raises(ShardkeeperError) as e:
            export_and_record(ckpt_dir, out)
    else:
        from ckpt.export import export_checkpoint as export_lib

        with pytest.raises(ShardkeeperError) as e:
            export_lib(ckpt_dir, out, deep=True)
    _one_line(str(e.value))
    assert case.names in str(e.value), str(e.value)
    assert not out.exists()


@pytest.mark.parametrize("case", DCP_CASES, ids=[k.id for k in DCP_CASES])
def test_dcp_corruption_is_refused(case: Case, tiny_run: Path, tmp_path: Path) -> None:
    _check(case, tiny_run / "checkpoints" / TINY_STEP, tmp_path)


def test_pristine_copies_are_valid(tiny_run: Path, ds_run: Path, tmp_path: Path) -> None:
    """The cases above are meaningful: the untouched checkpoints pass every check and export."""
    for src in (tiny_run / "checkpoints" / TINY_STEP, ds_run / "checkpoints" / DS_STEP):
        report = validate(src, deep=True)
        assert report.valid, report.errors
    run = tmp_path / "run"  # exporting records lineage in the run: a private copy, not the shared one
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".lock"))
    export_and_record(run / "checkpoints" / TINY_STEP, tmp_path / "export")


# ------------------------------------------------------------------------------------------ DeepSpeed
# ds_run: the session's DeepSpeed ZeRO-2 run (tests/conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("case", DS_CASES, ids=[k.id for k in DS_CASES])
def test_deepspeed_corruption_is_refused(case: Case, ds_run: Path, tmp_path: Path) -> None:
    _check(case, ds_run / "checkpoints" / DS_STEP, tmp_path)
