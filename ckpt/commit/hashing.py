"""Fast file checksums (xxh3-128), computed by the rank that wrote each file."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from ckpt.commit.fsutil import open_regular
from schemas.errors import CheckpointError

_CHUNK = 8 << 20


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Return (size, xxh3-128 hex) of a regular file, read in 8 MiB chunks (xxhash releases the GIL). A fifo,
    device, socket or directory at ``path`` is refused (CheckpointError), never waited on nor read without end."""
    fd = open_regular(path)
    try:
        return hash_fd(fd)
    finally:
        os.close(fd)


def hash_fd(fd: int) -> tuple[int, str]:
    """``hash_file`` of an open file, read with pread from offset 0 (the descriptor's position is left alone): the
    bytes of a file already opened, even once its directory was retired."""
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = os.preadv(fd, [buf], size)
        if not n:
            break
        h.update(view[:n])
        size += n
    return size, h.hexdigest()


def hash_files(paths: list[Path], threads: int = 2) -> dict[Path, tuple[int, str]]:
    """Hash several files in parallel threads."""
    if not paths:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(paths)))) as pool:
        return dict(zip(paths, pool.map(hash_file, paths)))


class ChecksumMismatch(CheckpointError):
    """A file's bytes do not match the size and xxh3-128 its manifest lists."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        super().__init__(mismatch_message(path))

    def __reduce__(self) -> tuple[type, tuple[str]]:  # sent between ranks (DCP's failures): rebuilt from the path,
        return (type(self), (self.path,))  # not from the message (which would say its phrase twice)


def mismatch_message(path: str | os.PathLike[str]) -> str:
    return f"{path}: checksum mismatch; the file is corrupted"
