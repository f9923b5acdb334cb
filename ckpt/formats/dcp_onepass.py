"""One-pass verified DCP loads: every byte is read once, hashed (xxh3-128) on its way into the tensors, and
nothing read is applied to the live state before every file of the checkpoint matched its manifest.

* Ownership: the coordinator's ``prepare_global_plan`` gives each file of the manifest to one rank: the rank
  that already reads most of it (the fewest extra bytes, balanced across ranks); a file no rank reads
  (``.metadata``, a file of a rank whose chunks nobody needs at this world size) goes to the least loaded rank.
* ``read_data``: an owned file is walked in offset order; each record is decoded and its bytes hashed from the
  decoded storages (the record's few zip header bytes are read again, never its tensor data); the bytes between
  and after records are read only to be hashed. A file this rank does not own is read as before, unhashed. The
  storages' CRC-32 is not checked: the file's xxh3 covers every byte, and is checked before any use.
* The copies into the live tensors are deferred: ``read_data`` keeps (target, chunk) pairs and raises a
  ChecksumMismatch (preferred) or the first decode error of this rank; DCP gathers every rank's failure after
  ``read_data``, so a rank returns from ``dcp.load`` only when all files of all ranks matched. ``apply`` then
  copies into the live tensors. A refused load leaves the model and optimizer untouched; the price is one
  chunk-sized copy of this rank's share of the state held in memory until the copies are made.
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckpt.formats import safe_pickle
from ckpt.formats.dcp import SafeFileSystemReader, SafeLoadPlanner, _check_extent, _pread_record, plain_name
from ckpt.formats.torchzip import TorchZip, byte_view
from ckpt.hashing import ChecksumMismatch
from schemas.errors import CheckpointError

_CHUNK = 8 << 20


class _Hasher:
    """xxh3-128 of one file, fed strictly in order; ``pos`` is the next byte it expects."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.pos = fd, size, 0
        self.h = xxhash.xxh3_128()
        self.extra = 0  # bytes read only to be hashed

    def update(self, data: Any, offset: int) -> None:
        if offset != self.pos:
            raise ValueError("out of order")
        self.h.update(data)
        self.pos += len(memoryview(data).cast("B"))

    def read_to(self, end: int, buf: memoryview) -> None:
        """Read and hash the file's bytes [pos, end)."""
        end = min(end, self.size)
        while self.pos < end:
            n = os.preadv(self.fd, [buf[: min(len(buf), end - self.pos)]], self.pos)
            if n <= 0:
                return  # shorter than the manifest says: the digest then differs
            self.h.update(buf[:n])
            self.pos += n
            self.extra += n


class OnePassReader(SafeFileSystemReader):
    """SafeFileSystemReader that verifies ``expected`` (file name -> (size, xxh3-128)) while it reads, and defers
    every copy into the live tensors to ``apply``."""

    def __init__(self, path: str | os.PathLike[str], expected: dict[str, tuple[int, str]]):
        super().__init__(path)
        self.expected = dict(expected)
        self.pending: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        self.digests: dict[str, tuple[int, str]] = {}
        self.extra_bytes = 0  # bytes this rank read only to hash them
        self._buf: memoryview | None = None

    # ------------------------------------------------------------------ plan
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        read: dict[str, dict[int, set[tuple[int, int]]]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                read.setdefault(info.relative_path, {}).setdefault(rank, set()).add((info.offset, info.length))
        load = [0] * len(plans)
        owned: list[list[str]] = [[] for _ in plans]
        for name in sorted(self.expected, key=lambda n: (-self.expected[n][0], n)):  # largest first: balance
            size = self.expected[name][0]
            mine = {r: sum(n for _, n in spans) for r, spans in read.get(name, {}).items()}
            rank = min(range(len(plans)), key=lambda r: (load[r] + max(0, size - mine.get(r, 0)), -mine.get(r, 0), r))
            load[rank] += max(0, size - mine.get(rank, 0))
            owned[rank].append(name)
        return [dataclasses.replace(plan, storage_data=sorted(owned[r])) for r, plan in enumerate(plans)]

    # ------------------------------------------------------------------ read
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner):
            raise CheckpointError(f"{self.path}: OnePassReader needs a SafeLoadPlanner")
        where_md = Path(self.path) / ".metadata"
        owned = set(plan.storage_data or ())
        per_file: dict[str, dict[tuple[int, int], list[ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(plain_name(info.relative_path, where_md), {}).setdefault(
                (info.offset, info.length), []).append(item)
        error: CheckpointError | None = None
        mismatch: ChecksumMismatch | None = None
        self._prefetch(per_file, owned)
        for name in sorted(set(per_file) | owned):
            path = Path(self.path) / plain_name(name, where_md)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                error = error or CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step")
                continue
            try:
                size = os.fstat(fd).st_size
                hasher = _Hasher(fd, size) if name in owned else None
                for (offset, length), reqs in sorted(per_file.get(name, {}).items()):
                    if hasher is not None and offset < hasher.pos:
                        hasher = None  # overlapping records (crafted): the file is hashed apart, below
                    if hasher is not None:
                        hasher.read_to(offset, self._buffer())
                    if error is None:
                        try:
                            self._read_record(fd, path, offset, length, reqs, planner, hasher)
                        except CheckpointError as e:
                            error = e
                    elif hasher is None:
                        break  # nothing left to do in this file
                    if hasher is not None:  # what the decode did not hash (it failed): hash it now
                        hasher.read_to(offset + length, self._buffer())
                if name in owned:
                    self._hash_whole(hasher or _Hasher(fd, size), name)
            finally:
                os.close(fd)
            if name in self.digests and self.digests[name] != self.expected.get(name):
                mismatch = mismatch or ChecksumMismatch(path)
        self._buf = None
        if mismatch is not None or error is not None:
            self.pending.clear()
            raise mismatch or error  # type: ignore[misc]
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _prefetch(self, per_file: dict[str, dict[tuple[int, int], list[ReadItem]]], owned: set[str]) -> None:
        """Ask the kernel to start reading, now and in the background, every byte this rank will read: the records
        of each file decode from the page cache while the disk streams the rest (advice only; errors ignored)."""
        for name in sorted(set(per_file) | owned):
            try:
                fd = os.open(Path(self.path) / plain_name(name, Path(self.path) / ".metadata"), os.O_RDONLY)
            except (OSError, CheckpointError):
                continue  # reported when it is read
            try:
                spans = [(0, 0)] if name in owned else sorted(per_file[name])
                for offset, length in spans:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                pass
            finally:
                os.close(fd)

    def _buffer(self) -> memoryview:
        if self._buf is None:
            self._buf = memoryview(bytearray(_CHUNK))
        return self._buf

    def _hash_whole(self, hasher: _Hasher, name: str) -> None:
        """Hash the rest of the file, record its digest."""
        hasher.read_to(hasher.size, self._buffer())
        self.extra_bytes += hasher.extra
        self.digests[name] = (hasher.pos, hasher.h.hexdigest())

    def _read_record(self, fd: int, path: Path, offset: int, length: int, reqs: list[ReadItem], planner: LoadPlanner,
                     hasher: _Hasher | None) -> None:
        """Decode one record (read once for all the items that need it), hash its bytes, keep the copies."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        first = reqs[0]
        info = self.storage_data[first.storage_index]
        where = f"{path}: record of {first.storage_index.fqn} at byte {offset}"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} uses DCP stream transforms, which this reader does not support")
        if first.type == LoadItemType.BYTE_IO:
            data = _pread_record(fd, offset, length, where)
            if hasher is not None:
                hasher.update(data, offset)
            for req in reqs:
                planner.record_where = where  # type: ignore[attr-defined]
                planner.load_bytes(req, io.BytesIO(data))
            return
        _check_extent(fd, offset, length, where)
        with TorchZip(fd, offset, length, where) as zf:
            zf.check_storage_crc = path.name not in self.expected  # else some rank hashes the whole file
            tensor = zf.materialize(safe_pickle.TENSOR_RECORD)
            if hasher is not None:
                self._hash_record(zf, fd, offset, length, hasher)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{where}: holds a {type(tensor).__name__}, not one tensor; the checkpoint is "
                                  "corrupted, pick another step")
        for req in reqs:
            piece = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != piece.size():
                raise CheckpointError(f"{where} holds {list(piece.size())}, the load plan expects {list(target.size())}; "
                                      "the checkpoint is corrupted, pick another step")
            self.pending.append((req, target, piece))

    def _hash_record(self, zf: TorchZip, fd: int, offset: int, length: int, hasher: _Hasher) -> None:
        """The record's bytes in order: its storages from the tensors just read, the zip structure around them
        read again (a few hundred bytes)."""
        spans = sorted((zf.storage_entry(key)[0], byte_view(t) if t.numel() else memoryview(b""))
                       for key, t in zf._storages.items())
        end = offset + length
        for start, view in spans:
            if start < hasher.pos or start + len(view) > end:  # not a plain layout: read the record again
                hasher.read_to(end, self._buffer())
                return
            hasher.read_to(start, self._buffer())
            hasher.update(view, start)
        hasher.read_to(end, self._buffer())

    # ------------------------------------------------------------------ apply
    def apply(self, planner: LoadPlanner) -> None:
        """Copy every chunk read into its live tensor (call once every rank's read_data succeeded)."""
        for req, target, piece in self.pending:
            target.copy_(piece)
            planner.commit_tensor(req, target)
        self.pending.clear()


def load_verified(state_dict: dict[str, Any], ckpt_dir: str | os.PathLike[str], expected: dict[str, tuple[int, str]],
                  *, process_group: Any = None, no_dist: bool = False) -> OnePassReader:
    """``dcp.load`` of ``ckpt_dir`` verified in one pass against ``expected``; on any rank's failure every rank
    raises (a ChecksumMismatch first) and ``state_dict``'s tensors are untouched. On success the chunks are
    copied in and the reader returned (its ``digests`` and ``extra_bytes`` for the record)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = OnePassReader(ckpt_dir, expected), SafeLoadPlanner()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as e:
        reader.pending.clear()
        ours = [exc for _, (exc, _tb) in sorted(e.failures.items()) if isinstance(exc, CheckpointError)]
        ours.sort(key=lambda exc: not isinstance(exc, ChecksumMismatch))
        if ours:
            raise ours[0] from None
        raise
    except BaseException:
        reader.pending.clear()
        raise
    reader.apply(planner)
    return reader


__all__ = ["OnePassReader", "load_verified"]
