"""Verified DCP loads in one pass over the device: every file is hashed (xxh3-128) as it comes off the disk, and
nothing is written into the live state before every file of the checkpoint matched its manifest.

* Ownership: the coordinator's ``prepare_global_plan`` gives each file of the manifest to one rank: the rank
  that already reads most of it (the fewest extra bytes, balanced across ranks); a file no rank reads
  (``.metadata``, a file of a rank whose chunks nobody needs at this world size) goes to the least loaded rank.
* ``read_data``: each owned file is hashed whole, in order, through one reused buffer (which also brings it into
  the page cache); then each record this rank needs is checked (zip structure, allow-listed pickle, extents,
  shapes against the plan) without reading its tensor bytes, and where those bytes go is noted. It raises a
  ChecksumMismatch (preferred) or the first decode error of this rank; DCP gathers every rank's failure after
  ``read_data``, so a rank returns from ``dcp.load`` only when all files of all ranks matched.
* ``apply`` then reads each chunk from the page cache straight into its live tensor (a record that only part of
  is needed, or of another layout, is decoded whole and the part copied). The storages' CRC-32 is not checked:
  the file's xxh3 covers every byte. With ``eager`` the same copy is made in ``read_data``, right behind the hash
  pass, while the disk streams the rest (a refused load has then written into the live state: for callers that
  load another checkpoint over it or stop). Otherwise a refused load leaves the model and optimizer untouched.
  Nothing of the state is staged in memory (staging this rank's share, fresh memory faulted in and copied once
  more, cost more than the load itself on small hosts). A file is read from the device twice only when the page
  cache cannot hold this rank's share; one changed after it was hashed (size, times, inode) is refused before its
  bytes are read (eager: refused after).
* ``verified``: a file this rank's node hashed whole against the same manifest entry earlier in this restore (a
  memory snapshot's file sent to or received from the peer node, or hashed while the model built) is not hashed
  again while it is still that file (same device, inode, size, mtime and ctime as when it was hashed).
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckpt.commit import fingerprint as fp
from ckpt.commit.fsutil import FileIdentity, file_identity, pread_full
from ckpt.commit.hashing import ChecksumMismatch
from ckpt.formats.dcp.reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    SharedMetadata,
    _check_extent,
    _pread_record,
    plain_name,
)
from ckpt.formats.pickle import safe_pickle
from ckpt.formats.pickle.safe_pickle import StoredTensor
from ckpt.formats.pickle.torchzip import TorchZip, byte_view
from schemas.errors import CheckpointError

_CHUNK = 8 << 20


class OnePassReader(SafeFileSystemReader):
    """SafeFileSystemReader that verifies ``expected`` (file name -> (size, xxh3-128)) in ``read_data`` and defers
    every read into the live tensors to ``apply``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        expected: dict[str, tuple[int, str]],
        node_size: int | None = None,
        verified: dict[str, tuple[int, str, FileIdentity]] | None = None,
        sum_method: str | None = None,
        sum_keys: set[tuple[int, int, torch.dtype]] | None = None,
        sum_parts: bool = False,
        eager: bool = False,
        shared: SharedMetadata | None = None,
    ):
        super().__init__(path, shared)
        # Each chunk is copied into its live tensor as soon as the hash pass has passed it (its bytes are then in
        # the page cache), while the disk streams the rest, instead of after every file of every rank matched: the
        # copy hides behind the device. A refused load has then written into the live state, so only a caller that
        # overwrites all of it or gives up on a refusal asks for it (trainer.checkpointer: a resume that falls back
        # to an older checkpoint, or stops, but never starts over from the state as it was).
        self.eager = eager
        self.written = False  # eager: whether any chunk was copied into the live state
        self._hashed_here: set[str] = set()
        # Files this process (its node's leader) hashed whole moments ago, each with its identity then (st_dev,
        # st_ino, st_size, st_mtime_ns, st_ctime_ns): one still the same file is not hashed again
        # (ckpt.memtier.replicate.Verified).
        self.verified = dict(verified or {})
        # Each node reads its own copy (a memory snapshot on several nodes): every file gets an owner on every node
        # (ranks [k * node_size, (k + 1) * node_size) are one node), so each node hashes every byte it reads.
        self.node_size = node_size
        self.expected = dict(expected)
        # (request, live target, (file name, byte offset, bytes)): bytes < 0 means a whole record of -bytes to decode
        self.pending: list[tuple[ReadItem, torch.Tensor, tuple[str, int, int]]] = []
        self.digests: dict[str, tuple[int, str]] = {}
        self.extra_bytes = 0  # bytes this rank read only to hash them
        self._identity: dict[str, FileIdentity] = {}
        self._buf: memoryview | None = None
        # The fingerprint's sums of the chunks read straight into a live tensor (whole records), computed from the
        # page cache right behind the hash pass, while the disk streams the rest: ``sums`` for ``sum_method``
        # (fingerprint.KnownSums; a tensor that more than one chunk fills gets none; with ``sum_keys``, only the
        # memory it names: the live state's own tensors).
        self.sum_method = sum_method
        self.sums: fp.KnownSums = {}
        self._summed: dict[tuple[int, int, torch.dtype], list[tuple[int, int, float]]] = {}  # tensor -> its chunks
        self._writes: list[tuple[int, int]] = []  # the memory span of every chunk the load writes
        self.sum_keys = sum_keys
        self.sum_parts = sum_parts and sum_keys is not None
        self._by_address: list[tuple[int, int, torch.dtype]] | None = None
        self._starts: list[int] = []
        self._maps: dict[int, mmap.mmap] = {}  # descriptor -> a map of its file, while read_data sums
        self._scratch: torch.Tensor | None = None

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
        per = self.node_size or len(plans)
        for first in range(0, len(plans), per):
            node = range(first, min(first + per, len(plans)))
            for name in sorted(self.expected, key=lambda n: (-self.expected[n][0], n)):  # largest first: balance
                size = self.expected[name][0]
                mine = {r: sum(n for _, n in spans) for r, spans in read.get(name, {}).items()}
                rank = min(node, key=lambda r: (load[r] + max(0, size - mine.get(r, 0)), -mine.get(r, 0), r))
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
                (info.offset, info.length), []
            ).append(item)
        error: CheckpointError | None = None
        mismatch: ChecksumMismatch | None = None
        self._prefetch(per_file, owned)
        fds: dict[str, int] = {}
        try:
            for name in sorted(set(per_file) | owned):
                path = Path(self.path) / plain_name(name, where_md)
                try:
                    fds[name] = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    error = error or CheckpointError(
                        f"{path}: missing; the checkpoint is incomplete, pick another step"
                    )
                    continue
                self._identity[name] = file_identity(os.fstat(fds[name]))
            # The owned files are hashed in order on a thread (preadv and xxh3 release the GIL) while this one checks
            # each record once the hash has passed it (its bytes are then in the page cache: no seek ahead of it).
            hashed = _Progress()
            known = {name for name in owned & set(fds) if self._still_verified(name)}
            for name in known:
                self.digests[name] = self.verified[name][:2]
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-verify") as pool:
                # eager: only the chunks of files this rank hashes (read behind its own hash, from the same open
                # file) are copied now; another rank's files wait for apply, which reopens them after every verdict
                self._hashed_here = (owned & set(fds)) | known
                jobs = {
                    name: pool.submit(self._hash_whole, fds[name], self._identity[name][2], hashed.report(name))
                    for name in sorted(owned & set(fds) - known)
                }
                try:
                    for name in sorted(fds):
                        path = Path(self.path) / name
                        for (offset, length), reqs in sorted(per_file.get(name, {}).items()) if error is None else ():
                            if name in jobs:
                                hashed.wait(name, offset + length)
                            try:
                                self._plan_record(fds[name], path, offset, length, reqs, planner)
                            except CheckpointError as e:
                                error = e
                                break
                finally:
                    hashed.stop()
            self._finish_sums()
            for name, job in jobs.items():
                self.digests[name] = job.result()
                self.extra_bytes += max(0, self.digests[name][0] - sum(n for _, n in per_file.get(name, {})))
            for name in owned & set(fds):
                if self.digests[name] != self.expected.get(name):
                    mismatch = mismatch or ChecksumMismatch(Path(self.path) / name)
            if self.eager and error is None:
                for name in sorted(self._hashed_here):  # the files copied eagerly; apply checks the others
                    if file_identity(os.fstat(fds[name])) != self._identity[name]:
                        error = error or _changed(Path(self.path) / name)
        finally:
            self._unmap()
            for fd in fds.values():
                os.close(fd)
        self._buf = None
        if mismatch is not None or error is not None:
            self.pending.clear()
            raise mismatch or error  # type: ignore[misc]
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _still_verified(self, name: str) -> bool:
        """``name`` was hashed whole against this manifest entry in this restore and is still that file."""
        known = self.verified.get(name)
        ident = self._identity[name]
        return (
            known is not None and known[:2] == self.expected.get(name) and known[2] == ident and ident[2] == known[0]
        )  # its size now is the manifest's

    def _prefetch(self, per_file: dict[str, dict[tuple[int, int], list[ReadItem]]], owned: set[str]) -> None:
        """Ask the kernel to start reading, now and in the background, every byte this rank will read: the files
        hash from the page cache while the disk streams the rest (advice only; errors ignored)."""
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

    def _hash_whole(self, fd: int, size: int, progress: Callable[[int], None]) -> tuple[int, str]:
        """(bytes read, xxh3-128) of the whole file, read in order into one reused buffer; ``progress`` is told
        how far it got."""
        if self._buf is None:
            self._buf = memoryview(bytearray(_CHUNK))
        h, pos = xxhash.xxh3_128(), 0
        try:
            while pos < size:
                n = os.preadv(fd, [self._buf[: min(_CHUNK, size - pos)]], pos)
                if n <= 0:
                    break  # shorter than its size said: the digest then differs
                h.update(self._buf[:n])
                pos += n
                progress(pos)
        finally:
            progress(-1)  # done (or failed): nobody waits for more of this file
        return pos, h.hexdigest()

    def _plan_record(
        self, fd: int, path: Path, offset: int, length: int, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        """Check one record's structure and where each request's bytes go (no tensor data is read); byte values
        are decoded now (they go into the state dict, not the live tensors); the tensor reads wait for apply."""
        first = reqs[0]
        info = self.storage_data[first.storage_index]
        where = f"{path}: record of {first.storage_index.fqn} at byte {offset}"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} uses DCP stream transforms, which this reader does not support")
        if first.type == LoadItemType.BYTE_IO:
            data = _pread_record(fd, offset, length, where)
            for req in reqs:
                planner.record_where = where  # type: ignore[attr-defined]
                planner.load_bytes(req, io.BytesIO(data))
            return
        _check_extent(fd, offset, length, where)
        with TorchZip(fd, offset, length, where) as zf:
            record = zf.describe(safe_pickle.TENSOR_RECORD)
            if not isinstance(record, StoredTensor):
                raise CheckpointError(
                    f"{where}: holds a {type(record).__name__}, not one tensor; the checkpoint is "
                    "corrupted, pick another step"
                )
            data_offset, storage_bytes, _crc = zf.storage_entry(record.key)  # the file's xxh3 covers its bytes
        itemsize = record.dtype.itemsize
        if record.offset < 0 or (record.offset + record.numel) * itemsize > storage_bytes:
            raise CheckpointError(
                f"{where}: tensor of {list(record.shape)} runs past its storage of {storage_bytes} "
                "bytes; the checkpoint is corrupted, pick another step"
            )
        for req in reqs:
            target = planner.resolve_tensor(req).detach()
            lengths, offsets = tuple(req.lengths), tuple(req.storage_offsets)
            if (
                len(lengths) != len(record.shape)
                or len(offsets) != len(lengths)
                or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, record.shape))
                or tuple(target.size()) != lengths
            ):
                raise CheckpointError(
                    f"{where} holds {list(record.shape)}, the load plan expects {list(target.size())}"
                    f" at {list(offsets)}; the checkpoint is corrupted, pick another step"
                )
            whole = not any(offsets) and lengths == record.shape
            if (
                whole
                and record.dtype == target.dtype
                and record.is_contiguous()
                and target.is_contiguous()
                and target.device.type == "cpu"
            ):
                where_bytes = (path.name, data_offset + record.offset * itemsize, record.numel * itemsize)
                self._take(fd, path, req, target, where_bytes, planner)
                if self.sum_method == fp.METHOD:
                    self._sum_chunk(fd, target, data_offset + record.offset * itemsize)
            else:  # a piece of the record, or another layout: decoded whole in apply, then narrowed and copied
                self._take(fd, path, req, target, (path.name, offset, -length), planner)
            if self.sum_method == fp.METHOD:
                self._writes.append(_span(target))

    def _take(
        self,
        fd: int,
        path: Path,
        req: ReadItem,
        target: torch.Tensor,
        where: tuple[str, int, int],
        planner: LoadPlanner,
    ) -> None:
        """Copy one chunk into ``target`` now (eager) or note it for ``apply``."""
        if self.eager and where[0] in self._hashed_here:
            self.written = True
            _copy_chunk(fd, path, req, target, where[1], where[2])
            planner.commit_tensor(req, target)
        else:
            self.pending.append((req, target, where))

    def _sum_chunk(self, fd: int, target: torch.Tensor, offset: int) -> None:
        """The fingerprint's sum of the bytes at ``offset`` that ``apply`` will copy whole into ``target``, read
        straight from the page cache (a map of the file, no copy; behind the hash pass where this rank hashes the
        file), in the method's blocks, for a tensor ``sum_keys`` names; with ``sum_parts``, also for a chunk that
        fills part of one (its parts' sums are added: other bits than one pass over the tensor, which a load at
        another world size compares within the fingerprint's tolerance). ``_finish_sums`` keeps a tensor's sum only
        where these chunks, and nothing else of the load, write all of its memory once."""
        key = fp.memory_key(target)
        if key is None:
            return
        if self.sum_keys is None or key in self.sum_keys:
            owner, at = key, 0
        elif self.sum_parts and (found := self._container(target)) is not None:
            owner, at = found, (target.data_ptr() - found[0]) // target.element_size()
        else:
            return
        total = self._blocked_sum_at(fd, target, offset)
        if total is not None:
            self._summed.setdefault(owner, []).append((at, target.numel(), total))

    def _blocked_sum_at(self, fd: int, target: torch.Tensor, offset: int) -> float | None:
        """The blocked sum of squares of ``target.numel()`` elements of ``target``'s dtype at ``offset`` in ``fd``'s
        file, through a shared read-only map of it (no memory is committed for it); None when the file is shorter
        or cannot be mapped (the fingerprint then reads the live tensor)."""
        mapped = self._maps.get(fd)
        if mapped is None:
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    return None
                mapped = self._maps[fd] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None
        n = target.numel()
        if offset < 0 or offset + n * target.element_size() > len(mapped):
            return None
        if self._scratch is None:
            self._scratch = fp.scratch()
        total = fp.BlockedSum(self._scratch)
        with warnings.catch_warnings():  # a read-only buffer: never written through
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(mapped, dtype=target.dtype, count=n, offset=offset)
        for at in range(0, n, fp.STREAM):
            total.add(src[at : at + fp.STREAM])
        del src
        return total.acc

    def _container(self, target: torch.Tensor) -> tuple[int, int, torch.dtype] | None:
        """The tensor of ``sum_keys`` whose memory holds all of ``target``'s (same dtype), if any."""
        if self._by_address is None:
            self._by_address = sorted(self.sum_keys or (), key=lambda k: (k[0], k[1]))
            self._starts = [k[0] for k in self._by_address]
        i = bisect.bisect_right(self._starts, target.data_ptr()) - 1
        if i < 0:
            return None
        whole = self._by_address[i]
        size = target.element_size()
        inside = target.data_ptr() + target.numel() * size <= whole[0] + whole[1] * size
        aligned = (target.data_ptr() - whole[0]) % size == 0
        return whole if whole[2] == target.dtype and inside and aligned else None

    def _finish_sums(self) -> None:
        """``sums``: each summed tensor whose memory the load writes exactly once, by the chunks summed for it and
        by nothing else (no other chunk, decoded record or overlapping view of the load writes into it); its
        chunks' sums added in order (one chunk: the method's own bits)."""
        summed, self._summed = self._summed, {}
        writes = sorted(w for w in self._writes if w[1] > w[0])
        self._writes = []
        starts = [w[0] for w in writes]
        reach: list[int] = []  # the furthest end of the writes up to each index
        for _, end in writes:
            reach.append(max(end, reach[-1]) if reach else end)
        for key, parts in summed.items():
            size = key[2].itemsize
            lo, hi = key[0], key[0] + key[1] * size
            first, last = bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)
            if first > 0 and reach[first - 1] > lo:
                continue  # a write that starts before the tensor reaches into it
            inside = writes[first:last]
            parts.sort()
            covered, total, exact = 0, 0.0, len(inside) == len(parts)
            for (at, n, part), (w_lo, w_hi) in zip(parts, inside):
                exact = exact and at == covered and (w_lo, w_hi) == (lo + at * size, lo + (at + n) * size)
                covered += n
                total += part
            if exact and covered == key[1]:
                self.sums[key] = torch.tensor(total, dtype=torch.float64)

    def _unmap(self) -> None:
        maps, self._maps = self._maps, {}
        for mapped in maps.values():
            try:
                mapped.close()
            except BufferError:  # a view still held (a failure's traceback): unmapped when it is freed
                pass

    # ------------------------------------------------------------------ apply
    def apply(self, planner: LoadPlanner) -> None:
        """Read every planned chunk into its live tensor (call once every rank's read_data succeeded). The files
        are read again, from the page cache the hash pass filled; a file changed since it was hashed (its size,
        times or inode) is refused before any of its bytes are read. Nothing to do after an eager read."""
        by_file: dict[str, list[tuple[ReadItem, torch.Tensor, tuple[str, int, int]]]] = {}
        for item in self.pending:
            by_file.setdefault(item[2][0], []).append(item)
        self.pending.clear()
        for name, items in sorted(by_file.items()):
            path = Path(self.path) / name
            fd = os.open(path, os.O_RDONLY)
            try:
                if file_identity(os.fstat(fd)) != self._identity.get(name):
                    raise _changed(path)
                for req, target, (_, offset, n) in sorted(items, key=lambda it: abs(it[2][1])):
                    _copy_chunk(fd, path, req, target, offset, n)
                    planner.commit_tensor(req, target)
            finally:
                os.close(fd)


def _copy_chunk(fd: int, path: Path, req: ReadItem, target: torch.Tensor, offset: int, n: int) -> None:
    """Read ``n`` bytes at ``offset`` straight into ``target``; ``n < 0``: decode the record of ``-n`` bytes at
    ``offset`` (its CRC-32 unchecked: the file's xxh3 covers it) and copy the request's part of it."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    if n >= 0:
        _pread_exact(fd, byte_view(target), offset, f"{path}: chunk of {req.storage_index.fqn}")
        return
    where = f"{path}: record of {req.storage_index.fqn} at byte {offset}"
    with TorchZip(fd, offset, -n, where) as zf:
        zf.check_storage_crc = False
        tensor = zf.materialize(safe_pickle.TENSOR_RECORD)
    target.copy_(narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths))


def _changed(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: changed after it was verified; something writes into a committed checkpoint, stop it and resume again"
    )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of memory ``t`` may write (its first to one past its last element; empty for no element)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


class _Progress:
    """How far the hashing thread got in each file, for the records checked behind it."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}
        self._stopped = False
        self._cond = threading.Condition()

    def report(self, name: str) -> Callable[[int], None]:
        def told(pos: int) -> None:
            with self._cond:
                self._at[name] = pos if pos >= 0 else 1 << 62
                self._cond.notify_all()

        return told

    def wait(self, name: str, end: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self._at.get(name, 0) >= end)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _pread_exact(fd: int, view: memoryview, offset: int, where: str) -> None:
    if not pread_full(fd, view, offset):
        raise CheckpointError(f"{where}: the file ended early; it changed after it was verified, resume again")


def load_verified(
    state_dict: dict[str, Any],
    ckpt_dir: str | os.PathLike[str],
    expected: dict[str, tuple[int, str]],
    *,
    process_group: Any = None,
    no_dist: bool = False,
    node_size: int | None = None,
    verified: dict[str, tuple[int, str, FileIdentity]] | None = None,
    sum_method: str | None = None,
    sum_keys: set[tuple[int, int, torch.dtype]] | None = None,
    sum_parts: bool = False,
    eager: bool = False,
    shared: SharedMetadata | None = None,
) -> OnePassReader:
    """``dcp.load`` of ``ckpt_dir`` verified in one pass against ``expected``; on any rank's failure every rank
    raises (a ChecksumMismatch first) and ``state_dict``'s tensors are untouched (unless ``eager``). On success the
    chunks are copied in and the reader returned (its ``digests`` and ``extra_bytes`` for the record).
    ``node_size``: each node of that many ranks reads its own copy of ``ckpt_dir`` and hashes all of it.
    ``verified``: files this rank's node hashed whole against ``expected`` in this restore (name -> size, digest,
    identity then); one still the same file is not hashed again. ``sum_method``: the fingerprint method whose
    per-tensor sums the reader computes as it reads (``reader.sums``, for ``fingerprint.local_sum_squares``'s
    ``known``), only for the memory ``sum_keys`` names when given; ``sum_parts``: also of those that several chunks
    fill (a load at another world size). ``eager``: each chunk is copied into ``state_dict`` while the files are
    read, behind the hash pass; a refusal then leaves the state partly written (``reader.written``), for a caller
    that loads another checkpoint over it or stops. ``shared``: the ``.metadata`` as another rank of this load
    parsed it (``ckpt.formats.dcp.reader.share_metadata``), taken for the same bytes instead of parsing them again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = (
        OnePassReader(ckpt_dir, expected, node_size, verified, sum_method, sum_keys, sum_parts, eager, shared),
        SafeLoadPlanner(),
    )
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
