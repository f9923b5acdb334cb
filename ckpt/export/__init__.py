"""Export a committed checkpoint (DCP or DeepSpeed) to a folder ``AutoModelForCausalLM.from_pretrained`` loads.

    from ckpt.export import export_checkpoint
    export_checkpoint("runs/demo/checkpoints/step-00000020", "runs/demo/exports/step-00000020", dtype="bfloat16")

(or ``shardkeeper export CKPT OUT --dtype bfloat16``). The folder holds ``config.json``,
``generation_config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``) and a short ``README.md``.

How it works, and why:

* Checked before anything is written: the options, the output folder, the checkpoint (quick
  validation: manifest, every file present at its size), every model chunk's record inside the
  ``.distcp`` files, the tensor names/shapes/dtypes against the manifest's inventory (recorded from
  the transformers model at save), and the CRC-32 of every model byte against its zip record (for
  DeepSpeed checkpoints: as the bytes are copied, each partition's zip entry once, before the commit).
* Streaming with bounded memory: DCP's default writer stores each chunk as a ``torch.save`` zip whose
  ``data/<key>`` entry is the raw storage, stored uncompressed. The exporter parses the zip and the
  tiny pickle (with an allow-list; nothing is executed) to find those bytes and streams them in
  16 MiB pieces (``preadv`` into reused buffers; cast pieces are cast with torch's ``copy_``)
  straight into the safetensors file. (mmap views were tried: no faster, and their page faults
  contend with the import thread for the process's memory-map lock.)
  Chunks that split a tensor by rows (FSDP2) stream without ever assembling the tensor; other
  layouts (2-D sharding, strided records) assemble one tensor at a time. Peak memory is a few pieces,
  plus one tensor in the assembled case: far below one output shard + 0.5 GB.
* DeepSpeed ZeRO checkpoints export in the same single pass: a parameter's fp32 master weight is a
  few element ranges of the ranks' flat partitions inside the ``*_optim_states.pt`` zips (the layout
  ``ckpt.formats.deepspeed.ZeroShards`` knows, ZeRO 1/2/3; or one ``universal/zero/<name>/fp32.pt`` each).
  Those ranges are the tensor's chunks, streamed in order; the header keeps the real shape. Each
  partition's storage entry is CRC-checked once, however many parameters it holds. The tensors are
  bit for bit those of ``deepspeed.utils.zero_to_fp32``.
* Speed: writing and SHA-256 hashing run in two threads that release the GIL; the file is written
  with O_DIRECT through an aligned staging buffer where the file system takes it (the page cache would
  only hold a copy nobody reads back, and filling it costs more than the disk write on this project's
  VMs). transformers is not imported at all when the manifest holds the ``hf_model`` record the trainer
  wrote at save (config.json and generation_config.json as save_pretrained writes them, and the tied
  names): names and shapes are then the manifest inventory's, which the files are checked against.
  For older checkpoints without it, importing transformers (seconds) and building the model on the
  meta device run in a background thread from the start, with the cyclic GC paused while it creates
  its long-lived objects. When the RunSpec declares ``tie_word_embeddings: false`` nothing can be a
  tied copy, so the copy does not wait for it; the names and shapes are then checked against the
  transformers model before the commit (they were already checked against the manifest before
  writing). Otherwise the check comes first.
* Bit-exactness: the bytes are the storage bytes ``torch.load`` would give; casts round to nearest
  even, as ``tensor.to(dtype)`` does.
* Byte reproducibility: tensors keep the checkpoint's order (the model's state_dict order), headers
  are compact JSON with sorted names and a fixed ``__metadata__``, and no file carries a time or path.
* Atomicity: everything is written into a hidden sibling folder, every file and the folder are
  fsynced, then the folder is renamed to ``out_dir`` and the parent fsynced. On any failure the
  sibling is removed, so a folder named ``out_dir`` is always complete.
* A tensor larger than ``max_shard_size`` is written alone in its own shard (with a warning), as
  ``save_pretrained`` does, rather than refused: a model must remain exportable whatever the limit.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import gc
import hashlib
import json
import logging
import math
import mmap
import os
import queue
import re
import resource
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckpt.state import tied_weights
from ckpt import __version__
from schemas.errors import CheckpointError, ExportError
from ckpt.formats.safe_pickle import TENSOR_RECORD, StoredTensor
from ckpt.formats.torchzip import TorchZip
from ckpt.fsutil import fsync_dir
from ckpt.manifest import read_manifest
from ckpt.validate import validate
from schemas import CheckpointManifest, ExportResult

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint alone takes ~0.7 s to import
    from torch.distributed.checkpoint.metadata import Metadata

    from ckpt.formats.deepspeed_convert import UniversalSource
    from ckpt.formats.deepspeed import TorchSaveFile, ZeroShards

log = logging.getLogger(__name__)

EXPORT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
# Module wrappers whose names appear inside parameter names: torch.compile, activation checkpointing, FSDP1.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_MODEL_PREFIX = "model."  # the top-level DCP key the trainer saves the model under

PIECE_BYTES = 16 << 20  # unit of streaming: read, cast, write and hash
POOL_PIECES = 4  # pieces in flight between the reader and the writer/hasher threads
STAGE_BYTES = 16 << 20  # O_DIRECT staging buffer of the writer thread (a multiple of _ALIGN)
_ALIGN = 4096  # O_DIRECT alignment of buffer addresses, offsets and lengths (covers 512-byte devices)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# ------------------------------------------------------------------------------------------ options
def export_dtype(name: str) -> tuple[str, torch.dtype]:
    """Canonical name and torch dtype of an export dtype; one-line ExportError for anything else."""
    canonical = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if canonical not in EXPORT_DTYPES:
        raise ExportError(f"dtype {name!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}")
    return canonical, EXPORT_DTYPES[canonical]


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string like '5GB' (10**9), '500MB', '2GiB' (2**30)."""
    if isinstance(size, bool):
        raise ExportError(f"max_shard_size {size!r} is not a size; give bytes as an int or a string like '5GB'")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise ExportError(f"max_shard_size {size!r} is not a size; give bytes as an int or a string like '5GB' or '500MB'")
        value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if value < 1:
        raise ExportError(f"max_shard_size {size!r} must be at least 1 byte; use e.g. '5GB'")
    return value


def _check_out_dir(ckpt_dir: Path, out_dir: Path, overwrite: bool) -> None:
    src, dst = ckpt_dir.resolve(), out_dir.resolve()
    if dst == src or src in dst.parents:
        raise ExportError(f"{out_dir}: is inside the checkpoint {ckpt_dir}; export to a folder outside it, e.g. RUN_DIR/exports/")
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ExportError(f"{out_dir}: exists and is not a folder; remove it or choose another output folder")
        if not overwrite:
            raise ExportError(f"{out_dir}: already exists; pass overwrite=True (--overwrite) to replace it or choose another folder")


def _check_checkpoint(ckpt_dir: Path, deep: bool) -> CheckpointManifest:
    report = validate(ckpt_dir, deep=deep)
    if not report.valid:
        more = f" (and {len(report.errors) - 1} more problems)" if len(report.errors) > 1 else ""
        raise CheckpointError(f"{report.errors[0]}{more}")
    return read_manifest(ckpt_dir)


# ------------------------------------------------------------------------- chunk records in .distcp
@dataclass(frozen=True)
class _Chunk:
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
        return (self.storage_offset == 0 and self.storage_bytes == self.numel * itemsize
                and (self.numel <= 1 or self.strides == _contiguous_strides(self.sizes)))


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _parse_chunk(path: Path, fd: int, file_size: int, key: str, info: Any, chunk_md: Any,
                 dtype: torch.dtype) -> _Chunk:
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
        raise CheckpointError(f"{where} is not a readable tensor record ({str(e).removeprefix(where + ': ')}); "
                              "the checkpoint is corrupted, pick another step") from None
    problem = None
    if record.dtype != dtype or record.shape != tuple(chunk_md.sizes):
        problem = f"{record.dtype} {list(record.shape)}, metadata says {dtype} {list(chunk_md.sizes)}"
    elif storage_bytes != record.storage_numel * dtype.itemsize:
        problem = f"storage of {storage_bytes} bytes for {record.storage_numel} elements"
    if problem:
        raise CheckpointError(f"{where}: {problem}; the checkpoint is corrupted or not written by DCP, pick another step")
    return _Chunk(path, fd, tuple(chunk_md.offsets), tuple(chunk_md.sizes), data_offset, storage_bytes,
                  crc, record.offset, record.stride)


# ------------------------------------------------------------------------------------ model tensors
@dataclass
class _Tensor:
    key: str  # DCP key
    name: str  # name in the export (transformers state_dict name)
    dtype: torch.dtype  # as stored
    out_dtype: torch.dtype  # as exported
    shape: tuple[int, ...]
    chunks: list[_Chunk] = field(default_factory=list)
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
            if (c.offsets[0] != row or any(c.offsets[1:]) or c.sizes[1:] != self.shape[1:]
                    or not c.is_dense(self.dtype.itemsize)):
                return False
            row += c.sizes[0]
        return row == self.shape[0]


def hf_name(dcp_key: str) -> str:
    """Name of a model tensor in the export: the DCP ``model.`` key without wrapper segments."""
    name = dcp_key.removeprefix(_MODEL_PREFIX)
    return ".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS)


class _OpenFiles:
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

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect_tensors(ckpt_dir: Path, md: Metadata, files: _OpenFiles, out_dtype: torch.dtype) -> list[_Tensor]:
    """Every ``model.*`` tensor of the checkpoint with its located chunks (optimizer state is skipped)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tensors = []
    for key, tmd in md.state_dict_metadata.items():
        if not key.startswith(_MODEL_PREFIX) or not isinstance(tmd, TensorStorageMetadata):
            continue
        dtype = tmd.properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(f"{ckpt_dir}: tensor {key} has dtype {dtype}, which safetensors export does not support")
        t = _Tensor(key, hf_name(key), dtype, out_dtype if dtype.is_floating_point else dtype, tuple(tmd.size))
        for chunk_md in sorted(tmd.chunks, key=lambda c: (tuple(c.offsets), tuple(c.sizes))):
            info = md.storage_data.get(MetadataIndex(key, chunk_md.offsets)) if md.storage_data else None
            if info is None:
                raise CheckpointError(f"{ckpt_dir / '.metadata'}: no storage entry for a chunk of {key}; "
                                      "the checkpoint is corrupted, pick another step")
            path, fd, size = files.get(info.relative_path)
            t.chunks.append(_parse_chunk(path, fd, size, key, info, chunk_md, dtype))
        if sum(c.numel for c in t.chunks) != t.numel:
            raise CheckpointError(f"{ckpt_dir / '.metadata'}: chunks of {key} do not cover its shape {list(t.shape)}; "
                                  "the checkpoint is corrupted, pick another step")
        tensors.append(t)
    if not tensors:
        raise CheckpointError(f"{ckpt_dir / '.metadata'}: holds no model.* tensors; export needs a checkpoint "
                              "written by the shardkeeper trainer")
    return tensors


# --------------------------------------------------------------------------------- tensor sources
@dataclass
class _Collected:
    """What a checkpoint format gives the exporter: the model tensors (chunks located, nothing read) and
    the zip entries that hold their bytes, each to be CRC-checked once."""

    tensors: list[_Tensor]
    entries: list[_Entry]
    source: str  # what the tensor list was read from, for messages
    # CRC-check the entries from the bytes the copy reads (before the commit) instead of in a pass of
    # their own before writing: for ZeRO partitions, whose entries are read in order with few gaps
    crc_in_stream: bool = False


Collector = Callable[[Path, CheckpointManifest, ExitStack, torch.dtype], _Collected]


def _collect_dcp(ckpt_dir: Path, manifest: CheckpointManifest, stack: ExitStack, out_dtype: torch.dtype) -> _Collected:
    from ckpt.formats.dcp import read_metadata

    files = stack.enter_context(_OpenFiles(ckpt_dir))
    tensors = _collect_tensors(ckpt_dir, read_metadata(ckpt_dir), files, out_dtype)
    return _Collected(tensors, _chunk_entries(tensors), ".metadata")


def _collect_deepspeed(ckpt_dir: Path, manifest: CheckpointManifest, stack: ExitStack,
                       out_dtype: torch.dtype) -> _Collected:
    """A deepspeed-format checkpoint: the fp32 master weights where DeepSpeed stored them, in the
    ``*_optim_states.pt`` partitions (or the universal/ folder when that is all the checkpoint has)."""
    from ckpt.formats.deepspeed import ZeroShards, read_state

    if read_state(ckpt_dir)["layout"] != "zero":  # what ckpt.formats.deepspeed_convert.open_source reads
        from ckpt.formats.deepspeed_convert import open_source

        src = open_source(ckpt_dir, manifest)
        stack.callback(src.close)
        return _collect_universal(src, stack, out_dtype)  # type: ignore[arg-type]
    # as ckpt.formats.deepspeed_convert.ZeroSource opens them (that module imports torch.distributed.checkpoint)
    shards = stack.enter_context(ZeroShards(ckpt_dir, expect_world_size=manifest.topology.world_size,
                                            expect_stage=manifest.run_spec.deepspeed.zero_stage))
    return _collect_zero(shards, out_dtype)


_F32 = torch.float32.itemsize


def _storage_entry(f: TorchSaveFile, st: StoredTensor, what: str) -> _Entry:
    """The zip entry of a stored float32 tensor's storage, checked to hold the tensor and to lie in the file."""
    where = f"{f.path}: {what}"
    if st.dtype != torch.float32 or not st.is_contiguous():
        raise CheckpointError(f"{where} is a {'' if st.is_contiguous() else 'strided '}{st.dtype} tensor, expected "
                              "contiguous float32 master weights; the checkpoint was not written by the deepspeed "
                              "backend, export a checkpoint of a shardkeeper deepspeed run")
    offset, length, crc = f.storage_entry(st.key)
    if offset + length > os.fstat(f.fileno()).st_size or (st.offset + st.numel) * _F32 > length:
        raise CheckpointError(f"{where}: storage {st.key} runs past its zip entry or the file; the file is truncated "
                              "or corrupted, pick another step")
    return _Entry(f.path, f.fileno(), offset, length, crc, f"storage {st.key} ({what})")


def _flat_chunk(f: TorchSaveFile, entry: _Entry, st: StoredTensor, start: int, numel: int, done: int) -> _Chunk:
    """Elements [start, start + numel) of flat stored tensor ``st``, as elements [done, done + numel) of a tensor."""
    return _Chunk(f.path, f.fileno(), (done,), (numel,), entry.data_offset + (st.offset + start) * _F32,
                  numel * _F32, 0, 0, (1,))


def _collect_zero(shards: ZeroShards, out_dtype: torch.dtype) -> _Collected:
    """ZeRO 1/2/3: each parameter is a few element ranges of the ranks' flat fp32 partitions
    (``ZeroShards.locate``); those are its chunks, streamed in order without assembly. Several
    parameters share one partition's storage entry, which is CRC-checked once."""
    entries: dict[tuple[Path, str], _Entry] = {}
    tensors = []
    for slot in shards.slots:
        key = _MODEL_PREFIX + slot.name
        t = _Tensor(key, hf_name(key), torch.float32, out_dtype, slot.shape, flat=True)
        done = 0
        for f, part, piece in shards.locate(slot, "fp32"):
            what = f"fp32 master partition of parameter group {slot.group}"
            entry = entries.get((f.path, part.key))
            if entry is None:
                entry = entries[(f.path, part.key)] = _storage_entry(f, part, what)
            if piece.start < 0 or piece.start + piece.numel > part.numel:
                raise CheckpointError(f"{f.path}: the {what} holds {part.numel} elements, {slot.name} needs elements "
                                      f"{piece.start}..{piece.start + piece.numel}; the checkpoint is inconsistent, "
                                      "pick another step")
            t.chunks.append(_flat_chunk(f, entry, part, piece.start, piece.numel, done))
            done += piece.numel
        tensors.append(t)
    return _Collected(tensors, sorted(entries.values(), key=lambda e: (str(e.path), e.data_offset)), "the ZeRO files",
                      crc_in_stream=True)


def _collect_universal(src: UniversalSource, stack: ExitStack, out_dtype: torch.dtype) -> _Collected:
    """The universal layout: one ``zero/<name>/fp32.pt`` per parameter, a whole tensor in one storage entry."""
    from ckpt.formats.deepspeed import TorchSaveFile

    tensors, entries = [], []
    for name, shape in (x for g in src.groups for x in g):
        f = stack.enter_context(TorchSaveFile(src.dir / "zero" / name / "fp32.pt"))
        rec = f.obj.get("param") if isinstance(f.obj, dict) else f.obj
        if not isinstance(rec, StoredTensor) or rec.shape != tuple(shape):
            raise CheckpointError(f"{f.path}: does not hold the {list(shape)} master weight of {name}; the universal "
                                  "checkpoint is corrupted, pick another step")
        entry = _storage_entry(f, rec, f"fp32 master weight of {name}")
        key = _MODEL_PREFIX + name
        t = _Tensor(key, hf_name(key), torch.float32, out_dtype, tuple(shape), flat=True)
        if rec.numel:
            t.chunks.append(_flat_chunk(f, entry, rec, 0, rec.numel, 0))
        tensors.append(t)
        entries.append(entry)
    return _Collected(tensors, entries, "the universal/ files", crc_in_stream=True)


_COLLECTORS: dict[str, Collector] = {"dcp": _collect_dcp, "deepspeed": _collect_deepspeed}


# ------------------------------------------------------------------------------- transformers side
@dataclass(frozen=True)
class _ModelSpecView:
    config_json: str  # config.json, with dtype and architectures set for the export
    generation_json: str  # generation_config.json
    architecture: str  # the model class name, e.g. LlamaForCausalLM
    shapes: dict[str, tuple[int, ...]] | None  # state_dict name -> shape of the transformers model; None: recorded
    tied: dict[str, str]  # tied name -> the name it is tied to (e.g. lm_head.weight -> model.embed_tokens.weight)


def _json_text(d: dict[str, Any]) -> str:
    """A config as transformers' ``to_json_string`` writes it: sorted keys, indent 2, final newline."""
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def _from_record(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> _ModelSpecView | None:
    """The model files from the manifest's ``hf_model`` record (written at save from the model the trainer
    built), without importing transformers; None when the checkpoint has no usable record (older ones).
    The names and shapes are those of the manifest's inventory, which the checkpoint's files are checked
    against: no model needs to be built."""
    rec = manifest.hf_model
    if (rec is None or rec.generation_config is None
            or not any(e.name.startswith(_MODEL_PREFIX) for e in manifest.tensors)):
        return None
    where = f"{ckpt_dir / 'manifest.json'}: field hf_model.config"
    arch = rec.config.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
        raise CheckpointError(f"{where}.architectures is {arch!r}, not a list of model class names; "
                              "the manifest is corrupted, pick another step")
    model_type = rec.config.get("model_type", manifest.run_spec.model.model_type)
    if model_type != manifest.run_spec.model.model_type:
        raise CheckpointError(f"{where}.model_type is {model_type!r} but run_spec.model.model_type is "
                              f"{manifest.run_spec.model.model_type!r}; the manifest is inconsistent, pick another step")
    config = dict(rec.config)
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype  # as the transformers path sets config.dtype
    return _ModelSpecView(_json_text(config), _json_text(rec.generation_config), arch[0], None, dict(rec.tied))


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic GC off while transformers is imported: the import creates a few hundred thousand
    long-lived objects, and the full collections their number triggers (about 1 s here, on the export's
    critical path) free nothing. Switched back on after, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _describe_model(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> _ModelSpecView:
    """Build the model the RunSpec describes on the meta device: names, shapes and ties, no memory."""
    with _gc_paused():
        return _describe_model_gc_off(ckpt_dir, manifest, dtype)


def _describe_model_gc_off(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> _ModelSpecView:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = manifest.run_spec.model
    where = f"{ckpt_dir / 'manifest.json'}: run_spec.model"
    try:
        config = AutoConfig.for_model(spec.model_type, **spec.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (KeyError, ValueError, TypeError) as e:
        raise ExportError(f"{where} ({spec.model_type}) is not a transformers causal LM ({e}); "
                          "export supports model types that AutoModelForCausalLM builds") from None
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = tied_weights(model, config)
    return _ModelSpecView(config.to_json_string(use_diff=True),
                          GenerationConfig.from_model_config(config).to_json_string(use_diff=True),
                          config.architectures[0], shapes, tied)


def _name_tensors(ckpt_dir: Path, tensors: list[_Tensor]) -> dict[str, _Tensor]:
    """Export name -> tensor, in the checkpoint's order (DCP keeps the model's state_dict order)."""
    if tensors and all(t.name.startswith("module.") for t in tensors):  # a DDP-wrapped model
        for t in tensors:
            t.name = t.name.removeprefix("module.")
    by_name: dict[str, _Tensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise ExportError(f"{ckpt_dir}: {by_name[t.name].key} and {t.key} both export as {t.name}; "
                              "the checkpoint's model keys are ambiguous")
        by_name[t.name] = t
    return by_name


def _check_inventory(ckpt_dir: Path, tensors: list[_Tensor], manifest: CheckpointManifest,
                     source: str = ".metadata") -> None:
    """The DCP metadata (ZeRO files) must hold exactly the model tensors the manifest recorded at save."""
    recorded = {e.name: (tuple(e.shape), e.dtype) for e in manifest.tensors if e.name.startswith(_MODEL_PREFIX)}
    stored = {t.key: (t.shape, str(t.dtype).removeprefix("torch.")) for t in tensors}
    if recorded and recorded != stored:
        diff = sorted(k for k in recorded.keys() | stored.keys() if recorded.get(k) != stored.get(k))
        raise CheckpointError(f"{ckpt_dir / 'manifest.json'}: its tensor inventory and {source} disagree on "
                              f"{', '.join(diff[:3])}; the checkpoint is inconsistent, pick another step")


def _drop_tied(ckpt_dir: Path, by_name: dict[str, _Tensor], tied: dict[str, str], pool: _BufferPool) -> None:
    for target, source in tied.items():
        if target in by_name and source in by_name:
            _check_tied(ckpt_dir, by_name[target], by_name[source], pool)
            log.info("%s is tied to %s and equal to it: not written (as save_pretrained does)", target, source)
            del by_name[target]


def _check_against_model(ckpt_dir: Path, by_name: dict[str, _Tensor], model: _ModelSpecView) -> None:
    """Names and shapes must be those of the model that run_spec.model builds (tied copies aside)."""
    expected = model.shapes
    if expected is None:  # from the record: the names and shapes are the inventory's, checked already
        return
    where = f"{ckpt_dir}: the checkpoint does not match run_spec.model in its manifest"
    unexpected = [n for n in by_name if n not in expected]
    if unexpected:
        raise ExportError(f"{where}: unexpected tensors {', '.join(unexpected[:3])}; export the run's own checkpoints")
    missing = [n for n in expected if n not in by_name and not (n in model.tied and model.tied[n] in by_name)]
    if missing:
        raise ExportError(f"{where}: missing tensors {', '.join(missing[:3])}; export the run's own checkpoints")
    for name, t in by_name.items():
        if t.shape != expected[name]:
            raise ExportError(f"{where}: {name} has shape {list(t.shape)}, the model expects {list(expected[name])}")


def _check_tied(ckpt_dir: Path, target: _Tensor, source: _Tensor, pool: _BufferPool) -> None:
    digests = []
    for t in (target, source):
        h = hashlib.sha256()
        _produce(t, t.dtype, pool, lambda view, release: (h.update(view), release and release()))
        digests.append(h.digest())
    if target.shape != source.shape or target.dtype != source.dtype or digests[0] != digests[1]:
        raise ExportError(f"{ckpt_dir}: {target.name} differs from {source.name} although the config ties them "
                          "(tie_word_embeddings); the checkpoint does not match its run_spec.model")


# ------------------------------------------------------------------------------------- streaming
class _BufferPool:
    """A fixed set of piece buffers: the pieces in flight, and so the memory, stay bounded whatever the
    model size."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = nbytes
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(count):
            self._free.put(bytearray(nbytes))
        self.scratch = bytearray(nbytes)  # source bytes of a piece that is cast into a pool buffer

    def get(self) -> bytearray:
        return self._free.get()

    def releaser(self, buf: bytearray) -> Callable[[], None]:
        return lambda: self._free.put(buf)


Emit = Callable[[memoryview, "Callable[[], None] | None"], Any]


Seen = Callable[[int, int, memoryview], None]  # (fd, file offset, bytes just read there)


def _pread_into(chunk: _Chunk | _Entry, view: memoryview, offset: int, seen: Seen | None = None) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(chunk.fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{chunk.path}: ends early; the checkpoint is truncated, pick another step")
        done += n
    if seen is not None:
        seen(chunk.fd, offset, view)


@dataclass(frozen=True)
class _Entry:
    """A zip entry (torch.save storage) that holds model bytes: CRC-checked once, whatever the number of
    tensors or chunks that lie in it."""

    path: Path
    fd: int
    data_offset: int
    nbytes: int
    crc32: int  # 0: torch.save ran with CRCs disabled and recorded none
    what: str  # for the error message, e.g. "model.x at offsets [0, 0]"


def _chunk_entries(tensors: list[_Tensor]) -> list[_Entry]:
    """DCP: every chunk is a torch.save record of its own with one storage entry."""
    return [_Entry(c.path, c.fd, c.data_offset, c.storage_bytes, c.crc32, f"{t.key} at offsets {list(c.offsets)}")
            for t in tensors for c in t.chunks]


def _verify_entries(entries: list[_Entry], pool: _BufferPool) -> None:
    """CRC-32 of every zip entry holding model bytes against its zip record, before anything is written.
    (torch.load does not check these; a flipped bit would otherwise be published silently.)"""
    unchecked = 0
    buf = memoryview(pool.scratch)
    for e in entries:
        if not e.crc32:  # torch.save with CRCs disabled (or an empty entry) records none
            unchecked += e.nbytes
            continue
        crc = 0
        for start in range(0, e.nbytes, len(buf)):
            piece = buf[: min(len(buf), e.nbytes - start)]
            _pread_into(e, piece, e.data_offset + start)
            crc = zlib.crc32(piece, crc)
        if crc != e.crc32:
            raise _crc_mismatch(e)
    _warn_unchecked(unchecked)


def _warn_unchecked(unchecked: int) -> None:
    if unchecked:
        log.warning("%d bytes of model chunks carry no CRC-32 (saved with CRCs disabled); "
                    "`shardkeeper validate --deep` checks them against the manifest", unchecked)


def _crc_mismatch(e: _Entry) -> CheckpointError:
    return CheckpointError(f"{e.path}: CRC-32 mismatch in {e.what}; "
                           "the file is corrupted, run `shardkeeper validate --deep` and pick another step")


@dataclass
class _CrcState:
    entry: _Entry
    cursor: int  # file offset up to which the CRC is computed
    crc: int = 0
    in_order: bool = True  # False: the copy read it out of order; checked whole at the end


class _StreamCrc:
    """CRC-32 of zip entries computed from the bytes the copy reads anyway (one read of the model
    bytes, not two), each entry once; ``finish`` adds what the copy did not read (padding between and
    after the pieces of a ZeRO partition) and compares, before the commit. An entry the copy reads out
    of order is checked on its own at the end."""

    def __init__(self, entries: list[_Entry]):
        self._unchecked = sum(e.nbytes for e in entries if not e.crc32)
        self._states = [_CrcState(e, e.data_offset) for e in sorted(entries, key=lambda e: (e.fd, e.data_offset))
                        if e.crc32]
        self._by_fd: dict[int, tuple[list[int], list[_CrcState]]] = {}
        for st in self._states:
            starts, states = self._by_fd.setdefault(st.entry.fd, ([], []))
            starts.append(st.entry.data_offset)
            states.append(st)
        self._gap = bytearray(1 << 20)

    def __call__(self, fd: int, offset: int, view: memoryview) -> None:
        starts, states = self._by_fd.get(fd, ((), ()))
        i = bisect.bisect_right(starts, offset) - 1  # type: ignore[arg-type]
        if i < 0:
            return
        st = states[i]
        if not st.in_order or offset + len(view) > st.entry.data_offset + st.entry.nbytes:
            return
        if offset < st.cursor:  # read again, or out of order
            st.in_order = False
            return
        if offset > st.cursor:  # bytes the copy skips (ZeRO-3 padding, a tied copy): read them now, in order
            st.crc = self._crc_range(st.entry, st.cursor, offset, st.crc)
        st.crc = zlib.crc32(view, st.crc)
        st.cursor = offset + len(view)

    def _crc_range(self, e: _Entry, start: int, end: int, crc: int) -> int:
        gap = memoryview(self._gap)
        for pos in range(start, end, len(gap)):
            piece = gap[: min(len(gap), end - pos)]
            _pread_into(e, piece, pos)
            crc = zlib.crc32(piece, crc)
        return crc

    def finish(self, pool: _BufferPool) -> None:
        """Raise CheckpointError unless every entry's bytes match its CRC-32."""
        for st in self._states:
            end = st.entry.data_offset + st.entry.nbytes
            if st.in_order and self._crc_range(st.entry, st.cursor, end, st.crc) != st.entry.crc32:
                raise _crc_mismatch(st.entry)
        _verify_entries([st.entry for st in self._states if not st.in_order], pool)
        _warn_unchecked(self._unchecked)


def _produce(t: _Tensor, out_dtype: torch.dtype, pool: _BufferPool, emit: Emit, seen: Seen | None = None) -> None:
    """Emit the bytes of ``t`` in ``out_dtype``, in order, as pieces (each with its release callback);
    ``seen`` is shown the source bytes as they are read."""
    if t.rowwise():
        _produce_rows(t, out_dtype, pool, emit, seen)
    else:
        _produce_assembled(t, out_dtype, pool, emit, seen)


def _produce_rows(t: _Tensor, out_dtype: torch.dtype, pool: _BufferPool, emit: Emit, seen: Seen | None = None) -> None:
    """Row-block chunks: the tensor's bytes are the chunks' storage bytes one after the other."""
    src_size, dst_size = t.dtype.itemsize, out_dtype.itemsize
    per_piece = pool.nbytes // max(src_size, dst_size)
    for chunk in t.chunks:
        for done in range(0, chunk.numel, per_piece):
            n = min(per_piece, chunk.numel - done)
            buf = pool.get()
            offset = chunk.data_offset + done * src_size
            if t.dtype == out_dtype:
                _pread_into(chunk, memoryview(buf)[: n * src_size], offset, seen)
                emit(memoryview(buf)[: n * src_size], pool.releaser(buf))
                continue
            _pread_into(chunk, memoryview(pool.scratch)[: n * src_size], offset, seen)
            out = torch.frombuffer(buf, dtype=out_dtype, count=n)
            out.copy_(torch.frombuffer(pool.scratch, dtype=t.dtype, count=n))  # what tensor.to(out_dtype) does
            emit(memoryview(buf)[: n * dst_size], pool.releaser(buf))


def _produce_assembled(t: _Tensor, out_dtype: torch.dtype, pool: _BufferPool, emit: Emit,
                       seen: Seen | None = None) -> None:
    """Chunks that are not row blocks (2-D sharding, strided records): assemble one tensor, then emit it."""
    out = torch.empty(t.shape, dtype=out_dtype)
    for chunk in t.chunks:
        if not chunk.numel:
            continue
        raw = bytearray(chunk.storage_bytes)
        _pread_into(chunk, memoryview(raw), chunk.data_offset, seen)
        src = torch.frombuffer(raw, dtype=t.dtype).as_strided(chunk.sizes, chunk.strides, chunk.storage_offset)
        dst = out.view(-1) if t.flat else out
        for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            dst = dst.narrow(dim, off, length)
        dst.copy_(src)
    flat = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(flat), pool.nbytes):
        emit(flat[start : start + pool.nbytes], None)


def _open_new(path: Path) -> tuple[int, bool]:
    """Create ``path`` for writing, with O_DIRECT where the file system takes it; (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


class _FileSink:
    """Writes pieces to a new file in order (one thread) while hashing them in order (another).

    The file is written with O_DIRECT through an aligned staging buffer where the file system allows
    it (else buffered): the output is not read back, and filling the page cache with a multi-GB file
    costs more than the disk writes (about 4x on this project's VMs, where fresh page-cache pages are
    slow to come by); ``finish`` still fsyncs."""

    def __init__(self, path: Path, on_written: Callable[[int], None] | None = None):
        self.path = path
        self.fd, self.direct = _open_new(path)
        self._stage = mmap.mmap(-1, STAGE_BYTES) if self.direct else None  # page-aligned
        # copies into it through numpy, which releases the GIL (a memoryview copy holds it)
        self._stage_np = None if self._stage is None else np.frombuffer(self._stage, dtype=np.uint8)
        self._staged = 0  # bytes in the staging buffer
        self.size = 0
        self.sha = hashlib.sha256()
        self.error: BaseException | None = None
        self._on_written = on_written
        self._lock = threading.Lock()
        self._queues: list[queue.Queue[list[Any] | None]] = [queue.Queue(), queue.Queue()]
        self._threads = [
            threading.Thread(target=self._loop, args=(self._queues[0], self._write), name="export-write", daemon=True),
            threading.Thread(target=self._loop, args=(self._queues[1], self.sha.update), name="export-hash", daemon=True),
        ]
        for th in self._threads:
            th.start()

    def put(self, view: memoryview, release: Callable[[], None] | None = None) -> None:
        if self.error is not None:
            raise self.error
        item = [view, release, len(self._queues)]
        for q in self._queues:
            q.put(item)

    def _write(self, view: memoryview) -> None:
        n = len(view)
        if self._stage_np is None:
            self._write_out(view)
        else:
            src = np.frombuffer(view, dtype=np.uint8)
            while len(src):
                take = min(len(src), STAGE_BYTES - self._staged)
                self._stage_np[self._staged : self._staged + take] = src[:take]
                self._staged += take
                src = src[take:]
                if self._staged == STAGE_BYTES:
                    self._write_out(memoryview(self._stage))
                    self._staged = 0
            del src
        self.size += n
        if self._on_written:
            self._on_written(n)

    def _write_out(self, view: memoryview) -> None:
        while len(view):
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as e:  # a file system that opens O_DIRECT files but refuses their writes
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self.direct = False

    def _flush_tail(self) -> None:
        """The last partial block: written padded to the alignment, then the file is cut to its size."""
        if self._stage_np is None or not self._staged:
            return
        padded = -(-self._staged // _ALIGN) * _ALIGN
        self._stage_np[self._staged : padded] = 0
        self._write_out(memoryview(self._stage)[:padded])
        os.ftruncate(self.fd, self.size)
        self._staged = 0

    def _loop(self, q: queue.Queue[list[Any] | None], work: Callable[[memoryview], Any]) -> None:
        while (item := q.get()) is not None:
            try:
                if self.error is None:
                    work(item[0])
            except BaseException as e:  # noqa: BLE001 - handed to the producer by put()/finish()
                self.error = self.error or e
            finally:
                with self._lock:
                    item[2] -= 1
                    last = item[2] == 0
                if last:
                    item[0] = None  # drop the view before the buffer is reused
                    if item[1] is not None:
                        item[1]()

    def _stop(self) -> None:
        for q in self._queues:
            q.put(None)
        for th in self._threads:
            th.join()

    def finish(self) -> str:
        """Wait for the pieces, fsync and close; return the file's sha256."""
        self._stop()
        try:
            if self.error is not None:
                raise self.error
            self._flush_tail()
            os.fsync(self.fd)
        finally:
            self._close()
        return self.sha.hexdigest()

    def abort(self) -> None:
        self._stop()
        self._close()

    def _close(self) -> None:
        os.close(self.fd)
        self._stage_np = None
        if self._stage is not None:
            with contextlib.suppress(BufferError):  # a view still held by an error's traceback: GC frees it
                self._stage.close()
            self._stage = None


def _write_small(path: Path, data: bytes) -> str:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------- safetensors files
def plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Greedy packing in order: a new shard when the next tensor would pass ``limit``; a tensor larger
    than ``limit`` gets a shard of its own (logged), as huggingface_hub's splitter does."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > limit:
            log.warning("%s is %d bytes, more than max_shard_size %d: it is written alone in its own shard",
                        name, nbytes, limit)
            if current:
                shards.append(current)
            shards.append([name])
            current, used = [], 0
            continue
        if current and used + nbytes > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _data_order(tensors: list[_Tensor]) -> list[_Tensor]:
    # Widest dtypes first keeps every tensor aligned to its element size (safetensors' own order).
    return sorted(tensors, key=lambda t: -t.out_dtype.itemsize)


def safetensors_header(tensors: list[_Tensor]) -> bytes:
    """8-byte little-endian length + compact JSON (fixed __metadata__, sorted names), space-padded to 8."""
    entries: dict[str, Any] = {}
    offset = 0
    for t in _data_order(tensors):
        entries[t.name] = {"dtype": _SAFETENSORS_DTYPES[t.out_dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.out_nbytes]}
        offset += t.out_nbytes
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header.update(sorted(entries.items()))
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(path: Path, tensors: list[_Tensor], pool: _BufferPool,
                 on_written: Callable[[int], None] | None, seen: Seen | None = None) -> str:
    sink = _FileSink(path, on_written)
    try:
        sink.put(memoryview(safetensors_header(tensors)))
        for t in _data_order(tensors):
            _produce(t, t.out_dtype, pool, sink.put, seen)
    except BaseException:
        sink.abort()
        raise
    return sink.finish()


def _index_json(shards: list[list[_Tensor]], names: list[str]) -> bytes:
    weight_map = {t.name: fname for fname, shard in zip(names, shards) for t in shard}
    index = {
        "metadata": {"total_size": sum(t.out_nbytes for s in shards for t in s),
                     "total_parameters": sum(t.numel for s in shards for t in s)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _readme(ckpt_dir: Path, manifest: CheckpointManifest, model: _ModelSpecView, dtype: str,
            num_params: int, num_shards: int) -> bytes:
    arch = model.architecture
    lines = [
        "---", "library_name: transformers", "tags:", "- shardkeeper", "---", "",
        f"# {manifest.run_name} at step {manifest.step}", "",
        f"Exported by shardkeeper {__version__} from checkpoint `{ckpt_dir.name}` of run `{manifest.run_name}` "
        "(master weights float32).", "",
        "| | |", "|---|---|",
        f"| architecture | {arch} ({manifest.run_spec.model.model_type}) |",
        f"| parameters | {num_params:,} |",
        f"| dtype | {dtype} |",
        f"| training step | {manifest.step} |",
        f"| tokens seen | {manifest.tokens:,} |",
        f"| safetensors files | {num_shards} |", "",
        "```python", "from transformers import AutoModelForCausalLM",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")', "```", "",
    ]
    return "\n".join(lines).encode("utf-8")


# ------------------------------------------------------------------------------------------- commit
def _temp_dir(out_dir: Path) -> Path:
    tmp = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, out_dir: Path) -> None:
    """fsync the folder, rename it to ``out_dir`` (moving an old one aside first), fsync the parent."""
    fsync_dir(tmp)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _progress_bar(enabled: bool, total: int, label: str) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn()) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _check_free_space(out_dir: Path, needed: int) -> None:
    parent = next((p for p in [out_dir.parent, *out_dir.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(parent).free
    if free < needed + (64 << 20):
        raise ExportError(f"{parent}: {free / 1e9:.2f} GB free, the export needs {needed / 1e9:.2f} GB; "
                          "free space or export elsewhere")


def _write_shards(tmp: Path, ckpt_dir: Path, dtype: str, shards: list[list[_Tensor]], pool: _BufferPool,
                  progress: bool, seen: Seen | None = None) -> dict[str, str]:
    """Write the safetensors files (and the index when there are several); return name -> sha256.
    ``seen`` is shown the source bytes as they are read."""
    names = shard_file_names(len(shards))
    hashes: dict[str, str] = {}
    total = sum(len(safetensors_header(s)) + sum(t.out_nbytes for t in s) for s in shards)
    with _progress_bar(progress, total, f"export {ckpt_dir.name} ({dtype})") as advance:
        for fname, shard in zip(names, shards):
            hashes[fname] = _write_shard(tmp / fname, shard, pool, advance, seen)
            log.info("wrote %s: %d tensors, %.1f MB", fname, len(shard), sum(t.out_nbytes for t in shard) / 1e6)
    if len(shards) > 1:
        hashes[INDEX_FILE] = _write_small(tmp / INDEX_FILE, _index_json(shards, names))
    return hashes


def _write_model_files(tmp: Path, ckpt_dir: Path, manifest: CheckpointManifest, model: _ModelSpecView, dtype: str,
                       shards: list[list[_Tensor]]) -> dict[str, str]:
    """config.json, generation_config.json and README.md; return name -> sha256."""
    config_json, gen_json = model.config_json, model.generation_json
    num_params = sum(t.numel for s in shards for t in s)
    readme = _readme(ckpt_dir, manifest, model, dtype, num_params, len(shards))
    return {
        "config.json": _write_small(tmp / "config.json", config_json.encode("utf-8")),
        "generation_config.json": _write_small(tmp / "generation_config.json", gen_json.encode("utf-8")),
        "README.md": _write_small(tmp / "README.md", readme),
    }


# ---------------------------------------------------------------------------------------------- API
class _Background:
    """Run a function in a thread; ``result()`` joins it and re-raises its error. Used for importing
    transformers (Python, holding the GIL) while the checks in the main thread run mostly in C."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="export-describe", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Casts run on the calling thread: torch's OpenMP workers would spin against the writer and hasher."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _plan(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    by_name = {t.name: t for t in tensors}
    return [[by_name[n] for n in names] for names in plan_shards([(t.name, t.out_nbytes) for t in tensors], limit)]


def _declared_untied(manifest: CheckpointManifest) -> bool:
    """run_spec.model.config says ``tie_word_embeddings: false``: nothing is dropped as a tied copy, so
    the copy need not wait for transformers (seconds to import) to describe the model."""
    return manifest.run_spec.model.config.get("tie_word_embeddings") is False


def _described(describing: _Background | _ModelSpecView, ckpt_dir: Path, by_name: dict[str, _Tensor],
               pool: _BufferPool) -> _ModelSpecView:
    """The model description (recorded, or built by the background thread); tied copies dropped, checked."""
    model: _ModelSpecView = describing if isinstance(describing, _ModelSpecView) else describing.result()
    _drop_tied(ckpt_dir, by_name, model.tied, pool)
    _check_against_model(ckpt_dir, by_name, model)
    return model


def export_checkpoint(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "float32",
                      max_shard_size: int | str = "5GB", overwrite: bool = False, progress: bool = False,
                      deep: bool = False) -> ExportResult:
    """Export a committed DCP or deepspeed checkpoint to ``out_dir`` in the ``from_pretrained`` layout.

    ``dtype`` is the published dtype of floating tensors (integer/bool tensors keep theirs);
    ``max_shard_size`` bounds each safetensors file (bytes, or '5GB' / '500MB' / '2GiB'); a tensor
    larger than that is written alone in its own file; ``overwrite`` replaces an existing ``out_dir``
    (atomically, once the new export is complete); ``progress`` shows a rich progress bar; ``deep``
    also checks every checksum in the manifest first, and for DCP the fingerprint (the model bytes are
    always CRC-checked: DCP chunks before anything is written, ZeRO partitions as they are copied,
    before the commit). A deepspeed checkpoint is read in one pass where DeepSpeed stored its fp32
    master weights. Raises ExportError (options, output folder, model mismatch) or CheckpointError
    (the checkpoint), each with a one-line message naming the fix.
    """
    t0 = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    dtype_name, out_dtype = export_dtype(dtype)
    limit = parse_size(max_shard_size)
    _check_out_dir(ckpt_dir, out_dir, overwrite)
    manifest = _check_checkpoint(ckpt_dir, deep)
    # The manifest's hf_model record, or else transformers builds the model on the meta device meanwhile.
    describing = (_from_record(ckpt_dir, manifest, dtype_name)
                  or _Background(_describe_model, ckpt_dir, manifest, dtype_name))
    pool = _BufferPool(POOL_PIECES, PIECE_BYTES)
    with ExitStack() as stack, _torch_threads(1):
        found = _COLLECTORS[manifest.format](ckpt_dir, manifest, stack, out_dtype)
        _check_inventory(ckpt_dir, found.tensors, manifest, found.source)
        crc = _StreamCrc(found.entries) if found.crc_in_stream else None
        if crc is None:
            _verify_entries(found.entries, pool)
        by_name = _name_tensors(ckpt_dir, found.tensors)
        recorded = isinstance(describing, _ModelSpecView)
        model = None if _declared_untied(manifest) and not recorded else _described(describing, ckpt_dir, by_name, pool)
        tensors = list(by_name.values())
        shards = _plan(tensors, limit)
        total = sum(t.out_nbytes for t in tensors)
        _check_free_space(out_dir, total)
        tmp = _temp_dir(out_dir)
        try:
            hashes = _write_shards(tmp, ckpt_dir, dtype_name, shards, pool, progress, crc)
            if crc is not None:  # what the copy read, and the rest of each entry, against the zip's CRC-32
                crc.finish(pool)
            if model is None:  # the names were checked against the manifest; now also against transformers
                model = _described(describing, ckpt_dir, by_name, pool)
            hashes.update(_write_model_files(tmp, ckpt_dir, manifest, model, dtype_name, shards))
            _commit(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    hashes = dict(sorted(hashes.items()))
    seconds = time.perf_counter() - t0
    log.info("exported %s to %s: %d tensors, %.1f MB %s in %d file(s), %.2f s", ckpt_dir.name, out_dir,
             len(tensors), total / 1e6, dtype_name, len(shards), seconds)
    return ExportResult(
        checkpoint=str(ckpt_dir), out_dir=str(out_dir), dtype=dtype_name,  # type: ignore[arg-type]
        files=hashes, num_shards=len(shards), total_bytes=total, num_tensors=len(tensors), seconds=seconds,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


__all__ = ["EXPORT_DTYPES", "export_checkpoint", "export_dtype", "hf_name", "parse_size", "plan_shards",
           "safetensors_header", "shard_file_names"]
