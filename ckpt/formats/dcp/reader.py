"""Safe access to DCP checkpoints.

DCP stores its ``.metadata`` and non-tensor values with pickle and loads them without the
weights-only restriction. A checkpoint may come from someone else, so every pickle here goes through
the one allow-list unpickler (``ckpt.formats.pickle.safe_pickle``) and every torch.save record through the
one record reader (``ckpt.formats.pickle.torchzip``):

* ``read_metadata`` / ``SafeFileSystemReader.read_metadata``: ``.metadata`` under the DCP metadata profile;
* ``SafeFileSystemReader.read_data``: DCP's tensor records and byte values (instead of DCP's torch.load);
* ``SafeLoadPlanner.load_bytes``: non-tensor values under the tensor-record profile;
* ``DCPTensorReader`` streams single tensors straight from the ``.distcp`` files, one chunk at a
  time, for export and deep validation without a process group or the whole state in memory.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckpt.commit.fsutil import open_regular
from ckpt.formats.dcp._metadata import (
    check_extents,
    file_sizes_of,
    metadata_bytes,
    plain_name,
    read_metadata_as,
    record_files,
)
from ckpt.formats.pickle import safe_pickle
from ckpt.formats.pickle.torchzip import TorchZip, load_bytes
from ckpt.gcpause import gc_paused
from schemas.errors import CheckpointError


@dataclass(frozen=True)
class SharedMetadata:
    """A ``.metadata`` that one rank of a load parsed for the others (``share_metadata``, ``shared_from``): the
    SHA-256 of the bytes it parsed, and the result. A rank takes it only for a ``.metadata`` whose bytes it reads
    itself and finds with that digest (``read_metadata``'s ``shared``)."""

    digest: bytes
    metadata: Metadata


def share_metadata(ckpt_dir: str | os.PathLike[str]) -> tuple[SharedMetadata, bytes] | None:
    """``ckpt_dir``'s ``.metadata``, parsed here for the ranks of a load (each checks its extents in ``read_metadata``).

    Returns:
        A ``SharedMetadata`` of the bytes read, for this rank, and the same pickled, to send to the other ranks as
        bytes (``shared_from``): a parsed value the pickler cannot take fails here, never inside the collective.
        None when the file is a symlink (the quick check refuses it), cannot be read, or is refused: each rank's
        own read then says why, in its own words.
    """
    path = Path(ckpt_dir) / ".metadata"
    try:
        if path.is_symlink():
            return None
        data = metadata_bytes(Path(ckpt_dir))
        shared = SharedMetadata(hashlib.sha256(data).digest(), _parsed(Path(ckpt_dir), data))
        return shared, pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - refused here: every rank reads it itself and refuses it in one line
        return None


def shared_from(blob: bytes | None) -> SharedMetadata | None:
    """What ``share_metadata`` made on another rank of this job, or None (nothing sent, or not a SharedMetadata).

    The bytes come from a rank of the same job through the control group, never from a file: the ranks of one job
    trust each other's pickles, as every object collective does (the file's bytes went through the allow-list).
    """
    if blob is None:
        return None
    try:
        with gc_paused():  # ~10^5 objects that live: see trainer.checkpointer.resumer.Resumer.load
            shared = pickle.loads(blob)  # noqa: S301 - a peer rank's pickle of what it parsed under the allow-list
    except Exception:  # noqa: BLE001 - each rank then parses the file itself
        return None
    ok = isinstance(shared, SharedMetadata) and type(shared.digest) is bytes and isinstance(shared.metadata, Metadata)
    return shared if ok else None


def read_metadata(
    ckpt_dir: str | os.PathLike[str], data: bytes | None = None, shared: SharedMetadata | None = None
) -> Metadata:
    """``ckpt_dir``'s ``.metadata`` through the allow-list, as DCP's own classes, its extents proven against the data
    files there (``ckpt.formats.dcp._metadata.check_extents``: chunks in bounds and tiling each tensor, records
    inside their files). Every reader of a DCP checkpoint -- a load, export, deep validation, conversion, import --
    reads it here. The quick check reads it without torch: ``ckpt.formats.dcp._metadata.read_layout``.

    Args:
        ckpt_dir: the checkpoint directory.
        data: the ``.metadata``'s bytes, already read by the caller.
        shared: what another rank of the same load parsed (``share_metadata``): taken instead of parsing when the
            bytes here have its digest; the checks of the structure and extents run here all the same.

    Raises:
        CheckpointError: the file is missing, refused by the allow-list, or describes chunks outside their tensors
            or files (one line naming it).
    """
    ckpt_dir = Path(ckpt_dir)
    if shared is not None and data is None:
        data = metadata_bytes(ckpt_dir)
    if shared is not None and data is not None and hashlib.sha256(data).digest() == shared.digest:
        md = shared.metadata  # the same bytes, parsed by another rank of this load as ``_parsed`` does
    else:
        md = _parsed(ckpt_dir, data)
    where = ckpt_dir / ".metadata"
    check_extents(md, where, file_sizes_of(ckpt_dir, record_files(md, where), where))
    return md


def _parsed(ckpt_dir: Path, data: bytes | None) -> Metadata:
    """``.metadata`` through the allow-list, in the structure DCP writes; its extents not checked yet."""
    md = read_metadata_as(ckpt_dir, data, safe_pickle.DCP_METADATA, Metadata)
    if not isinstance(md.storage_data, dict) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(
            f"{ckpt_dir / '.metadata'}: not the structure DCP writes (storage_data, state_dict_metadata); the "
            "checkpoint is corrupted, pick another step"
        )
    return md


def _value(data: bytes, where: str) -> Any:
    """A DCP byte value (a torch.save record of a non-tensor object) under the tensor-record profile."""
    return load_bytes(data, safe_pickle.TENSOR_RECORD, where)


def _tensor(data: bytes, where: str) -> torch.Tensor:
    t = load_bytes(data, safe_pickle.TENSOR_RECORD, where)
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(
            f"{where}: holds a {type(t).__name__}, not one tensor; the checkpoint is corrupted, pick another step"
        )
    return t


def _tensor_at(fd: int, offset: int, length: int, where: str) -> torch.Tensor:
    """The tensor of the record at bytes [offset, offset + length) of ``fd``: the same checks as ``_tensor`` (extent,
    zip structure, allow-list, CRC-32 of the storage), but the storage is read from the file straight into the
    tensor: not first into a buffer of the whole record, then its copy, then a slice of it (three copies less)."""
    _check_extent(fd, offset, length, where)
    with TorchZip(fd, offset, length, where) as zf:
        t = zf.materialize(safe_pickle.TENSOR_RECORD)
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(
            f"{where}: holds a {type(t).__name__}, not one tensor; the checkpoint is corrupted, pick another step"
        )
    return t


def _check_extent(fd: int, offset: int, length: int, where: str) -> None:
    size = os.fstat(fd).st_size
    if offset < 0 or length < 0 or offset + length > size:
        raise CheckpointError(
            f"{where}: declares bytes {offset}..{offset + length} of a {size}-byte file; "
            "the checkpoint is truncated or crafted, pick another step"
        )


def _pread_record(fd: int, offset: int, length: int, where: str) -> bytes:
    """The bytes of one record, after checking that the extent ``.metadata`` declares lies inside the file:
    a crafted length must not make us allocate it (os.pread allocates ``length`` bytes up front)."""
    _check_extent(fd, offset, length, where)
    return os.pread(fd, length, offset)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata and records are read with the allow-list unpickler (``shared``: the
    ``.metadata`` as another rank of this load parsed it, ``read_metadata``'s)."""

    def __init__(self, path: str | os.PathLike[str], shared: SharedMetadata | None = None):
        super().__init__(path)
        self.shared = shared

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self.path, shared=self.shared)
        self.shared = None  # one load's: DCP sets its load id on it
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch's FileSystemReader.read_data, with each record decoded by our reader, not torch.load."""
        if not isinstance(planner, SafeLoadPlanner):  # DCP's default planner torch.loads byte values unrestricted
            raise CheckpointError(f"{self.path}: SafeFileSystemReader needs a SafeLoadPlanner")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            plain_name(self.storage_data[item.storage_index].relative_path, Path(self.path) / ".metadata")
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, reqs in per_file.items():
            path = Path(self.path) / relative_path
            try:
                f = os.fdopen(open_regular(path), "rb")  # closed below
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
            with f:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_item(f.fileno(), path, req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, fd: int, path: Path, req: ReadItem, planner: LoadPlanner) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        info = self.storage_data[req.storage_index]
        where = f"{path}: record of {req.storage_index.fqn} at byte {info.offset}"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} uses DCP stream transforms, which this reader does not support")
        if req.type == LoadItemType.BYTE_IO:
            data = _pread_record(fd, info.offset, info.length, where)
            planner.record_where = where  # type: ignore[attr-defined]  # so a refusal names the file
            planner.load_bytes(req, io.BytesIO(data))
            return
        tensor = narrow_tensor_by_index(
            _tensor_at(fd, info.offset, info.length, where), req.storage_offsets, req.lengths
        )
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"{where} holds {list(tensor.size())}, the load plan expects {list(target.size())}; "
                "the checkpoint is corrupted, pick another step"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are decoded by the allow-list record reader."""

    record_where: str | None = None  # set by SafeFileSystemReader.read_data: the file and record being read

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = _value(value.getvalue(), self.record_where or f"DCP value {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_state(
    state_dict: dict[str, Any], ckpt_dir: str | os.PathLike[str], *, process_group: Any = None, no_dist: bool = False
) -> None:
    """``dcp.load`` into ``state_dict`` through SafeFileSystemReader and SafeLoadPlanner. DCP gathers the
    ranks' failures into a multi-line CheckpointException; a CheckpointError of any rank (a refused
    record, a missing file) is raised as itself, one line naming the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(ckpt_dir),
            planner=SafeLoadPlanner(),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as e:
        ours = [exc for _, (exc, _tb) in sorted(e.failures.items()) if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def save_in_process(state_dict: dict[str, Any], storage_writer: Any, planner: Any) -> None:
    """``dcp.save`` in this one process (no group: a conversion or an import writing a whole checkpoint). DCP gathers
    a failure into its multi-line CheckpointException, which derives from BaseException (``except Exception`` misses
    it); here it comes out as one error: a source's refusal (a CheckpointError raised while a tensor was produced in
    DCP's writer threads, which the writer may record against its file as an OSError) as itself, naming the source
    file; else the writer's OSError (a full disk: ENOSPC, naming the file); else a RuntimeError of one line."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(state_dict, storage_writer=storage_writer, planner=planner, no_dist=True)
    except CheckpointException as e:
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        raise _first_failure(failures) from None
    except OSError as e:
        raise _first_failure([e]) from None


def _first_failure(failures: list[BaseException]) -> BaseException:
    """What a failed save says in one line: a CheckpointError behind any failure, else an OSError, else the first."""

    def chain(exc: BaseException | None) -> Iterator[BaseException]:
        for _ in range(16):
            if exc is None:
                return
            yield exc
            exc = exc.__cause__ or exc.__context__

    found = [exc for failure in failures for exc in chain(failure)]
    for kind in (CheckpointError, OSError):
        first = next((exc for exc in found if isinstance(exc, kind)), None)
        if first is not None:
            return first
    first = failures[0] if failures else None
    return RuntimeError(f"DCP save failed ({type(first).__name__}: {' '.join(str(first).split())[:300]})")


class DCPTensorReader:
    """Reads whole tensors of a DCP checkpoint one at a time, in one process, without a group."""

    def __init__(self, ckpt_dir: str | os.PathLike[str]):
        self.dir = Path(ckpt_dir)
        self.metadata = read_metadata(self.dir)
        self._files: dict[str, Any] = {}

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def byte_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.dir}: no tensor named {key!r} in the checkpoint")
        return md

    def _where(self, index: MetadataIndex) -> str:
        info = self.metadata.storage_data[index]
        return f"{self.dir / info.relative_path}: record of {index.fqn} at byte {info.offset}"

    def _read(self, index: MetadataIndex) -> bytes:
        info = self.metadata.storage_data[index]
        plain_name(info.relative_path, self.dir / ".metadata")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.dir}: {index.fqn} uses DCP stream transforms, which export does not support")
        f = self._files.get(info.relative_path)
        if f is None:
            path = self.dir / info.relative_path
            try:
                f = self._files[info.relative_path] = os.fdopen(open_regular(path), "rb")
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
        return _pread_record(f.fileno(), info.offset, info.length, self._where(index))

    def read_bytes_value(self, key: str) -> Any:
        index = MetadataIndex(key)
        return _value(self._read(index), self._where(index))

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Assemble the full tensor ``key`` from its chunks (into ``out`` when given). Its extents were proven when
        ``.metadata`` was read (``read_metadata``): the chunks tile it and the records holding them lie in files of
        at least its size, so a crafted size cannot allocate more than the files hold; each record must hold its
        chunk (its elements, of its dtype), or the read is refused naming it."""
        md = self.meta(key)
        if out is None:
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            index = MetadataIndex(key, chunk.offsets)
            piece = _tensor(self._read(index), self._where(index))
            if piece.numel() != math.prod(chunk.sizes) or piece.dtype != md.properties.dtype:
                raise CheckpointError(
                    f"{self._where(index)}: holds {piece.dtype} {list(piece.shape)}, .metadata "
                    f"says {md.properties.dtype} {list(chunk.sizes)}; the checkpoint is corrupted or "
                    "crafted, pick another step"
                )
            dst = out
            for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                dst = dst.narrow(dim, off, length)
            dst.copy_(piece.reshape(tuple(chunk.sizes)))
        return out

    def iter_tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.tensor_keys():
            if key.startswith(prefix):
                yield key, self.read(key)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> DCPTensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "SharedMetadata",
    "share_metadata",
    "shared_from",
    "DCPTensorReader",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load_state",
    "plain_name",
    "read_metadata",
    "save_in_process",
]
