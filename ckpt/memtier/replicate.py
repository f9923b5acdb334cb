"""Moving memory-tier files between nodes over a gloo group (``ckpt.memtier.nodes`` holds the layout and plan).

* ``exchange``: at a snapshot, on the checkpoint thread, every rank sends the files it wrote to the same local rank
  of the next node, and receives those of the previous node into its node's ``.partial``; every received byte is
  hashed (xxh3-128) and compared with what its writer hashed.
* ``fetch``: before a restore, the node leaders run the plan's transfers (every rank in the same order), each
  received file hashed against the manifest before it joins the node's copy, and each sent file hashed as it is
  read (the sender's own copy checked on the way). Both sides return what they verified (``Verified``): the
  verified load then reads those files without hashing them again, as long as each is still the same file.

Both stream fixed-size chunks (isend/irecv posted together, so two nodes sending to each other never wait on one
another): the sender straight from a map of each file (the socket's copy is the only one, no read into a buffer
first), the receiver through reused buffers into the files. A sender that cannot read a file still sends its length
(zeros), and the receiver's hash refuses it.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ckpt.commit.fsutil import FileIdentity as Identity
from ckpt.commit.fsutil import file_identity as identity
from ckpt.commit.fsutil import pwrite_all
from schemas import FileEntry

CHUNK = 32 << 20

# file name -> (size, xxh3-128, identity): a file whose every byte this process hashed against its manifest entry
# (and, received, wrote whole), with its identity (ckpt.commit.fsutil.file_identity) as it was then.
Verified = dict[str, tuple[int, str, Identity]]


class _Out:
    """The chunks of the files this rank sends, straight from each file's pages (a map of the file: the send copies
    them into the socket, no copy into a buffer first; a memory snapshot's files are in tmpfs); with ``verify``,
    each file hashed as it is sent, in order (``verified``: those that matched their entry, unchanged while sent).
    A file that cannot be mapped whole (missing, shorter than its entry) is sent as zeros from a buffer."""

    def __init__(self, root: Path, files: list[FileEntry], verify: bool = False) -> None:
        self.verify = verify
        self.files = files
        self.parts = [
            (i, off, min(CHUNK, f.size - off)) for i, f in enumerate(files) for off in range(0, f.size, CHUNK)
        ]
        self._zeros: torch.Tensor | None = None
        self.root, self.problem = root, None
        self.hashes = [xxhash.xxh3_128() for _ in files]
        self.seen: dict[int, Identity | None] = {}  # the file's identity; None: it changed or failed
        self._open: tuple[int, int, mmap.mmap, torch.Tensor] | None = None  # (file, descriptor, its map, as bytes)
        # earlier files' maps: a send of their chunks may be in flight
        self._retired: list[tuple[int, int, mmap.mmap, torch.Tensor]] = []

    def chunk(self, i: int) -> torch.Tensor:
        """Chunk ``i``: a view of its file's map (valid until the next file's first chunk, or ``close``)."""
        k, off, n = self.parts[i]
        whole = self._mapped(k)
        if whole is None:  # said in ``problem``; the receiver's hash refuses the zeros
            if self._zeros is None or self._zeros.numel() < n:
                self._zeros = torch.zeros(CHUNK, dtype=torch.uint8)
            return self._zeros[:n]
        view = whole[off : off + n]
        if self.verify:
            self.hashes[k].update(memoryview(view.numpy()))
        if self.verify and off + n == self.files[k].size:  # its last chunk: unchanged since it was mapped?
            fd = self._open[1] if self._open is not None else -1
            try:
                if identity(os.fstat(fd)) != self.seen.get(k):
                    self.seen[k] = None
            except OSError:
                self.seen[k] = None
        return view

    def _mapped(self, k: int) -> torch.Tensor | None:
        """File ``k`` mapped (the previous file's map released); None when it cannot be read whole."""
        if self._open is not None and self._open[0] == k:
            return self._open[3]
        if k in self.seen and self.seen[k] is None:
            return None  # failed before
        if self._open is not None:  # released once its last chunk's send is done (``release``)
            self._retired.append(self._open)
            self._open = None
        path = self.root / self.files[k].path
        size = self.files[k].size
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            return self._unreadable(k, path, e)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                raise OSError(0, "shorter than its manifest says" if stat.S_ISREG(st.st_mode) else "not a regular file")
            # private and writable (never written: no page is copied), so that torch takes it without a copy
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            return self._unreadable(k, path, e)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        self.seen[k] = identity(st)
        self._open = (k, fd, mapped, whole)
        return whole

    def _unreadable(self, k: int, path: Path, e: OSError) -> None:
        self.seen[k] = None
        self.problem = self.problem or f"{path}: could not be read to send it ({e.strerror or e})"

    def release(self) -> None:
        """Unmap the files before the current one (call when no send of their chunks is in flight)."""
        retired, self._retired = self._retired, []
        for _, fd, mapped, whole in retired:
            del whole
            try:
                mapped.close()
            except BufferError:  # a view still held (a failed send's traceback): unmapped when it is freed
                pass
            os.close(fd)

    def close(self) -> None:
        """Unmap every file (call when no send is in flight)."""
        if self._open is not None:
            self._retired.append(self._open)
            self._open = None
        self.release()

    def verified(self) -> Verified:
        if not self.verify:
            return {}
        return {
            f.path: (f.size, f.xxh3_128, ident)
            for f, h, ident in ((f, h, self.seen.get(k)) for k, (f, h) in enumerate(zip(self.files, self.hashes)))
            if ident is not None and ident[2] == f.size and h.hexdigest() == f.xxh3_128
        }


class _In:
    """The files this rank receives: written into ``root`` as their chunks arrive, hashed on the way."""

    def __init__(self, root: Path, files: list[FileEntry], reuse: Path | None = None) -> None:
        self.root, self.files, self.reuse = root, files, reuse
        self.parts = [
            (i, off, min(CHUNK, f.size - off)) for i, f in enumerate(files) for off in range(0, f.size, CHUNK)
        ]
        size = min(CHUNK, max((n for _, _, n in self.parts), default=1))
        # three buffers: chunk k + 1 arrives while chunk k is written (on the writer thread) and k - 1's write ends
        self.bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(max(1, min(3, len(self.parts))))]
        self.hashes = [xxhash.xxh3_128() for _ in files]
        self.fds: dict[int, int] = {}
        self.problem: str | None = None
        self.idents: dict[int, Identity] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._writing: dict[int, Future] = {}  # buffer -> the write of the chunk it holds

    def buffer(self, k: int) -> torch.Tensor:
        """The buffer chunk ``k`` is received into, once the write of the chunk it held before has ended."""
        b = k % len(self.bufs)
        if b in self._writing:
            self._writing.pop(b).result()
        return self.bufs[b][: self.parts[k][2]]

    def open_all(self) -> None:
        """Open every file to receive; with ``reuse`` (a retired snapshot's dir, ``ckpt.memtier.recycle.recycle``) a
        file of the same name there is taken over and overwritten in place (its tmpfs pages reused), cut to its size."""
        from ckpt.formats.dcp.direct_io import DATA_FILE, take_over

        for i, f in enumerate(self.files):
            path = self.root / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            taken = (
                take_over(self.reuse, path)
                if self.reuse is not None and path.parent == self.root and DATA_FILE.match(path.name)
                else None
            )
            if taken is not None:
                self.fds[i] = taken  # closed by close(), whatever happens next
                os.ftruncate(taken, f.size)
                continue
            self.fds[i] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)

    def take(self, k: int, view: torch.Tensor) -> None:
        """Hash chunk ``k`` (in ``view``, its buffer) and write it on the writer thread."""
        i, off, n = self.parts[k]
        data = memoryview(view.numpy())[:n]
        self.hashes[i].update(data)
        if i not in self.fds or self.problem:  # could not be opened, or a write failed: said already
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-replica-write")
        self._writing[k % len(self.bufs)] = self._writer.submit(self._write, i, data, off, n)

    def _write(self, i: int, data: memoryview, off: int, n: int) -> None:
        try:
            pwrite_all(self.fds[i], data[:n], off)  # a short write continued; a write of nothing is ENOSPC
        except OSError as e:
            self.problem = self.problem or _write_problem(self.root / self.files[i].path, e)
        except Exception as e:  # noqa: BLE001 - one line, agreed with the other ranks like any write failure
            self.problem = self.problem or f"{self.root / self.files[i].path}: not written ({e}); nothing was committed"

    def close(self) -> str | None:
        if self._writer is not None:  # every write ended (each catches its own failure) before a descriptor closes
            self._writer.shutdown(wait=True)
            self._writer = None
        self._writing.clear()
        for i, fd in self.fds.items():
            try:
                self.idents[i] = identity(os.fstat(fd))
            except OSError as e:
                self.problem = self.problem or _write_problem(self.root / self.files[i].path, e)
            finally:
                os.close(fd)
        self.fds.clear()
        if self.problem:
            return self.problem
        for f, h in zip(self.files, self.hashes):
            if h.hexdigest() != f.xxh3_128:
                return (
                    f"{self.root / f.path}: the bytes received from the peer node differ from its checksum "
                    "(corrupted in the sender's memory or on the way); not kept"
                )
        return None

    def verified(self) -> Verified:
        """Call after a ``close`` that found no problem: every file received matched its entry and was written whole
        (the identity of one renamed since must be taken again: ``rebase``)."""
        return {
            f.path: (f.size, f.xxh3_128, self.idents[i])
            for i, f in enumerate(self.files)
            if i in self.idents and self.idents[i][2] == f.size
        }


def rebase(verified: Verified, names: set[str], root: Path) -> Verified:
    """``verified`` after its files ``names`` were renamed into ``root`` (a rename moves ctime): each such file's
    identity taken again where it is otherwise the same file (device, inode, size, mtime); one that is not, or cannot
    be looked at, is no longer verified."""
    out: Verified = {}
    for name, (size, digest, ident) in verified.items():
        if name not in names:
            out[name] = (size, digest, ident)
            continue
        try:
            now = identity(os.stat(root / name, follow_symlinks=False))
        except OSError:
            continue
        if now[:4] == ident[:4]:
            out[name] = (size, digest, now)
    return out


def _write_problem(where: Path, e: OSError) -> str:
    """One line; a full memory dir says so the way every save does ("disk full at ..."), so the tier goes off."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full at {where}: the peer node's files do not fit; nothing was committed"
    return f"{where}: the peer node's files cannot be written there ({e.strerror or e}); nothing was committed"


def stream(out: _Out | None, dst: int | None, inc: _In | None, src: int | None, group: dist.ProcessGroup) -> None:
    """Send ``out``'s chunks to ``dst`` and receive ``inc``'s from ``src``, pipelined: chunk k travels while the
    sender hashes chunk k+1 (both straight from the file's map) and the receiver hashes chunk k-1 and writes it on
    its writer thread (three buffers: a buffer is received into again once its chunk's write ended)."""
    n_out = len(out.parts) if out else 0
    n_in = len(inc.parts) if inc else 0

    def post(k: int) -> tuple[torch.Tensor, Any]:
        assert inc is not None
        view = inc.buffer(k)
        return view, dist.irecv(view, src=src, group=group)

    ready = out.chunk(0) if out is not None and n_out else None
    incoming = post(0) if n_in else None
    for k in range(max(n_out, n_in)):
        sent = dist.isend(ready, dst=dst, group=group) if ready is not None and k < n_out else None
        if incoming is not None and k < n_in:
            view, req = incoming
            req.wait()
            incoming = post(k + 1) if k + 1 < n_in else None
            assert inc is not None
            inc.take(k, view)  # while chunk k + 1 arrives in the other buffer
        if out is not None and k + 1 < n_out:
            ready = out.chunk(k + 1)  # mapped (a new file's) and hashed while chunk k is in flight
        if sent is not None:
            sent.wait()
            assert out is not None
            out.release()  # the maps of files whose every chunk is sent


def _transfer(
    root: Path,
    out_files: list[FileEntry],
    dst: int | None,
    in_files: list[FileEntry],
    src: int | None,
    group: dist.ProcessGroup,
    reuse: Path | None = None,
    verified: Verified | None = None,
) -> tuple[str | None, str | None]:
    """Send ``out_files`` (in ``root``) to ``dst`` and receive ``in_files`` from ``src`` into ``root`` (either side
    may be None; ``reuse``: a retired snapshot's dir whose files of the same names are overwritten in place).
    Returns (the receiver's problem, the sender's problem); ``verified`` gets the files hashed on the way."""
    out = _Out(root, out_files, verify=verified is not None) if dst is not None else None
    inc = _In(root, in_files, reuse) if src is not None else None
    if inc is not None:
        try:
            inc.open_all()
        except OSError as e:
            inc.problem = _write_problem(root, e)
    try:
        stream(out, dst, inc, src, group)
    finally:
        received = inc.close() if inc is not None else None
        if out is not None:  # a send that failed raised out of its wait: none is in flight any more
            out.close()
    if verified is not None:
        verified.update(out.verified() if out is not None else {})
        verified.update(inc.verified() if inc is not None and received is None else {})
    return received, out.problem if out is not None else None


def exchange(
    root: Path,
    mine: list[FileEntry],
    dst: int,
    theirs: list[FileEntry],
    src: int,
    group: dist.ProcessGroup,
    reuse: Path | None = None,
) -> str | None:
    """Send ``mine`` (in ``root``) to rank ``dst``; receive ``theirs`` from rank ``src`` into ``root`` (over the
    files of ``reuse``, a retired snapshot's dir, where it has them). One line when a received file does not hash
    to what its writer hashed, or cannot be written; else None."""
    return _transfer(root, mine, dst, theirs, src, group, reuse)[0]


def send(
    root: Path, files: list[FileEntry], dst: int, group: dist.ProcessGroup, verified: Verified | None = None
) -> str | None:
    return _transfer(root, files, dst, [], None, group, verified=verified)[1]


def receive(
    root: Path, files: list[FileEntry], src: int, group: dist.ProcessGroup, verified: Verified | None = None
) -> str | None:
    return _transfer(root, [], None, files, src, group, verified=verified)[0]
