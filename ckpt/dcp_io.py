"""Safe access to DCP checkpoints.

DCP stores its ``.metadata`` and non-tensor values with pickle and loads them without
the weights-only restriction. A checkpoint may come from someone else, so here:

* ``.metadata`` is read with an unpickler that admits only DCP's metadata classes and torch
  dtypes/sizes (``SafeFileSystemReader``);
* non-tensor values are loaded with ``torch.load(weights_only=True)`` (``SafeLoadPlanner``);
* ``DCPTensorReader`` streams single tensors straight from the ``.distcp`` files, one chunk at a
  time, for export and deep validation without a process group or the whole state in memory.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem


from ckpt.errors import CheckpointError

_ALLOWED_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_ALLOWED_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool", "slice"}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint"):
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, _ALLOWED_TORCH_TYPES):
                return obj
        if module == "torch.serialization" and name == "_get_layout":  # maps "torch.strided" to the layout
            return super().find_class(module, name)
        if module == "pathlib" and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}:
            return super().find_class(module, name)  # StorageMeta.checkpoint_id
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            raise pickle.UnpicklingError("tensors are not expected in DCP metadata")
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata(ckpt_dir: str | os.PathLike[str]) -> Metadata:
    path = Path(ckpt_dir) / ".metadata"
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the DCP checkpoint is incomplete, pick another step") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read safely ({e}); the checkpoint is corrupted or not DCP") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: holds {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self.path)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that unpickles non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class DCPTensorReader:
    """Reads whole tensors of a DCP checkpoint one at a time, in one process, without a group."""

    def __init__(self, ckpt_dir: str | os.PathLike[str]):
        self.dir = Path(ckpt_dir)
        self.metadata = read_metadata(self.dir)
        self._files: dict[str, Any] = {}

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def byte_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.dir}: no tensor named {key!r} in the checkpoint")
        return md

    def _read(self, index: MetadataIndex) -> bytes:
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.dir}: {index.fqn} uses DCP stream transforms, which export does not support")
        f = self._files.get(info.relative_path)
        if f is None:
            path = self.dir / info.relative_path
            try:
                f = self._files[info.relative_path] = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the checkpoint is incomplete, pick another step") from None
        data = os.pread(f.fileno(), info.length, info.offset)
        if len(data) != info.length:
            raise CheckpointError(f"{self.dir / info.relative_path}: truncated at {index.fqn}; the checkpoint is corrupted")
        return data

    def read_bytes_value(self, key: str) -> Any:
        return torch.load(io.BytesIO(self._read(MetadataIndex(key))), weights_only=True)

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Assemble the full tensor ``key`` from its chunks (into ``out`` when given)."""
        md = self.meta(key)
        if out is None:
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            raw = self._read(MetadataIndex(key, chunk.offsets))
            piece = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            dst = out
            for dim, (off, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                dst = dst.narrow(dim, off, length)
            dst.copy_(piece.reshape(tuple(chunk.sizes)))
        return out

    def iter_tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.tensor_keys():
            if key.startswith(prefix):
                yield key, self.read(key)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> DCPTensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DCPTensorReader", "SafeFileSystemReader", "SafeLoadPlanner", "read_metadata"]
