"""Conversions of DeepSpeed ZeRO checkpoints: to any world size, to DCP (FSDP2), and back from DCP.

    from ckpt.formats.deepspeed_convert import ensure_universal, to_dcp, from_dcp
    ensure_universal("runs/ds/checkpoints/step-00000020")            # -> step-00000020/universal/
    to_dcp("runs/ds/checkpoints/step-00000020", "runs/fsdp/checkpoints/step-00000020")
    to_dcp(ckpt, tmp / "step-00000020", model_only=True)              # what export of a ZeRO checkpoint uses
    from_dcp("runs/fsdp/checkpoints/step-00000020", "runs/ds/checkpoints/step-00000020", zero_stage=2)

(or ``shardkeeper reshard CKPT --world-size N`` / ``shardkeeper convert CKPT --to dcp|deepspeed OUT``).

All three stream one parameter at a time: the fp32 master weight and the two AdamW moments of a
parameter are assembled from the byte ranges the ZeRO partitions hold (``ckpt.formats.deepspeed``, no
unpickling of code), written, and dropped, so memory stays at a few parameters whatever the model
size. Each output is committed like a training checkpoint: written into a ``.partial`` sibling,
every file hashed while written and fsynced, ``manifest.json`` last, renamed, parent fsynced. Its
fingerprint (per-tensor L2 norms in float64) is computed from the tensors as they stream through and
must match the source's manifest within the cross-world tolerance, or nothing is committed.

The universal layout is DeepSpeed's own (``deepspeed.checkpoint.ds_to_universal``): per parameter
``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` plus ``zero/optimizer_state.pt`` and a model-states
file; engines at any world size and any ZeRO stage load it with ``checkpoint.load_universal``.
"""

from __future__ import annotations

import collections
import importlib.metadata
import io
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItem

from ckpt.state import MOMENTS, elastic_rng_state
from ckpt import fingerprint as fp, lineage
from ckpt.formats.deepspeed import (
    read_rng,
    STATE_FILE,
    STATE_KEYS,
    UNIVERSAL_DIR,
    HashingFile,
    TorchSaveFile,
    ZeroShards,
    read_state,
    rng_file,
    save_torch,
    write_hashed,
)
from schemas.errors import CheckpointError
from ckpt.fsutil import fsync_dir
from ckpt.layout import RunDir
from ckpt.manifest import read_manifest, write_manifest
from ckpt.validate import validate
from schemas import CheckpointManifest, ClusterTopology, FileEntry, Fingerprint, TensorEntry

log = logging.getLogger(__name__)

_IO_THREADS = 2


# ---------------------------------------------------------------------------------------- sources
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
        self.shards = ZeroShards(ckpt_dir, expect_world_size=manifest.topology.world_size,
                                 expect_stage=manifest.run_spec.deepspeed.zero_stage)
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
        from ckpt.formats.dcp import DCPTensorReader

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
            raise CheckpointError(f"{ckpt_dir}: no optimizer state (optim.param_groups) in the DCP checkpoint; "
                                  "only full training checkpoints can be converted")
        self.groups = [[(n, tuple(self.reader.meta(f"model.{n}").size)) for n in g["params"]] for g in self._groups]
        step_keys = [k for k in self.reader.tensor_keys() if k.startswith("optim.state.") and k.endswith(".step")]
        if not step_keys:
            raise CheckpointError(f"{ckpt_dir}: no optimizer step in the DCP checkpoint; only AdamW state can be converted")
        self._step = float(self._read(step_keys[0]).item())

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
            raise CheckpointError(f"{self.reader.dir}: no {key} for {name}; only AdamW state (exp_avg, exp_avg_sq) "
                                  "can be converted") from None

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
    return UniversalSource(_committed_universal(ckpt_dir))


# ---------------------------------------------------------------------------------------- helpers
class _FingerprintSums:
    """Per-tensor float64 sums of squares gathered from tensors as they stream through (thread-safe)."""

    def __init__(self) -> None:
        self.model: dict[str, float] = {}
        self.optim: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, name: str, key: str, t: torch.Tensor) -> None:
        # float64 accumulation over 4 Mi-element pieces: no float64 copy of a whole embedding. The grouping
        # differs from the trainers' (rounding, ~1e-13 relative), so converted checkpoints are always
        # compared within the cross-world tolerance.
        sq = sum(torch.linalg.vector_norm(c, dtype=torch.float64).square().item() for c in t.reshape(-1).split(1 << 22))
        with self._lock:
            if key == "fp32":
                self.model[name] = sq
            else:
                self.optim[f"{name}.{key}"] = sq

    def fingerprint(self, step: float) -> Fingerprint:
        return fp.make_fingerprint(self.model, self.optim, step)


def _check_fingerprint(src: Path, saved: Fingerprint, now: Fingerprint, *, model_only: bool = False) -> None:
    if model_only:
        saved = saved.model_copy(update={"optim": {}, "optim_step": now.optim_step})
    fp.require_match(src, saved, now, exact=False, converted=True)


def _inventory(groups: list[list[tuple[str, tuple[int, ...]]]], *, model_only: bool = False) -> list[TensorEntry]:
    out = [TensorEntry(name=f"model.{n}", shape=list(s), dtype="float32") for g in groups for n, s in g]
    if not model_only:
        out += [TensorEntry(name=f"optim.state.{n}.{m}", shape=list(s), dtype="float32")
                for g in groups for n, s in g for m in MOMENTS]
    return out


def _check_target(out_dir: Path) -> None:
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: already exists; nothing was overwritten, choose another output or remove it")
    if not out_dir.parent.is_dir():
        out_dir.parent.mkdir(parents=True, exist_ok=True)


def _quick_valid(ckpt_dir: Path) -> CheckpointManifest:
    report = validate(ckpt_dir)
    if not report.valid:
        raise CheckpointError(report.errors[0])
    return read_manifest(ckpt_dir)


@contextmanager
def _partial_dir(final: Path) -> Iterator[Path]:
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


def _commit_dir(tmp: Path, final: Path, manifest: CheckpointManifest) -> bool:
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


def _ds_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "0.16.0"


def _write_param_universal(src: Source, root: Path, name: str, step: torch.Tensor, sums: _FingerprintSums,
                           entries: list[FileEntry], lock: threading.Lock) -> None:
    pdir = root / "zero" / name
    pdir.mkdir(parents=True, exist_ok=True)
    mine: list[FileEntry] = []
    for key in STATE_KEYS:
        t = src.read(name, key)
        sums.add(name, key, t)
        # the dict form ds_to_universal writes; cat_dim only matters for tensor parallelism
        size, digest = save_torch(pdir / f"{key}.pt", {"param": t, "cat_dim": 0})
        del t  # one tensor per thread at a time
        mine.append(FileEntry(path=f"zero/{name}/{key}.pt", size=size, xxh3_128=digest))
    size, digest = save_torch(pdir / "step.pt", step.clone())
    mine.append(FileEntry(path=f"zero/{name}/step.pt", size=size, xxh3_128=digest))
    with lock:
        entries.extend(mine)


def _universal_model_states(template: dict[str, Any], groups: list[list[tuple[str, tuple[int, ...]]]],
                            manifest: CheckpointManifest) -> dict[str, Any]:
    """The model-states record DeepSpeed's universal loader reads (counters, shapes); no weights in it."""
    keep = {k: v for k, v in template.items() if k not in ("module", "optimizer") and not _has_stored(v)}
    keep.update({
        "module": {}, "optimizer": None, "buffer_names": keep.get("buffer_names", []),
        "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups],
        "global_steps": manifest.step, "global_samples": manifest.samples, "skipped_steps": keep.get("skipped_steps", 0),
        "dp_world_size": manifest.topology.world_size, "mp_world_size": 1,
        "ds_version": keep.get("ds_version", _ds_version()),
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.2},
    })
    for k in ("lr_scheduler", "data_sampler", "random_ltd", "frozen_param_shapes", "frozen_param_fragments"):
        keep.setdefault(k, None)
    keep.setdefault("shared_params", {})
    keep.setdefault("ds_config", {})
    return keep


def _has_stored(v: Any) -> bool:
    from ckpt.formats.deepspeed import Opaque, StoredTensor

    if isinstance(v, StoredTensor | Opaque):
        return True
    if isinstance(v, dict):
        return any(_has_stored(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(_has_stored(x) for x in v)
    return False


def write_universal(src: Source, root: Path, manifest: CheckpointManifest, *, model_states: dict[str, Any],
                    clip_grad: float, threads: int = _IO_THREADS) -> tuple[list[FileEntry], Fingerprint]:
    """Write ``src`` in DeepSpeed's universal layout under ``root``; return the files and the fingerprint."""
    step = torch.tensor(src.step(), dtype=torch.float32)
    sums = _FingerprintSums()
    entries: list[FileEntry] = []
    lock = threading.Lock()
    names = [n for g in src.groups for n, _ in g]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="universal") as pool:
        for f in [pool.submit(_write_param_universal, src, root, n, step, sums, entries, lock) for n in names]:
            f.result()
    groups = [{**h, "params": list(range(len(g)))} for h, g in zip(src.hparams(), src.groups)]
    optimizer_state = {
        "zero_stage": manifest.run_spec.deepspeed.zero_stage, "dynamic_loss_scale": False, "overflow": False,
        "clip_grad": clip_grad, "ds_version": model_states.get("ds_version", _ds_version()),
        "param_groups": groups,
        # ZeRO-3's universal loader reads the step and the group hyperparameters from here
        "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups},
    }
    for rel, obj in (("zero/optimizer_state.pt", optimizer_state),
                     ("mp_rank_00_model_states.pt", model_states),  # ZeRO-1/2 engines read this name
                     ("zero_pp_rank_0_mp_rank_00_model_states.pt", model_states)):  # ZeRO-3 engines this one
        size, digest = save_torch(root / rel, obj)
        entries.append(FileEntry(path=rel, size=size, xxh3_128=digest))
    return sorted(entries, key=lambda e: e.path), sums.fingerprint(src.step())


def _committed_universal(ckpt_dir: Path) -> Path:
    udir = ckpt_dir / UNIVERSAL_DIR
    report = validate(udir)
    if not report.valid:
        raise CheckpointError(report.errors[0])
    return udir


@dataclass(frozen=True)
class UniversalResult:
    path: Path
    seconds: float
    converted: bool  # False when a committed universal/ was already there (the conversion is cached)


def ensure_universal(ckpt_dir: str | os.PathLike[str], *, run_dir: RunDir | None = None,
                     to_world_size: int | None = None, threads: int = _IO_THREADS) -> UniversalResult:
    """Make a deepspeed checkpoint loadable at any world size: ``<ckpt>/universal/``, converted once and cached.

    Records a lineage "reshard" event in ``run_dir`` (or the checkpoint's own run) when it converts."""
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    manifest = _quick_valid(ckpt_dir)
    if manifest.format != "deepspeed":
        raise CheckpointError(f"{ckpt_dir}: a {manifest.format} checkpoint; only deepspeed checkpoints need a "
                              "universal conversion (DCP reshards at load time)")
    udir = ckpt_dir / UNIVERSAL_DIR
    if (udir / "manifest.json").exists():
        _committed_universal(ckpt_dir)
        return UniversalResult(udir, time.perf_counter() - t0, converted=False)
    for stale in ckpt_dir.glob(f"{UNIVERSAL_DIR}.partial-*"):  # a conversion that died: never loaded, removed
        shutil.rmtree(stale, ignore_errors=True)
    src = ZeroSource(ckpt_dir, manifest)
    try:
        with _partial_dir(udir) as tmp:
            template = _universal_model_states(src.model_states(), src.groups, manifest)
            files, fingerprint = write_universal(src, tmp, manifest, model_states=template,
                                                 clip_grad=src.clip_grad(), threads=threads)
            _check_fingerprint(ckpt_dir, manifest.fingerprint, fingerprint)
            out = manifest.model_copy(update={
                "reason": "converted", "created_at": lineage.now_iso(), "files": files, "parent": ckpt_dir.name,
                "fingerprint": fingerprint, "save_seconds": time.perf_counter() - t0, "async_save": False})
            committed = _commit_dir(tmp, udir, out)
    finally:
        src.close()
    seconds = time.perf_counter() - t0
    if committed:
        log.info("converted %s to the universal layout in %.2f s (%.1f MB)", ckpt_dir.name, seconds,
                 sum(f.size for f in files) / 1e6)
        _record_reshard(run_dir, ckpt_dir, manifest, udir, to_world_size, seconds)
    return UniversalResult(udir, seconds, converted=committed)


def _record_reshard(run_dir: RunDir | None, ckpt_dir: Path, manifest: CheckpointManifest, target: Path,
                    to_world_size: int | None, seconds: float) -> None:
    run = run_dir or RunDir.of_checkpoint(ckpt_dir)
    if run is None:
        return
    root = run.root
    lineage.record(root, "reshard", f"reshard:{ckpt_dir.name}:universal", parent=lineage.checkpoint_event_id(manifest.step),
                   step=manifest.step, uri=target.resolve().as_uri(), method="deepspeed-universal",
                   from_world_size=manifest.topology.world_size, to_world_size=to_world_size,
                   seconds=round(seconds, 3))


def recompute_fingerprint(ckpt_dir: str | os.PathLike[str], manifest: CheckpointManifest) -> Fingerprint:
    """Fingerprint of a deepspeed checkpoint's stored state, one parameter at a time (validate --deep).
    ``ckpt_dir`` is a step directory, or the ``universal/`` folder cached inside one."""
    ckpt_dir = Path(ckpt_dir)
    is_universal = not (ckpt_dir / STATE_FILE).exists() and (ckpt_dir / "zero" / "optimizer_state.pt").is_file()
    src = UniversalSource(ckpt_dir) if is_universal else open_source(ckpt_dir, manifest)
    try:
        sums = _FingerprintSums()
        for name, _ in (x for g in src.groups for x in g):
            for key in STATE_KEYS:
                sums.add(name, key, src.read(name, key))
        return sums.fingerprint(src.step())
    finally:
        src.close()


# ---------------------------------------------------------------------------------------- to DCP
class _StreamingSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose meta-tensor placeholders are produced only when DCP writes them.

    DCP's FileSystemWriter keeps a reference to every tensor of a file until the file is closed (for
    its safetensors mode), which would hold the whole checkpoint in memory. Its serial loader (used for
    CPU tensors and thread_count > 1) writes each tensor before resolving the next one of the same
    thread, so the previous tensor's storage is released when the next is produced."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self.produce = produce
        self._last = threading.local()

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        obj = self.lookup_object(write_item.index)
        if not (isinstance(obj, torch.Tensor) and obj.is_meta):
            return self.transform_object(write_item, obj)
        previous = getattr(self._last, "tensor", None)
        if previous is not None:
            previous.untyped_storage().resize_(0)
        self._last.tensor = self.produce(write_item.index.fqn)
        return self._last.tensor


class _HashingFileSystem(FileSystem):
    """DCP FileSystem whose write streams hash (xxh3-128) on the way through; fsync only when durable."""

    def __init__(self, durable: bool) -> None:
        super().__init__()
        self.durable = durable
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as s:
                yield s
            return
        stream = HashingFile(path, sync=self.durable)
        try:
            yield stream
        finally:
            stream.close()
            with self._lock:
                self.digests[Path(path).name] = (stream.size, stream.digest)


def _dcp_state(src: Source, manifest: CheckpointManifest, rng: torch.Tensor, model_only: bool
               ) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The nested state dict the fsdp2 Checkpointer saves, with meta placeholders for the big tensors."""
    lazy: dict[str, tuple[str, str]] = {}
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for g in src.groups:
        for name, shape in g:
            model[name] = torch.empty(shape, dtype=torch.float32, device="meta")
            lazy[f"model.{name}"] = (name, "fp32")
            if model_only:
                continue
            state[name] = {"step": torch.tensor(src.step(), dtype=torch.float32)}
            for m in MOMENTS:
                state[name][m] = torch.empty(shape, dtype=torch.float32, device="meta")
                lazy[f"optim.state.{name}.{m}"] = (name, m)
    sd: dict[str, Any] = {"model": model}
    if not model_only:
        groups = [{**h, "params": [n for n, _ in g]} for h, g in zip(src.hparams(), src.groups)]
        sd["optim"] = {"state": state, "param_groups": groups}
        sd["trainer"] = {k: torch.tensor(getattr(manifest, k), dtype=torch.int64) for k in ("step", "tokens", "samples")}
        sd["rng"] = {"rank0": {"cpu": rng}}
    return sd, lazy


def _rng_of(ckpt_dir: Path, manifest: CheckpointManifest) -> torch.Tensor:
    """Rank 0's CPU RNG state of the source, or a state seeded like an elastic resume when it has none."""
    path = ckpt_dir / rng_file(0)
    if path.is_file():
        return read_rng(path)["cpu"]
    return elastic_rng_state(manifest.run_spec.seed, manifest.step)


def to_dcp(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, model_only: bool = False,
           durable: bool = True, threads: int = _IO_THREADS) -> Path:
    """Convert a deepspeed checkpoint into a committed DCP checkpoint directory ``out_dir``.

    The result loads in the fsdp2 backend at any world size (it is a 1-rank DCP save of whole tensors)
    and holds model, AdamW state, counters and rank 0's RNG; with ``model_only`` just the fp32 model
    (what the export stage needs). ``durable=False`` skips the fsync of its files, for a temporary
    that is read back at once (export). Returns ``out_dir``."""
    from torch.distributed.checkpoint import save as dcp_save

    t0 = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = _quick_valid(ckpt_dir)
    if manifest.format != "deepspeed":
        raise CheckpointError(f"{ckpt_dir}: already a {manifest.format} checkpoint; nothing to convert")
    _check_target(out_dir)
    src = open_source(ckpt_dir, manifest)
    sums = _FingerprintSums()
    try:
        sd, lazy = _dcp_state(src, manifest, _rng_of(ckpt_dir, manifest), model_only)

        def produce(fqn: str) -> torch.Tensor:
            name, key = lazy[fqn]
            t = src.read(name, key)
            sums.add(name, key, t)
            return t

        with _partial_dir(out_dir) as tmp:
            writer = FileSystemWriter(tmp, sync_files=durable, thread_count=max(2, threads), overwrite=False)
            writer.fs = fs = _HashingFileSystem(durable)  # max(2, ...): see _StreamingSavePlanner
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process.*")
                dcp_save(sd, storage_writer=writer, planner=_StreamingSavePlanner(produce), no_dist=True)
            fingerprint = sums.fingerprint(0.0 if model_only else src.step())
            _check_fingerprint(ckpt_dir, manifest.fingerprint, fingerprint, model_only=model_only)
            files = _dcp_files(tmp, fs.digests)
            out = manifest.model_copy(update={
                "format": "dcp", "reason": "converted", "created_at": lineage.now_iso(), "files": files,
                "tensors": _inventory(src.groups, model_only=model_only), "parent": ckpt_dir.name,
                "topology": _one_rank(manifest.topology), "fingerprint": fingerprint,
                "run_spec": manifest.run_spec.model_copy(update={"backend": "fsdp2"}),
                "save_seconds": time.perf_counter() - t0, "async_save": False})
            if not _commit_dir(tmp, out_dir, out):
                raise CheckpointError(f"{out_dir}: appeared while converting; nothing was overwritten")
    finally:
        src.close()
    log.info("converted %s to DCP %s in %.2f s", ckpt_dir, out_dir, time.perf_counter() - t0)
    return out_dir


def _dcp_files(tmp: Path, digests: dict[str, tuple[int, str]]) -> list[FileEntry]:
    from ckpt.hashing import hash_files

    entries = [FileEntry(path=".metadata" if n == ".metadata.tmp" else n, size=s, xxh3_128=d, rank=0)
               for n, (s, d) in sorted(digests.items())]
    if not any(e.path == ".metadata" for e in entries):
        size, digest = hash_files([tmp / ".metadata"])[tmp / ".metadata"]
        entries.append(FileEntry(path=".metadata", size=size, xxh3_128=digest, rank=0))
    return sorted(entries, key=lambda e: e.path)


def _one_rank(topo: ClusterTopology) -> ClusterTopology:
    return topo.model_copy(update={"nodes": 1, "procs_per_node": 1})


# ---------------------------------------------------------------------------------------- from DCP
def from_dcp(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, zero_stage: int | None = None,
             threads: int = _IO_THREADS) -> Path:
    """Convert a DCP (fsdp2) checkpoint into a committed deepspeed checkpoint directory ``out_dir``.

    The result holds the universal layout only (``out_dir/universal/``), which DeepSpeed engines load at
    any world size and ZeRO stage; the first save of the continued run writes native ZeRO shards again."""
    t0 = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = _quick_valid(ckpt_dir)
    if manifest.format != "dcp":
        raise CheckpointError(f"{ckpt_dir}: already a {manifest.format} checkpoint; nothing to convert")
    _check_target(out_dir)
    stage = zero_stage or manifest.run_spec.deepspeed.zero_stage
    spec = manifest.run_spec.model_copy(update={"backend": "deepspeed", "deepspeed": manifest.run_spec.deepspeed.model_copy(
        update={"zero_stage": stage})})
    target = manifest.model_copy(update={"run_spec": spec, "format": "deepspeed", "topology": _one_rank(manifest.topology)})
    src = DCPSource(ckpt_dir)
    try:
        with _partial_dir(out_dir) as tmp:
            (tmp / UNIVERSAL_DIR).mkdir()
            template = _universal_model_states({}, src.groups, target)
            ufiles, fingerprint = write_universal(src, tmp / UNIVERSAL_DIR, target, model_states=template,
                                                  clip_grad=spec.optim.grad_clip or 0.0, threads=threads)
            _check_fingerprint(ckpt_dir, manifest.fingerprint, fingerprint)
            common = {"reason": "converted", "created_at": lineage.now_iso(), "parent": ckpt_dir.name,
                      "tensors": _inventory(src.groups), "fingerprint": fingerprint, "async_save": False}
            write_manifest(tmp / UNIVERSAL_DIR, target.model_copy(update={**common, "files": ufiles,
                                                                           "save_seconds": time.perf_counter() - t0}))
            files = _write_state_files(tmp, ckpt_dir, manifest, stage)
            out = target.model_copy(update={**common, "files": files, "save_seconds": time.perf_counter() - t0})
            if not _commit_dir(tmp, out_dir, out):
                raise CheckpointError(f"{out_dir}: appeared while converting; nothing was overwritten")
    finally:
        src.close()
    log.info("converted %s to a deepspeed (universal) checkpoint %s in %.2f s", ckpt_dir, out_dir, time.perf_counter() - t0)
    return out_dir


def _write_state_files(tmp: Path, src_dir: Path, manifest: CheckpointManifest, stage: int) -> list[FileEntry]:
    from ckpt.formats.dcp import DCPTensorReader

    with DCPTensorReader(src_dir) as reader:
        rng = reader.read("rng.rank0.cpu") if "rng.rank0.cpu" in reader.tensor_keys() else None
    if rng is None:
        rng = elastic_rng_state(manifest.run_spec.seed, manifest.step)
    state = {"step": manifest.step, "tokens": manifest.tokens, "samples": manifest.samples,
             "schedule_last_step": manifest.step - 1, "zero_stage": stage, "world_size": 1, "layout": "universal"}
    text = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    entries = []
    for name, fill in ((STATE_FILE, lambda f: f.write(text)), (rng_file(0), lambda f: torch.save({"cpu": rng}, f))):
        size, digest = write_hashed(tmp / name, fill)
        entries.append(FileEntry(path=name, size=size, xxh3_128=digest, rank=0))
    return entries


__all__ = ["DCPSource", "Source", "UniversalResult", "UniversalSource", "ZeroSource", "ensure_universal", "from_dcp",
           "open_source", "recompute_fingerprint", "to_dcp", "write_universal"]
