"""The DCP format (FSDP2's checkpoints): its entry in the format registry (``ckpt.registry``).

What a DCP checkpoint holds: ``.metadata`` (read through the allow-list, ``ckpt.formats.dcp.reader``) and one
``__RANK_N.distcp`` per writing rank; the manifest must list exactly what ``.metadata`` references, the
tensors it records must be those ``.metadata`` describes, and every rank of the recorded world size wrote.
DCP reshards at load time: a reshard is a recorded no-op.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir
from ckpt.commit.state import MOMENTS
from ckpt.formats.dcp._metadata import read_layout
from ckpt.formats.pickle import safe_pickle
from ckpt.registry import register
from ckpt.validate.checks import check_ranks
from schemas import MANIFEST_NAME, CheckpointManifest, Fingerprint
from schemas.errors import CheckpointError

DCP_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
# torch and DCP are imported where tensors are read, not with the registry: the quick check reads .metadata into
# stand-ins of DCP's classes (ckpt.formats.dcp._metadata), so `status`, a quick `validate` and the launcher's checks
# import no torch


def check_layout(ckpt_dir: Path, manifest: CheckpointManifest, inputs: Mapping[str, bytes] | None = None) -> list[str]:
    """The manifest lists exactly what ``.metadata`` references, its extents are sound (every tensor tiled by its
    chunks, every record inside its file: ``ckpt.formats.dcp._metadata.check_extents``), its tensors are those
    ``.metadata`` describes, every rank wrote. A pure function of the manifest and the bytes of ``.metadata``
    (``inputs``, when the caller read them: ``ckpt.validate.checks`` remembers a pass for exactly those bytes)."""
    listed = {e.path for e in manifest.files}
    if ".metadata" not in listed:
        return [f"{ckpt_dir / MANIFEST_NAME}: does not list .metadata; the DCP checkpoint is incomplete"]
    try:
        # the manifest's sizes are the files' (checked before the layout), so the extents proof reads no file
        md = read_layout(ckpt_dir, (inputs or {}).get(".metadata"), {e.path: e.size for e in manifest.files})
        referenced = {".metadata"} | {info.relative_path for info in md.storage_data.values()}
        inventory = check_inventory(ckpt_dir, manifest, md) if referenced == listed else []
    except CheckpointError as e:
        return [str(e)]
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as e:  # a record missing a field, ...
        return [
            f"{ckpt_dir / '.metadata'}: not the structure DCP writes ({type(e).__name__}); the checkpoint is "
            "corrupted or crafted, pick another step"
        ]
    if referenced != listed:
        diff = sorted(referenced ^ listed)[0]
        side = (
            "referenced by .metadata but not listed in the manifest"
            if diff in referenced
            else "listed in the manifest but not referenced by .metadata"
        )
        return [f"{ckpt_dir / diff}: {side}; the manifest does not describe this DCP checkpoint, pick another step"]
    if inventory:
        return inventory
    ranks = {e.path: int(m.group(1)) for e in manifest.files if (m := DCP_FILE_RE.match(e.path))}
    for e in manifest.files:
        if e.path in ranks and e.rank is not None and e.rank != ranks[e.path]:
            return [
                f"{ckpt_dir / e.path}: the manifest says rank {e.rank} wrote it, its name says rank "
                f"{ranks[e.path]}; the manifest is inconsistent, pick another step"
            ]
    # a converted checkpoint is written by one process whatever world size it records
    required = set(range(manifest.topology.world_size)) if manifest.reason != "converted" else set()
    return check_ranks(ckpt_dir, manifest, ranks, required)


def check_inventory(ckpt_dir: Path, manifest: CheckpointManifest, md: Any) -> list[str]:
    """The tensors the manifest recorded at save are those ``.metadata`` describes (names, shapes, dtypes), and
    ``.metadata`` holds no model weight or AdamW moment the manifest does not record: a manifest of another
    architecture beside these files, or files of another model, disagree here."""
    tensor_class = safe_pickle.LAYOUT_RECORDS["TensorStorageMetadata"]
    recorded = {t.name for t in manifest.tensors}
    unrecorded = sorted(
        k
        for k, v in md.state_dict_metadata.items()
        if type(v) is tensor_class
        and type(k) is str
        and k not in recorded
        and (k.startswith("model.") or (k.startswith("optim.state.") and k.endswith(tuple(f".{m}" for m in MOMENTS))))
    )
    if unrecorded:
        return [
            f"{ckpt_dir / '.metadata'}: holds {unrecorded[0]}, which the manifest's tensor inventory does not "
            "record; the manifest is of another model or run, pick another step"
        ]
    for t in manifest.tensors:
        meta = md.state_dict_metadata.get(t.name)
        properties = getattr(meta, "properties", None)
        if (
            type(meta) is not tensor_class
            or type(getattr(meta, "size", None)) is not tuple
            or type(properties) is not safe_pickle.LAYOUT_RECORDS["TensorProperties"]
            or type(getattr(properties, "dtype", None)) is not safe_pickle.LayoutDType
        ):
            return [
                f"{ckpt_dir / '.metadata'}: holds no tensor {t.name} that the manifest records; the files are "
                "of another model or run, pick another step"
            ]
        shape, dtype = list(meta.size), str(meta.properties.dtype).removeprefix("torch.")
        if (shape, dtype) != (t.shape, t.dtype):
            return [
                f"{ckpt_dir / '.metadata'}: {t.name} is {dtype}{shape}, the manifest records {t.dtype}{t.shape}; "
                "the files are of another architecture, pick another step"
            ]
    return []


def check_counters(ckpt_dir: Path, manifest: CheckpointManifest) -> None:
    """Deep, DCP: the stored trainer counters are the manifest's."""
    from ckpt.formats.dcp.reader import DCPTensorReader

    with DCPTensorReader(ckpt_dir) as reader:
        keys = set(reader.tensor_keys())
        for key in ("step", "tokens", "samples"):
            if f"trainer.{key}" not in keys:
                raise CheckpointError(
                    f"{ckpt_dir}: no trainer.{key} stored; not a shardkeeper DCP checkpoint, pick another step"
                )
            stored = int(reader.read(f"trainer.{key}").item())
            if stored != getattr(manifest, key):
                raise CheckpointError(
                    f"{ckpt_dir}: stored trainer.{key} is {stored}, the manifest says "
                    f"{getattr(manifest, key)}; the checkpoint is inconsistent, pick another step"
                )


def recompute_fingerprint(ckpt_dir: Path, manifest: CheckpointManifest) -> Fingerprint:
    """Fingerprint of the state as stored on disk, one tensor at a time (stored counters checked first)."""
    from ckpt.commit import fingerprint as fp
    from ckpt.formats.dcp.reader import DCPTensorReader

    check_counters(ckpt_dir, manifest)
    with DCPTensorReader(ckpt_dir) as reader:
        keys = set(reader.tensor_keys())
        model_sq = fp.sum_squares((k[len("model.") :], reader.read(k)) for k in sorted(keys) if k.startswith("model."))
        optim_names = [k for k in sorted(keys) if k.startswith("optim.state.") and k.rsplit(".", 1)[-1] in MOMENTS]
        optim_sq = fp.sum_squares((k[len("optim.state.") :], reader.read(k)) for k in optim_names)
        step_keys = [k for k in sorted(keys) if k.startswith("optim.state.") and k.endswith(".step")]
        step = float(reader.read(step_keys[0]).item()) if step_keys else 0.0
        # every other record too (rng, counters, steps, byte values): each is parsed with the allow-list,
        # so a checkpoint that passes --deep holds nothing a resume would refuse
        for k in sorted(keys - set(step_keys[:1]) - {k for k in keys if k.startswith("model.")} - set(optim_names)):
            value = reader.read(k)
            if k.startswith(
                "extra."
            ):  # a script's tracked state (ckpt.formats.packed): it must unpack, as a load would
                from ckpt.formats.packed import unpack

                unpack(value, f"{ckpt_dir / '.metadata'}: {k}")
        for k in reader.byte_keys():
            reader.read_bytes_value(k)
    return fp.make_fingerprint(model_sq, optim_sq, step)


class DCPFormat:
    name = "dcp"
    nested: frozenset[str] = frozenset()
    layout_inputs: tuple[str, ...] = (".metadata",)  # the only file check_layout reads (see ckpt.validate.checks)

    def path_error(self, rel: str) -> str | None:
        if rel == ".metadata" or DCP_FILE_RE.match(rel):
            return None
        return "DCP checkpoints hold only .metadata and __RANK_N.distcp files"

    def check_layout(
        self, ckpt_dir: Path, manifest: CheckpointManifest, inputs: Mapping[str, bytes] | None = None
    ) -> list[str]:
        return check_layout(ckpt_dir, manifest, inputs)

    def recompute_fingerprint(self, ckpt_dir: Path, manifest: CheckpointManifest) -> Fingerprint:
        return recompute_fingerprint(ckpt_dir, manifest)

    def convert_from(self, src_dir: Path, target: Path, *, zero_stage: int | None = None) -> Path:
        from ckpt.formats.deepspeed.convert import to_dcp

        return to_dcp(src_dir, target)

    def reshard(self, ckpt_dir: Path, manifest: CheckpointManifest, world_size: int) -> tuple[Path, str, float]:
        """DCP reshards at load time: nothing to write; recorded in the run's lineage when the size changes."""
        if manifest.topology.world_size == world_size:
            return ckpt_dir, "none", 0.0
        run = RunDir.of_checkpoint(ckpt_dir)
        if run is not None:
            lineage.record(
                run.root,
                "reshard",
                f"reshard:{ckpt_dir.name}:{world_size}",
                parent=f"checkpoint:{ckpt_dir.name}",
                step=manifest.step,
                method="dcp-load-time",
                from_world_size=manifest.topology.world_size,
                to_world_size=world_size,
            )
        return ckpt_dir, "dcp-load-time", 0.0


FORMAT = register(DCPFormat())
