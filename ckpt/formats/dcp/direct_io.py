"""A DCP storage writer that writes with O_DIRECT and hashes while it writes.

On many hosts buffered writes followed by fsync run well below the device's direct-write bandwidth
(page-cache allocation dominates), and hashing afterwards would read every byte back. This writer
keeps DCP's file format byte for byte — only the I/O path differs: bytes are staged in a
page-aligned buffer, written in aligned blocks with O_DIRECT, the tail block is padded and the file
truncated to its real length, and an xxh3-128 digest is updated on the way through. Three 16 MiB buffers per
file: one is filled (each 1 MiB piece copied, then hashed while it is still in the cache) while pool threads write
the other two, each at its own file offset (pwrite), so the copy and the hash overlap the device's work and the
device always has the next write queued (one write in flight at a time left it idle between buffers: 1.19x the
parallel dd yardstick's time at 4 streams, 1.01-1.15x with two in flight; bench/save_profile.py). Where O_DIRECT
is not supported (tmpfs, some network file systems) it falls back to buffered writes + fsync; so does a
file system that accepts O_DIRECT at open but refuses the writes (EINVAL), once per file, logged once.

A file's (size, digest) is recorded only when every byte was written, the tail fsynced and the size on
disk equals the bytes hashed; any failure is kept in ``errors`` and re-raised (naming the file) by
``HashingDirectWriter.write_data``, which also checks that every item DCP planned was written: DCP's
extra writer threads would otherwise die with their exception and leave their items out of the plan.

Where O_DIRECT is refused at open, or not asked for (``direct=False``: the memory tier's tmpfs), there is no
staging at all: each 1 MiB piece of the caller's bytes is hashed and written straight into the file. A symlink at
a file's path is refused (O_NOFOLLOW). A memory snapshot's writer may be given a retired snapshot's dir
(``reuse``, ``ckpt.memtier.recycle.recycle``): a file of the same name there is moved into place and overwritten, then
cut to its new length, so its tmpfs pages are reused instead of allocated and zeroed (only a regular file with
no other link, checked on the file opened; anything else is removed and the file created as usual).

torch.save (which DCP's writer threads call per tensor) computes a CRC-32 of every record by default: about half
the CPU time of a save. The manifest's xxh3-128 of each file covers every byte (resume, validation and export
check it), so each stream of ``HashingDirectFileSystem`` turns torch's CRC-32 off in the thread that writes it
(torch's serialization settings are per thread) while it is open; the records then carry CRC 0, which torch.load
and this project's readers accept as "none recorded".
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import mmap
import os
import re
import stat
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from ckpt.formats.pickle.torchzip import byte_view

log = logging.getLogger(__name__)

_ALIGN = 4096
_BUF = 16 << 20
_warned_einval = False


def _warn_buffered(path: Path) -> None:
    global _warned_einval
    if not _warned_einval:
        _warned_einval = True
        log.warning("%s: the file system refused an O_DIRECT write (EINVAL); writing buffered instead", path.parent)


_PIECE = 1 << 20  # copied, then hashed from the cache, one piece at a time
_pool: ThreadPoolExecutor | None = None
DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # a rank's DCP data file (the only files ever taken over)
_pool_lock = threading.Lock()


def _io_pool() -> ThreadPoolExecutor:
    """The threads that issue the writes of full buffers (each stream has at most one write in flight)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="ckpt-direct-io")
        return _pool


class _HashingDirectStream(io.RawIOBase):
    hashing = True  # benchmarks turn it off to measure what checksumming costs
    pipelined = True  # benchmarks turn it off to compare with one buffer, hashed before the copy, written in place
    depth = 3  # buffers when pipelined: one fills while up to depth - 1 are written (the device never waits for a fill)

    def __init__(
        self,
        path: Path,
        sink: dict[str, tuple[int, str]],
        lock: threading.Lock,
        direct: bool = True,
        reuse: Path | None = None,
    ):
        super().__init__()
        self.path = path
        self._sink, self._lock = sink, lock
        self._hash = xxhash.xxh3_128()
        self._pos = 0
        self._fill = 0
        self._pending: deque[Future] = deque()  # the writes in flight, oldest first (buffers in round-robin order)
        self._flushed = 0  # file offset of the next buffer written
        self._switch = threading.Lock()
        self.direct = direct and hasattr(os, "O_DIRECT")
        # O_NOFOLLOW: a symlink planted where a file goes is refused, never written through.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        taken = take_over(reuse, path) if reuse is not None and not self.direct else None
        self.reused = taken is not None
        if taken is not None:
            self._fd = taken
        else:
            try:
                self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise
                self.direct = False
                self._fd = os.open(path, flags, 0o644)
        # Where the file system has no O_DIRECT, or it buys nothing (``direct=False``: the memory tier's tmpfs, which
        # accepts O_DIRECT on recent kernels but has no device behind it), the bytes go from the caller's buffer
        # straight into the file (the kernel's copy is the only one), hashed on the way; no staging buffers.
        self.passthrough = not self.direct
        # ``depth`` buffers (one when not pipelined): one fills (copy + hash) while the others are written. Anonymous
        # maps are page-aligned, as O_DIRECT requires.
        count = max(2, self.depth) if self.pipelined else 1
        self._bufs = [] if self.passthrough else [mmap.mmap(-1, _BUF) for _ in range(count)]
        self._views = [memoryview(b) for b in self._bufs]
        self._arrays = [np.frombuffer(b, dtype=np.uint8) for b in self._bufs]
        self._cur = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if self.passthrough:
            for at in range(0, n, _PIECE):
                piece = mv[at : at + _PIECE]
                if self.hashing:
                    self._hash.update(piece)
                self._write_all(piece)
            self._pos += n
            return n
        pipelined = len(self._bufs) >= 2
        if self.hashing and not pipelined:
            self._hash.update(mv)
        done = 0
        while done < n:
            take = min(_BUF - self._fill, n - done)
            array, view = self._arrays[self._cur], self._views[self._cur]
            # numpy copies without the GIL (a memoryview slice assignment holds it for the whole memcpy), so a
            # background save does not stall the training thread's Python; xxhash hashes without it too
            for at in range(0, take, _PIECE if pipelined else take):
                k = min(take - at, _PIECE) if pipelined else take
                start = self._fill + at
                np.copyto(array[start : start + k], np.frombuffer(mv[done + at : done + at + k], dtype=np.uint8))
                if self.hashing and pipelined:
                    self._hash.update(view[start : start + k])  # the piece just copied: still in the cache
            self._fill += take
            done += take
            if self._fill == _BUF:
                self._flush_full()
        self._pos += n
        return n

    def fill_from(self, fd: int) -> int:
        """Read ``fd`` from its offset to its end into the file, hashed on the way; returns the bytes read. Staged
        (O_DIRECT): read straight into the staging buffers, a piece at a time, each hashed while it is still in the
        cache -- the kernel's copy out of the source is the only one, and what is hashed is the private copy that
        is written, whatever happens to the source meanwhile. Passthrough: through one reused buffer."""
        total = 0
        if self.passthrough or len(self._bufs) < 2:
            buf = bytearray(_PIECE)
            view = memoryview(buf)
            try:
                while n := os.readv(fd, [view]):
                    self.write(view[:n])
                    total += n
            finally:
                view.release()
            return total
        while True:
            view = self._views[self._cur]
            n = os.readv(fd, [view[self._fill : self._fill + _PIECE]])
            if n == 0:
                return total
            if self.hashing:
                self._hash.update(view[self._fill : self._fill + n])
            self._fill += n
            self._pos += n
            total += n
            if self._fill == _BUF:
                self._flush_full()

    def _flush_full(self) -> None:
        """The current buffer is full: write it (in the background when pipelined: several buffers' writes may be in
        flight, each at its own offset), go on in the next buffer once its previous write is done."""
        at, self._flushed = self._flushed, self._flushed + _BUF
        if len(self._bufs) == 1:
            self._drain(0, _BUF, at)
            self._fill = 0
            return
        self._pending.append(_io_pool().submit(self._drain, self._cur, _BUF, at))
        self._cur = (self._cur + 1) % len(self._bufs)
        if len(self._pending) == len(self._bufs):  # the oldest write is the next buffer's: wait for it
            self._pending.popleft().result()
        self._fill = 0

    def _wait_pending(self) -> None:
        """Every write in flight, oldest first (each one waited for even when an earlier one failed)."""
        first: BaseException | None = None
        while self._pending:
            try:
                self._pending.popleft().result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others ended
                first = first or e
        if first is not None:
            raise first

    def _drain(self, which: int, length: int, at: int) -> None:
        """Write buffer ``which``[:length] at file offset ``at``."""
        self._write_all(self._views[which][:length], at)

    def _write_all(self, view: memoryview, at: int | None = None) -> None:
        """Write ``view`` (at offset ``at``: positional, so writes of several buffers may be in flight; else at the
        file offset), looping over short writes; EINVAL under O_DIRECT switches this file to buffered I/O (a refused
        write wrote nothing, so it resumes where it stopped)."""
        written = 0
        while written < len(view):
            as_direct = self.direct  # another buffer's write may switch the file to buffered meanwhile
            try:
                n = (
                    os.write(self._fd, view[written:])
                    if at is None
                    else os.pwrite(self._fd, view[written:], at + written)
                )
            except OSError as e:
                if e.errno != errno.EINVAL or not as_direct:
                    raise
                self._to_buffered()
                continue
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes", str(self.path))
            written += n

    def _to_buffered(self) -> None:
        with self._switch:  # once, whichever write in flight was refused first
            if not self.direct:
                return
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
        _warn_buffered(self.path)

    def flush(self) -> None:  # O_DIRECT can only write whole blocks; the tail goes out at close()
        pass

    def close(self, failed: bool = False) -> None:
        """Wait for the write in flight, flush the tail, fsync, check the size on disk, then record (size, digest)
        — unless a write failed (``failed``), in which case nothing is recorded and the file is left for the error
        path."""
        if self.closed:
            return
        try:
            if failed:
                try:
                    self._wait_pending()
                except Exception:  # noqa: BLE001
                    pass  # the failure being handled, or one more of the same file: nothing is recorded either way
                return
            self._wait_pending()
            if self._fill:
                view = self._views[self._cur]
                if self.direct:
                    padded = -(-self._fill // _ALIGN) * _ALIGN
                    view[self._fill : padded] = bytes(padded - self._fill)
                    self._drain(self._cur, padded, self._flushed)
                    os.ftruncate(self._fd, self._pos)
                else:
                    self._drain(self._cur, self._fill, self._flushed)
                self._fill = 0
            if self.reused:  # a taken-over file may have been longer
                os.ftruncate(self._fd, self._pos)
            os.fsync(self._fd)
            on_disk = os.fstat(self._fd).st_size
            if on_disk != self._pos:
                raise OSError(errno.EIO, f"{on_disk} bytes on disk after writing {self._pos}", str(self.path))
            with self._lock:
                self._sink[self.path.name] = (self._pos, self._hash.hexdigest())
        finally:
            if self._pending:  # a failure above while writes were in flight: let them end first
                try:
                    self._wait_pending()
                except Exception:  # noqa: BLE001 - the failure above is the one raised
                    pass
            os.close(self._fd)
            del self._arrays
            for v, b in zip(self._views, self._bufs):
                try:
                    v.release()
                    b.close()
                except BufferError:  # a failed write's traceback still holds a slice: freed with it
                    pass
            super().close()


def take_over(reuse: Path, path: Path, mode: int = os.O_WRONLY) -> int | None:
    """Move ``reuse``'s file of ``path``'s name to ``path`` and open it for overwriting (no O_TRUNC: its pages stay);
    None when there is none, or it is not a regular file of this user with this one name (then it is removed, never
    written through, and the caller creates ``path``). ``reuse`` is opened as a directory without following a
    symlink, and the file is looked up and moved relative to that descriptor; the open does not block (a FIFO
    swapped in is refused by the check on the file opened, not waited on). ``mode``: O_WRONLY, or O_RDWR (a map)."""
    try:
        dfd = os.open(reuse, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            return None
        os.rename(path.name, path, src_dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # swapped for something that cannot be opened so (a FIFO without a reader, a symlink)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    now = os.fstat(fd)
    if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev) or now.st_nlink != 1 or not stat.S_ISREG(now.st_mode):
        os.close(fd)  # swapped between the check and the open: not ours to overwrite
        os.unlink(path)
        return None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def write_direct(
    path: str | os.PathLike[str], fill: Callable[[io.RawIOBase], None], direct: bool = True
) -> tuple[int, str]:
    """Create ``path`` with ``fill(stream)`` through the same O_DIRECT, hashing stream (no page-cache copy of
    the bytes; buffered + fsync where O_DIRECT is refused); return (size, xxh3-128) once the whole file is
    on disk. On a failure nothing is returned and the (partial) file is left for the caller's error path."""
    sink: dict[str, tuple[int, str]] = {}
    stream = _HashingDirectStream(Path(path), sink, threading.Lock(), direct)
    try:
        try:
            fill(stream)
        except BaseException:
            stream.close(failed=True)
            raise
        stream.close()
    except OSError as e:
        if e.filename is None:  # a full disk says which file it stopped (the CLI's one line names it)
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    return sink[stream.path.name]


def copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], direct: bool = True) -> tuple[int, str]:
    """Copy ``src`` into a new file ``dst`` through the hashing O_DIRECT stream (``fill_from``: one copy of each
    byte, no page-cache copy of the bytes written); return (size, xxh3-128) of what was written, once it is on disk.
    A source that is a symlink is refused (O_NOFOLLOW). Raises OSError."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return write_direct(dst, lambda stream: stream.fill_from(fd), direct)  # type: ignore[attr-defined]
    finally:
        os.close(fd)


class HashingDirectFileSystem(FileSystem):
    """DCP FileSystem whose write streams are O_DIRECT and record (size, xxh3-128) per file name."""

    torch_crc32 = False  # benchmarks turn it on to measure what torch's CRC-32 of every record costs

    def __init__(self, direct: bool = True, reuse: Path | None = None) -> None:
        super().__init__()
        self.direct = direct
        self.reuse = reuse  # a retired memory snapshot whose data files may be overwritten in place
        self.digests: dict[str, tuple[int, str]] = {}
        self.errors: dict[str, BaseException] = {}  # file name -> why its write failed
        self.swallow = False  # set while write_data runs (see create_stream)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as s:
                yield s
            return
        try:
            reuse = self.reuse if DATA_FILE.match(Path(path).name) else None
            stream = _HashingDirectStream(Path(path), self.digests, self._lock, self.direct, reuse)
        except BaseException as e:
            with self._lock:
                self.errors.setdefault(Path(path).name, e)
            raise
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(self.torch_crc32)  # this thread's torch.save calls into the stream
        try:
            yield stream
        except Exception as e:
            with self._lock:
                self.errors.setdefault(stream.path.name, e)
            stream.close(failed=True)
            if not self.swallow:
                raise
            # Inside write_data: DCP's extra writer threads would die printing a traceback; the error is
            # kept and write_data raises it, naming the file, once every thread is done.
            return
        finally:
            torch.serialization.set_crc32_options(crc32)
        try:
            stream.close()
        except BaseException as e:
            with self._lock:
                self.errors.setdefault(stream.path.name, e)
            raise


class ExactStoragePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose tensors reach DCP's writer as aliases with a storage of exactly their bytes. DCP
    clones a tensor whose storage is larger than it (an FSDP2 shard is a view into its padded flat buffer), so
    that torch.save does not write the whole storage: an alias writes the same bytes without that copy (and
    the fresh memory it faults in)."""

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.numel()
            and data.is_contiguous()
            and data.untyped_storage().nbytes() != data.numel() * data.element_size()
        ):
            # held alive by the state dict this planner writes, until dcp.save returns
            return torch.frombuffer(byte_view(data.detach()), dtype=data.dtype).view(data.shape)
        return data


class HashingDirectWriter(FileSystemWriter):
    """FileSystemWriter over HashingDirectFileSystem; ``digests`` maps file name -> (size, xxh3-128)."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True, reuse: Path | None = None, **kwargs: Any):
        """``direct=False``: buffered writes straight from the caller's bytes (a tmpfs: the memory tier);
        ``reuse``: a retired snapshot's dir whose data files of the same names are overwritten in place."""
        super().__init__(path, **kwargs)
        self.fs = HashingDirectFileSystem(direct, reuse)
        self.results: list = []  # this rank's WriteResults and plan items (ckpt.memtier.stage's template)
        self.items: list = []
        self.metadata: Any = None  # the coordinator's Metadata, once written

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        return self.fs.digests

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's write, then proof that it wrote everything: no stream failed, every planned item has a
        result, every file a result names was hashed whole. Raises OSError naming the file otherwise."""
        self.fs.swallow = True
        try:
            fut = super().write_data(plan, planner)
        finally:
            self.fs.swallow = False
        self._raise_recorded()
        results = fut.value()
        self.results, self.items = list(results), list(plan.items)
        done = {r.index for r in results}
        lost = [item.index.fqn for item in plan.items if item.index not in done]
        if lost:
            raise OSError(errno.EIO, f"{len(lost)} planned items were not written (first: {lost[0]})", str(self.path))
        unhashed = sorted({r.storage_data.relative_path for r in results} - set(self.digests))
        if unhashed:
            raise OSError(errno.EIO, "written but not recorded whole", str(Path(self.path) / unhashed[0]))
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        self._raise_recorded()
        self.metadata = metadata

    def _raise_recorded(self) -> None:
        if not self.fs.errors:
            return
        name, err = sorted(self.fs.errors.items())[0]
        path = Path(self.path) / name
        if isinstance(err, OSError):
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise OSError(errno.EIO, f"{type(err).__name__}: {err}", str(path)) from err
