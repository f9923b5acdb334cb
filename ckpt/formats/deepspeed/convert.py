"""Conversions of DeepSpeed ZeRO checkpoints: to any world size, to DCP (FSDP2), and back from DCP.

    from ckpt.formats.deepspeed.convert import ensure_universal, to_dcp, from_dcp
    ensure_universal("runs/ds/checkpoints/step-00000020")            # -> step-00000020/universal/
    to_dcp("runs/ds/checkpoints/step-00000020", "runs/fsdp/checkpoints/step-00000020")
    to_dcp(ckpt, tmp / "step-00000020", model_only=True)              # what export of a ZeRO checkpoint uses
    from_dcp("runs/fsdp/checkpoints/step-00000020", "runs/ds/checkpoints/step-00000020", zero_stage=2)

(or ``shardkeeper reshard CKPT --world-size N`` / ``shardkeeper convert CKPT --to dcp|deepspeed OUT``).

All three stream one parameter at a time: the fp32 master weight and the two AdamW moments of a
parameter are assembled from the byte ranges the ZeRO partitions hold (``ckpt.formats.deepspeed.zero``, no
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

import ctypes
import functools
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from ckpt.commit import lineage
from ckpt.commit.manifest import write_manifest
from ckpt.commit.state import MOMENTS, elastic_rng_state
from ckpt.formats.dcp.direct_io import HashingDirectWriter
from ckpt.formats.deepspeed.zero import STATE_FILE, UNIVERSAL_DIR, read_rng, rng_file, write_hashed
from schemas import CheckpointManifest, ClusterTopology, FileEntry
from schemas.errors import CheckpointError

log = logging.getLogger(__name__)
from ckpt.formats.deepspeed.sources import (
    IO_THREADS,
    DCPSource,
    FingerprintSums,
    Source,
    check_fingerprint,
    check_target,
    commit_dir,
    inventory,
    open_source,
    partial_dir,
    quick_valid,
    tied_of,
    with_tied,
    without_tied,
)
from ckpt.formats.deepspeed.universal import universal_model_states, write_universal


class StreamingSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose meta-tensor placeholders are produced only when DCP writes them.

    DCP's FileSystemWriter keeps a reference to every tensor of a file until the file is closed (for
    its safetensors mode), which would hold the whole checkpoint in memory. Its serial loader (used for
    CPU tensors and thread_count > 1) writes each tensor before resolving the next one of the same
    thread, so the previous tensor's storage is released when the next is produced, and the heap
    pages it leaves free are handed back to the OS (``release_free_heap``)."""

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
            release_free_heap()
        self._last.tensor = self.produce(write_item.index.fqn)
        return self._last.tensor


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on musl and macOS
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the free pages of malloc's heaps to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Why: once glibc's dynamic mmap threshold has grown past a freed tensor (up to 32 MiB), tensors of
    a few MiB come from its arenas instead of their own mappings. Freed in the two writer threads, in
    an interleaved order, they fragment the arenas, and the free pages stay resident: a 271M-parameter
    conversion peaked at 1.1-1.9 GB resident instead of the ~0.6 GB its few live tensors need."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def dcp_state(
    src: Source, manifest: CheckpointManifest, rng: torch.Tensor, model_only: bool, tied: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, tuple[str, str, str]]]:
    """The nested state dict the fsdp2 Checkpointer saves, with meta placeholders for the big tensors.

    ``lazy``: DCP key -> (source parameter, key, name in the fingerprint). A tied name (``tied``: tied ->
    source) is a model entry of its own, as in FSDP2's state dict, holding the source's values; the
    optimizer state keeps the source's name only, as FSDP2's does."""
    lazy: dict[str, tuple[str, str, str]] = {}
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for g in src.groups:
        for name, shape in g:
            shapes[name] = shape
            model[name] = torch.empty(shape, dtype=torch.float32, device="meta")
            lazy[f"model.{name}"] = (name, "fp32", name)
            if model_only:
                continue
            state[name] = {"step": torch.tensor(src.step(), dtype=torch.float32)}
            for m in MOMENTS:
                state[name][m] = torch.empty(shape, dtype=torch.float32, device="meta")
                lazy[f"optim.state.{name}.{m}"] = (name, m, name)
    for name, source in (tied or {}).items():
        model[name] = torch.empty(shapes[source], dtype=torch.float32, device="meta")
        lazy[f"model.{name}"] = (source, "fp32", name)
    sd: dict[str, Any] = {"model": model}
    if not model_only:
        groups = [{**h, "params": [n for n, _ in g]} for h, g in zip(src.hparams(), src.groups)]
        sd["optim"] = {"state": state, "param_groups": groups}
        sd["trainer"] = {
            k: torch.tensor(getattr(manifest, k), dtype=torch.int64) for k in ("step", "tokens", "samples")
        }
        sd["rng"] = {"rank0": {"cpu": rng}}
    return sd, lazy


def producer(
    src: Source, lazy: dict[str, tuple[str, str, str]], sums: FingerprintSums
) -> Callable[[str], torch.Tensor]:
    """What a StreamingSavePlanner writes for a DCP key of ``dcp_state``'s ``lazy`` map: the tensor read from
    ``src``, summed into the fingerprint under its name as it streams through."""

    def produce(fqn: str) -> torch.Tensor:
        name, key, as_name = lazy[fqn]
        t = src.read(name, key)
        sums.add(as_name, key, t)
        return t

    return produce


def rng_of(ckpt_dir: Path, manifest: CheckpointManifest) -> torch.Tensor:
    """Rank 0's CPU RNG state of the source, or a state seeded like an elastic resume when it has none."""
    path = ckpt_dir / rng_file(0)
    if path.is_file():
        return read_rng(path)["cpu"]
    return elastic_rng_state(manifest.run_spec.seed, manifest.step)


def to_dcp(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_only: bool = False,
    threads: int = IO_THREADS,
) -> Path:
    """Convert a deepspeed checkpoint into a committed DCP checkpoint directory ``out_dir``.

    The result loads in the fsdp2 backend at any world size (it is a 1-rank DCP save of whole tensors)
    and holds model, AdamW state, counters and rank 0's RNG; with ``model_only`` just the fp32 model
    (what the export stage needs). Written by the trainer's hashing writer (``ckpt.formats.dcp.direct_io``), which
    also proves every planned item written: a write that fails in any of DCP's writer threads (a full disk) is
    one OSError naming its file, and nothing is committed. Returns ``out_dir``."""
    from ckpt.formats.dcp.reader import save_in_process

    t0 = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = quick_valid(ckpt_dir)
    if manifest.format != "deepspeed":
        raise CheckpointError(f"{ckpt_dir}: already a {manifest.format} checkpoint; nothing to convert")
    check_target(out_dir)
    src = open_source(ckpt_dir, manifest)
    sums = FingerprintSums()
    try:
        tied = tied_of(manifest, {n for g in src.groups for n, _ in g})
        sd, lazy = dcp_state(src, manifest, rng_of(ckpt_dir, manifest), model_only, tied)

        produce = producer(src, lazy, sums)
        with partial_dir(out_dir) as tmp:
            # max(2, ...): see StreamingSavePlanner
            writer = HashingDirectWriter(tmp, sync_files=True, thread_count=max(2, threads), overwrite=False)
            save_in_process(sd, writer, StreamingSavePlanner(produce))  # one error, also for a full disk
            fingerprint = sums.fingerprint(0.0 if model_only else src.step())
            check_fingerprint(ckpt_dir, with_tied(manifest.fingerprint, tied), fingerprint, model_only=model_only)
            files = dcp_files(tmp, writer.digests)
            out = manifest.model_copy(
                update={
                    "format": "dcp",
                    "reason": "converted",
                    "created_at": lineage.now_iso(),
                    "files": files,
                    "tensors": inventory(src.groups, model_only=model_only, tied=tied),
                    "parent": ckpt_dir.name,
                    "topology": one_rank(manifest.topology),
                    "fingerprint": fingerprint,
                    "source_world_size": source_world_size(manifest),
                    "run_spec": manifest.run_spec.model_copy(update={"backend": "fsdp2"}),
                    "save_seconds": time.perf_counter() - t0,
                    "async_save": False,
                }
            )
            if not commit_dir(tmp, out_dir, out):
                raise CheckpointError(f"{out_dir}: appeared while converting; nothing was overwritten")
    finally:
        src.close()
    log.info("converted %s to DCP %s in %.2f s", ckpt_dir, out_dir, time.perf_counter() - t0)
    return out_dir


def dcp_files(tmp: Path, digests: dict[str, tuple[int, str]]) -> list[FileEntry]:
    from ckpt.commit.hashing import hash_files

    entries = [
        FileEntry(path=".metadata" if n == ".metadata.tmp" else n, size=s, xxh3_128=d, rank=0)
        for n, (s, d) in sorted(digests.items())
    ]
    if not any(e.path == ".metadata" for e in entries):
        size, digest = hash_files([tmp / ".metadata"])[tmp / ".metadata"]
        entries.append(FileEntry(path=".metadata", size=size, xxh3_128=digest, rank=0))
    return sorted(entries, key=lambda e: e.path)


def source_world_size(manifest: CheckpointManifest) -> int:
    """The world size the training state was saved at, carried through conversions of conversions."""
    return manifest.source_world_size or manifest.topology.world_size


def one_rank(topo: ClusterTopology) -> ClusterTopology:
    return topo.model_copy(update={"nodes": 1, "procs_per_node": 1})


def from_dcp(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    zero_stage: int | None = None,
    threads: int = IO_THREADS,
) -> Path:
    """Convert a DCP (fsdp2) checkpoint into a committed deepspeed checkpoint directory ``out_dir``.

    The result holds the universal layout only (``out_dir/universal/``), which DeepSpeed engines load at
    any world size and ZeRO stage; the first save of the continued run writes native ZeRO shards again."""
    t0 = time.perf_counter()
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = quick_valid(ckpt_dir)
    if manifest.format != "dcp":
        raise CheckpointError(f"{ckpt_dir}: already a {manifest.format} checkpoint; nothing to convert")
    check_target(out_dir)
    stage = zero_stage or manifest.run_spec.deepspeed.zero_stage
    spec = manifest.run_spec.model_copy(
        update={
            "backend": "deepspeed",
            "deepspeed": manifest.run_spec.deepspeed.model_copy(update={"zero_stage": stage}),
        }
    )
    target = manifest.model_copy(
        update={"run_spec": spec, "format": "deepspeed", "topology": one_rank(manifest.topology)}
    )
    src = DCPSource(ckpt_dir)
    try:
        # FSDP2 saves a tied pair under both names, DeepSpeed under the source's only: the tied copies stay behind
        tied = src.tied(tied_of(manifest, {n for g in src.groups for n, _ in g}))
        with partial_dir(out_dir) as tmp:
            (tmp / UNIVERSAL_DIR).mkdir()
            template = universal_model_states({}, src.groups, target)
            ufiles, fingerprint = write_universal(
                src,
                tmp / UNIVERSAL_DIR,
                target,
                model_states=template,
                clip_grad=spec.optim.grad_clip or 0.0,
                threads=threads,
            )
            check_fingerprint(ckpt_dir, without_tied(manifest.fingerprint, tied), fingerprint)
            common = {
                "reason": "converted",
                "created_at": lineage.now_iso(),
                "parent": ckpt_dir.name,
                "source_world_size": source_world_size(manifest),
                "tensors": inventory(src.groups),
                "fingerprint": fingerprint,
                "async_save": False,
            }
            write_manifest(
                tmp / UNIVERSAL_DIR,
                target.model_copy(update={**common, "files": ufiles, "save_seconds": time.perf_counter() - t0}),
            )
            files = write_state_files(tmp, ckpt_dir, manifest, stage)
            out = target.model_copy(update={**common, "files": files, "save_seconds": time.perf_counter() - t0})
            if not commit_dir(tmp, out_dir, out):
                raise CheckpointError(f"{out_dir}: appeared while converting; nothing was overwritten")
    finally:
        src.close()
    log.info(
        "converted %s to a deepspeed (universal) checkpoint %s in %.2f s", ckpt_dir, out_dir, time.perf_counter() - t0
    )
    return out_dir


def write_state_files(tmp: Path, src_dir: Path, manifest: CheckpointManifest, stage: int) -> list[FileEntry]:
    from ckpt.formats.dcp.reader import DCPTensorReader

    with DCPTensorReader(src_dir) as reader:
        rng = reader.read("rng.rank0.cpu") if "rng.rank0.cpu" in reader.tensor_keys() else None
    if rng is None:
        rng = elastic_rng_state(manifest.run_spec.seed, manifest.step)
    state = {
        "step": manifest.step,
        "tokens": manifest.tokens,
        "samples": manifest.samples,
        "schedule_last_step": manifest.step - 1,
        "zero_stage": stage,
        "world_size": 1,
        "layout": "universal",
    }
    text = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    entries = []
    for name, fill in ((STATE_FILE, lambda f: f.write(text)), (rng_file(0), lambda f: torch.save({"cpu": rng}, f))):
        size, digest = write_hashed(tmp / name, fill)
        entries.append(FileEntry(path=name, size=size, xxh3_128=digest, rank=0))
    return entries


# what callers of the conversions reach through this module
from ckpt.formats.deepspeed.sources import UniversalSource, ZeroSource  # noqa: E402
from ckpt.formats.deepspeed.universal import UniversalResult, ensure_universal, recompute_fingerprint  # noqa: E402

__all__ = [
    "DCPSource",
    "Source",
    "UniversalResult",
    "UniversalSource",
    "ZeroSource",
    "ensure_universal",
    "from_dcp",
    "open_source",
    "recompute_fingerprint",
    "to_dcp",
    "write_universal",
]
