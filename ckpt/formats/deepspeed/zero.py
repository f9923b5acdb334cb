"""Read DeepSpeed ZeRO checkpoint files safely, one parameter slice at a time, without DeepSpeed.

DeepSpeed writes its state with ``torch.save`` (a zip of one pickle and raw storages) and its own
loaders call ``torch.load`` without the weights-only restriction: unpickling a checkpoint someone handed you runs
whatever code it names. Here:

* ``TorchSaveFile`` reads the zip with ``ckpt.formats.pickle.torchzip`` and unpickles ``data.pkl`` with the one
  allow-list unpickler (``ckpt.formats.pickle.safe_pickle``, DeepSpeed profile): containers, ``torch.Size``,
  the tensor rebuild records (turned into ``StoredTensor`` records, no data is read) and DeepSpeed's
  value classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) as inert stand-ins.
* Tensor data is read with ``os.preadv`` straight from the storage record in the zip, so a parameter
  is assembled from the few byte ranges the ZeRO partitions hold, and memory stays at one
  parameter whatever the checkpoint size (no mmap, so resident memory does not grow with it).
* ``ZeroShards`` knows DeepSpeed's ZeRO 1/2/3 layouts (the same knowledge as
  ``deepspeed.utils.zero_to_fp32`` and ``deepspeed.checkpoint.ds_to_universal``) and yields, per
  parameter, its fp32 master weight and AdamW moments as whole tensors.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from ckpt.commit.state import MOMENTS
from ckpt.formats.dcp.direct_io import write_direct
from ckpt.formats.deepspeed._state import STATE_FILE, UNIVERSAL_DIR, read_state  # noqa: F401  (this format's names, here too)
from ckpt.formats.pickle.safe_pickle import DEEPSPEED_RECORDS, TENSOR_RECORD, Opaque, StoredTensor
from ckpt.formats.pickle.torchzip import TorchZip, load_file
from schemas.errors import CheckpointError

log = logging.getLogger(__name__)

STATE_KEYS = ("fp32", *MOMENTS)
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def read_rng(path: Path) -> dict[str, torch.Tensor]:
    """An ``rng_rank_XXXXX.pt`` file: {"cpu": uint8 tensor, maybe "cuda": ...}, read with the allow-list."""
    rng = load_file(path, TENSOR_RECORD)
    if (
        not isinstance(rng, dict)
        or not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in rng.values())
        or "cpu" not in rng
    ):
        raise CheckpointError(
            f"{path}: not an RNG state file (a dict of uint8 tensors with 'cpu'); "
            "the checkpoint is corrupted, pick another step"
        )
    return rng


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
    """Create ``path`` with ``fill(stream)``, durably, return (size, xxh3-128): written with O_DIRECT while
    hashed (ckpt.formats.dcp.direct_io; buffered + fsync where the file system refuses O_DIRECT), so a save
    neither copies every byte into the page cache nor reads it back to hash it."""
    return write_direct(path, fill)  # type: ignore[arg-type]


def save_torch(path: str | os.PathLike[str], obj: Any) -> tuple[int, str]:
    """torch.save (zip format) into ``path`` through write_hashed."""
    return write_hashed(path, lambda f: torch.save(obj, f))


class TorchSaveFile:
    """One torch.save zip file: its object tree (tensors as StoredTensor records) and preadv access.
    The zip and pickle are parsed by ``ckpt.formats.pickle.torchzip`` under the DeepSpeed allow-list."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._zip: TorchZip | None = TorchZip.open(self.path)
        try:
            self.obj = self._zip.describe(DEEPSPEED_RECORDS)
        except BaseException:
            self.close()
            raise

    def _open(self) -> TorchZip:
        if self._zip is None:
            raise CheckpointError(f"{self.path}: read after close")
        return self._zip

    def fileno(self) -> int:
        """The file's descriptor, for readers that ``pread`` storage bytes themselves (export)."""
        return self._open()._fd()

    def storage_entry(self, key: str) -> tuple[int, int, int]:
        """(data offset, length, CRC-32 from the zip directory) of storage ``key``; the CRC is 0 when
        torch.save ran with CRCs disabled. The bytes are not read here."""
        return self._open().storage_entry(key)

    def read(
        self, t: StoredTensor, start: int = 0, count: int | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flat elements ``[start, start + count)`` of a contiguous stored tensor (into ``out`` if given)."""
        count = t.numel - start if count is None else count
        if not t.is_contiguous() or start < 0 or start + count > t.numel:
            raise CheckpointError(f"{self.path}: cannot read elements {start}..{start + count} of {t}")
        base, length, _ = self.storage_entry(t.key)
        item = torch.empty((), dtype=t.dtype).element_size()
        if (t.offset + start + count) * item > length:
            raise CheckpointError(f"{self.path}: storage {t.key} is shorter than its tensors; the file is truncated")
        if out is None:
            out = torch.empty(count, dtype=t.dtype)
        self._open().read_into(base + (t.offset + start) * item, count * item, out)
        return out

    def value(self, t: StoredTensor | Any) -> Any:
        """A small stored tensor (e.g. a step counter) as a real tensor; other values unchanged."""
        if isinstance(t, StoredTensor):
            return self.read(t).reshape(t.shape)
        return t

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None

    def __enter__(self) -> TorchSaveFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _at(items: Any, index: int, path: Path, what: str, kind: type | None = None) -> Any:
    """``items[index]`` of a per-group list a file holds (of ``kind`` when given), else one line naming it."""
    if not isinstance(items, list) or index >= len(items) or (kind is not None and not isinstance(items[index], kind)):
        raise CheckpointError(
            f"{path}: {what} has no entry for parameter group {index}; not a ZeRO checkpoint this "
            "reader understands, or a crafted one"
        )
    return items[index]


def _count(value: Any, path: Path, field: str) -> int:
    """A count a file declares (a world size): a whole number of at least 1, else one line naming the field."""
    if type(value) is not int or value < 1:
        raise CheckpointError(
            f"{path}: {field} is {value!r:.40}, not a whole number of at least 1; the file is "
            "corrupted or crafted, pick another step"
        )
    return value


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) <= 64 and all(type(x) is int and x >= 0 for x in value)


def stored_number(f: TorchSaveFile, value: Any, what: str) -> float:
    """A finite, non-negative number stored as a number or a one-element tensor (a step counter, a clip norm)."""
    if isinstance(value, StoredTensor):
        if value.numel != 1:
            raise CheckpointError(
                f"{f.path}: {what} is a tensor of {list(value.shape)}, not one number; the file is "
                "corrupted or crafted, pick another step"
            )
        value = f.value(value).item()
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise CheckpointError(
            f"{f.path}: {what} is {value!r:.40}, not a finite number of at least 0; the file is "
            "corrupted or crafted, pick another step"
        )
    return float(value)


def zero_files(ckpt_dir: Path) -> tuple[dict[int, Path], list[Path]]:
    """The per-rank optimizer files (by data-parallel rank) and the model-states files of a directory."""
    optim: dict[int, Path] = {}
    for p in sorted(ckpt_dir.iterdir()):
        m = _OPTIM_RE.match(p.name)
        if m:
            if int(m.group(2)) != 0:
                raise CheckpointError(
                    f"{p}: tensor/pipeline-parallel checkpoints (mp_rank {m.group(2)}) are not supported"
                )
            optim[int(m.group(1))] = p
    models = sorted(p for p in ckpt_dir.iterdir() if p.name.endswith("_model_states.pt") and "expert" not in p.name)
    return optim, models


class ZeroShards:
    """The ZeRO 1/2/3 partitions of one DeepSpeed checkpoint directory, read one parameter at a time."""

    def __init__(
        self, ckpt_dir: str | os.PathLike[str], *, expect_world_size: int | None = None, expect_stage: int | None = None
    ):
        self.dir = Path(ckpt_dir)
        optim_paths, model_paths = zero_files(self.dir)
        if not model_paths:
            raise CheckpointError(f"{self.dir}: no *_model_states.pt file; not a DeepSpeed checkpoint directory")
        with TorchSaveFile(model_paths[0]) as f:
            self.model_states = f.obj
        world = _count(
            _get(self.model_states, "dp_world_size", model_paths[0], "data-parallel world size"),
            model_paths[0],
            "dp_world_size",
        )
        if expect_world_size is not None and world != expect_world_size:
            raise CheckpointError(
                f"{model_paths[0]}: written at world size {world}, the manifest says {expect_world_size}; "
                "the checkpoint is inconsistent, pick another step"
            )
        if world > len(optim_paths) or any(r not in optim_paths for r in range(world)):
            # the first rank without its file, found among the files present (never a list of the declared size)
            missing = next(r for r in range(len(optim_paths) + 1) if r not in optim_paths)
            raise CheckpointError(
                f"{self.dir}: expected {world} ZeRO optimizer files, found {len(optim_paths)} "
                f"(missing zero_pp_rank_{missing}_mp_rank_00_optim_states.pt); possibly an interrupted copy or "
                "an overwrite of an old checkpoint, pick another step"
            )
        self.world_size = world
        self.files: list[TorchSaveFile] = []
        try:
            for r in range(world):
                self.files.append(TorchSaveFile(optim_paths[r]))
            self.optim = [_get(f.obj, "optimizer_state_dict", f.path, "optimizer state") for f in self.files]
            self.stage = self._stage()
            if expect_stage is not None and self.stage != expect_stage:
                raise CheckpointError(
                    f"{self.files[0].path}: holds ZeRO stage {self.stage} state, the manifest says "
                    f"stage {expect_stage}; the checkpoint is inconsistent, pick another step"
                )
            self.slots = self._slots_stage3() if self.stage == 3 else self._slots_stage12()
            self._check_adamw()
            self._check_partitions()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ layout
    def _stage(self) -> int:
        """The ZeRO stage every rank's file declares (1, 2 or 3, the same in each: the layout of the partitions
        depends on it, and DeepSpeed's own loader reads each rank's file by it)."""
        stages = [osd.get("zero_stage", 1) if isinstance(osd, dict) else None for osd in self.optim]
        for f, stage in zip(self.files, stages):
            if type(stage) is not int or stage not in (1, 2, 3):
                raise CheckpointError(
                    f"{f.path}: zero_stage is {stage!r:.40}, not 1, 2 or 3; the file is corrupted or "
                    "crafted, pick another step"
                )
            if stage != stages[0]:
                raise CheckpointError(
                    f"{f.path}: zero_stage is {stage}, {self.files[0].path.name} says {stages[0]}; "
                    "the ranks' files are of different checkpoints, pick another step"
                )
        return stages[0]

    def _group_state(self, rank: int, group: int) -> dict[str, Any]:
        osd = self.optim[rank]
        if self.stage == 3:
            state = _get(
                _get(osd, "optimizer_state_dict", self.files[rank].path, "base optimizer"),
                "state",
                self.files[rank].path,
                "optimizer state",
            )
        else:
            base = _get(osd, "base_optimizer_state", self.files[rank].path, "base optimizer state")
            if not isinstance(base, dict):
                raise CheckpointError(
                    f"{self.files[rank].path}: elastic ZeRO checkpoints are not supported; "
                    "save with zero_optimization.elastic_checkpoint=false"
                )
            state = _get(base, "state", self.files[rank].path, "optimizer state")
        return _get(state, group, self.files[rank].path, f"state of parameter group {group}")

    def flat(self, rank: int, group: int, key: str) -> StoredTensor:
        """The flat partition of ``key`` (fp32 master, exp_avg, exp_avg_sq) of one group on one rank."""
        osd = self.optim[rank]
        if key == "fp32":
            name = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            path = self.files[rank].path
            t = _at(_get(osd, name, path, "fp32 master partitions"), group, path, name)
        else:
            t = _get(self._group_state(rank, group), key, self.files[rank].path, f"optimizer moment {key}")
        if not isinstance(t, StoredTensor) or len(t.shape) != 1:
            raise CheckpointError(f"{self.files[rank].path}: {key} of group {group} is not a flat tensor")
        return t

    def _param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        shapes = _get(self.model_states, "param_shapes", self.dir, "parameter shapes")
        if not isinstance(shapes, list) or not all(
            isinstance(g, dict) and all(type(k) is str and _is_shape(v) for k, v in g.items()) for g in shapes
        ):
            raise CheckpointError(
                f"{self.dir}: param_shapes is not a list of {{name: shape}} per parameter group; the "
                "model states file is corrupted or crafted, pick another step"
            )
        return [{k: tuple(v) for k, v in g.items()} for g in shapes]

    def _slots_stage12(self) -> list[ParamSlot]:
        slots: list[ParamSlot] = []
        for g, shapes in enumerate(self._param_shapes()):
            maps = [
                _at(
                    _get(osd, "param_slice_mappings", f.path, "parameter slice mappings"),
                    g,
                    f.path,
                    "parameter slice mappings",
                    dict,
                )
                for osd, f in zip(self.optim, self.files)
            ]
            for name, shape in shapes.items():
                pieces = tuple(Piece(r, *self._fragment(m[name], r, name)) for r, m in enumerate(maps) if name in m)
                slots.append(self._checked(ParamSlot(name, shape, g, pieces)))
        return slots

    def _fragment(self, address: Any, rank: int, name: str) -> tuple[int, int]:
        """(start, numel) of a parameter's slice in a rank's flat partition (DeepSpeed's fragment_address)."""
        start, numel = getattr(address, "start", None), getattr(address, "numel", None)
        if type(start) is not int or type(numel) is not int or start < 0 or numel < 0:
            raise CheckpointError(
                f"{self.files[rank].path}: the slice mapping of {name} is not a start and a count of "
                "elements; the file is corrupted or crafted, pick another step"
            )
        return start, numel

    def _slots_stage3(self) -> list[ParamSlot]:
        slots: list[ParamSlot] = []
        w = self.world_size
        for g, shapes in enumerate(self._param_shapes()):
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                part = -(-numel // w)  # whole numbers: a crafted size must not overflow a float
                pieces = tuple(Piece(r, offset, max(0, min(part, numel - r * part))) for r in range(w))
                slots.append(self._checked(ParamSlot(name, shape, g, tuple(p for p in pieces if p.numel))))
                offset += part
        return slots

    def _checked(self, slot: ParamSlot) -> ParamSlot:
        if sum(p.numel for p in slot.pieces) != slot.numel:
            raise CheckpointError(
                f"{self.dir}: the ZeRO partitions hold {sum(p.numel for p in slot.pieces)} elements of "
                f"{slot.name}, its shape {list(slot.shape)} needs {slot.numel}; the checkpoint is inconsistent"
            )
        return slot

    def _check_partitions(self) -> None:
        """Before anything is allocated by them: every parameter's pieces lie inside its rank's flat partition of each
        state (fp32, exp_avg, exp_avg_sq), each partition inside the storage its file holds, and no two parameters
        share an element of one partition. A crafted shape or slice mapping then allocates no more than the files
        hold, and no value is read into two places."""
        spans: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
        for slot in self.slots:
            for p in slot.pieces:
                if p.numel:
                    spans.setdefault((p.rank, slot.group), []).append((p.start, p.start + p.numel, slot.name))
        for (rank, group), used in sorted(spans.items()):
            used.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(used):
                if start < end:
                    raise CheckpointError(
                        f"{self.files[rank].path}: {a} and {b} both claim elements {start}..{end} "
                        f"of the flat partition of group {group}; the checkpoint is corrupted or "
                        "crafted, pick another step"
                    )
            need = max(end for _, end, _ in used)
            for key in STATE_KEYS:
                flat = self.flat(rank, group, key)
                if flat.numel < need:
                    raise CheckpointError(
                        f"{self.files[rank].path}: the {key} partition of group {group} holds "
                        f"{flat.numel} elements, its parameters need {need}; the checkpoint is "
                        "inconsistent or crafted, pick another step"
                    )

    def _check_adamw(self) -> None:
        state = self._group_state(0, 0)
        keys = sorted(k for k in state if k != "step")
        if set(keys) != set(MOMENTS):
            raise CheckpointError(
                f"{self.files[0].path}: optimizer state has {keys or 'no moments'}; only AdamW/Adam "
                "state (exp_avg, exp_avg_sq) can be converted, resume it with the same optimizer instead"
            )

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
                raise CheckpointError(
                    f"{self.files[p.rank].path}: {key} is {flat.dtype}, expected float32 master state"
                )
            self.files[p.rank].read(flat, p.start, p.numel, out=out[done : done + p.numel])
            done += p.numel
        return out.view(slot.shape)

    def step(self) -> float:
        return stored_number(self.files[0], self._group_state(0, 0).get("step", 0), "the optimizer step")

    def param_groups(self) -> list[dict[str, Any]]:
        osd = self.optim[0]
        base = osd["optimizer_state_dict"] if self.stage == 3 else osd["base_optimizer_state"]
        groups = _get(base, "param_groups", self.files[0].path, "parameter groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(
                f"{self.files[0].path}: param_groups is not a list of groups; the file is corrupted "
                "or crafted, pick another step"
            )
        return [dict(g) for g in groups]

    def clip_grad(self) -> float:
        return stored_number(self.files[0], self.optim[0].get("clip_grad", 0.0) or 0.0, "clip_grad")

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> ZeroShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "STATE_FILE",
    "STATE_KEYS",
    "UNIVERSAL_DIR",
    "HashingFile",
    "Opaque",
    "ParamSlot",
    "Piece",
    "StoredTensor",
    "TorchSaveFile",
    "ZeroShards",
    "read_rng",
    "read_state",
    "rng_file",
    "save_torch",
    "stored_number",
    "write_hashed",
    "zero_files",
]
