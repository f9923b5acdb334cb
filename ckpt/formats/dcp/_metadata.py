"""Reading a DCP checkpoint's ``.metadata`` through the allow-list: as DCP's own classes for a load
(``ckpt.formats.dcp.reader.read_metadata``, torch), or as stand-ins of them for the quick check (``read_layout``): which
files, which tensors of which shapes and dtypes, without importing torch -- ``status``, a quick ``validate`` and
the launcher's checks before and after a segment then start in a fraction of a second instead of ~3 s.

Either way the extents it declares are proven before anything reads by them (``check_extents``): every chunk lies
inside its tensor and the chunks of each tensor tile it exactly (no overlap, no gap), every chunk and value has its
storage record, every record lies inside its file, does not share bytes with another, and is large enough for its
chunk. DCP's planner checks the same of its own plan when it saves (``_validate_global_plan``), but a load of
someone else's ``.metadata`` trusts it: two chunks claiming the same rows would leave the rows of neither read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import not_regular, read_regular
from ckpt.formats.pickle import safe_pickle
from ckpt.gcpause import gc_paused
from schemas.errors import CheckpointError

# bytes per element of the dtypes DCP's metadata can name (torch's own itemsize, without torch)
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
MAX_DIMS = 64  # dimensions of one tensor (torch itself allows 64)
# boxes visited by the tiling check per chunk beyond a regular grid (which visits each chunk once per dimension): a
# crafted layout of chunks that overlap in one dimension but not in the next cannot make the check quadratic
_TILING_WORK = 64
_CRAFTED = "the checkpoint is corrupted or crafted, pick another step"


def metadata_bytes(ckpt_dir: Path) -> bytes:
    """The bytes of ``ckpt_dir``'s ``.metadata`` (a regular file, at most ``safe_pickle.MAX_PICKLE_BYTES``).

    Raises:
        CheckpointError: it is missing, not a regular file, or larger (one line naming it).
    """
    path = ckpt_dir / ".metadata"
    try:
        return read_regular(path, safe_pickle.MAX_PICKLE_BYTES, "a DCP .metadata")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the DCP checkpoint is incomplete, pick another step") from None


def read_metadata_as(ckpt_dir: Path, data: bytes | None, profile: safe_pickle.Profile, metadata_class: type) -> Any:
    """``ckpt_dir``'s ``.metadata`` (``data``: its bytes, already read by the caller) through the allow-list under
    ``profile``, which must make it a ``metadata_class``. The structure and extents are not checked here
    (``check_extents``)."""
    path = ckpt_dir / ".metadata"
    md = safe_pickle.load(metadata_bytes(ckpt_dir) if data is None else data, profile, where=str(path))
    if not isinstance(md, metadata_class):
        raise CheckpointError(
            f"{path}: holds {type(md).__name__}, not DCP Metadata; the checkpoint is corrupted, pick another step"
        )
    return md


def read_layout(ckpt_dir: Path, data: bytes | None = None, file_sizes: Mapping[str, int] | None = None) -> Any:
    """``.metadata`` as stand-ins of DCP's classes (``safe_pickle.DCP_LAYOUT``, no torch): the files and tensors it
    describes, in the shapes the checks below read, its extents proven (``check_extents``; ``file_sizes``: the size
    of each data file, e.g. the manifest's; a file not in it is not measured). Anything else is a one-line refusal."""
    records = safe_pickle.LAYOUT_RECORDS
    md = read_metadata_as(ckpt_dir, data, safe_pickle.DCP_LAYOUT, records["Metadata"])
    where = ckpt_dir / ".metadata"
    storage, tensors = getattr(md, "storage_data", None), getattr(md, "state_dict_metadata", None)
    if (
        not isinstance(storage, dict)
        or not isinstance(tensors, dict)
        or not all(
            type(k) is records["MetadataIndex"]
            and type(v) is records["_StorageInfo"]
            and type(getattr(v, "relative_path", None)) is str
            for k, v in storage.items()
        )
    ):
        raise CheckpointError(
            f"{where}: not the structure DCP writes (storage_data, state_dict_metadata); the "
            "checkpoint is corrupted, pick another step"
        )
    check_extents(md, where, file_sizes)
    return md


def plain_name(name: Any, where: Path, record: str | None = None) -> str:
    """A data file named by the metadata must be a plain name inside the checkpoint directory (``record``: whose
    storage record names it, for the message)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        whose = f"the record of {record} " if record else ""
        raise CheckpointError(
            f"{where}: {whose}names data file {name!r:.80}, not a plain file name in the checkpoint; "
            "the checkpoint is corrupted or hostile, pick another step"
        )
    return name


def record_files(md: Any, where: Path) -> set[str]:
    """The data files ``.metadata``'s storage records name, each a plain file name (else refused naming the record)."""
    names: set[str] = set()
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if type(name) is not str or name not in names:
            names.add(
                plain_name(
                    name, where, _label(str(getattr(index, "fqn", "?"))[:200], _dims(getattr(index, "offset", None)))
                )
            )
    return names


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype or of its stand-in (``safe_pickle.LayoutDType``); 1 for a name not known
    here (a lower bound: the record checks below then ask less of it, never more)."""
    size = getattr(dtype, "itemsize", None)
    return size if type(size) is int and size > 0 else _ITEMSIZE.get(str(dtype).removeprefix("torch."), 1)


def _dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of non-negative ints (torch.Size is one), or None."""
    if (
        not isinstance(value, tuple)
        or len(value) > MAX_DIMS
        or not all(type(v) is int for v in value)
        or (value and min(value) < 0)
    ):
        return None
    return tuple(value)


def file_sizes_of(ckpt_dir: Path, names: set[str], where: Path) -> dict[str, int]:
    """The size of each data file ``names`` of ``ckpt_dir`` (plain file names: ``record_files``), which must all be
    there: a missing one, or a fifo, device, socket or directory under one of those names, is refused here, before
    anything opens it or allocates by it."""
    import stat

    sizes = {}
    for name in sorted(names):
        path = ckpt_dir / plain_name(name, where)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
        sizes[name] = st.st_size
    return sizes


# ------------------------------------------------------------------------------------------ extents
def check_extents(md: Any, where: Path, file_sizes: Mapping[str, int] | None = None) -> None:
    """Prove the extents ``.metadata`` (``where``) declares, in O(chunks log chunks), or raise a one-line
    CheckpointError naming the tensor and the two chunks (or the gap, or the record and its file):

    * every storage record: a plain file name, a non-negative offset and length, inside its file (``file_sizes``:
      the size of each data file; a file not in it is not measured), no two records of one file sharing a byte;
    * every tensor: a shape; every chunk inside it, with its storage record, which holds at least the chunk's
      bytes; the chunks tile it exactly (``tiling_problem``); every value (bytes) with its record;
    * every record belongs to a chunk or value that ``.metadata`` describes.

    Works on DCP's own classes and on the stand-ins of ``read_layout`` alike (fields are read by name)."""
    with gc_paused():  # a freshly parsed .metadata is millions of young objects: no collection rescans them mid-check
        _check_extents(md, where, file_sizes or {})


def _check_extents(md: Any, where: Path, sizes: Mapping[str, int]) -> None:
    records: Records = {}
    per_file: dict[str, list[tuple[int, int, str, tuple[int, ...] | None]]] = {}
    for index, info in md.storage_data.items():
        fqn, at = getattr(index, "fqn", None), getattr(index, "offset", None)
        offsets = None if at is None else _dims(at)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        name = getattr(info, "relative_path", None)
        if (
            type(fqn) is not str
            or (at is not None and offsets is None)
            or type(start) is not int
            or type(length) is not int
            or start < 0
            or length < 0
        ):
            raise CheckpointError(
                f"{where}: a storage record ({str(fqn)[:80]}) without a name, offset and length; "
                f"not the structure DCP writes, {_CRAFTED}"
            )
        spans = per_file.get(name)  # type: ignore[arg-type]
        if spans is None:
            spans = per_file[plain_name(name, where, _label(fqn, offsets))] = []
        size = sizes.get(name)
        if size is not None and start + length > size:
            raise CheckpointError(
                f"{where}: the record of {_label(fqn, offsets)} declares bytes "
                f"{start}..{start + length} of {name}, a {size}-byte file; the checkpoint is "
                "truncated or crafted, pick another step"
            )
        records[(fqn, offsets)] = (length, name)
        spans.append((start, length, fqn, offsets))
    for name, spans in per_file.items():
        _disjoint_records(where, name, spans)
    named: set[tuple[str, tuple[int, ...] | None]] = set()
    for fqn, meta in md.state_dict_metadata.items():
        kind = type(meta).__name__
        if type(fqn) is not str or kind not in ("TensorStorageMetadata", "BytesStorageMetadata"):
            raise CheckpointError(
                f"{where}: an entry ({str(fqn)[:80]}: {kind}) that is neither a tensor nor a value; "
                f"not the structure DCP writes, {_CRAFTED}"
            )
        if kind == "BytesStorageMetadata":
            if (fqn, None) not in records:
                raise CheckpointError(f"{where}: no storage record for the value {fqn}; {_CRAFTED}")
            named.add((fqn, None))
            continue
        named.update(_check_tensor(where, fqn, meta, records))
    extra = [k for k in records if k not in named]
    if extra:
        raise CheckpointError(
            f"{where}: a storage record of {_label(*min(extra, key=str))}, which no tensor chunk or "
            f"value of .metadata describes; {_CRAFTED}"
        )


def _label(fqn: str, offsets: tuple[int, ...] | None) -> str:
    return fqn if offsets is None else f"{fqn} at {list(offsets)}"


def _disjoint_records(where: Path, name: str, spans: list[tuple[int, int, str, tuple[int, ...] | None]]) -> None:
    """No two records of one file share a byte (DCP writes each once, one after the other): two chunks read
    from one record would put the same values in two places."""
    spans.sort(key=lambda span: span[0])
    end, last = 0, spans[0]
    for span in spans:
        start, length = span[0], span[1]
        if length and start < end:
            raise CheckpointError(
                f"{where}: the records of {_label(*last[2:])} and {_label(*span[2:])} share bytes "
                f"{start}..{min(end, start + length)} of {name}; {_CRAFTED}"
            )
        if length and start + length > end:
            end, last = start + length, span


Records = dict[tuple[str, tuple[int, ...] | None], tuple[int, str]]  # (fqn, chunk offsets) -> (length, file)


def _check_tensor(where: Path, fqn: str, meta: Any, records: Records) -> list[tuple[str, tuple[int, ...]]]:
    """One tensor's chunks: in bounds, each with a record large enough for it, tiling the tensor. Returns their
    record keys."""
    shape, chunks = _dims(getattr(meta, "size", None)), getattr(meta, "chunks", None)
    if shape is None or not isinstance(chunks, list):
        raise CheckpointError(
            f"{where}: tensor {fqn} without a shape and a list of chunks; not the structure DCP writes, {_CRAFTED}"
        )
    item = itemsize(getattr(getattr(meta, "properties", None), "dtype", None))
    boxes, keys = [], []
    for chunk in chunks:
        offsets, lengths = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
        if offsets is None or lengths is None or len(offsets) != len(shape) or len(lengths) != len(shape):
            raise CheckpointError(
                f"{where}: tensor {fqn} {list(shape)} has a chunk that is not {len(shape)} offsets "
                f"and sizes; {_CRAFTED}"
            )
        if any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            raise CheckpointError(
                f"{where}: tensor {fqn} {list(shape)} has the chunk {_box(offsets, lengths)}, which "
                f"reaches past the tensor; {_CRAFTED}"
            )
        record = records.get((fqn, offsets))
        if record is None:
            raise CheckpointError(
                f"{where}: tensor {fqn} has no storage record for its chunk {_box(offsets, lengths)}; {_CRAFTED}"
            )
        if record[0] < math.prod(lengths) * item:
            raise CheckpointError(
                f"{where}: the record of {fqn} for its chunk {_box(offsets, lengths)} in {record[1]} "
                f"is {record[0]} bytes, fewer than the chunk's {math.prod(lengths)} x {item}; "
                f"{_CRAFTED}"
            )
        boxes.append((offsets, lengths))
        keys.append((fqn, offsets))
    problem = tiling_problem(shape, boxes)
    if problem is not None:
        raise CheckpointError(f"{where}: tensor {fqn} {list(shape)}: {problem}; {_CRAFTED}")
    return keys


def _box(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> str:
    return f"at {list(offsets)} of {list(lengths)}"


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def tiling_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """None when ``boxes`` (each inside ``shape``) tile ``shape`` exactly: every element in exactly one of them.
    Otherwise the first problem in one phrase: the two chunks that overlap, or the first element no chunk holds.

    Row blocks (FSDP's shards: offsets and sizes beyond dimension 0 are the whole tensor's) are sorted and swept.
    Any other layout is cut into slabs along dimension 0 at every chunk boundary; the chunks spanning a slab must
    tile the rest of the tensor, checked the same way along dimension 1, and so on: a grid of N chunks (DTensor's
    2-D shardings) costs O(N log N) per dimension, exact for any layout. Chunks of no elements cover nothing and
    may share offsets (the empty shards of a tensor smaller than the world)."""
    if math.prod(shape) == 0:
        return None
    full = [b for b in boxes if all(b[1])]
    if shape and all(not any(o[1:]) and n[1:] == shape[1:] for o, n in full):
        full.sort(key=lambda b: b[0][0])
        end, prev = 0, None
        for box in full:
            if box[0][0] > end:
                break
            if box[0][0] < end:
                return _overlap(prev, box)  # type: ignore[arg-type]
            end, prev = box[0][0] + box[1][0], box
        return None if end >= shape[0] else _gap((end,) + (0,) * (len(shape) - 1))
    budget = [max(1 << 20, _TILING_WORK * len(full))]
    try:
        return _slabs(shape, full, 0, (), budget)
    except _TooIrregular:
        covered = sum(math.prod(n) for _, n in full)
        if covered != math.prod(shape):
            return f"its chunks hold {covered} elements, the tensor has {math.prod(shape)}"
        return f"its {len(full)} chunks form a layout too irregular to prove (not a grid); re-save it with DCP"


class _TooIrregular(Exception):
    pass


def _slabs(shape: tuple[int, ...], boxes: list[Box], d: int, at: tuple[int, ...], budget: list[int]) -> str | None:
    """``boxes`` (each spanning the slab ``at`` of dimensions < d) tile the rest of the tensor (dimensions >= d)."""
    if d == len(shape) or len(boxes) <= 1:
        if not boxes:
            return _gap(at + (0,) * (len(shape) - d))
        if len(boxes) > 1:
            return _overlap(boxes[0], boxes[1])
        offsets, lengths = boxes[0]
        for k in range(d, len(shape)):  # one chunk left: it must span every remaining dimension whole
            if offsets[k] or lengths[k] != shape[k]:
                point = at + (0,) * (len(shape) - d)
                return _gap(point if any(offsets[d:]) else point[:k] + (lengths[k],) + point[k + 1 :])
        return None
    cuts = sorted({0, shape[d], *(o[d] for o, _ in boxes), *(o[d] + n[d] for o, n in boxes)})
    slot = {c: i for i, c in enumerate(cuts)}
    members: list[list[Box]] = [[] for _ in cuts[:-1]]
    for box in sorted(boxes):
        first, last = slot[box[0][d]], slot[box[0][d] + box[1][d]]
        budget[0] -= last - first
        if budget[0] < 0:
            raise _TooIrregular
        for i in range(first, last):
            members[i].append(box)
    previous: list[Box] | None = None
    for i, inside in enumerate(members):
        if inside == previous:  # the same chunks span the slab before: the same answer
            continue
        problem = _slabs(shape, inside, d + 1, at + (cuts[i],), budget)
        if problem is not None:
            return problem
        previous = inside
    return None


def _overlap(a: Box, b: Box) -> str:
    return f"the chunks {_box(*a)} and {_box(*b)} overlap"


def _gap(point: tuple[int, ...]) -> str:
    return f"no chunk holds element {list(point)} (the chunks leave a gap)"


__all__ = [
    "check_extents",
    "file_sizes_of",
    "itemsize",
    "plain_name",
    "read_layout",
    "metadata_bytes",
    "read_metadata_as",
    "record_files",
    "tiling_problem",
]
