"""A tracked object's ``state_dict()`` as one uint8 tensor, without pickle: safetensors bytes whose metadata holds
the structure as JSON (dicts, lists, tuples, numbers, strings, booleans, None) and whose tensors are the leaves.

Used for what a user's script tracks besides model and optimizer (LR scheduler, data loader position, ...):
the checkpoint stores one such tensor per rank and object, and loading it executes nothing.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from schemas.errors import CheckpointError

_STRUCT = "shardkeeper.structure"


class UnpackableState(TypeError):
    """A state_dict holds a value that cannot be stored without pickle."""


def pack(state: Any, where: str = "state") -> torch.Tensor:
    """``state`` -> uint8 tensor (a copy: training may change the object afterwards)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = v.detach().to("cpu").contiguous().clone()
            return {"__t": key}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"__f": repr(v)}
        if isinstance(v, (list, tuple)):
            out = [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
            return out if isinstance(v, list) else {"__tuple": out}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: enc(x, f"{path}.{k}") for k, x in v.items()}
            items = []
            for k, x in v.items():
                if not isinstance(k, (str, int, bool, float)) and k is not None:
                    raise UnpackableState(f"{path}: a dict key of type {type(k).__name__}")
                items.append([enc(k, path), enc(x, f"{path}[{k!r}]")])
            return {"__dict": items}
        raise UnpackableState(f"{path}: a {type(v).__name__}")

    structure = enc(state, where)
    blob = save(tensors, metadata={_STRUCT: json.dumps(structure, separators=(",", ":"))})
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack(blob: torch.Tensor, where: str) -> Any:
    """The inverse of ``pack``; a blob that does not parse is a corrupted checkpoint (one line, nothing executed)."""
    from safetensors.torch import load

    try:
        raw = bytes(blob.to(torch.uint8).contiguous().numpy().tobytes())
        tensors = load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__", {})
        structure = json.loads(meta[_STRUCT])
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's
        raise CheckpointError(
            f"{where}: not a readable tracked state ({type(e).__name__}); the checkpoint is "
            "corrupted, pick another step"
        ) from None

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if isinstance(v, dict):
            if set(v) == {"__t"}:
                if v["__t"] not in tensors:
                    raise CheckpointError(f"{where}: names a tensor it does not hold; the checkpoint is corrupted")
                return tensors[v["__t"]]
            if set(v) == {"__f"}:
                return float(v["__f"])
            if set(v) == {"__tuple"}:
                return tuple(dec(x) for x in v["__tuple"])
            if set(v) == {"__dict"}:
                return {dec(k): dec(x) for k, x in v["__dict"]}
            return {k: dec(x) for k, x in v.items()}
        return v

    return dec(structure)
