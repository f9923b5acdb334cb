"""Checkpoints written by other tools: which layout a folder holds, and a reader per layout that yields each
parameter's fp32 weight and AdamW moments as whole tensors, one at a time.

    from ckpt.formats.foreign.readers import open_foreign
    with open_foreign(
        "out/checkpoint-500", step=None, expect=[("model.embed_tokens.weight", (32000, 1024)), ...]
    ) as src:
        src.layout, src.path, src.global_step, src.shapes        # what was found
        src.verify()                                              # CRC-32 of every ZeRO partition, before writing
        src.read("model.embed_tokens.weight", "exp_avg")          # fp32 | exp_avg | exp_avg_sq

Layouts (``LAYOUTS``): DeepSpeed ZeRO-1/2/3 as ``engine.save_checkpoint`` writes it (``latest`` + ``global_stepN/``,
or ``global_stepN/`` itself, also inside a Hugging Face Trainer ``checkpoint-N/``), read by the same
``ckpt.formats.deepspeed.zero.ZeroShards`` the conversions use; the Hugging Face Trainer's unsharded checkpoint
(``model.safetensors`` or ``pytorch_model.bin`` + ``optimizer.pt`` + ``trainer_state.json``); and DCP checkpoints
(plain ``dcp.save`` of model and optimizer, torchtitan's ``step-N/``, Accelerate's FSDP ``pytorch_model_fsdp_0/`` +
``optimizer_0/``: ``ckpt.formats.foreign._dcp``). Every pickle goes through the one allow-list unpickler
(``ckpt.formats.pickle.safe_pickle``, by way of ``TorchSaveFile``/``TorchZip``); files a reader does not need
(``rng_state*.pth``, ``scheduler.pt``, ``training_args.bin``) are never opened.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch

from ckpt.commit.fsutil import read_regular
from ckpt.commit.identity import canonical
from ckpt.commit.state import MOMENTS
from ckpt.formats.deepspeed.zero import TorchSaveFile, ZeroShards, stored_number, zero_files
from ckpt.formats.foreign._dcp import open_dcp
from ckpt.formats.pickle.safe_pickle import StoredTensor
from ckpt.formats.pickle.torchzip import TorchZip, byte_view
from ckpt.pretrained import read_elements, tensor_index, weight_files
from schemas.errors import CheckpointError, ShardkeeperError

LAYOUTS: dict[str, str] = {
    "deepspeed": "DeepSpeed ZeRO-1/2/3 (engine.save_checkpoint: latest + global_stepN/, or global_stepN/ itself; "
    "also inside a Hugging Face Trainer checkpoint-N/)",
    "hf-trainer": "Hugging Face Trainer checkpoint-N/ (model.safetensors or pytorch_model.bin + optimizer.pt)",
    "dcp": "torch.distributed.checkpoint of {'model', 'optimizer'} state dicts",
    "torchtitan": "torchtitan step-N/ (model at the top level, optimizer, train_state)",
    "accelerate-fsdp": "Accelerate FSDP sharded state (pytorch_model_fsdp_0/ + optimizer_0/)",
}
# folders that hold one checkpoint each, named by step: DeepSpeed tags, HF Trainer, torchtitan, Accelerate
_STEP_DIR = re.compile(r"^(?:global_step|checkpoint-|step-|checkpoint_)(\d+)$")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_CRC_PIECE = 16 << 20
_LATEST_BYTES = 4096
_TRAINER_STATE_BYTES = 64 << 20  # trainer_state.json: the Trainer's log history, a few MB for a long run


class ForeignSource(Protocol):
    """One checkpoint of another tool: its model tensors by name and their AdamW state."""

    layout: str  # a key of LAYOUTS
    path: Path  # the folder read
    global_step: int  # the training step counter the other tool recorded
    shapes: dict[str, tuple[int, ...]]  # model tensor name -> shape, as stored

    def read(self, name: str, key: str) -> torch.Tensor: ...  # key: fp32 | exp_avg | exp_avg_sq; whole tensor

    def optim_step(self) -> float: ...

    def verify(self) -> None: ...  # integrity checks that reads alone would not do (before anything is written)

    def close(self) -> None: ...


def layouts_line() -> str:
    return "; ".join(f"{k}: {v}" for k, v in LAYOUTS.items())


def unknown_layout(src: Path, why: str = "") -> CheckpointError:
    return CheckpointError(
        f"{src}: not a checkpoint layout shardkeeper import understands{why}; it reads {layouts_line()}"
    )


# ------------------------------------------------------------------------------------------ finding it
def open_foreign(
    src: str | os.PathLike[str],
    *,
    step: int | None = None,
    expect: Callable[[], list[tuple[str, tuple[int, ...]]]] | None = None,
) -> ForeignSource:
    """The checkpoint in ``src`` (``step``: which one of several); ``expect()`` gives the target model's parameters
    in ``model.parameters()`` order, which an ``optimizer.pt`` (parameters by position) needs: called only then."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory; pass the folder the other tool wrote")
    if not src.is_dir():
        raise unknown_layout(src, " (a file; pass the folder that holds it)")
    if (src / "manifest.json").is_file():
        raise CheckpointError(
            f"{src}: already a shardkeeper checkpoint; resume it with shardkeeper train, or use "
            "shardkeeper convert to change its backend"
        )
    found, consumed = _resolve(src, step)
    source = _open_at(found, expect or list)
    if step is not None and not consumed and source.global_step != step:
        source.close()
        raise CheckpointError(
            f"{src}: holds step {source.global_step} only, not --step {step}; present: {source.global_step}"
        )
    return with_canonical_names(source)


def _resolve(d: Path, step: int | None) -> tuple[Path, bool]:
    """The folder of the one checkpoint to read, and whether ``step`` chose it among several."""
    if _direct(d) is not None:
        return d, False
    children = {int(m.group(1)): p for p in d.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))}
    if not children:
        raise unknown_layout(d)
    if step is not None:
        if step not in children:
            raise CheckpointError(
                f"{d}: no checkpoint of step {step}; present: {', '.join(map(str, sorted(children)))}"
            )
        chosen = children[step]
    else:
        chosen = children[_latest_tag(d, children) or max(children)]
    inner, _ = _resolve(chosen, None)
    return inner, step is not None


def _latest_tag(d: Path, children: dict[int, Path]) -> int | None:
    """DeepSpeed's ``latest`` file names the tag its loader takes by default."""
    path = d / "latest"
    if not os.path.lexists(path):
        return None
    # a few bytes ("global_step500"): never read whole whatever it is (a link to a large file), never waited on (a fifo)
    try:
        raw = read_regular(path, _LATEST_BYTES, "DeepSpeed's latest (one tag name)")
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: a link to a missing file; pass --step N (present: {', '.join(map(str, sorted(children)))})"
        ) from None
    tag = raw.decode("utf-8", "replace").strip()[:200]
    m = _STEP_DIR.match(tag)
    if m is None or int(m.group(1)) not in children:
        raise CheckpointError(
            f"{path}: names tag {tag!r}, which is not a folder beside it; pass --step N "
            f"(present: {', '.join(map(str, sorted(children)))})"
        )
    return int(m.group(1))


def _direct(d: Path) -> str | None:
    """The layout of a folder that is itself one checkpoint, else None."""
    names = {p.name for p in d.iterdir()}
    if zero_files(d)[0]:
        return "deepspeed"
    if "pytorch_model_fsdp_0" in names:
        return "accelerate-fsdp"
    if ".metadata" in names:
        return "dcp"  # or torchtitan: told apart by its keys
    weights = [w for w in _WEIGHTS if w in names]
    if weights and "optimizer.pt" in names:
        return "hf-trainer"
    if weights and not any(_STEP_DIR.match(n) for n in names):
        raise CheckpointError(
            f"{d}: holds model weights ({weights[0]}) but no optimizer state (optimizer.pt); import "
            "adopts a training state: to start a run from these weights, set model.pretrained to this folder"
        )
    return None


def _open_at(d: Path, expect: Callable[[], list[tuple[str, tuple[int, ...]]]]) -> ForeignSource:
    layout = _direct(d)
    if layout == "deepspeed":
        return ZeroForeign(d)
    if layout == "hf-trainer":
        return HFTrainerForeign(d, expect())
    return open_dcp(d)


# ------------------------------------------------------------------------------------------ DeepSpeed
class ZeroForeign:
    """DeepSpeed ZeRO partitions as ``engine.save_checkpoint`` wrote them (no shardkeeper manifest)."""

    layout = "deepspeed"

    def __init__(self, d: Path):
        self.path = d
        self.shards = ZeroShards(d)
        self._slots = {s.name: s for s in self.shards.slots}
        self.shapes = {s.name: s.shape for s in self.shards.slots}
        steps = self.shards.model_states.get("global_steps")
        self.global_step = steps if type(steps) is int and steps >= 0 else int(self.shards.step())

    def read(self, name: str, key: str) -> torch.Tensor:
        return self.shards.read(self._slots[name], key)

    def optim_step(self) -> float:
        return self.shards.step()

    def verify(self) -> None:
        """The reads take byte ranges of the flat partitions, which their zip CRC-32 cannot cover: every
        partition file's storages are checked whole first (a flipped bit is refused before anything is written)."""
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="crc") as pool:
            for f in [pool.submit(check_storage_crcs, t.path) for t in self.shards.files]:
                f.result()

    def close(self) -> None:
        self.shards.close()

    def __enter__(self) -> ZeroForeign:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_storage_crcs(path: Path) -> None:
    """Every storage of a torch.save file against the CRC-32 its zip directory records (none: not checked)."""
    with TorchZip.open(path) as zf:
        for name in sorted(n for n in zf.entries if n.startswith(zf.prefix + "data/")):
            offset, size, crc = zf.entry(name)
            if not crc:
                continue
            got, done = 0, 0
            while done < size:
                piece = zf.pread(min(_CRC_PIECE, size - done), offset + done)
                if not piece:
                    raise CheckpointError(f"{path}: ends inside storage {name}; the file is truncated, re-copy it")
                got = zlib.crc32(piece, got)
                done += len(piece)
            if got != crc:
                raise CheckpointError(f"{path}: CRC-32 mismatch in {name}; the file is corrupted, re-copy it")


def read_whole(f: TorchSaveFile, t: StoredTensor) -> torch.Tensor:
    """A stored tensor read with its whole storage, whose CRC-32 is checked (a moment or weight of its own). The
    storage's entry is exactly its declared size (``TorchZip.describe``), and the tensor lies inside it."""
    if not isinstance(t, StoredTensor):
        raise CheckpointError(
            f"{f.path}: holds a {type(t).__name__} where a tensor belongs; the file is corrupted or crafted, re-copy it"
        )
    _, length, crc = f.storage_entry(t.key)
    item = t.dtype.itemsize
    if length != t.storage_numel * item:
        raise CheckpointError(
            f"{f.path}: storage {t.key} holds {length} bytes, its tensor says {t.storage_numel} x "
            f"{item}; the file is corrupted or crafted, re-copy it"
        )
    whole = StoredTensor(t.key, t.dtype, 0, (length // item,), (1,), length // item)
    buf = f.read(whole)
    if crc and zlib.crc32(byte_view(buf)) != crc:
        raise CheckpointError(f"{f.path}: CRC-32 mismatch in storage {t.key}; the file is corrupted, re-copy it")
    return torch.as_strided(buf, t.shape, t.stride, t.offset).contiguous()


# ------------------------------------------------------------------------------------------ HF Trainer
def _split(names: list[str], decays: Callable[[str], bool]) -> tuple[list[str], list[int]]:
    """Parameters in the order of a two-group optimizer (weight decay first), with the group sizes."""
    decay = [n for n in names if decays(n)]
    rest = [n for n in names if not decays(n)]
    return decay + rest, [len(decay), len(rest)]


# transformers' Trainer.get_decay_parameter_names: no weight decay on biases and normalization weights
_HF_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


class HFTrainerForeign:
    """The Hugging Face Trainer's unsharded checkpoint: weights (safetensors or .bin) and ``optimizer.pt``
    (``optimizer.state_dict()``: parameters by position over its groups, which are matched to names here)."""

    layout = "hf-trainer"

    def __init__(self, d: Path, expect: list[tuple[str, tuple[int, ...]]]):
        self.path = d
        self._bin: TorchSaveFile | None = None
        self._files: list[TorchSaveFile] = []  # what close() closes, also after a failed __init__
        try:
            self._weights = self._index_weights(d)
            self.shapes = {n: tuple(t.shape) for n, t in self._weights.items()}
            self._optim = TorchSaveFile(d / "optimizer.pt")
            self._files.append(self._optim)
            self._state, groups = self._optimizer_tree()
            self._by_name = self._match_positions(groups, expect)
            self.global_step = self._trainer_step(d)
        except BaseException:
            self.close()
            raise

    def _index_weights(self, d: Path) -> dict[str, Any]:
        if (d / "model.safetensors.index.json").is_file() or (d / "model.safetensors").is_file():
            try:
                return dict(tensor_index(weight_files(d, str(d))))
            except ShardkeeperError as e:
                raise CheckpointError(str(e)) from None
        self._bin = TorchSaveFile(d / "pytorch_model.bin")
        self._files.append(self._bin)
        obj = self._bin.obj
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, StoredTensor) for k, v in obj.items()
        ):
            raise CheckpointError(f"{self._bin.path}: not a state dict of tensors; the file is not a model checkpoint")
        return dict(obj)

    def _optimizer_tree(self) -> tuple[dict[Any, Any], list[list[int]]]:
        osd, where = self._optim.obj, self._optim.path
        state, groups = (osd.get("state"), osd.get("param_groups")) if isinstance(osd, dict) else (None, None)
        if (
            not isinstance(state, dict)
            or not isinstance(groups, list)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            raise CheckpointError(
                f"{where}: not an optimizer.state_dict() (state + param_groups); the file is not a Trainer checkpoint"
            )
        for pid, st in state.items():  # noqa: B007
            keys = sorted(k for k in st if k != "step") if isinstance(st, dict) else ["?"]
            if keys != sorted(MOMENTS):
                raise CheckpointError(
                    f"{where}: optimizer state has {keys or 'no moments'}; only AdamW/Adam state "
                    "(exp_avg, exp_avg_sq) can be imported"
                )
        if not all(type(i) is int for g in groups for i in g["params"]):
            raise CheckpointError(
                f"{where}: param_groups name parameters by other than their positions; the file is "
                "not an optimizer.state_dict(), or a crafted one"
            )
        return state, [list(g["params"]) for g in groups]

    def _match_positions(self, groups: list[list[int]], expect: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
        """Which parameter each position of ``optimizer.pt`` is: the Trainer's decay/no-decay split, the model
        order, or a split by dimensions; the first whose group sizes and every moment's shape agree."""
        names = [n for n, _ in expect]
        shape = dict(expect)
        ids = [i for g in groups for i in g]
        sizes = [len(g) for g in groups]
        candidates = [
            _split(names, lambda n: _HF_NO_DECAY.search(n.lower()) is None),
            (names, sizes),
            _split(names, lambda n: len(shape[n]) >= 2),
        ]
        for order, split in candidates:
            if split != sizes or len(order) != len(ids):
                continue
            if all(self._shape_of(i) == shape[n] for i, n in zip(ids, order)):
                return {n: self._state[i] for i, n in zip(ids, order)}
        raise CheckpointError(
            f"{self._optim.path}: its {len(ids)} parameters in groups of {sizes} do not line up with the "
            f"{len(names)} parameters of the config's model (by the Trainer's decay split or model order); "
            "import it with the config of the model that wrote it"
        )

    def _shape_of(self, pid: int) -> tuple[int, ...] | None:
        st = self._state.get(pid)
        t = st.get("exp_avg") if isinstance(st, dict) else None
        return tuple(t.shape) if isinstance(t, StoredTensor) else None

    def _trainer_step(self, d: Path) -> int:
        path = d / "trainer_state.json"
        if path.is_file():
            try:
                step = json.loads(read_regular(path, _TRAINER_STATE_BYTES, "a trainer_state.json")).get("global_step")
            except (ValueError, AttributeError):
                raise CheckpointError(f"{path}: not readable JSON; the checkpoint is corrupted, re-copy it") from None
            if type(step) is int and step >= 0:
                return step
        return int(self.optim_step())

    def read(self, name: str, key: str) -> torch.Tensor:
        if key == "fp32":
            t = self._weights[name]
            if isinstance(t, StoredTensor):
                assert self._bin is not None
                return read_whole(self._bin, t).float()
            out = torch.empty(t.shape, dtype=torch.float32)
            read_elements(t, 0, math.prod(t.shape), out.view(-1))
            return out
        st = self._by_name[name]
        return read_whole(self._optim, st[key]).float()

    def optim_step(self) -> float:
        st = next(iter(self._by_name.values()), {})
        step = st.get("step", 0) if isinstance(st, dict) else 0
        return stored_number(self._optim, step, "the optimizer step")

    def verify(self) -> None:
        pass  # every storage read is checked whole against its CRC-32 (safetensors records none)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> HFTrainerForeign:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_mismatch(
    source: ForeignSource,
    expect: Iterable[tuple[str, tuple[int, ...]]],
    tied: dict[str, str],
    *,
    model: str = "the config's model",
) -> str | None:
    """One line naming the first tensor whose name or shape differs between the source and the target model
    (``model``: how the messages call it)."""
    expect = list(expect)
    have = source.shapes
    for name, shape in expect:
        if name not in have:
            return f"has no tensor {name} ({model} has it, {list(shape)})"
        if tuple(have[name]) != tuple(shape):
            return f"holds {name} as {list(have[name])}, {model} has {list(shape)}"
    known = {n for n, _ in expect}
    extra = [n for n in have if n not in known and n not in tied]
    if extra:
        return f"holds tensor {extra[0]} {list(have[extra[0]])}, which {model} lacks"
    return None


class CanonicalNames:
    """A source seen under its tensors' canonical names (``ckpt.commit.identity.canonical``: a DDP model's ``module.``,
    a
    compiled one's ``_orig_mod.`` left out), as the model that adopts it names them."""

    def __init__(self, src: ForeignSource):
        self.src = src
        self.layout, self.path, self.global_step = src.layout, src.path, src.global_step
        self._raw = {canonical(n): n for n in src.shapes}
        self.shapes = {canonical(n): s for n, s in src.shapes.items()}

    def read(self, name: str, key: str) -> torch.Tensor:
        return self.src.read(self._raw[name], key)

    def optim_step(self) -> float:
        return self.src.optim_step()

    def verify(self) -> None:
        self.src.verify()

    def close(self) -> None:
        self.src.close()


def with_canonical_names(src: ForeignSource) -> ForeignSource:
    """``src`` under canonical names when a wrapper prefixed any of them (and no two come out the same), else itself."""
    names = {canonical(n) for n in src.shapes}
    if names == set(src.shapes) or len(names) != len(src.shapes):
        return src
    return CanonicalNames(src)


__all__ = [
    "LAYOUTS",
    "CanonicalNames",
    "ForeignSource",
    "HFTrainerForeign",
    "ZeroForeign",
    "check_storage_crcs",
    "first_mismatch",
    "layouts_line",
    "open_foreign",
    "read_whole",
    "unknown_layout",
    "with_canonical_names",
]
