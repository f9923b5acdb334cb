"""Streaming with bounded memory: a pool of reused piece buffers, CRC checks of every model byte, casting
producers, and the writer/hasher threads (O_DIRECT where the file system takes it)."""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schemas.errors import CheckpointError

log = logging.getLogger(__name__)
from ckpt.export._options import ALIGN, O_DIRECT_FLAG, STAGE_BYTES
from ckpt.export._records import Emit, Entry, ExportTensor, Seen, pread_into


class BufferPool:
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


def chunk_entries(tensors: list[ExportTensor]) -> list[Entry]:
    """DCP: every chunk is a torch.save record of its own with one storage entry."""
    return [
        Entry(c.path, c.fd, c.data_offset, c.storage_bytes, c.crc32, f"{t.key} at offsets {list(c.offsets)}")
        for t in tensors
        for c in t.chunks
    ]


def verify_entries(entries: list[Entry], pool: BufferPool) -> None:
    """CRC-32 of every zip entry holding model bytes against its zip record, read on purpose (the entries
    a streamed check could not follow). torch.load does not check these; a flipped bit would otherwise
    be published silently."""
    unchecked = 0
    buf = memoryview(pool.scratch)
    for e in entries:
        if not e.crc32:  # torch.save with CRCs disabled (or an empty entry) records none
            unchecked += e.nbytes
            continue
        crc = 0
        for start in range(0, e.nbytes, len(buf)):
            piece = buf[: min(len(buf), e.nbytes - start)]
            pread_into(e, piece, e.data_offset + start)
            crc = zlib.crc32(piece, crc)
        if crc != e.crc32:
            raise crc_mismatch(e)
    warn_unchecked(unchecked)


def warn_unchecked(unchecked: int) -> None:
    if unchecked:
        log.warning(
            "%d bytes of model chunks carry no CRC-32 (saved with CRCs disabled); "
            "`shardkeeper validate --deep` checks them against the manifest",
            unchecked,
        )


def crc_mismatch(e: Entry) -> CheckpointError:
    return CheckpointError(
        f"{e.path}: CRC-32 mismatch in {e.what}; "
        "the file is corrupted, run `shardkeeper validate --deep` and pick another step"
    )


@dataclass
class CrcState:
    entry: Entry
    cursor: int  # file offset up to which the CRC is computed
    crc: int = 0
    in_order: bool = True  # False: the copy read it out of order; checked whole at the end


class StreamCrc:
    """CRC-32 of zip entries computed from the bytes the copy reads anyway (one read of the model
    bytes, not two), each entry once; ``finish`` adds what the copy did not read (padding between and
    after the pieces of a ZeRO partition) and compares, before the commit. An entry the copy reads out
    of order is checked on its own at the end."""

    def __init__(self, entries: list[Entry]):
        self._unchecked = sum(e.nbytes for e in entries if not e.crc32)
        self._states = [
            CrcState(e, e.data_offset) for e in sorted(entries, key=lambda e: (e.fd, e.data_offset)) if e.crc32
        ]
        self._by_fd: dict[int, tuple[list[int], list[CrcState]]] = {}
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

    def _crc_range(self, e: Entry, start: int, end: int, crc: int) -> int:
        gap = memoryview(self._gap)
        for pos in range(start, end, len(gap)):
            piece = gap[: min(len(gap), end - pos)]
            pread_into(e, piece, pos)
            crc = zlib.crc32(piece, crc)
        return crc

    def finish(self, pool: BufferPool) -> None:
        """Raise CheckpointError unless every entry's bytes match its CRC-32."""
        for st in self._states:
            end = st.entry.data_offset + st.entry.nbytes
            if st.in_order and self._crc_range(st.entry, st.cursor, end, st.crc) != st.entry.crc32:
                raise crc_mismatch(st.entry)
        verify_entries([st.entry for st in self._states if not st.in_order], pool)
        warn_unchecked(self._unchecked)


def produce(t: ExportTensor, out_dtype: torch.dtype, pool: BufferPool, emit: Emit, seen: Seen | None = None) -> None:
    """Emit the bytes of ``t`` in ``out_dtype``, in order, as pieces (each with its release callback);
    ``seen`` is shown the source bytes as they are read."""
    if t.rowwise():
        produce_rows(t, out_dtype, pool, emit, seen)
    else:
        produce_assembled(t, out_dtype, pool, emit, seen)


def produce_rows(
    t: ExportTensor, out_dtype: torch.dtype, pool: BufferPool, emit: Emit, seen: Seen | None = None
) -> None:
    """Row-block chunks: the tensor's bytes are the chunks' storage bytes one after the other."""
    src_size, dst_size = t.dtype.itemsize, out_dtype.itemsize
    per_piece = pool.nbytes // max(src_size, dst_size)
    for chunk in t.chunks:
        for done in range(0, chunk.numel, per_piece):
            n = min(per_piece, chunk.numel - done)
            buf = pool.get()
            offset = chunk.data_offset + done * src_size
            if t.dtype == out_dtype:
                pread_into(chunk, memoryview(buf)[: n * src_size], offset, seen)
                emit(memoryview(buf)[: n * src_size], pool.releaser(buf))
                continue
            pread_into(chunk, memoryview(pool.scratch)[: n * src_size], offset, seen)
            out = torch.frombuffer(buf, dtype=out_dtype, count=n)
            out.copy_(torch.frombuffer(pool.scratch, dtype=t.dtype, count=n))  # what tensor.to(out_dtype) does
            emit(memoryview(buf)[: n * dst_size], pool.releaser(buf))


def produce_assembled(
    t: ExportTensor, out_dtype: torch.dtype, pool: BufferPool, emit: Emit, seen: Seen | None = None
) -> None:
    """Chunks that are not row blocks (2-D sharding, strided records): assemble one tensor, then emit it."""
    out = torch.empty(t.shape, dtype=out_dtype)
    for chunk in t.chunks:
        if not chunk.numel:
            continue
        raw = bytearray(chunk.storage_bytes)
        pread_into(chunk, memoryview(raw), chunk.data_offset, seen)
        src = torch.frombuffer(raw, dtype=t.dtype).as_strided(chunk.sizes, chunk.strides, chunk.storage_offset)
        dst = out.view(-1) if t.flat else out
        for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
            dst = dst.narrow(dim, off, length)
        dst.copy_(src)
    flat = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(flat), pool.nbytes):
        emit(flat[start : start + pool.nbytes], None)


def open_new(path: Path) -> tuple[int, bool]:
    """Create ``path`` for writing, with O_DIRECT where the file system takes it; (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if O_DIRECT_FLAG:
        try:
            return os.open(path, flags | O_DIRECT_FLAG, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


class FileSink:
    """Writes pieces to a new file in order (one thread) while hashing them in order (another).

    The file is written with O_DIRECT through an aligned staging buffer where the file system allows
    it (else buffered): the output is not read back, and filling the page cache with a multi-GB file
    costs more than the disk writes (about 4x on this project's VMs, where fresh page-cache pages are
    slow to come by); ``finish`` still fsyncs."""

    def __init__(self, path: Path, on_written: Callable[[int], None] | None = None):
        self.path = path
        self.fd, self.direct = open_new(path)
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
            threading.Thread(
                target=self._loop, args=(self._queues[1], self.sha.update), name="export-hash", daemon=True
            ),
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
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT_FLAG)
                self.direct = False

    def _flush_tail(self) -> None:
        """The last partial block: written padded to the alignment, then the file is cut to its size."""
        if self._stage_np is None or not self._staged:
            return
        padded = -(-self._staged // ALIGN) * ALIGN
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


def write_small_file(path: Path, data: bytes) -> str:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()
