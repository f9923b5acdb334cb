"""A memory snapshot at the cost of one copy: the state is staged straight into the snapshot's own files.

A DCP save serializes each tensor with ``torch.save`` (a small zip: headers, a pickle, the raw bytes) into the
rank's ``__R_I.distcp`` files. With torch's CRC-32 off, two saves of a state of the same shapes differ only in the
raw bytes of the tensors and in the byte items (the pickled non-tensors: an LR, the param groups). So after one
ordinary snapshot, ``SnapshotTemplate.build`` records where each of this rank's tensors' bytes lie in its files
(checked: the bytes found there are the tensor's), where each byte item lies, and the bytes around them.

``StageFiles`` then lays the next snapshot's files out in the memory dir before it is due (the retired snapshot's
files taken over, their tmpfs pages reused; the bytes around the tensors written; every page mapped), and hands
out a state dict whose tensors are views of those files: the training thread's one copy of the state *is* the
write. The background thread renames the files into the snapshot's ``.partial``, writes the byte items (of the
size the template holds, else the snapshot is written the ordinary way), hashes each file whole and, on rank 0,
writes ``.metadata``; the commit is the usual one (manifest, checksums, validation). The files are byte for byte
those ``dcp.save`` writes (tests/test_memtier.py compares them). The template is kept only while every rank's
ordinary writes lay their files out as it says (``same_layout``; trainer.checkpointer.dcp_backend agrees on it): rank
0's holds
the global ``.metadata``, which names every rank's offsets.
"""

from __future__ import annotations

import copy
import io
import mmap
import os
import pickle
import struct
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from ckpt.commit.fsutil import pwrite_all
from ckpt.formats.dcp.direct_io import take_over

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header (30 bytes)
EXTRA = "extra."  # the state dict's section of tracked objects' packed states (trainer.extras), per rank
_PIECE = 64 << 20  # hashed per piece (a memoryview of the whole map would pin it)


@dataclass(frozen=True)
class Region:
    file: str
    offset: int
    nbytes: int


@dataclass
class SnapshotTemplate:
    """Where one rank's snapshot files hold what (see the module's docstring)."""

    sizes: dict[str, int]  # file name -> size
    tensors: dict[str, Region]  # flattened state-dict key -> the raw bytes of its (one) chunk on this rank
    blobs: dict[str, Region]  # flattened key -> its byte item (a torch.save of the value)
    skeleton: dict[str, list[tuple[int, bytes]]]  # file name -> the bytes around the tensors and byte items
    metadata: Any = None  # rank 0: DCP's global Metadata of the snapshot written ordinarily
    dtypes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    layout: dict[Any, tuple[str, int, int]] = field(default_factory=dict)  # item -> (file, offset, length)

    def same_layout(self, results: list, flat: dict[str, Any]) -> bool:
        """Whether an ordinary write of ``flat`` (flattened as DCP does) put every item where this template has it,
        every tensor of the dtype and shape it has (a torch.save zip pads its data: a tensor a few bytes longer
        can leave every offset as it was)."""
        from torch.distributed.tensor import DTensor

        if _layout(results) != self.layout:
            return False
        for fqn, (dtype, shape) in self.dtypes.items():
            value = flat.get(fqn)
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or local.dtype != dtype or tuple(local.shape) != shape:
                return False
        return True

    @classmethod
    def build(
        cls, root: Path, results: list, items: list, flat: dict[str, Any], metadata: Any = None
    ) -> SnapshotTemplate | None:
        """From an ordinary DCP write of ``flat`` (the staged state dict, flattened as DCP flattens it) into
        ``root``: this rank's ``results`` (WriteResults) and plan ``items``. None when the layout is not one the
        stage can reproduce (a key written in several chunks, a tensor whose bytes are not found where the zip
        says, a file another rank also wrote)."""
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.tensor import DTensor

        kinds = {it.index: it.type for it in items}
        tensors: dict[str, Region] = {}
        blobs: dict[str, Region] = {}
        dtypes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for r in results:
            fqn, info = r.index.fqn, r.storage_data
            if fqn in tensors or fqn in blobs or getattr(info, "transform_descriptors", None):
                return None
            if kinds.get(r.index) == WriteItemType.BYTE_IO:
                blobs[fqn] = Region(info.relative_path, info.offset, info.length)
                continue
            value = flat.get(fqn)
            local = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(local, torch.Tensor) or not local.is_contiguous():
                return None
            at = _data_offset(root / info.relative_path, info.offset, info.length)
            nbytes = local.numel() * local.element_size()
            if at is None or at + nbytes > info.offset + info.length:
                return None
            tensors[fqn] = Region(info.relative_path, at, nbytes)
            dtypes[fqn] = (local.dtype, tuple(local.shape))
        names = sorted({r.file for r in [*tensors.values(), *blobs.values()]})
        sizes = {n: os.stat(root / n).st_size for n in names}
        skeleton: dict[str, list[tuple[int, bytes]]] = {n: [] for n in names}
        covered: dict[str, list[tuple[int, int]]] = {n: [] for n in names}
        for reg in [*tensors.values(), *blobs.values()]:
            covered[reg.file].append((reg.offset, reg.offset + reg.nbytes))
        for n in names:
            with open(root / n, "rb") as f:
                at = 0
                for start, end in sorted(covered[n]) + [(sizes[n], sizes[n])]:
                    if start < at:
                        return None  # overlapping regions: not a layout this knows
                    if start > at:
                        f.seek(at)
                        skeleton[n].append((at, f.read(start - at)))
                    at = end
        tpl = cls(sizes, tensors, blobs, skeleton, metadata, dtypes, _layout(results))
        return tpl if tpl._holds(root, flat) else None

    def _holds(self, root: Path, flat: dict[str, Any]) -> bool:
        """Every tensor's bytes are found at its region (the layout is understood, not assumed)."""
        import numpy as np
        from torch.distributed.tensor import DTensor

        maps = {}
        for n, size in self.sizes.items():
            if size:
                with open(root / n, "rb") as f:
                    maps[n] = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            for fqn, reg in self.tensors.items():
                if not reg.nbytes:
                    continue
                value = flat[fqn]
                local = (value.to_local() if isinstance(value, DTensor) else value).detach()
                found = np.frombuffer(maps[reg.file], dtype=np.uint8, count=reg.nbytes, offset=reg.offset)
                same = (
                    xxhash.xxh3_128(found).digest()  # two hashes: ~10x faster than comparing the arrays
                    == xxhash.xxh3_128(local.reshape(-1).view(torch.uint8).numpy()).digest()
                )
                del found
                if not same:
                    return False
        finally:
            for m in maps.values():
                m.close()
        return True


def _layout(results: list) -> dict[Any, tuple[str, int, int]]:
    return {r.index: (r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length) for r in results}


def _data_offset(path: Path, offset: int, length: int) -> int | None:
    """The file offset of the raw bytes of the one storage in the ``torch.save`` zip at [offset, offset+length)."""
    with open(path, "rb") as f:
        try:
            with zipfile.ZipFile(_Window(f, offset, length)) as z:
                data = [i for i in z.infolist() if "/data/" in i.filename]
                if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
                    return None
                f.seek(offset + data[0].header_offset)
                head = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        except (zipfile.BadZipFile, struct.error, OSError):
            return None
    if head[0] != 0x04034B50:
        return None
    return offset + data[0].header_offset + _LOCAL_HEADER.size + head[9] + head[10]


class _Window(io.RawIOBase):
    """A seekable read-only window [offset, offset+length) of an open file (for zipfile)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.base + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class StageFiles:
    """The next snapshot's files of this rank, laid out and mapped in ``stage_dir`` (taken over from ``reuse``
    where it holds them). ``staged``: the state dict to copy the state into (tensors written by this rank are
    views of the files; the others are ``like``'s own buffers)."""

    def __init__(
        self,
        template: SnapshotTemplate,
        stage_dir: Path,
        reuse: Path | None,
        like: dict[str, Any],
        kept: dict[tuple[int, int], tuple[int, mmap.mmap]] | None = None,
    ) -> None:
        """``kept``: maps made for earlier stages, by file (device, inode): a file staged before (the snapshots
        alternate between two sets of files) is written through its map again; a new map's page tables cost as
        much as writing the file. Updated with the maps made here."""
        self.template, self.dir = template, stage_dir
        self.maps: dict[str, mmap.mmap] = {}
        self.keys: set[tuple[int, int]] = set()
        self.moved = False
        kept = {} if kept is None else kept
        try:
            for name, size in template.sizes.items():
                path = stage_dir / name
                fd = take_over(reuse, path, os.O_RDWR) if reuse is not None else None
                if fd is None:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                try:
                    st = os.fstat(fd)
                    key = (st.st_dev, st.st_ino)
                    known = kept.get(key)
                    if known is None or known[0] != size or st.st_size != size:
                        known = None
                        os.ftruncate(fd, size)
                        if size:
                            os.posix_fallocate(fd, 0, size)  # every page now, on this thread: none faulted in later
                    if size:
                        if known is None:
                            known = (
                                size,
                                mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)),
                            )
                            kept[key] = known
                        self.maps[name] = known[1]
                        self.keys.add(key)
                finally:
                    os.close(fd)
            self.staged = _views(like, template, self.maps)
            # the packed states of tracked objects (``extra.rankR.NAME``, uint8): copied in by ``put_extras``
            self.extras = {
                fqn: (
                    torch.frombuffer(self.maps[reg.file], dtype=torch.uint8, count=reg.nbytes, offset=reg.offset)
                    if reg.nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
                for fqn, reg in template.tensors.items()
                if fqn.startswith(EXTRA)
            }
        except BaseException:
            self.discard()
            for name in template.sizes:  # a stage that failed (a full memory dir) holds no memory
                try:
                    os.unlink(stage_dir / name)
                except OSError:
                    pass
            raise

    def put_extras(self, extra: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any] | None:
        """Copy the tracked objects' packed states (``{"rankR": {name: uint8 tensor}}``) into their places; the same
        structure of views returned. None (nothing copied) when they are not the template's names and sizes."""
        flat = {f"{EXTRA}{rank}.{name}": t for rank, named in extra.items() for name, t in named.items()}
        if set(flat) != set(self.extras) or any(
            t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != self.extras[k].numel() for k, t in flat.items()
        ):
            return None
        for k, t in flat.items():
            self.extras[k].copy_(t)
        return {rank: {name: self.extras[f"{EXTRA}{rank}.{name}"] for name in named} for rank, named in extra.items()}

    def move_into(self, partial: Path) -> None:
        """The files join the snapshot's ``.partial`` (their maps stay valid)."""
        for name in self.template.sizes:
            os.rename(self.dir / name, partial / name)
        self.moved = True

    def blob_bytes(self, staged: dict[str, Any]) -> dict[str, bytes] | None:
        """The byte items of ``staged`` (serialized as DCP does); None when one's size is not the template's."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, _ = flatten_state_dict(staged)
        out = {}
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)  # as HashingDirectFileSystem writes them
        try:
            for fqn, reg in self.template.blobs.items():
                if fqn not in flat:
                    return None
                buf = io.BytesIO()
                torch.save(flat[fqn], buf)
                if buf.getbuffer().nbytes != reg.nbytes:
                    return None
                out[fqn] = buf.getvalue()
        finally:
            torch.serialization.set_crc32_options(crc)
        return out

    def write_blobs(self, blobs: dict[str, bytes]) -> None:
        """The byte items, and every byte around the tensors as the template has it: written after the state was
        copied in and right before the files are hashed, so that nothing written into the stage dir meanwhile
        (the files lie there for a whole snapshot interval) is hashed into the snapshot but the tensors' bytes."""
        for name, regions in self.template.skeleton.items():
            m = self.maps.get(name)
            for at, raw in regions if m is not None else ():
                m[at : at + len(raw)] = raw
        for fqn, reg in self.template.blobs.items():
            self.maps[reg.file][reg.offset : reg.offset + reg.nbytes] = blobs[fqn]

    def digests(self) -> dict[str, tuple[int, str]]:
        """(size, xxh3-128) of each file, hashed whole from its map."""
        out = {}
        for name, size in self.template.sizes.items():
            h = xxhash.xxh3_128()
            m = self.maps.get(name)
            if m is not None:
                view = memoryview(m)
                try:
                    for at in range(0, size, _PIECE):
                        h.update(view[at : at + _PIECE])
                finally:
                    view.release()
            out[name] = (size, h.hexdigest())
        return out

    def discard(self) -> None:
        """Let go of the maps: each is unmapped once the last tensor viewing it is gone (never closed here: a
        tensor still viewing it, the fingerprint's say, would read unmapped memory). The files, wherever they are
        now, are left to their directory's clean-up."""
        self.staged = {}
        self.maps = {}


def write_metadata(partial: Path, metadata: Any) -> tuple[int, str]:
    """Rank 0: the snapshot's ``.metadata`` (DCP's Metadata of the template, with this save's id and path)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    meta = copy.copy(metadata)
    meta.storage_meta = StorageMeta(checkpoint_id=str(partial), save_id=str(uuid.uuid4()))
    raw = pickle.dumps(meta)
    fd = os.open(partial / ".metadata", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        pwrite_all(fd, raw, 0)
    finally:
        os.close(fd)
    return len(raw), xxhash.xxh3_128(raw).hexdigest()


def _views(like: dict[str, Any], template: SnapshotTemplate, maps: dict[str, mmap.mmap]) -> dict[str, Any]:
    """``like`` (the staging buffers' state dict) with each tensor this rank writes replaced by a view of its bytes
    in the files (a DTensor keeps its mesh and placements)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, mapping = flatten_state_dict(like)
    out = dict(flat)
    for fqn, reg in template.tensors.items():
        if fqn.startswith(EXTRA) and fqn not in flat:  # a tracked object's packed state: not in the staged state
            continue
        value = flat.get(fqn)
        dtype, shape = template.dtypes[fqn]
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, torch.Tensor) or local.dtype != dtype or tuple(local.shape) != shape:
            raise ValueError(f"{fqn}: not the tensor the template holds")
        view = (
            torch.frombuffer(maps[reg.file], dtype=dtype, count=local.numel(), offset=reg.offset).view(shape)
            if reg.nbytes
            else torch.empty(shape, dtype=dtype)
        )
        out[fqn] = (
            DTensor.from_local(
                view, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
            if isinstance(value, DTensor)
            else view
        )
    return unflatten_state_dict(out, mapping)
