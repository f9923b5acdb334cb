"""DeepSpeed saves in two halves: capture what ``engine.save_checkpoint`` would write, write it later.

``CapturingEngine`` replaces DeepSpeed's checkpoint engine: ``save(state_dict, path)`` records the state
object instead of writing it, and DeepSpeed creates no directory. A sync save writes the captured objects
at once (they are the live state, training waits). An async save first copies them with ``HostStaging``
into host buffers that are allocated once and reused, then the Checkpointer's background thread writes
the copies with the same ``torch.save`` the sync save uses: the files are the same bytes on disk.

The copy is per storage, the unit ``torch.save`` writes (keyed by ``_cdata``, as torch.save keys them):
DeepSpeed saves views — module parameters inside one flat bit16 group, fp32 partitions trimmed of their
padding — and ``torch.save`` writes each view's whole storage once. Each captured tensor is rebuilt on
its staged storage with the same offset, size, stride, dtype, ``requires_grad`` and class, so the saved
records match those of the live state byte for byte; non-tensor values are deep-copied.

Why not one of DeepSpeed's own engines: the decoupled engine (``checkpoint.writer.decoupled``) hands the
live tensors to a writer process and waits for it before the next optimizer step, so the stall is the
write minus one forward/backward, and no file is hashed or fsynced for the commit; FastPersist
(``FastCheckpointEngine``) writes faster but synchronously, through the async_io op (libaio); Nebula and
DataStates are external services/packages. None stages a copy that training may overwrite.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Captured:
    """One save: DeepSpeed's files (path relative to the step directory, state object) in the order it
    saved them, the fingerprint's fragments, the optimizer step and this rank's RNG state."""

    files: list[tuple[str, Any]]
    fragments: list[tuple[str, torch.Tensor, dict[str, torch.Tensor]]]
    optim_step: float
    rng: dict[str, torch.Tensor]


def capturing_engine() -> Any:
    """DeepSpeed's torch.save checkpoint engine that records saves instead of writing them; loads go through
    the one allow-list record reader (ckpt.formats.pickle.torchzip) instead of torch.load: DeepSpeed's value
    classes are returned as themselves, tensors on the CPU (DeepSpeed moves them)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from ckpt.formats.pickle.safe_pickle import DEEPSPEED_STATE
    from ckpt.formats.pickle.torchzip import load_file
    from schemas.errors import CheckpointError

    class CapturingEngine(TorchCheckpointEngine):
        def __init__(self) -> None:
            super().__init__(None)
            self.captured: list[tuple[str, Any]] = []

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            """The Checkpointer creates the step directory (``.partial``), the writer any subdirectory."""

        def save(self, state_dict: Any, path: str) -> None:
            self.captured.append((path, state_dict))

        def take(self, root: str) -> list[tuple[str, Any]]:
            out = [(os.path.relpath(p, root), sd) for p, sd in self.captured]
            self.captured = []
            return out

        def load(self, path: str, map_location: Any = None) -> Any:
            state = load_file(path, DEEPSPEED_STATE)
            if not isinstance(state, dict):
                raise CheckpointError(
                    f"{path}: holds a {type(state).__name__}, not a DeepSpeed state dict; "
                    "the checkpoint is corrupted, pick another step"
                )
            return state

    return CapturingEngine()


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor in the containers of a state object (others are deep-copied by value)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


class HostStaging:
    """Host buffers for async saves, one per storage in capture order, reused while the sizes stay the same
    (pinned when the state lives on a GPU, so the copies run at full bandwidth)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: list[torch.UntypedStorage] = []

    def _buffer(self, i: int, nbytes: int) -> torch.UntypedStorage:
        if i < len(self.buffers) and self.buffers[i].nbytes() == nbytes:
            return self.buffers[i]
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
        if i < len(self.buffers):
            self.buffers[i] = buf
        else:
            self.buffers.append(buf)
        return buf

    def stage(self, cap: Captured) -> Captured:
        """A copy of ``cap`` that shares no storage with the live state: training may go on at once."""
        live = _tensors([sd for _, sd in cap.files], [])
        frag = [t for _, t, ms in cap.fragments for t in (t, *ms.values())]
        live_ids = {id(t) for t in live}
        staged: dict[int, torch.UntypedStorage] = {}
        for t in live + frag:
            st = t.untyped_storage()
            if st._cdata not in staged and (id(t) in live_ids or st.nbytes()):
                buf = self._buffer(len(staged), st.nbytes())
                buf.copy_(st, non_blocking=self.pin)
                staged[st._cdata] = buf
        del self.buffers[len(staged) :]
        if self.pin:
            torch.cuda.synchronize()

        memo: dict[int, Any] = {}

        def view(t: torch.Tensor) -> torch.Tensor:
            buf = staged.get(t.untyped_storage()._cdata)
            if buf is None:  # a fragment outside the saved state (an empty one): copied by value
                return t.detach().to("cpu", copy=True)
            v = torch.empty(0, dtype=t.dtype).set_(buf, t.storage_offset(), t.size(), t.stride())
            if isinstance(t, torch.nn.Parameter):
                v = torch.nn.Parameter(v, requires_grad=t.requires_grad)
            else:
                v.requires_grad_(t.requires_grad)
            if t.__dict__:  # attributes DeepSpeed set (ZeRO-3's ds_id) are pickled with the tensor
                v.__dict__.update(copy.deepcopy(t.__dict__, memo))
            return v

        for t in live:
            if id(t) not in memo:
                memo[id(t)] = view(t)
        files = [(path, copy.deepcopy(sd, memo)) for path, sd in cap.files]
        fragments = [(n, view(t), {m: view(x) for m, x in ms.items()}) for n, t, ms in cap.fragments]
        return Captured(files, fragments, cap.optim_step, cap.rng)

    def release(self) -> None:
        self.buffers = []
