"""THE reader of ``torch.save`` zip records: whole ``.pt`` files (DeepSpeed, rng states) and the
one-tensor records inside DCP's ``.distcp`` files.

A record is a stored (never compressed) zip of ``<prefix>/data.pkl`` (the object tree), a
``byteorder`` entry and ``<prefix>/data/<key>`` storages. ``TorchZip`` parses the central directory
(zipfile, over a byte window of a file descriptor or a bytes buffer), reads ``data.pkl`` through its
local header with its CRC checked, and unpickles it with ``safe_pickle.load`` under a profile:

* ``describe()``: tensors become ``StoredTensor`` records and nothing else is read (export, deep
  validation, DeepSpeed layout reads, and the pre-parse before DeepSpeed's own loaders);
* ``materialize()``: tensors become real CPU tensors whose storages are read from their entries
  (what ``torch.load`` returned: DCP loads, DeepSpeed's engine, rng files).

``torch.load`` is never called on a file of a run directory.
"""

from __future__ import annotations

import ctypes
import io
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from ckpt.commit.fsutil import open_regular, pread_full
from ckpt.formats.pickle import safe_pickle
from ckpt.formats.pickle.safe_pickle import Profile, StorageRef, StorageType, StoredTensor
from schemas.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header (30 bytes)


class _Window(io.RawIOBase):
    """Read-only file object over bytes [0, length) of a ``pread(n, offset)`` source."""

    def __init__(self, zf: TorchZip):
        self.zf, self.pos = zf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.zf.length + pos}[whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        data = self.zf.pread(max(0, min(len(b), self.zf.length - self.pos)), self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    """The entry name as stored in the archive (before zipfile's cut at a NUL byte)."""
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


def _check_unambiguous(infos: list[zipfile.ZipInfo], where: str) -> None:
    """Refuse a zip that two readers could read differently: torch.load (miniz) and Python's zipfile differ
    on names with a NUL byte and on duplicate names, so a crafted file could show us a harmless data.pkl and
    DeepSpeed's torch.load another one. torch.save writes neither."""
    raw = [i.orig_filename for i in infos]
    if (
        len(set(raw)) != len(raw)
        or len({i.filename for i in infos}) != len(infos)
        or any("\0" in n or i.filename != n for i, n in zip(infos, raw))
    ):
        raise CheckpointError(
            f"{where}: zip directory with duplicate or NUL-cut entry names; torch.save never "
            "writes that, the file is crafted, pick another step"
        )


class TorchZip:
    """One torch.save zip: bytes [start, start + length) of ``fd``, or a bytes buffer (``from_bytes``).
    ``where`` names it in every error (``path`` or ``path: chunk of KEY at byte N``)."""

    def __init__(
        self, fd: int | None, start: int, length: int, where: str, *, data: bytes | None = None, owns_fd: bool = False
    ):
        self.fd, self.start, self.length, self.where = fd, start, length, where
        self._data = data
        self._owns_fd = owns_fd
        self._storages: dict[str, torch.Tensor] = {}
        # False: storages are not CRC-checked, because the reader hashes the whole file against its manifest
        # before anything read from it is used (ckpt.formats.dcp.onepass); data.pkl is checked when it has one.
        self.check_storage_crc = True
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        where = self.where
        try:
            with zipfile.ZipFile(_Window(self)) as zf:
                infos = zf.infolist()
        except Exception as e:  # noqa: BLE001 - BadZipFile, struct.error, ValueError, OSError... of a hostile file
            raise CheckpointError(
                f"{where}: not a torch.save zip record ({type(e).__name__}: {e}); "
                "the file is corrupted or not written by torch.save, pick another step"
            ) from None
        _check_unambiguous(infos, where)
        self.entries = {i.filename: i for i in infos}
        for name in self.entries:  # every local header agrees with the directory, not only those we read
            self.entry(name)
        pkl = [n for n in self.entries if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CheckpointError(
                f"{where}: no single data.pkl record; the file is not a torch.save checkpoint, pick another step"
            )
        self.prefix = pkl[0][: -len("data.pkl")]
        order = self.entries.get(self.prefix + "byteorder")
        if order is not None and self.read_entry(order.filename, 64).strip() != b"little":
            raise CheckpointError(f"{where}: big-endian torch.save record; re-save it on a little-endian machine")

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TorchZip:
        """A whole ``.pt`` file (the descriptor is owned and closed by ``close``)."""
        try:
            fd = open_regular(path)  # a fifo or device is refused, never waited on
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
        return cls(fd, 0, os.fstat(fd).st_size, str(path), owns_fd=True)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> TorchZip:
        return cls(None, 0, len(data), where, data=bytes(data))

    # ---------------------------------------------------------------- raw access
    def pread(self, n: int, offset: int) -> bytes:
        """``n`` bytes at ``offset`` of the record (fewer at its end)."""
        n = max(0, min(n, self.length - offset))
        if self._data is not None:
            return self._data[offset : offset + n]
        if self.fd is None:
            raise CheckpointError(f"{self.where}: read after close")
        return os.pread(self.fd, n, self.start + offset)

    def entry(self, name: str) -> tuple[int, int, int]:
        """(absolute offset of the bytes, length, CRC-32 from the directory; 0 when torch.save recorded
        none) of a stored entry, through its local header (torch pads the header's extra field)."""
        info = self.entries.get(name)
        if info is None:
            raise CheckpointError(f"{self.where}: no entry {name}; the record is corrupted, pick another step")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CheckpointError(
                f"{self.where}: entry {name} is compressed; torch.save never does that, the record is not genuine"
            )
        head = self.pread(_LOCAL_HEADER.size, info.header_offset)
        if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
            raise CheckpointError(
                f"{self.where}: damaged local header of {name}; the record is corrupted, pick another step"
            )
        *_, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        if self.pread(name_len, info.header_offset + _LOCAL_HEADER.size) != _raw_name(info):
            raise CheckpointError(
                f"{self.where}: local header of {name} names another entry than the zip directory; "
                "torch.save never writes that, the file is crafted, pick another step"
            )
        rel = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if rel + info.file_size > self.length:
            raise CheckpointError(
                f"{self.where}: entry {name} runs past the record; the file is truncated, pick another step"
            )
        return self.start + rel, info.file_size, info.CRC

    def read_entry(self, name: str, max_bytes: int) -> bytes:
        offset, size, crc = self.entry(name)
        if size > max_bytes:
            raise CheckpointError(f"{self.where}: entry {name} of {size} bytes is larger than {max_bytes}; refused")
        data = self.pread(size, offset - self.start)
        # CRC 0: torch.save ran with torch.serialization.set_crc32_options(False), which records none.
        if len(data) != size or (crc and zlib.crc32(data) != crc):
            raise CheckpointError(f"{self.where}: CRC-32 mismatch in {name}; the file is corrupted, pick another step")
        return data

    def storage_entry(self, key: str) -> tuple[int, int, int]:
        """(absolute data offset, length, CRC-32) of storage ``key``; the bytes are not read."""
        return self.entry(f"{self.prefix}data/{key}")

    # ---------------------------------------------------------------- objects
    def _pickle(self) -> bytes:
        return self.read_entry(self.prefix + "data.pkl", safe_pickle.MAX_PICKLE_BYTES)

    def describe(self, profile: Profile) -> Any:
        """The object tree with tensors as StoredTensor records (no tensor data read). Each storage the pickle names
        must be an entry of the zip of exactly its declared size, so every record's geometry (checked against the
        declared size as it is unpickled) lies inside bytes the file holds."""

        def storage(kind: StorageType, key: str, numel: int) -> StorageRef:
            info = self.entries.get(f"{self.prefix}data/{key}")
            itemsize = kind.dtype.itemsize
            if info is None or info.file_size != numel * itemsize:
                held = "no such entry" if info is None else f"an entry of {info.file_size} bytes"
                raise CheckpointError(
                    f"{self.where}: storage {key} is declared as {numel} x {itemsize} bytes, the zip "
                    f"holds {held}; the file is corrupted or crafted, pick another step"
                )
            return StorageRef(key, kind.dtype, numel)

        return safe_pickle.load(self._pickle(), profile, where=self.where, storage=storage)

    def materialize(self, profile: Profile) -> Any:
        """The object tree with real CPU tensors (what torch.load returned), storages read once each."""
        return safe_pickle.load(self._pickle(), profile, where=self.where, storage=self._load_storage)

    def _load_storage(self, kind: StorageType, key: str, numel: int) -> torch.Tensor:
        found = self._storages.get(key)
        if found is not None:
            if found.dtype != kind.dtype or found.numel() != numel:
                raise CheckpointError(
                    f"{self.where}: storage {key} named with two dtypes or sizes; the record is not genuine"
                )
            return found
        offset, size, crc = self.storage_entry(key)
        itemsize = torch.empty((), dtype=kind.dtype).element_size()
        if size != numel * itemsize:
            raise CheckpointError(
                f"{self.where}: storage {key} holds {size} bytes, its record says {numel} x {itemsize}; "
                "the file is corrupted, pick another step"
            )
        out = torch.empty(numel, dtype=kind.dtype)
        self.read_into(offset, size, out)
        if crc and self.check_storage_crc and zlib.crc32(byte_view(out)) != crc:
            raise CheckpointError(
                f"{self.where}: CRC-32 mismatch in storage {key}; the file is corrupted, pick another step"
            )
        self._storages[key] = out
        return out

    def read_into(self, offset: int, size: int, out: torch.Tensor) -> None:
        """``size`` bytes at absolute ``offset`` into the contiguous CPU tensor ``out``. A record of no elements (the
        empty shard of a tensor smaller than the world) reads nothing: its tensor is already whole."""
        if size == 0:
            return
        view = byte_view(out)[:size]
        if self._data is not None:
            chunk = self._data[offset : offset + size]
            if len(chunk) != size:
                raise CheckpointError(f"{self.where}: truncated storage; the file is corrupted, pick another step")
            view[:] = chunk
            return
        if not pread_full(self._fd(), view, offset):
            raise CheckpointError(
                f"{self.where}: truncated while reading a storage; the file is corrupted, pick another step"
            )

    def _fd(self) -> int:
        if self.fd is None:
            raise CheckpointError(f"{self.where}: read after close")
        return self.fd

    def close(self) -> None:
        self._storages.clear()
        if self._owns_fd and self.fd is not None:
            os.close(self.fd)
        self.fd = None if self._owns_fd else self.fd

    def __enter__(self) -> TorchZip:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (through ctypes, not numpy, whose views
    pin the storage and so keep it from being released early)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte views need a contiguous CPU tensor")
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def load_file(path: str | os.PathLike[str], profile: Profile) -> Any:
    """A whole torch.save file as torch.load would return it (CPU tensors), under ``profile``."""
    with TorchZip.open(path) as zf:
        return zf.materialize(profile)


def load_bytes(data: bytes, profile: Profile, where: str) -> Any:
    """A torch.save record held in memory (a DCP value or chunk) with real tensors, under ``profile``."""
    with TorchZip.from_bytes(data, where) as zf:
        return zf.materialize(profile)


def check_file(path: str | os.PathLike[str], profile: Profile = safe_pickle.DEEPSPEED_RECORDS) -> None:
    """Parse a whole .pt file with the allow-list (nothing read beyond its pickle): the pre-parse before
    a loader we do not control (DeepSpeed's own torch.load) opens it. CheckpointError if refused."""
    with TorchZip.open(path) as zf:
        zf.describe(profile)


def pt_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.pt") if p.is_file())


__all__ = ["StoredTensor", "TorchZip", "byte_view", "check_file", "load_bytes", "load_file", "pt_files"]
