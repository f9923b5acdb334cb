"""The model tensors of a checkpoint, per format (DCP, DeepSpeed ZeRO shards, the universal layout):
``COLLECTORS[manifest.format]``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ckpt.formats.pickle.safe_pickle import StoredTensor
from schemas import CheckpointManifest
from schemas.errors import CheckpointError, ExportError

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint alone takes ~0.7 s to import
    from torch.distributed.checkpoint.metadata import Metadata

    from ckpt.formats.deepspeed.convert import UniversalSource
    from ckpt.formats.deepspeed.zero import TorchSaveFile, ZeroShards

log = logging.getLogger(__name__)
from ckpt.export._options import F32, MODEL_PREFIX, SAFETENSORS_DTYPES
from ckpt.export._records import Chunk, Entry, ExportTensor, hf_name, parse_chunk
from ckpt.export._sink import chunk_entries


class OpenFiles:
    """The checkpoint's .distcp files, opened once, read with pread, closed at the end."""

    def __init__(self, ckpt_dir: Path):
        self.dir = ckpt_dir
        self._fds: dict[str, tuple[int, int]] = {}

    def get(self, relative: str) -> tuple[Path, int, int]:
        path = self.dir / relative
        if relative not in self._fds:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
            self._fds[relative] = (fd, os.fstat(fd).st_size)
        fd, size = self._fds[relative]
        return path, fd, size

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def collect_tensors(ckpt_dir: Path, md: Metadata, files: OpenFiles, out_dtype: torch.dtype) -> list[ExportTensor]:
    """Every ``model.*`` tensor of the checkpoint with its located chunks (optimizer state is skipped)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tensors = []
    for key, tmd in md.state_dict_metadata.items():
        if not key.startswith(MODEL_PREFIX) or not isinstance(tmd, TensorStorageMetadata):
            continue
        dtype = tmd.properties.dtype
        if dtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"{ckpt_dir}: tensor {key} has dtype {dtype}, which safetensors export does not support")
        t = ExportTensor(key, hf_name(key), dtype, out_dtype if dtype.is_floating_point else dtype, tuple(tmd.size))
        for chunk_md in sorted(tmd.chunks, key=lambda c: (tuple(c.offsets), tuple(c.sizes))):
            info = md.storage_data.get(MetadataIndex(key, chunk_md.offsets)) if md.storage_data else None
            if info is None:
                raise CheckpointError(
                    f"{ckpt_dir / '.metadata'}: no storage entry for a chunk of {key}; "
                    "the checkpoint is corrupted, pick another step"
                )
            path, fd, size = files.get(info.relative_path)
            t.chunks.append(parse_chunk(path, fd, size, key, info, chunk_md, dtype))
        if sum(c.numel for c in t.chunks) != t.numel:
            raise CheckpointError(
                f"{ckpt_dir / '.metadata'}: chunks of {key} do not cover its shape {list(t.shape)}; "
                "the checkpoint is corrupted, pick another step"
            )
        tensors.append(t)
    if not tensors:
        raise CheckpointError(
            f"{ckpt_dir / '.metadata'}: holds no model.* tensors; export needs a checkpoint "
            "written by the shardkeeper trainer"
        )
    return tensors


@dataclass
class Collected:
    """What a checkpoint format gives the exporter: the model tensors (chunks located, nothing read) and
    the zip entries that hold their bytes, each to be CRC-checked once."""

    tensors: list[ExportTensor]
    entries: list[Entry]
    source: str  # what the tensor list was read from, for messages
    # CRC-check the entries from the bytes the copy reads (before the commit) instead of in a pass of
    # their own before writing: one read of the model bytes, not two (every built-in layout reads its
    # entries in order; an entry read out of order, e.g. a tied copy, is checked whole at the end)
    crc_in_stream: bool = False


Collector = Callable[[Path, CheckpointManifest, ExitStack, torch.dtype], Collected]


def collect_dcp(ckpt_dir: Path, manifest: CheckpointManifest, stack: ExitStack, out_dtype: torch.dtype) -> Collected:
    from ckpt.formats.dcp.reader import read_metadata

    files = stack.enter_context(OpenFiles(ckpt_dir))
    tensors = collect_tensors(ckpt_dir, read_metadata(ckpt_dir), files, out_dtype)
    return Collected(tensors, chunk_entries(tensors), ".metadata", crc_in_stream=True)


def collect_deepspeed(
    ckpt_dir: Path, manifest: CheckpointManifest, stack: ExitStack, out_dtype: torch.dtype
) -> Collected:
    """A deepspeed-format checkpoint: the fp32 master weights where DeepSpeed stored them, in the
    ``*_optim_states.pt`` partitions (or the universal/ folder when that is all the checkpoint has)."""
    from ckpt.formats.deepspeed.zero import ZeroShards, read_state

    if read_state(ckpt_dir)["layout"] != "zero":  # what ckpt.formats.deepspeed.convert.open_source reads
        from ckpt.formats.deepspeed.convert import open_source

        src = open_source(ckpt_dir, manifest)
        stack.callback(src.close)
        return collect_universal(src, stack, out_dtype)  # type: ignore[arg-type]
    # as ckpt.formats.deepspeed.convert.ZeroSource opens them (that module imports torch.distributed.checkpoint)
    shards = stack.enter_context(
        ZeroShards(
            ckpt_dir,
            expect_world_size=manifest.topology.world_size,
            expect_stage=manifest.run_spec.deepspeed.zero_stage,
        )
    )
    return collect_zero(shards, out_dtype)


def storage_entry(f: TorchSaveFile, st: StoredTensor, what: str) -> Entry:
    """The zip entry of a stored float32 tensor's storage, checked to hold the tensor and to lie in the file."""
    where = f"{f.path}: {what}"
    if st.dtype != torch.float32 or not st.is_contiguous():
        raise CheckpointError(
            f"{where} is a {'' if st.is_contiguous() else 'strided '}{st.dtype} tensor, expected "
            "contiguous float32 master weights; the checkpoint was not written by the deepspeed "
            "backend, export a checkpoint of a shardkeeper deepspeed run"
        )
    offset, length, crc = f.storage_entry(st.key)
    if offset + length > os.fstat(f.fileno()).st_size or (st.offset + st.numel) * F32 > length:
        raise CheckpointError(
            f"{where}: storage {st.key} runs past its zip entry or the file; the file is truncated "
            "or corrupted, pick another step"
        )
    return Entry(f.path, f.fileno(), offset, length, crc, f"storage {st.key} ({what})")


def flat_chunk(f: TorchSaveFile, entry: Entry, st: StoredTensor, start: int, numel: int, done: int) -> Chunk:
    """Elements [start, start + numel) of flat stored tensor ``st``, as elements [done, done + numel) of a tensor."""
    return Chunk(
        f.path, f.fileno(), (done,), (numel,), entry.data_offset + (st.offset + start) * F32, numel * F32, 0, 0, (1,)
    )


def collect_zero(shards: ZeroShards, out_dtype: torch.dtype) -> Collected:
    """ZeRO 1/2/3: each parameter is a few element ranges of the ranks' flat fp32 partitions
    (``ZeroShards.locate``); those are its chunks, streamed in order without assembly. Several
    parameters share one partition's storage entry, which is CRC-checked once."""
    entries: dict[tuple[Path, str], Entry] = {}
    tensors = []
    for slot in shards.slots:
        key = MODEL_PREFIX + slot.name
        t = ExportTensor(key, hf_name(key), torch.float32, out_dtype, slot.shape, flat=True)
        done = 0
        for f, part, piece in shards.locate(slot, "fp32"):
            what = f"fp32 master partition of parameter group {slot.group}"
            entry = entries.get((f.path, part.key))
            if entry is None:
                entry = entries[(f.path, part.key)] = storage_entry(f, part, what)
            if piece.start < 0 or piece.start + piece.numel > part.numel:
                raise CheckpointError(
                    f"{f.path}: the {what} holds {part.numel} elements, {slot.name} needs elements "
                    f"{piece.start}..{piece.start + piece.numel}; the checkpoint is inconsistent, "
                    "pick another step"
                )
            t.chunks.append(flat_chunk(f, entry, part, piece.start, piece.numel, done))
            done += piece.numel
        tensors.append(t)
    return Collected(
        tensors,
        sorted(entries.values(), key=lambda e: (str(e.path), e.data_offset)),
        "the ZeRO files",
        crc_in_stream=True,
    )


def collect_universal(src: UniversalSource, stack: ExitStack, out_dtype: torch.dtype) -> Collected:
    """The universal layout: one ``zero/<name>/fp32.pt`` per parameter, a whole tensor in one storage entry."""
    from ckpt.formats.deepspeed.zero import TorchSaveFile

    tensors, entries = [], []
    for name, shape in (x for g in src.groups for x in g):
        f = stack.enter_context(TorchSaveFile(src.dir / "zero" / name / "fp32.pt"))
        rec = f.obj.get("param") if isinstance(f.obj, dict) else f.obj
        if not isinstance(rec, StoredTensor) or rec.shape != tuple(shape):
            raise CheckpointError(
                f"{f.path}: does not hold the {list(shape)} master weight of {name}; the universal "
                "checkpoint is corrupted, pick another step"
            )
        entry = storage_entry(f, rec, f"fp32 master weight of {name}")
        key = MODEL_PREFIX + name
        t = ExportTensor(key, hf_name(key), torch.float32, out_dtype, tuple(shape), flat=True)
        if rec.numel:
            t.chunks.append(flat_chunk(f, entry, rec, 0, rec.numel, 0))
        tensors.append(t)
        entries.append(entry)
    return Collected(tensors, entries, "the universal/ files", crc_in_stream=True)


COLLECTORS: dict[str, Collector] = {"dcp": collect_dcp, "deepspeed": collect_deepspeed}
