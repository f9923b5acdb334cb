"""DCP checkpoints of other tools, read one whole tensor at a time through ``ckpt.formats.dcp.reader.DCPTensorReader``
(``.metadata`` and every record under the allow-list unpickler, each record's CRC-32 checked):

* ``dcp``: ``dcp.save({"model": model_sd, "optimizer": optim_sd})`` with the state dicts of
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` (keys ``model.<fqn>``, ``optimizer.state.<fqn>.exp_avg``);
* ``torchtitan``: ``step-N/`` with the model state dict flattened at the top level (``<fqn>``) beside
  ``optimizer`` (``flatten_optimizer_state_dict``: ``optimizer.state.<fqn>.exp_avg``), ``lr_scheduler``,
  ``dataloader`` and ``train_state`` (``train_state.step``);
* ``accelerate-fsdp``: Accelerate's sharded FSDP state, ``pytorch_model_fsdp_0/`` (``{"model": sd}``) and
  ``optimizer_0/`` (``{"optimizer": osd}``).

The model's names must be the target model's (an FSDP2/HF model saved through get_state_dict has them);
torchtitan's own Llama names (``tok_embeddings``, ``layers.0.attention.wq``) are not translated.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch

from ckpt.commit.state import MOMENTS
from ckpt.formats.dcp.reader import DCPTensorReader
from schemas.errors import CheckpointError

OPTIM = "optimizer.state."
# torchtitan's top-level entries besides the model (their keys are not model tensors)
_TITAN_OTHERS = ("optimizer.", "lr_scheduler", "lr_schedulers", "dataloader", "train_state", "ft_")


class DCPForeign:
    """Model tensors under ``model_prefix`` of one DCP folder, AdamW state under ``optimizer.state.`` of another
    (or the same)."""

    def __init__(self, layout: str, path: Path, model_dir: Path, optim_dir: Path, model_prefix: str):
        self.layout, self.path, self._prefix = layout, path, model_prefix
        self._lock = threading.Lock()  # DCPTensorReader caches open files in a dict
        self._model = DCPTensorReader(model_dir)
        self._optim = self._model if optim_dir == model_dir else DCPTensorReader(optim_dir)
        try:
            self._index()
        except BaseException:
            self.close()
            raise

    def _index(self) -> None:
        keys = self._model.tensor_keys()
        if self._prefix:
            names = [k[len(self._prefix) :] for k in keys if k.startswith(self._prefix)]
        else:
            names = [k for k in keys if not k.startswith(_TITAN_OTHERS)]
        self.shapes = {n: tuple(self._model.meta(self._prefix + n).size) for n in names}
        if not self.shapes:
            raise CheckpointError(
                f"{self.path}: a DCP checkpoint without model tensors ('{self._prefix}*'); import reads "
                "DCP saves of {'model', 'optimizer'}, torchtitan step-N/ and Accelerate FSDP folders"
            )
        moments = {k for k in self._optim.tensor_keys() if k.startswith(OPTIM)}
        if not moments:
            raise CheckpointError(
                f"{self.path}: a DCP checkpoint without optimizer state ({OPTIM}*); import adopts a "
                "training state: to start a run from these weights, export them and set model.pretrained"
            )
        first = next(iter(self.shapes))
        found = sorted(
            k[len(OPTIM) + len(first) + 1 :]
            for k in moments
            if k.startswith(f"{OPTIM}{first}.") and "." not in k[len(OPTIM) + len(first) + 1 :]
        )
        if [k for k in found if k != "step"] != sorted(MOMENTS):
            raise CheckpointError(
                f"{self.path}: optimizer state of {first} has {found or 'no entries'}; only AdamW/Adam "
                "state (exp_avg, exp_avg_sq) can be imported"
            )
        self._step_key = f"{OPTIM}{first}.step"
        self.global_step = self._global_step()

    def _global_step(self) -> int:
        if "train_state.step" in self._model.tensor_keys():
            return int(self._number(self._model, "train_state.step"))
        return int(self.optim_step())

    def _number(self, reader: DCPTensorReader, key: str) -> float:
        """A counter stored as a one-element tensor: a finite number of at least 0, else one line naming it."""
        t = self._read(reader, key)
        value = t.item() if t.numel() == 1 and not t.is_complex() else None
        if value is None or not math.isfinite(value) or value < 0:
            raise CheckpointError(
                f"{reader.dir / '.metadata'}: {key} is not one finite number of at least 0 "
                f"({t.dtype} {list(t.shape)}); the checkpoint is corrupted or crafted"
            )
        return float(value)

    def _read(self, reader: DCPTensorReader, key: str) -> torch.Tensor:
        with self._lock:
            return reader.read(key)

    def read(self, name: str, key: str) -> torch.Tensor:
        if key == "fp32":
            return self._read(self._model, self._prefix + name).float()
        try:
            return self._read(self._optim, f"{OPTIM}{name}.{key}").float()
        except CheckpointError as e:
            if "no tensor named" not in str(e):
                raise
            raise CheckpointError(
                f"{self.path}: no {key} for {name} in the optimizer state; only AdamW state of every "
                "parameter can be imported"
            ) from None

    def optim_step(self) -> float:
        if self._step_key not in self._optim.tensor_keys():
            raise CheckpointError(
                f"{self.path}: no optimizer step ({self._step_key}); only AdamW state can be imported"
            )
        return self._number(self._optim, self._step_key)

    def verify(self) -> None:
        pass  # every record read is checked against its CRC-32 (DCPTensorReader)

    def close(self) -> None:
        for reader in {id(r): r for r in (getattr(self, "_model", None), getattr(self, "_optim", None)) if r}.values():
            reader.close()

    def __enter__(self) -> DCPForeign:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_dcp(d: Path) -> DCPForeign:
    """The DCP layout in ``d``: Accelerate's two folders, torchtitan's top-level model, or a plain save."""
    if (d / "pytorch_model_fsdp_0").is_dir():
        optim = d / "optimizer_0"
        if not (optim / ".metadata").is_file():
            raise CheckpointError(
                f"{d}: Accelerate FSDP model state without optimizer_0/.metadata; import adopts a "
                "training state (save_state writes both), or set model.pretrained to exported weights"
            )
        return DCPForeign("accelerate-fsdp", d, d / "pytorch_model_fsdp_0", optim, "model.")
    reader = DCPTensorReader(d)
    try:
        keys = reader.tensor_keys()
    finally:
        reader.close()
    if any(k.startswith("model.") for k in keys) and not any(k.startswith("train_state") for k in keys):
        return DCPForeign("dcp", d, d, d, "model.")
    return DCPForeign("torchtitan", d, d, d, "")


__all__ = ["DCPForeign", "open_dcp"]
