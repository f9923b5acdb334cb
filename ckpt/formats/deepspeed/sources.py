"""Where a DeepSpeed checkpoint's tensors are (ZeRO shards, the universal layout, or a DCP checkpoint being
converted), read one parameter at a time; the streamed fingerprint; the commit of a converted checkpoint."""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from ckpt.commit import fingerprint as fp
from ckpt.commit.fsutil import fsync_dir
from ckpt.commit.manifest import write_manifest
from ckpt.commit.state import MOMENTS
from ckpt.formats.deepspeed.zero import UNIVERSAL_DIR, TorchSaveFile, ZeroShards, read_state
from ckpt.validate.checks import checked_manifest, validate
from schemas import CheckpointManifest, Fingerprint, TensorEntry
from schemas.errors import CheckpointError

log = logging.getLogger(__name__)


IO_THREADS = 2


class Source(Protocol):
    """Whole fp32 tensors of a checkpoint's parameters, in optimizer order, one at a time."""

    groups: list[list[tuple[str, tuple[int, ...]]]]  # per optimizer group: (parameter name, shape)

    def read(self, name: str, key: str) -> torch.Tensor: ...  # key: fp32 | exp_avg | exp_avg_sq

    def step(self) -> float: ...

    def hparams(self) -> list[dict[str, Any]]: ...  # per group, without "params"

    def close(self) -> None: ...


class ZeroSource:
    """A native DeepSpeed ZeRO 1/2/3 checkpoint (its rank partitions)."""

    def __init__(self, ckpt_dir: Path, manifest: CheckpointManifest):
        self.shards = ZeroShards(
            ckpt_dir,
            expect_world_size=manifest.topology.world_size,
            expect_stage=manifest.run_spec.deepspeed.zero_stage,
        )
        self._slots = {s.name: s for s in self.shards.slots}
        self.groups = [[] for _ in range(1 + max((s.group for s in self.shards.slots), default=0))]
        for s in self.shards.slots:
            self.groups[s.group].append((s.name, s.shape))

    def read(self, name: str, key: str) -> torch.Tensor:
        return self.shards.read(self._slots[name], key)

    def step(self) -> float:
        return self.shards.step()

    def hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.shards.param_groups()]

    def clip_grad(self) -> float:
        return self.shards.clip_grad()

    def model_states(self) -> dict[str, Any]:
        return self.shards.model_states

    def close(self) -> None:
        self.shards.close()


class UniversalSource:
    """A universal-layout directory written by this module (the only kind it reads back)."""

    def __init__(self, udir: Path):
        self.dir = udir
        with TorchSaveFile(udir / "zero" / "optimizer_state.pt") as f:
            self._opt = f.obj
            step = f.value(self._opt["optimizer_state_dict"]["state"][0]["step"])
        self._step = float(step)
        with TorchSaveFile(udir / "mp_rank_00_model_states.pt") as f:
            shapes = f.obj["param_shapes"]
        self.groups = [[(str(n), tuple(int(x) for x in s)) for n, s in g.items()] for g in shapes]

    def read(self, name: str, key: str) -> torch.Tensor:
        with TorchSaveFile(self.dir / "zero" / name / f"{key}.pt") as f:
            rec = f.obj["param"] if isinstance(f.obj, dict) else f.obj
            return f.read(rec).view(rec.shape)

    def step(self) -> float:
        return self._step

    def hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self._opt["param_groups"]]

    def close(self) -> None:
        pass


class DCPSource:
    """A DCP checkpoint of the fsdp2 backend, read one whole tensor at a time."""

    def __init__(self, ckpt_dir: Path):
        from ckpt.formats.dcp.reader import DCPTensorReader

        self.reader = DCPTensorReader(ckpt_dir)
        self._lock = threading.Lock()
        keys = set(self.reader.byte_keys())
        self._groups: list[dict[str, Any]] = []
        i = 0
        while f"optim.param_groups.{i}.params" in keys:
            fields = sorted({k.split(".", 3)[3] for k in keys if k.startswith(f"optim.param_groups.{i}.")})
            self._groups.append({f: self._bytes(f"optim.param_groups.{i}.{f}") for f in fields})
            i += 1
        if not self._groups:
            raise CheckpointError(
                f"{ckpt_dir}: no optimizer state (optim.param_groups) in the DCP checkpoint; "
                "only full training checkpoints can be converted"
            )
        self.groups = [[(n, tuple(self.reader.meta(f"model.{n}").size)) for n in g["params"]] for g in self._groups]
        step_keys = [k for k in self.reader.tensor_keys() if k.startswith("optim.state.") and k.endswith(".step")]
        if not step_keys:
            raise CheckpointError(
                f"{ckpt_dir}: no optimizer step in the DCP checkpoint; only AdamW state can be converted"
            )
        step = self._read(step_keys[0])
        if step.numel() != 1 or step.is_complex() or not math.isfinite(step.item()) or step.item() < 0:
            raise CheckpointError(
                f"{ckpt_dir / '.metadata'}: {step_keys[0]} is not one finite number of at least 0 "
                f"({step.dtype} {list(step.shape)}); the checkpoint is corrupted or crafted, pick "
                "another step"
            )
        self._step = float(step.item())

    def untracked(self) -> list[str]:
        """Model tensors without optimizer state: in FSDP2's state dict, the tied names of a tied pair."""
        names = {n for g in self.groups for n, _ in g}
        return sorted(k[6:] for k in self.reader.tensor_keys() if k.startswith("model.") and k[6:] not in names)

    def tied(self, tied: dict[str, str]) -> dict[str, str]:
        """The tied names this checkpoint holds beside their sources (``tied``: the model's tied pairs), each
        checked to hold its source's values; any other model tensor without optimizer state is refused."""
        out = {}
        for name in self.untracked():
            source = tied.get(name)
            if source is None:
                raise CheckpointError(
                    f"{self.reader.dir}: model tensor {name} has no optimizer state and is tied to no "
                    "parameter (hf_model.tied); only checkpoints whose every parameter is trained "
                    "can be converted"
                )
            if not torch.equal(self._read(f"model.{name}"), self._read(f"model.{source}")):
                raise CheckpointError(
                    f"{self.reader.dir}: {name} is tied to {source} but holds other values; the "
                    "checkpoint does not match its run_spec.model (tie_word_embeddings)"
                )
            out[name] = source
        return out

    def _bytes(self, key: str) -> Any:
        with self._lock:
            return self.reader.read_bytes_value(key)

    def _read(self, key: str) -> torch.Tensor:
        with self._lock:  # DCPTensorReader caches open files in a dict; keep it single-threaded
            return self.reader.read(key)

    def read(self, name: str, key: str) -> torch.Tensor:
        if key == "fp32":
            return self._read(f"model.{name}").float()
        try:
            return self._read(f"optim.state.{name}.{key}")
        except CheckpointError:
            raise CheckpointError(
                f"{self.reader.dir}: no {key} for {name}; only AdamW state (exp_avg, exp_avg_sq) can be converted"
            ) from None

    def step(self) -> float:
        return self._step

    def hparams(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self._groups]

    def close(self) -> None:
        self.reader.close()


def open_source(ckpt_dir: Path, manifest: CheckpointManifest) -> ZeroSource | UniversalSource:
    """The tensors of a deepspeed-format checkpoint: its ZeRO partitions, or its universal/ when that is all it has."""
    if read_state(ckpt_dir)["layout"] == "zero":
        return ZeroSource(ckpt_dir, manifest)
    return UniversalSource(committed_universal(ckpt_dir))


class FingerprintSums:
    """Per-tensor float64 sums of squares gathered from tensors as they stream through (thread-safe)."""

    def __init__(self) -> None:
        self.model: dict[str, float] = {}
        self.optim: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, key: str, t: torch.Tensor) -> None:
        # the trainers' blocked float64 sum (no float64 copy of a whole embedding); a tensor gathered from
        # partitions is summed in another grouping than a rank's shard (rounding, ~1e-13 relative), so
        # converted checkpoints are always compared within the cross-world tolerance.
        sq = float(fp.local_sum_squares([(name, t)])[1][0])
        with self._lock:
            if key == "fp32":
                self.model[name] = sq
            else:
                self.optim[f"{name}.{key}"] = sq

    def fingerprint(self, step: float) -> Fingerprint:
        return fp.make_fingerprint(self.model, self.optim, step)


def check_fingerprint(src: Path, saved: Fingerprint, now: Fingerprint, *, model_only: bool = False) -> None:
    if model_only:
        saved = saved.model_copy(update={"optim": {}, "optim_step": now.optim_step})
    fp.require_match(src, saved, now, exact=False, converted=True)


def tied_of(manifest: CheckpointManifest, names: set[str]) -> dict[str, str]:
    """Tied name -> the name it is tied to, for the tied pairs whose source is among ``names`` (the parameters
    a checkpoint holds optimizer state for) and whose tied name is not. FSDP2's state dict holds both names of
    a tied pair (lm_head.weight and model.embed_tokens.weight), its optimizer state and DeepSpeed's checkpoints
    only the source: a conversion adds or drops the tied names. From the model's record (hf_model.tied)."""
    tied = manifest.hf_model.tied if manifest.hf_model is not None else {}
    return {t: s for t, s in tied.items() if s in names and t not in names}


def with_tied(saved: Fingerprint, tied: dict[str, str]) -> Fingerprint:
    """``saved`` with each tied name's model norm equal to its source's (both names are one parameter)."""
    model = {**saved.model, **{t: saved.model[s] for t, s in tied.items() if s in saved.model}}
    return saved.model_copy(update={"model": model})


def without_tied(saved: Fingerprint, tied: dict[str, str]) -> Fingerprint:
    return saved.model_copy(update={"model": {k: v for k, v in saved.model.items() if k not in tied}})


def inventory(
    groups: list[list[tuple[str, tuple[int, ...]]]], *, model_only: bool = False, tied: dict[str, str] | None = None
) -> list[TensorEntry]:
    out = [TensorEntry(name=f"model.{n}", shape=list(s), dtype="float32") for g in groups for n, s in g]
    shapes = {n: s for g in groups for n, s in g}
    out += [TensorEntry(name=f"model.{t}", shape=list(shapes[s]), dtype="float32") for t, s in (tied or {}).items()]
    if not model_only:
        out += [
            TensorEntry(name=f"optim.state.{n}.{m}", shape=list(s), dtype="float32")
            for g in groups
            for n, s in g
            for m in MOMENTS
        ]
    return out


def check_target(out_dir: Path) -> None:
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; nothing was overwritten, choose another output or remove it")
    if not out_dir.parent.is_dir():
        out_dir.parent.mkdir(parents=True, exist_ok=True)


def quick_valid(ckpt_dir: Path) -> CheckpointManifest:
    """The manifest, read once and quick-validated (CheckpointRetired when a writer retired the checkpoint)."""
    return checked_manifest(ckpt_dir)


@contextmanager
def partial_dir(final: Path) -> Iterator[Path]:
    """A fresh ``<final>.partial-<pid>`` sibling, removed unless the caller renamed it to ``final``."""
    tmp = final.with_name(f"{final.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def commit_dir(tmp: Path, final: Path, manifest: CheckpointManifest) -> bool:
    """Write the manifest, rename ``tmp`` to ``final``, fsync the parent. False if ``final`` appeared meanwhile."""
    write_manifest(tmp, manifest)
    fsync_dir(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        if final.is_dir():  # another process committed the same conversion first: keep theirs
            return False
        raise
    fsync_dir(final.parent)
    return True


def ds_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "0.16.0"


def committed_universal(ckpt_dir: Path) -> Path:
    udir = ckpt_dir / UNIVERSAL_DIR
    report = validate(udir)
    if not report.valid:
        raise CheckpointError(report.errors[0])
    return udir
