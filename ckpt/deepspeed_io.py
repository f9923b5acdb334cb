"""Read DeepSpeed ZeRO checkpoint files safely, one parameter slice at a time, without DeepSpeed.

DeepSpeed writes its state with ``torch.save`` (a zip of one pickle and raw storages) and its own
loaders call ``torch.load`` without the weights-only restriction: unpickling a checkpoint someone handed you runs
whatever code it names. Here:

* ``TorchSaveFile`` unpickles ``data.pkl`` with an allow-list: containers, ``torch.Size``, the
  storage/tensor rebuild records (turned into ``StoredTensor`` records, no data is read) and three
  DeepSpeed value classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``), which become
  inert stand-ins that only hold their fields. Anything else is refused.
* Tensor data is read with ``os.preadv`` straight from the storage record in the zip, so a parameter
  is assembled from the few byte ranges the ZeRO partitions hold, and memory stays at one
  parameter whatever the checkpoint size (no mmap, so resident memory does not grow with it).
* ``ZeroShards`` knows DeepSpeed's ZeRO 1/2/3 layouts (the same knowledge as
  ``deepspeed.utils.zero_to_fp32`` and ``deepspeed.checkpoint.ds_to_universal``) and yields, per
  parameter, its fp32 master weight and AdamW moments as whole tensors.
"""

from __future__ import annotations

import collections
import ctypes
import io
import json
import logging
import math
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from ckpt.errors import CheckpointError

log = logging.getLogger(__name__)

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
# shardkeeper's files beside DeepSpeed's own in a ``step-XXXXXXXX/`` directory of the deepspeed format
STATE_FILE = "shardkeeper_state.json"  # counters, schedule position, ZeRO stage, layout ("zero" | "universal")
UNIVERSAL_DIR = "universal"  # DeepSpeed universal layout, committed with its own manifest.json
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def read_state(ckpt_dir: Path) -> dict[str, Any]:
    """The shardkeeper_state.json of a deepspeed-format checkpoint."""
    path = ckpt_dir / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; not a shardkeeper deepspeed checkpoint, pick another step") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e}); the checkpoint is corrupted, pick another step") from None
    if not isinstance(state, dict) or state.get("layout") not in ("zero", "universal"):
        raise CheckpointError(f"{path}: no valid 'layout' field; the checkpoint is corrupted, pick another step")
    return state


class HashingFile(io.RawIOBase):
    """A write-only file that hashes (xxh3-128) what goes through it and fsyncs on close (unless ``sync=False``)."""

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True):
        super().__init__()
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._hash = xxhash.xxh3_128()
        self._sync = sync
        self.size = 0
        self.digest = ""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._f.fileno()

    def tell(self) -> int:  # DCP records each item's offset
        return self.size

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._hash.update(mv)
        self._f.write(mv)
        self.size += len(mv)
        return len(mv)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._f.flush()
            if self._sync:
                os.fsync(self._f.fileno())
            self.digest = self._hash.hexdigest()
        finally:
            self._f.close()
            super().close()


def write_hashed(path: str | os.PathLike[str], fill: Callable[[BinaryIO], None]) -> tuple[int, str]:
    """Create ``path`` with ``fill(stream)``, fsync it, return (size, xxh3-128)."""
    stream = HashingFile(path)
    try:
        fill(stream)  # type: ignore[arg-type]
    finally:
        stream.close()
    return stream.size, stream.digest


def save_torch(path: str | os.PathLike[str], obj: Any) -> tuple[int, str]:
    """torch.save (zip format) into ``path`` through HashingFile."""
    return write_hashed(path, lambda f: torch.save(obj, f))


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor of a torch.save file lives: storage record, dtype, element offset, shape, stride."""

    key: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expect, acc = [], 1
        for size in reversed(self.shape):
            expect.append(acc)
            acc *= size
        return all(s == e or d == 1 for s, e, d in zip(self.stride, reversed(expect), self.shape))


class Opaque:
    """Stand-in for an allow-listed DeepSpeed value object: keeps the fields, runs no code."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _opaque(name: str) -> type[Opaque]:
    return type(name, (Opaque,), {})


_DEEPSPEED_VALUES: dict[tuple[str, str], Any] = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _opaque("LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _opaque("DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _opaque("fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int,  # ZeroStageEnum(2) -> 2
}
_BUILTINS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict, "int": int,
             "float": float, "str": str, "bytes": bytes, "bool": bool, "slice": slice, "complex": complex}


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


def _rebuild_tensor(storage: _StorageRef, offset: int, size: Any, stride: Any, *_: Any) -> StoredTensor:
    return StoredTensor(storage.key, storage.dtype, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_from_type(func: Any, _type: Any, args: tuple, _state: Any) -> Any:
    return func(*args)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


class _StorageType:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DEEPSPEED_VALUES:
            return _DEEPSPEED_VALUES[(module, name)]
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name == "Tensor":
            return torch.Tensor
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        kind = pid[1]
        dtype = kind.dtype if isinstance(kind, _StorageType) else getattr(kind, "dtype", None)
        if not isinstance(dtype, torch.dtype):  # UntypedStorage: the dtype comes with the tensor record
            raise pickle.UnpicklingError(f"untyped storage {pid[2]!r} is not supported")
        return _StorageRef(str(pid[2]), dtype)


class TorchSaveFile:
    """One torch.save zip file: its object tree (tensors as StoredTensor records) and preadv access."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            zf = zipfile.ZipFile(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing; the checkpoint is incomplete, pick another step") from None
        except zipfile.BadZipFile:
            raise CheckpointError(f"{self.path}: not a torch.save zip file (legacy or corrupted); "
                                  "re-save it with a current DeepSpeed or pick another step") from None
        with zf:
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise CheckpointError(f"{self.path}: no data.pkl record; the file is not a torch.save checkpoint")
            self._prefix = pkl[0][: -len("data.pkl")]
            self._infos = {i.filename: i for i in zf.infolist()}
            with zf.open(pkl[0]) as f:
                try:
                    self.obj = _AllowListUnpickler(f, self.path).load()
                except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                    raise CheckpointError(f"{self.path}: refused to unpickle ({e}); only DeepSpeed's own ZeRO "
                                          "checkpoint files can be read") from None
        self._offsets: dict[str, tuple[int, int]] = {}
        self._fd: int | None = os.open(self.path, os.O_RDONLY)  # opened once: readers share it through pread

    def _record(self, key: str) -> tuple[int, int]:
        """(data offset, length) of storage ``key`` inside the zip (stored, never compressed by torch)."""
        found = self._offsets.get(key)
        if found is not None:
            return found
        info = self._infos.get(f"{self._prefix}data/{key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: storage record {key} missing or compressed; the file is corrupted")
        header = os.pread(self._open(), 30, info.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{self.path}: bad zip header for storage {key}; the file is corrupted")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        found = (info.header_offset + 30 + name_len + extra_len, info.file_size)
        self._offsets[key] = found
        return found

    def _open(self) -> int:
        if self._fd is None:
            raise CheckpointError(f"{self.path}: read after close")
        return self._fd

    def fileno(self) -> int:
        """The file's descriptor, for readers that ``pread`` storage bytes themselves (export)."""
        return self._open()

    def storage_entry(self, key: str) -> tuple[int, int, int]:
        """(data offset, length, CRC-32 from the zip directory) of storage ``key``; the CRC is 0 when
        torch.save ran with CRCs disabled. The bytes are not read here."""
        offset, length = self._record(key)
        return offset, length, self._infos[f"{self._prefix}data/{key}"].CRC

    def read(self, t: StoredTensor, start: int = 0, count: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat elements ``[start, start + count)`` of a contiguous stored tensor (into ``out`` if given)."""
        count = t.numel - start if count is None else count
        if not t.is_contiguous() or start < 0 or start + count > t.numel:
            raise CheckpointError(f"{self.path}: cannot read elements {start}..{start + count} of {t}")
        base, length = self._record(t.key)
        item = torch.empty((), dtype=t.dtype).element_size()
        begin = base + (t.offset + start) * item
        if (t.offset + start + count) * item > length:
            raise CheckpointError(f"{self.path}: storage {t.key} is shorter than its tensors; the file is truncated")
        if out is None:
            out = torch.empty(count, dtype=t.dtype)
        view = _byte_view(out) if count else memoryview(b"")
        done = 0
        while done < len(view):
            n = os.preadv(self._open(), [view[done:]], begin + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: truncated while reading storage {t.key}; the file is corrupted")
            done += n
        return out

    def value(self, t: StoredTensor | Any) -> Any:
        """A small stored tensor (e.g. a step counter) as a real tensor; other values unchanged."""
        if isinstance(t, StoredTensor):
            return self.read(t).reshape(t.shape)
        return t

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TorchSaveFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (through ctypes, not numpy, whose views
    pin the storage and so keep it from being released early)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte views need a contiguous CPU tensor")
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class Piece:
    rank: int
    start: int  # element offset in that rank's flat partition
    numel: int


@dataclass(frozen=True)
class ParamSlot:
    """A model parameter in a ZeRO checkpoint: name, full shape, group, and where its elements lie."""

    name: str
    shape: tuple[int, ...]
    group: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _get(d: Any, key: Any, path: Path, what: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{path}: no {what} ({key!r}); not a ZeRO checkpoint this reader understands")
    return d[key]


def zero_files(ckpt_dir: Path) -> tuple[dict[int, Path], list[Path]]:
    """The per-rank optimizer files (by data-parallel rank) and the model-states files of a directory."""
    optim: dict[int, Path] = {}
    for p in sorted(ckpt_dir.iterdir()):
        m = _OPTIM_RE.match(p.name)
        if m:
            if int(m.group(2)) != 0:
                raise CheckpointError(f"{p}: tensor/pipeline-parallel checkpoints (mp_rank {m.group(2)}) are not supported")
            optim[int(m.group(1))] = p
    models = sorted(p for p in ckpt_dir.iterdir() if p.name.endswith("_model_states.pt") and "expert" not in p.name)
    return optim, models


class ZeroShards:
    """The ZeRO 1/2/3 partitions of one DeepSpeed checkpoint directory, read one parameter at a time."""

    def __init__(self, ckpt_dir: str | os.PathLike[str], *, expect_world_size: int | None = None,
                 expect_stage: int | None = None):
        self.dir = Path(ckpt_dir)
        optim_paths, model_paths = zero_files(self.dir)
        if not model_paths:
            raise CheckpointError(f"{self.dir}: no *_model_states.pt file; not a DeepSpeed checkpoint directory")
        with TorchSaveFile(model_paths[0]) as f:
            self.model_states = f.obj
        world = int(_get(self.model_states, "dp_world_size", model_paths[0], "data-parallel world size"))
        if expect_world_size is not None and world != expect_world_size:
            raise CheckpointError(f"{model_paths[0]}: written at world size {world}, the manifest says {expect_world_size}; "
                                  "the checkpoint is inconsistent, pick another step")
        missing = [r for r in range(world) if r not in optim_paths]
        if missing:
            raise CheckpointError(
                f"{self.dir}: expected {world} ZeRO optimizer files, found {len(optim_paths)} "
                f"(missing zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt); possibly an interrupted copy or "
                "an overwrite of an old checkpoint, pick another step")
        self.world_size = world
        self.files = [TorchSaveFile(optim_paths[r]) for r in range(world)]
        self.optim = [_get(f.obj, "optimizer_state_dict", f.path, "optimizer state") for f in self.files]
        self.stage = int(self.optim[0].get("zero_stage", 1))
        if expect_stage is not None and self.stage != expect_stage:
            raise CheckpointError(f"{self.files[0].path}: holds ZeRO stage {self.stage} state, the manifest says stage "
                                  f"{expect_stage}; the checkpoint is inconsistent, pick another step")
        self.slots = self._slots_stage3() if self.stage == 3 else self._slots_stage12()
        self._check_adamw()

    # ------------------------------------------------------------------ layout
    def _group_state(self, rank: int, group: int) -> dict[str, Any]:
        osd = self.optim[rank]
        if self.stage == 3:
            state = _get(_get(osd, "optimizer_state_dict", self.files[rank].path, "base optimizer"), "state",
                         self.files[rank].path, "optimizer state")
        else:
            base = _get(osd, "base_optimizer_state", self.files[rank].path, "base optimizer state")
            if not isinstance(base, dict):
                raise CheckpointError(f"{self.files[rank].path}: elastic ZeRO checkpoints are not supported; "
                                      "save with zero_optimization.elastic_checkpoint=false")
            state = _get(base, "state", self.files[rank].path, "optimizer state")
        return _get(state, group, self.files[rank].path, f"state of parameter group {group}")

    def flat(self, rank: int, group: int, key: str) -> StoredTensor:
        """The flat partition of ``key`` (fp32 master, exp_avg, exp_avg_sq) of one group on one rank."""
        osd = self.optim[rank]
        if key == "fp32":
            name = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            t = _get(osd, name, self.files[rank].path, "fp32 master partitions")[group]
        else:
            t = _get(self._group_state(rank, group), key, self.files[rank].path, f"optimizer moment {key}")
        if not isinstance(t, StoredTensor) or len(t.shape) != 1:
            raise CheckpointError(f"{self.files[rank].path}: {key} of group {group} is not a flat tensor")
        return t

    def _param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        shapes = _get(self.model_states, "param_shapes", self.dir, "parameter shapes")
        return [{str(k): tuple(int(x) for x in v) for k, v in g.items()} for g in shapes]

    def _slots_stage12(self) -> list[ParamSlot]:
        slots: list[ParamSlot] = []
        for g, shapes in enumerate(self._param_shapes()):
            maps = [_get(osd, "param_slice_mappings", f.path, "parameter slice mappings")[g]
                    for osd, f in zip(self.optim, self.files)]
            for name, shape in shapes.items():
                pieces = tuple(Piece(r, int(m[name].start), int(m[name].numel)) for r, m in enumerate(maps) if name in m)
                slots.append(self._checked(ParamSlot(name, shape, g, pieces)))
        return slots

    def _slots_stage3(self) -> list[ParamSlot]:
        slots: list[ParamSlot] = []
        w = self.world_size
        for g, shapes in enumerate(self._param_shapes()):
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / w)
                pieces = tuple(Piece(r, offset, max(0, min(part, numel - r * part))) for r in range(w))
                slots.append(self._checked(ParamSlot(name, shape, g, tuple(p for p in pieces if p.numel))))
                offset += part
        return slots

    def _checked(self, slot: ParamSlot) -> ParamSlot:
        if sum(p.numel for p in slot.pieces) != slot.numel:
            raise CheckpointError(f"{self.dir}: the ZeRO partitions hold {sum(p.numel for p in slot.pieces)} elements of "
                                  f"{slot.name}, its shape {list(slot.shape)} needs {slot.numel}; the checkpoint is inconsistent")
        return slot

    def _check_adamw(self) -> None:
        state = self._group_state(0, 0)
        keys = sorted(k for k in state if k != "step")
        if set(keys) != {"exp_avg", "exp_avg_sq"}:
            raise CheckpointError(f"{self.files[0].path}: optimizer state has {keys or 'no moments'}; only AdamW/Adam "
                                  "state (exp_avg, exp_avg_sq) can be converted, resume it with the same optimizer instead")

    # ------------------------------------------------------------------ values
    def locate(self, slot: ParamSlot, key: str = "fp32") -> list[tuple[TorchSaveFile, StoredTensor, Piece]]:
        """Where the elements of ``key`` of a parameter lie, in the parameter's flat order: per piece,
        the rank's file and its flat partition (the piece starts at element ``flat.offset + piece.start``
        of the partition's storage ``flat.key``). Nothing is read; ``read`` assembles the same pieces."""
        return [(self.files[p.rank], self.flat(p.rank, slot.group, key), p) for p in slot.pieces]

    def read(self, slot: ParamSlot, key: str) -> torch.Tensor:
        """The whole fp32 tensor ``key`` (fp32, exp_avg, exp_avg_sq) of a parameter, in its shape."""
        out = torch.empty(slot.numel, dtype=torch.float32)
        done = 0
        for p in slot.pieces:
            flat = self.flat(p.rank, slot.group, key)
            if flat.dtype != torch.float32:
                raise CheckpointError(f"{self.files[p.rank].path}: {key} is {flat.dtype}, expected float32 master state")
            self.files[p.rank].read(flat, p.start, p.numel, out=out[done : done + p.numel])
            done += p.numel
        return out.view(slot.shape)

    def step(self) -> float:
        value = self.files[0].value(self._group_state(0, 0).get("step", 0))
        return float(value)

    def param_groups(self) -> list[dict[str, Any]]:
        osd = self.optim[0]
        base = osd["optimizer_state_dict"] if self.stage == 3 else osd["base_optimizer_state"]
        return [dict(g) for g in _get(base, "param_groups", self.files[0].path, "parameter groups")]

    def clip_grad(self) -> float:
        return float(self.optim[0].get("clip_grad", 0.0) or 0.0)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> ZeroShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["STATE_FILE", "STATE_KEYS", "UNIVERSAL_DIR", "HashingFile", "Opaque", "ParamSlot", "Piece", "StoredTensor", "TorchSaveFile", "ZeroShards", "read_state", "rng_file", "save_torch", "write_hashed", "zero_files"]
