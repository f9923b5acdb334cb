"""Where a model tensor's bytes are inside a checkpoint: DCP chunk records in ``.distcp`` zips (parsed with
the one torch-zip reader and the allow-list unpickler), export tensors, and positioned reads of them."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt.commit.fsutil import pread_full
from ckpt.formats.pickle.safe_pickle import TENSOR_RECORD, StoredTensor
from ckpt.formats.pickle.torchzip import TorchZip
from schemas.errors import CheckpointError, ExportError

log = logging.getLogger(__name__)
from ckpt.export._options import MODEL_PREFIX, WRAPPER_SEGMENTS


@dataclass(frozen=True)
class Chunk:
    """One DCP chunk of a tensor and where its raw storage bytes lie in the ``.distcp`` file."""

    path: Path
    fd: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data_offset: int  # absolute file offset of the storage bytes
    storage_bytes: int
    crc32: int
    storage_offset: int  # elements
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def is_dense(self, itemsize: int) -> bool:
        """Stored row-major with nothing around it: the storage bytes are exactly the chunk."""
        return (
            self.storage_offset == 0
            and self.storage_bytes == self.numel * itemsize
            and (self.numel <= 1 or self.strides == contiguous_strides(self.sizes))
        )


def contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def parse_chunk(path: Path, fd: int, file_size: int, key: str, info: Any, chunk_md: Any, dtype: torch.dtype) -> Chunk:
    """Locate a chunk's raw bytes inside its torch.save record; raise CheckpointError if it is not sound."""
    where = f"{path}: chunk of {key} at byte {info.offset}"
    if getattr(info, "transform_descriptors", None):
        raise ExportError(f"{where} uses DCP stream transforms, which export does not read; save without them")
    if info.offset + info.length > file_size:
        raise CheckpointError(f"{where} runs past the end of the file; the checkpoint is truncated, pick another step")
    try:
        with TorchZip(fd, info.offset, info.length, where) as record_zip:  # the one torch.save record reader
            record = record_zip.describe(TENSOR_RECORD)
            if not isinstance(record, StoredTensor):
                raise CheckpointError(f"{where}: holds a {type(record).__name__}, not one tensor")
            data_offset, storage_bytes, crc = record_zip.storage_entry(record.key)
    except CheckpointError as e:
        raise CheckpointError(
            f"{where} is not a readable tensor record ({str(e).removeprefix(where + ': ')}); "
            "the checkpoint is corrupted, pick another step"
        ) from None
    problem = None
    if record.dtype != dtype or record.shape != tuple(chunk_md.sizes):
        problem = f"{record.dtype} {list(record.shape)}, metadata says {dtype} {list(chunk_md.sizes)}"
    elif storage_bytes != record.storage_numel * dtype.itemsize:
        problem = f"storage of {storage_bytes} bytes for {record.storage_numel} elements"
    if problem:
        raise CheckpointError(
            f"{where}: {problem}; the checkpoint is corrupted or not written by DCP, pick another step"
        )
    return Chunk(
        path,
        fd,
        tuple(chunk_md.offsets),
        tuple(chunk_md.sizes),
        data_offset,
        storage_bytes,
        crc,
        record.offset,
        record.stride,
    )


@dataclass
class ExportTensor:
    key: str  # DCP key
    name: str  # name in the export (transformers state_dict name)
    dtype: torch.dtype  # as stored
    out_dtype: torch.dtype  # as exported
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)
    # True when the chunks are 1-D element ranges of the flattened tensor (offsets/sizes of one dim), as
    # the pieces of a ZeRO partition are; the header still gives the real shape.
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize

    def rowwise(self) -> bool:
        """True when the chunks, in order, are consecutive row blocks stored densely: the tensor's
        bytes are then the chunks' bytes one after the other, and it streams without assembly.
        Flat chunks must be consecutive element ranges covering the tensor."""
        if self.flat:
            done = 0
            for c in self.chunks:
                if c.offsets != (done,) or not c.is_dense(self.dtype.itemsize):
                    return False
                done += c.numel
            return done == self.numel
        if not self.shape:
            return len(self.chunks) == 1 and self.chunks[0].is_dense(self.dtype.itemsize)
        row = 0
        for c in self.chunks:
            if (
                c.offsets[0] != row
                or any(c.offsets[1:])
                or c.sizes[1:] != self.shape[1:]
                or not c.is_dense(self.dtype.itemsize)
            ):
                return False
            row += c.sizes[0]
        return row == self.shape[0]


def hf_name(dcp_key: str) -> str:
    """Name of a model tensor in the export: the DCP ``model.`` key without wrapper segments."""
    name = dcp_key.removeprefix(MODEL_PREFIX)
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


Emit = Callable[[memoryview, "Callable[[], None] | None"], Any]


Seen = Callable[[int, int, memoryview], None]  # (fd, file offset, bytes just read there)


def pread_into(chunk: Chunk | Entry, view: memoryview, offset: int, seen: Seen | None = None) -> None:
    if not pread_full(chunk.fd, view, offset):
        raise CheckpointError(f"{chunk.path}: ends early; the checkpoint is truncated, pick another step")
    if seen is not None:
        seen(chunk.fd, offset, view)


@dataclass(frozen=True)
class Entry:
    """A zip entry (torch.save storage) that holds model bytes: CRC-checked once, whatever the number of
    tensors or chunks that lie in it."""

    path: Path
    fd: int
    data_offset: int
    nbytes: int
    crc32: int  # 0: torch.save ran with CRCs disabled and recorded none
    what: str  # for the error message, e.g. "model.x at offsets [0, 0]"
