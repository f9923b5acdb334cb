"""The allow-list unpickler: every pickle read from a run directory goes through ``load`` here.

(One module on purpose, over the house's ~400 lines: the trust boundary — every admitted name, every checked
opcode and every limit — is reviewable in one place; splitting it would hide one rule from the next.)

A run directory may come from someone else, and unpickling runs whatever the pickle names. Here:

* ``find_class`` admits only EXACT ``(module, name)`` pairs of the profile in use (no prefixes, no
  dotted names, so no getattr chains), and returns what the profile maps the pair to: the real torch
  or DeepSpeed object where a caller needs it, our own rebuild function for tensors.
* The opcodes that call or mutate are re-implemented with checks (this is a subclass of the
  pure-Python ``pickle._Unpickler``, whose opcodes can be overridden; the C unpickler's cannot):
  REDUCE calls only the profile's callables; NEWOBJ only its classes, without arguments; BUILD only
  on instances of those classes (never on a class or function, which would patch it for the whole
  process), with a dict of plain attribute names; APPEND(S)/SETITEM(S)/ADDITEMS only on real
  lists/dicts/sets (the C and Python unpicklers call ``.extend``/``.append``/``__setitem__``/``.add``
  of whatever object is on the stack); INST, OBJ, EXT1/2/4, text PERSID and protocol 5's buffers
  (BYTEARRAY8 allocates its declared size first) are refused; a read past the end is an error, not a
  short item.
* Persistent ids are accepted only in the shape ``torch.save`` writes for a storage, with a storage
  type of the profile; the caller's ``storage`` hook turns them into data (or a record of where it is).
* Limits: pickle size, MARK depth, memo entries, and the nesting depth / object count of the result.
* Every failure becomes a one-line ``CheckpointError`` naming the file and the cause.

Why each admitted callable is harmless with hostile arguments (they are the only code a pickle can
run): ``collections.OrderedDict``, ``builtins.set``/``frozenset``, ``torch.Size`` build containers from
other unpickled values (finite); ``torch.serialization._get_layout`` is a dict lookup and
``pathlib.PosixPath`` joins strings (both called with str arguments only); ``_MEM_FORMAT_ENCODING`` and
``ZeroStageEnum`` are Enum lookups (one int only: two arguments would build a new Enum class);
``torch._utils._rebuild_tensor_v2`` is OUR function (``rebuild_tensor``): it accepts only a storage made
by the ``storage`` hook, integer geometry inside that storage, ``requires_grad`` a bool, and empty
backward hooks / metadata (so no hook callable and no tensor-metadata setter is ever installed);
``torch._tensor._rebuild_from_type_v2`` is ours too (``rebuild_from_type``): our tensor rebuild, plain
``torch.Tensor`` (admitted as a value, never called), plain attribute values. The
admitted classes (DCP's metadata dataclasses, DeepSpeed's LossScaler/fragment_address) are only
created empty by NEWOBJ and filled by BUILD with plain fields (TensorProperties decodes its tuple with
its own ``__setstate__``). ``DCP_LAYOUT`` admits the same pairs as ``DCP_METADATA`` but maps them to inert
stand-ins defined here (``LayoutRecord`` classes, dtype names, ``torch.Size`` as a tuple of ints): the quick
check reads a checkpoint's layout without importing torch. Never admitted: ``_rebuild_parameter`` (hooks), ``copyreg``,
``functools``, ``builtins.getattr``/``eval``/``exec``/``__import__``/``bytes``/``bytearray`` (``bytes(10**12)``), ...

Cost: the Python unpickler is ~5-10x slower than the C one (a 3 MB DCP metadata, ~20k chunks: ~2 s
against ~0.2 s; 19 MB, 98k chunks at 4,096 ranks: ~8 s against ~0.5 s + a type walk); torch's own
weights-only unpickler makes the same trade. Why not the C unpickler with ``find_class`` overridden and the
result type-checked afterwards (measured on this project's CPython 3.11): a subclass can replace only
``find_class`` and ``persistent_load``, every other opcode runs unchecked in C, and three of them cannot be
made safe from outside:

* memo indices are unbounded: ``LONG_BINPUT 0xFFFFFFFF`` makes it grow and zero-fill its memo to 2**33
  slots (64 GiB) before anything can refuse -- a 9-byte pickle with ``LONG_BINPUT 2**27`` took 2 GiB of
  resident memory here and then *succeeded*; text ``PUT`` takes any index;
* ``EXT1/2/4`` look in ``copyreg._extension_cache`` first and push what they find without calling
  ``find_class`` (any callable a previous unpickle in the process resolved: the corpus' ``ext2-cache-only``);
* ``BUILD`` sets attributes on whatever is on the stack -- an admitted Enum member or dtype (shared by the
  whole process), an admitted class (``setattr`` per slot-state item), a tensor (``Tensor.__setstate__``
  calls ``set_`` with pickled geometry) -- and a walk after the fact sees the damage only once it is done.

So validation is made cheap by not parsing twice instead (``ckpt.validate.checks`` remembers a pass for the exact
bytes of ``.metadata``; ``ckpt.validate.retention`` parses only what decides its plan); the corpus
(tests/reliability/hostile.py) holds each of these attacks, so an engine that lets one through fails it.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import math
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt.gcpause import gc_paused
from schemas.errors import CheckpointError

if TYPE_CHECKING:
    import torch
# torch is imported when a pickle names one of its objects or holds a tensor, never with this module: the
# quick check of a DCP checkpoint (DCP_LAYOUT) runs without it

MAX_PICKLE_BYTES = 1 << 30  # a DCP .metadata of a very large run is ~100 MB; anything over 1 GiB is refused
MAX_MARK_DEPTH = 64  # nested MARKs (tuples/lists built item by item); real files use < 10
MAX_NESTING = 64  # containers inside containers in the result; real files use < 12
MAX_TUPLE_NESTING = 16  # tuples inside tuples (real files: 2); a deeper DAG of shared tuples hashes for ever
MAX_KEY_ITEMS = 64  # elements of a tuple, fields of an object, used as a dict key or set element
MAX_OBJECTS = 50_000_000  # containers + instances in the result (a 10 MB metadata holds ~2M)
MAX_MEMO = 50_000_000  # memo entries (each costs ~100 bytes of memory)


# ------------------------------------------------------------------------------------ stand-ins
class Opaque:
    """Stand-in for an allow-listed DeepSpeed value object when only the layout is read: keeps the
    fields, runs no code (DeepSpeed's own classes are used only when DeepSpeed loads the state)."""

    def __init__(self, *args: Any) -> None:
        self.args = args


def _opaque(name: str) -> type[Opaque]:
    return type(name, (Opaque,), {"__module__": __name__})


@dataclass(frozen=True)
class StorageType:
    """What a storage class name (``torch.FloatStorage``) unpickles to: only its dtype."""

    name: str
    dtype: torch.dtype


STORAGE_TYPES: dict[str, str] = {  # torch.storage._dtype_to_storage_type_map, the names torch.save writes: dtype names
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
)


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a torch.save record, not read: storage key, dtype, element offset, shape, stride and
    the storage's element count."""

    key: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_numel: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        expect, acc = [], 1
        for size in reversed(self.shape):
            expect.append(acc)
            acc *= size
        return all(s == e or d == 1 for s, e, d in zip(self.stride, reversed(expect), self.shape))


@dataclass(frozen=True)
class StorageRef:
    """A storage named by a persistent id, when only the layout is read."""

    key: str
    dtype: torch.dtype
    numel: int


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError(f"tensor {what} {value!r:.80} is not a tuple of non-negative ints")
    return tuple(value)


def rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
    *rest: Any,
) -> Any:
    """What ``torch._utils._rebuild_tensor_v2`` unpickles to: a StoredTensor for a StorageRef, a real
    tensor (a view of the storage's data) for a loaded storage. Hooks and metadata must be empty."""
    if rest or (backward_hooks is not None and (type(backward_hooks) not in (dict, OrderedDict) or backward_hooks)):
        raise pickle.UnpicklingError("tensor record with backward hooks or extra arguments")
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise pickle.UnpicklingError("tensor record with tensor metadata")
    if type(requires_grad) is not bool or type(storage_offset) is not int or storage_offset < 0:
        raise pickle.UnpicklingError("tensor record with a bad offset or requires_grad")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    import torch

    numel = (
        storage.numel
        if isinstance(storage, StorageRef)
        else storage.numel()
        if isinstance(storage, torch.Tensor)
        else None
    )
    if numel is None:
        raise pickle.UnpicklingError("tensor record without a storage")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"tensor record with size {list(shape)} and stride {list(strides)}")
    if math.prod(shape) and storage_offset + sum((s - 1) * st for s, st in zip(shape, strides)) >= numel:
        raise pickle.UnpicklingError(
            f"tensor view {list(shape)} at {storage_offset} reaches past its storage of {numel}"
        )
    if isinstance(storage, StorageRef):
        return StoredTensor(storage.key, storage.dtype, storage_offset, shape, strides, storage.numel)
    out = torch.as_strided(storage, shape, strides, storage_offset)
    return out.requires_grad_(True) if requires_grad else out


def rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """What ``torch._tensor._rebuild_from_type_v2`` unpickles to (ZeRO-3 saves its flat partitions so,
    with a ``ds_id`` attribute): only our tensor rebuild, only plain ``torch.Tensor``, and attributes that
    are plain values under names torch.Tensor does not have (``data``/``grad`` cannot be replaced)."""
    import torch

    if func is not rebuild_tensor or new_type is not torch.Tensor or type(args) is not tuple:
        raise pickle.UnpicklingError("tensor subclass record other than a plain tensor")
    if state is not None and (
        type(state) is not dict
        or not all(
            type(k) is str and not k.startswith("_") and not hasattr(torch.Tensor, k) and type(v) in _LEAVES
            for k, v in state.items()
        )
    ):
        raise pickle.UnpicklingError("tensor record with attributes other than plain named values")
    out = rebuild_tensor(*args)
    if isinstance(out, torch.Tensor):
        for k, v in (state or {}).items():
            setattr(out, k, v)
    return out


# ------------------------------------------------------------------------------------ profiles
@dataclass(frozen=True)
class _Lazy:
    """An admitted object imported only when a pickle names it (DeepSpeed is imported lazily)."""

    module: str
    name: str

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


def _ints_only(args: tuple[Any, ...]) -> bool:
    return len(args) == 1 and type(args[0]) is int


def _strs_only(args: tuple[Any, ...]) -> bool:
    return 0 < len(args) <= 256 and all(type(a) is str for a in args)


@dataclass(frozen=True)
class _Checked(_Lazy):
    """An admitted callable of torch/DeepSpeed called only with the argument types it exists for
    (an Enum called with two arguments would build a new Enum class, for instance)."""

    check: Callable[[tuple[Any, ...]], bool] = _ints_only

    def resolve(self) -> Any:
        real, check, what = super().resolve(), self.check, f"{self.module}.{self.name}"

        def call(*args: Any) -> Any:
            if not check(args):
                raise pickle.UnpicklingError(f"{what} called with {[type(a).__name__ for a in args]}")
            return real(*args)

        return call


@dataclass(frozen=True)
class _StorageToken(_Lazy):
    """A storage class name (``torch.FloatStorage``): a StorageType with its torch dtype, made when a pickle
    names it."""

    def resolve(self) -> Any:
        import torch

        return StorageType(self.name, getattr(torch, STORAGE_TYPES[self.name]))


# ------------------------------------------------------------------------------------ DCP's metadata, without torch
class LayoutRecord:
    """Stand-in for one of DCP's metadata dataclasses when only the checkpoint's layout is checked (DCP_LAYOUT:
    which files, which tensors of which shapes and dtypes): created empty by NEWOBJ and filled by BUILD with plain
    fields, like the real ones, but no code of torch runs and torch is not imported (a quick ``validate`` or
    ``status`` costs no torch import). Names and fields are DCP's; a field the pickle does not set is missing."""

    def __repr__(self) -> str:  # field names and their types only: a value could be a crafted structure
        return f"{type(self).__name__}({', '.join(f'{k}: {type(v).__name__}' for k, v in vars(self).items())})"


def _record(name: str, **attrs: Any) -> type[LayoutRecord]:
    return type(name, (LayoutRecord,), {"__module__": __name__, **attrs})


def _index_key(self: Any) -> tuple[Any, Any]:
    return (self.fqn, self.offset)  # no fqn: AttributeError, as DCP's own class raises


@dataclass(frozen=True)
class LayoutMemoryFormat:
    """A member of DCP's ``_MEM_FORMAT_ENCODING``: 0 contiguous, 1 channels last, 2 preserve."""

    value: int


def _properties_setstate(self: Any, state: Any) -> None:
    """TensorProperties.__setstate__: (dtype, layout, requires_grad, memory format encoding, pin_memory); the
    encoding must be a member of the enumeration, as DCP's own decoding requires."""
    if type(state) is not tuple or len(state) != 5 or type(state[3]) is not LayoutMemoryFormat:
        raise pickle.UnpicklingError(
            "TensorProperties state is not (dtype, layout, requires_grad, memory format, "
            "pin_memory) with a member of _MEM_FORMAT_ENCODING"
        )
    (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory) = state


@dataclass(frozen=True)
class LayoutDType:
    """A torch dtype named by DCP's metadata, as its name (``str()`` is torch's: ``torch.float32``)."""

    name: str

    def __str__(self) -> str:
        return f"torch.{self.name}"


def _layout_size(*args: Any) -> tuple[int, ...]:
    """``torch.Size(sizes)``: one list or tuple of ints, as a tuple."""
    if len(args) != 1 or type(args[0]) not in (list, tuple) or not all(type(v) is int for v in args[0]):
        raise pickle.UnpicklingError(f"torch.Size called with {[type(a).__name__ for a in args]}")
    return tuple(args[0])


def _layout_mem_format(*args: Any) -> LayoutMemoryFormat:
    """``_MEM_FORMAT_ENCODING(value)``: one of its three members, or refused (as the Enum refuses another value)."""
    if len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2):
        raise pickle.UnpicklingError(f"_MEM_FORMAT_ENCODING called with {[type(a).__name__ for a in args]}")
    return LayoutMemoryFormat(args[0])


# torch's layouts, as torch.serialization._get_layout knows them (tests compare the two)
LAYOUT_NAMES = frozenset(
    {
        "torch.strided",
        "torch.sparse_coo",
        "torch.sparse_csr",
        "torch.sparse_csc",
        "torch.sparse_bsr",
        "torch.sparse_bsc",
        "torch._mkldnn",
        "torch.jagged",
    }
)


def _layout_name(*args: Any) -> str:
    """``torch.serialization._get_layout(name)``: the layout's name (``torch.strided``); another name is refused,
    as torch's lookup refuses it."""
    if len(args) != 1 or type(args[0]) is not str or args[0] not in LAYOUT_NAMES:
        raise pickle.UnpicklingError("_get_layout called with other than the name of one of torch's layouts")
    return args[0]


LAYOUT_RECORDS: dict[str, type[LayoutRecord]] = {  # with the class-level defaults of DCP's fields (None)
    **{n: _record(n) for n in ("TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")},
    "Metadata": _record("Metadata", planner_data=None, storage_data=None, storage_meta=None, version=None),
    "StorageMeta": _record("StorageMeta", checkpoint_id=None, save_id=None, load_id=None),
    "_StorageInfo": _record("_StorageInfo", transform_descriptors=None),
    # a frozen dataclass in DCP: equal and hashed by (fqn, offset), never by its index hint
    "MetadataIndex": _record(
        "MetadataIndex",
        offset=None,
        index=None,
        __hash__=lambda self: hash(_index_key(self)),
        __eq__=lambda self, other: type(other) is type(self) and _index_key(other) == _index_key(self),
    ),
    "TensorProperties": _record("TensorProperties", __setstate__=_properties_setstate),
}


@dataclass(frozen=True)
class Profile:
    """A named allow-list: exact (module, name) pairs and what each unpickles to; which of them
    REDUCE may call, which NEWOBJ may instantiate (and BUILD fill), and whether storages may appear."""

    name: str
    objects: Mapping[tuple[str, str], Any]
    callables: frozenset[tuple[str, str]]
    classes: frozenset[tuple[str, str]]
    storages: bool = False

    @property
    def pairs(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.objects)


def _profile(
    name: str,
    objects: dict[tuple[str, str], Any],
    callables: set[tuple[str, str]],
    classes: set[tuple[str, str]],
    storages: bool,
) -> Profile:
    unknown = (callables | classes) - set(objects)
    if unknown or callables & classes:
        raise RuntimeError(f"profile {name}: bad callables/classes {sorted(unknown | (callables & classes))}")
    return Profile(name, dict(objects), frozenset(callables), frozenset(classes), storages)


_MD = "torch.distributed.checkpoint.metadata"
_TENSORS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", n): _StorageToken("torch", n) for n in STORAGE_TYPES},
}
_DS_NAMES = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
_ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
_CONTAINERS = {
    ("torch", "Size"): _Lazy("torch", "Size"),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type,
    ("torch", "Tensor"): _Lazy("torch", "Tensor"),
}
_MD_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
)
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_MD_CALLABLES = {
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    (_MD, "_MEM_FORMAT_ENCODING"),
}

DCP_METADATA = _profile(  # what DCP's load plans from: its real classes
    "DCP metadata",
    {
        **{(_MD, n): _Lazy(_MD, n) for n in _MD_CLASSES},
        (_MD, "_MEM_FORMAT_ENCODING"): _Checked(_MD, "_MEM_FORMAT_ENCODING"),
        _STORAGE_INFO: _Lazy(*_STORAGE_INFO),
        ("torch.serialization", "_get_layout"): _Checked("torch.serialization", "_get_layout", _strs_only),
        ("pathlib", "PosixPath"): _Checked("pathlib", "PosixPath", _strs_only),  # StorageMeta.checkpoint_id
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): _Lazy("torch", "Size"),
        **{("torch", n): _Lazy("torch", n) for n in _DTYPE_NAMES},
    },
    callables=_MD_CALLABLES,
    classes={(_MD, n) for n in _MD_CLASSES} | {_STORAGE_INFO},
    storages=False,
)
DCP_LAYOUT = _profile(  # the same pairs as inert stand-ins (LayoutRecord): the quick check, without torch
    "DCP metadata",
    {
        **{(_MD, n): LAYOUT_RECORDS[n] for n in _MD_CLASSES},
        (_MD, "_MEM_FORMAT_ENCODING"): _layout_mem_format,
        _STORAGE_INFO: LAYOUT_RECORDS["_StorageInfo"],
        ("torch.serialization", "_get_layout"): _layout_name,
        ("pathlib", "PosixPath"): _Checked("pathlib", "PosixPath", _strs_only),
        ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): _layout_size,
        **{("torch", n): LayoutDType(n) for n in _DTYPE_NAMES},
    },
    callables=_MD_CALLABLES,
    classes={(_MD, n) for n in _MD_CLASSES} | {_STORAGE_INFO},
    storages=False,
)
TENSOR_RECORD = _profile(
    "tensor record",
    _TENSORS,
    callables={("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")},
    classes=set(),
    storages=True,
)
_DS_CALLABLES = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),
    _ZERO_STAGE,
    *(set(_CONTAINERS) - {("torch", "Tensor")}),
}
DEEPSPEED_RECORDS = _profile(  # the layout of DeepSpeed's files: value classes as inert stand-ins
    "DeepSpeed state",
    {**_TENSORS, **_CONTAINERS, **{p: _opaque(p[1]) for p in _DS_NAMES}, _ZERO_STAGE: int},
    callables=_DS_CALLABLES,
    classes=_DS_NAMES,
    storages=True,
)
DEEPSPEED_STATE = _profile(  # what DeepSpeed's engine loads: its real value classes, same pairs
    "DeepSpeed state",
    {**_TENSORS, **_CONTAINERS, **{p: _Lazy(*p) for p in _DS_NAMES}, _ZERO_STAGE: _Checked(*_ZERO_STAGE)},
    callables=_DS_CALLABLES,
    classes=_DS_NAMES,
    storages=True,
)
PROFILES = (DCP_METADATA, DCP_LAYOUT, TENSOR_RECORD, DEEPSPEED_RECORDS, DEEPSPEED_STATE)
ALLOWED: frozenset[tuple[str, str]] = frozenset().union(*(p.pairs for p in PROFILES))


# ------------------------------------------------------------------------------------ unpickler
def _refuser(opcode: bytes) -> Callable[[Any], None]:
    name = next((n for n in dir(pickle) if n.isupper() and getattr(pickle, n) == opcode), repr(opcode))

    def refuse(self: Any) -> None:
        raise pickle.UnpicklingError(f"opcode {name} is not allowed")

    return refuse


class SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the Python implementation: opcodes overridable
    """Unpickles one pickle under a ``Profile``; see the module docstring for every rule."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes, profile: Profile, storage: Callable[[StorageType, str, int], Any] | None = None):
        self._buffer = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._buffer, encoding="ASCII")
        self.profile = profile
        self._storage = storage
        self._resolved: dict[tuple[str, str], Any] = {}
        self._callables: set[int] = set()
        self._classes: set[int] = set()
        self._built: set[int] = set()  # objects BUILD filled: once each (a key must not change after it is hashed)

    # ---------------------------------------------------------------- names
    def find_class(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str) or "." in name:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in {self.profile.name}")
        if self.proto < 3 and (module, name) in _compat_pickle.NAME_MAPPING:  # protocol 2 writes __builtin__
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif self.proto < 3 and module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        pair = (module, name)
        if pair not in self.profile.objects:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in {self.profile.name}")
        obj = self._resolved.get(pair)
        if obj is None:
            obj = self.profile.objects[pair]
            obj = obj.resolve() if isinstance(obj, _Lazy) else obj
            self._resolved[pair] = obj
            if pair in self.profile.callables:
                self._callables.add(id(obj))
            if pair in self.profile.classes:
                self._classes.add(id(obj))
        return obj

    def persistent_load(self, pid: Any) -> Any:
        ok = (
            self._storage is not None
            and type(pid) is tuple
            and len(pid) == 5
            and type(pid[0]) is str
            and pid[0] == "storage"
            and isinstance(pid[1], StorageType)
            and type(pid[2]) is str
            and 0 < len(pid[2]) <= 64
            and pid[2].isalnum()
            and type(pid[3]) is str
            and type(pid[4]) is int
            and pid[4] >= 0
        )
        if not ok:
            shown = (
                repr(pid)[:80]
                if type(pid) in (str, tuple) and all(type(x) in _LEAVES | {StorageType} for x in pid)
                else type(pid).__name__
            )
            raise pickle.UnpicklingError(f"persistent id {shown} is not a torch.save storage")
        return self._storage(pid[1], pid[2], pid[4])  # type: ignore[misc]

    # ---------------------------------------------------------------- calls
    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if id(func) not in self._callables or type(args) is not tuple:
            raise pickle.UnpicklingError(f"REDUCE of a {type(func).__name__} is not allowed")
        if func in (set, frozenset, OrderedDict) and args:  # what torch.save writes: one list (or tuple) of items
            if len(args) != 1 or type(args[0]) not in (list, tuple):
                raise pickle.UnpicklingError(f"{func.__name__} called with other than one list")
            _flat_keys([p[0] if func is OrderedDict and type(p) in (list, tuple) and p else p for p in args[0]])
        stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if id(cls) not in self._classes or type(args) is not tuple or args:
            raise pickle.UnpicklingError(f"NEWOBJ of a {type(cls).__name__} is not allowed")
        self.append(cls.__new__(cls))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        if type(kwargs) is not dict or kwargs:
            raise pickle.UnpicklingError("NEWOBJ_EX with keyword arguments is not allowed")
        self.load_newobj()

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(cls) not in self._classes and cls is not OrderedDict:  # a state_dict's OrderedDict keeps _metadata
            raise pickle.UnpicklingError(f"BUILD of a {cls.__name__} is not allowed")
        if id(inst) in self._built:
            raise pickle.UnpicklingError(f"BUILD of a {cls.__name__} twice")
        self._built.add(id(inst))
        own = cls.__dict__.get("__setstate__") or next(
            (k.__dict__["__setstate__"] for k in cls.__mro__[1:-1] if "__setstate__" in k.__dict__), None
        )
        if own is not None:  # the admitted class's own code (TensorProperties decodes its tuple)
            own(inst, state)
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
            raise pickle.UnpicklingError(f"BUILD state of a {cls.__name__} is not a dict of field names")
        # fields only: an instance attribute would shadow a method (an OrderedDict's own ``items``, ``get``)
        if any(callable(getattr(cls, k, None)) for k in state) or (cls is OrderedDict and set(state) - {"_metadata"}):
            raise pickle.UnpicklingError(f"BUILD state of a {cls.__name__} names one of its methods")
        inst.__dict__.update(state)

    # ---------------------------------------------------------------- containers
    def load_append(self) -> None:
        value = self.stack.pop()
        self._expect(self.stack[-1], list, "APPEND").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._expect(self.stack[-1], list, "APPENDS").extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._expect(self.stack[-1], (dict, OrderedDict), "SETITEM")[_flat_keys([key])[0]] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._expect(self.stack[-1], (dict, OrderedDict), "SETITEMS")
        _flat_keys(items[0::2])
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        _flat_keys(items[0::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def load_frozenset(self) -> None:
        items = self.pop_mark()  # before self.append is looked up: pop_mark rebinds it to the outer stack
        self.append(frozenset(_flat_keys(items)))

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._expect(self.stack[-1], set, "ADDITEMS").update(_flat_keys(items))

    @staticmethod
    def _expect(obj: Any, kinds: type | tuple[type, ...], op: str) -> Any:
        if type(obj) not in (kinds if isinstance(kinds, tuple) else (kinds,)):
            raise pickle.UnpicklingError(f"{op} on a {type(obj).__name__} is not allowed")
        return obj

    # ---------------------------------------------------------------- reading
    def load(self) -> Any:
        """pickle._Unpickler.load, reading straight from the in-memory pickle (a C method per read instead of the
        Python-level unframer: a third of the time of a large ``.metadata``). Frames are only length hints, so
        they are checked against the data and otherwise ignored. A read past the end returns a short item but
        can never be followed by STOP (it took everything up to the end), so the load still fails; and no read
        allocates more than what is left of the pickle."""
        self.read = read = self._buffer.read
        self.readline = self._buffer.readline
        self.readinto = None  # only BYTEARRAY8 and NEXT_BUFFER use it: refused
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        dispatch = self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise pickle.UnpicklingError("pickle data was truncated (it ends before STOP)")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        data = self.read(8)
        if len(data) != 8:
            raise pickle.UnpicklingError("pickle data was truncated (in a FRAME header)")
        (frame_size,) = struct.unpack("<Q", data)
        if frame_size > self._size - self._buffer.tell():
            raise pickle.UnpicklingError(f"frame of {frame_size} bytes runs past the end of the pickle")

    # ---------------------------------------------------------------- limits
    def load_mark(self) -> None:
        if len(self.metastack) >= MAX_MARK_DEPTH:
            raise pickle.UnpicklingError(f"nested deeper than {MAX_MARK_DEPTH} marks")
        super().load_mark()

    def load_memoize(self) -> None:
        memo = self.memo
        if len(memo) >= MAX_MEMO:
            raise pickle.UnpicklingError(f"more than {MAX_MEMO} memo entries")
        memo[len(memo)] = self.stack[-1]

    def _put(self, index: int) -> None:
        if index < 0 or index >= MAX_MEMO:
            raise pickle.UnpicklingError(f"memo index {index} out of range")
        self.memo[index] = self.stack[-1]

    def load_put(self) -> None:
        self._put(int(self.readline()[:-1]))

    def load_binput(self) -> None:
        self._put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._put(struct.unpack("<I", self.read(4))[0])


_D = SafeUnpickler.dispatch
for _op in (
    pickle.INST,
    pickle.OBJ,
    pickle.EXT1,
    pickle.EXT2,
    pickle.EXT4,
    pickle.PERSID,
    pickle.BYTEARRAY8,
    pickle.NEXT_BUFFER,
    pickle.READONLY_BUFFER,
):  # bytearray(n) allocates n first
    _D[_op[0]] = _refuser(_op)
for _op, _fn in (
    (pickle.REDUCE, SafeUnpickler.load_reduce),
    (pickle.NEWOBJ, SafeUnpickler.load_newobj),
    (pickle.NEWOBJ_EX, SafeUnpickler.load_newobj_ex),
    (pickle.BUILD, SafeUnpickler.load_build),
    (pickle.APPEND, SafeUnpickler.load_append),
    (pickle.APPENDS, SafeUnpickler.load_appends),
    (pickle.SETITEM, SafeUnpickler.load_setitem),
    (pickle.SETITEMS, SafeUnpickler.load_setitems),
    (pickle.ADDITEMS, SafeUnpickler.load_additems),
    (pickle.MARK, SafeUnpickler.load_mark),
    (pickle.DICT, SafeUnpickler.load_dict),
    (pickle.FROZENSET, SafeUnpickler.load_frozenset),
    (pickle.FRAME, SafeUnpickler.load_frame),
):
    _D[_op[0]] = _fn
for _op, _fn in (
    (pickle.MEMOIZE, SafeUnpickler.load_memoize),
    (pickle.PUT, SafeUnpickler.load_put),
    (pickle.BINPUT, SafeUnpickler.load_binput),
    (pickle.LONG_BINPUT, SafeUnpickler.load_long_binput),
):
    _D[_op[0]] = _fn


_LEAVES = frozenset({int, float, str, bytes, bool, type(None), complex})
_ITEMS, _MAPPING, _ATTRS, _NONE = 1, 2, 3, 0


def _flat(value: Any) -> bool:
    return type(value) in _LEAVES or (
        isinstance(value, tuple) and len(value) <= MAX_KEY_ITEMS and all(type(v) in _LEAVES for v in value)
    )


def _flat_keys(keys: list[Any]) -> list[Any]:
    """Dict keys and set elements must be flat before anything hashes them: a leaf, a tuple of leaves (a
    torch.Size), or an instance whose fields are such (DCP's MetadataIndex). A nested one could be a DAG of shared
    sub-tuples -- a few hundred bytes of pickle whose hash takes exponential time."""
    for key in keys:
        if _flat(key):
            continue
        fields = getattr(key, "__dict__", None)
        if type(fields) is not dict or len(fields) > MAX_KEY_ITEMS or not all(_flat(v) for v in fields.values()):
            raise pickle.UnpicklingError(f"a {type(key).__name__} nested in a dict key or set element")
    return keys


def _kind(t: type) -> int:
    """How the walk finds an object's children, decided once per type."""
    if issubclass(t, dict):
        return _MAPPING
    if issubclass(t, (list, tuple, set, frozenset)):  # torch.Size is a tuple
        return _ITEMS
    torch = sys.modules.get("torch")  # not imported: no tensor can be in the result
    if issubclass(t, type) or (torch is not None and issubclass(t, torch.Tensor)) or "__dict__" not in dir(t):
        return _NONE
    return _ATTRS


def _check_shape(obj: Any) -> None:
    """Nesting depth, object count and absence of cycles in the result, iteratively (deep nesting built
    without MARKs, e.g. TUPLE1 chains, or a list that holds itself would otherwise surface later as a
    RecursionError far from the file)."""
    kinds: dict[type, int] = {}
    leaves = _LEAVES
    todo: list[tuple[Any, int, bool]] = [(obj, 0, False)]
    on_path: set[int] = set()
    done: set[int] = set()
    heights: dict[int, int] = {}  # tuples: how many tuples deep (as a DAG: shared sub-tuples count at every use)
    while todo:
        item, depth, leaving = todo.pop()
        if leaving:
            on_path.discard(id(item))
            done.add(id(item))
            if isinstance(item, tuple):
                height = 1 + max((heights.get(id(v), 0) for v in item if isinstance(v, tuple)), default=0)
                if height > MAX_TUPLE_NESTING:
                    raise pickle.UnpicklingError(f"tuples nested deeper than {MAX_TUPLE_NESTING} levels")
                heights[id(item)] = height
            continue
        if id(item) in on_path:
            raise pickle.UnpicklingError("an object contains itself")
        if id(item) in done:
            continue
        if depth > MAX_NESTING:
            raise pickle.UnpicklingError(f"nested deeper than {MAX_NESTING} levels")
        if len(done) > MAX_OBJECTS:
            raise pickle.UnpicklingError(f"more than {MAX_OBJECTS} objects")
        t = type(item)
        kind = kinds.get(t)
        if kind is None:
            kind = kinds[t] = _kind(t)
        if kind == _ITEMS:
            children = [v for v in item if type(v) not in leaves]
        elif kind == _MAPPING:
            children = [v for kv in dict.items(item) for v in kv if type(v) not in leaves]
            if t is not dict and getattr(item, "__dict__", None):  # an OrderedDict's attributes (state_dict _metadata)
                children += [v for v in item.__dict__.values() if type(v) not in leaves]
        elif kind == _ATTRS and type(getattr(item, "__dict__", None)) is dict:
            children = [v for v in item.__dict__.values() if type(v) not in leaves]
        else:
            children = None
        if not children:
            done.add(id(item))
            if isinstance(item, tuple):
                heights[id(item)] = 1
            continue
        on_path.add(id(item))
        todo.append((item, depth, True))
        depth += 1
        todo.extend([(c, depth, False) for c in children])


def load(
    data: bytes,
    profile: Profile,
    *,
    where: str,
    storage: Callable[[StorageType, str, int], Any] | None = None,
    max_bytes: int | None = None,
) -> Any:
    """Unpickle ``data`` (read from ``where``) under ``profile``; CheckpointError on anything refused."""
    limit = MAX_PICKLE_BYTES if max_bytes is None else max_bytes
    if len(data) > limit:
        raise CheckpointError(
            f"{where}: refused to unpickle ({len(data)} bytes of pickle, more than {limit}); "
            "the file is not a checkpoint this tool writes, pick another step"
        )
    try:
        with gc_paused():  # the cyclic GC rescans the growing object graph on every few hundred allocations
            obj = SafeUnpickler(data, profile, storage).load()
            _check_shape(obj)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(
            f"{where}: refused to unpickle (nested too deeply); the file is corrupted or hostile, pick another step"
        ) from None
    except Exception as e:  # noqa: BLE001 - every failure of hostile input is a refusal
        cause = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise CheckpointError(
            f"{where}: refused to unpickle ({cause}); only files written by this tool's "
            "backends can be read, pick another step"
        ) from None
    return obj


def admitted(profile: Profile) -> list[str]:
    """The profile's allow-list as 'module.name' strings (for documentation and reports)."""
    return sorted(f"{m}.{n}" for m, n in profile.pairs)


__all__ = [
    "ALLOWED",
    "DCP_LAYOUT",
    "DCP_METADATA",
    "DEEPSPEED_RECORDS",
    "DEEPSPEED_STATE",
    "MAX_PICKLE_BYTES",
    "Opaque",
    "PROFILES",
    "LAYOUT_RECORDS",
    "LayoutDType",
    "LayoutRecord",
    "Profile",
    "SafeUnpickler",
    "StorageRef",
    "StorageType",
    "StoredTensor",
    "TENSOR_RECORD",
    "admitted",
    "load",
    "rebuild_tensor",
]
