"""A checkpoint's identity is its state: the names, global shapes and dtypes of its model tensors, as the manifest's
inventory records them (``manifest.tensors``, the ``model.*`` entries). A run of any kind (the built-in trainer, a
script, the Hugging Face Trainer or Accelerate adapters, an import) may continue a checkpoint whose model tensors
are those its own save would record; how the run was described (a config, a script) does not enter.

Names are compared after the renames that wrappers make (``canonical``): a leading ``module.`` (DDP, DeepSpeed, the
Hugging Face Trainer), ``_orig_mod.`` (``torch.compile``), ``_fsdp_wrapped_module.`` (FSDP1) and
``_checkpoint_wrapped_module.`` (activation checkpointing). DCP's ``get_state_dict`` already removes them from the
names a DCP checkpoint holds; a DeepSpeed engine's parameter names keep what the module it wraps calls them.

``signature`` is the ``model_signature`` every manifest records: a digest of the canonical model inventory, the
same for every kind of run that trains the same model (tied names left out: a DCP checkpoint holds both names of a
tied pair, DeepSpeed's the source only). Checkpoints written before it was defined so carry another digest; no
load compares it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

from schemas import TensorEntry

MODEL_PREFIX = "model."  # the inventory's section of the model tensors (the rest: optim.state.*)
# Module names wrappers insert into parameter names: anywhere in a name, and (``module``) at its start.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_LEADING_WRAPPER = "module"

Shape = tuple[tuple[int, ...], str]  # (global shape, dtype name)


def canonical(name: str) -> str:
    """``name`` without the module names wrappers insert (``module.`` at its start, ``_orig_mod.``,
    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.`` anywhere)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == _LEADING_WRAPPER:
        parts = parts[1:]
    return ".".join(parts)


def model_tensors(entries: Iterable[TensorEntry]) -> dict[str, Shape]:
    """The model tensors of an inventory by canonical name (without the ``model.`` section prefix), in its order."""
    out: dict[str, Shape] = {}
    for e in entries:
        if e.name.startswith(MODEL_PREFIX):
            out.setdefault(canonical(e.name[len(MODEL_PREFIX) :]), (tuple(e.shape), e.dtype))
    return out


def _show(entry: Shape) -> str:
    return f"{list(entry[0])} {entry[1]}"


def first_difference(here: Mapping[str, Shape], there: Mapping[str, Shape]) -> str | None:
    """The first model tensor that differs between this run's model (``here``) and a checkpoint (``there``), both
    from ``model_tensors``: its name and what each side holds; None when they are the same. The checkpoint's order
    first, then the tensors only this run's model has."""
    for name, saved in there.items():
        mine = here.get(name)
        if mine is None:
            return f"{name} {_show(saved)} is in the checkpoint but not in this run's model"
        if mine != saved:
            return f"{name} is {_show(saved)} in the checkpoint, {_show(mine)} in this run's model"
    for name, mine in here.items():
        if name not in there:
            return f"{name} {_show(mine)} is in this run's model but not in the checkpoint"
    return None


def tie_difference(here: Mapping[str, str], there: Mapping[str, str]) -> str | None:
    """The first tie (tied name -> its source) in which this run's model (``here``) and the checkpoint (``there``)
    differ: a tied and an untied model hold the same names in a DCP checkpoint, not the same parameters."""
    mine = {canonical(t): canonical(s) for t, s in here.items()}
    saved = {canonical(t): canonical(s) for t, s in there.items()}
    for tied in sorted(set(mine) | set(saved)):
        a, b = mine.get(tied), saved.get(tied)
        if a == b:
            continue
        if a is None:
            return f"{tied} is tied to {b} in the checkpoint, not in this run's model"
        if b is None:
            return f"{tied} is tied to {a} in this run's model, not in the checkpoint"
        return f"{tied} is tied to {b} in the checkpoint, to {a} in this run's model"
    return None


def renames(here: Iterable[str], there: Iterable[str]) -> dict[str, str]:
    """This run's model tensor names -> the checkpoint's, for the names that differ only by wrapper prefixes."""
    saved = {canonical(n): n for n in there}
    return {n: saved[canonical(n)] for n in here if canonical(n) in saved and saved[canonical(n)] != n}


def signature(entries: Iterable[TensorEntry], tied: Mapping[str, str] | None = None) -> str:
    """sha256 over the canonical model inventory (name, global shape, dtype), tied names (``tied``: tied name ->
    its source) left out: the same for every kind of run and either backend that trains the same model."""
    tensors = model_tensors(entries)
    drop = {canonical(t) for t, s in (tied or {}).items() if canonical(s) in tensors}
    rows = sorted((n, list(shape), dtype) for n, (shape, dtype) in tensors.items() if n not in drop)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


__all__ = ["MODEL_PREFIX", "canonical", "first_difference", "model_tensors", "renames", "signature", "tie_difference"]
