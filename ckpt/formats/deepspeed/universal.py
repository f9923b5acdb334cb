"""DeepSpeed's universal layout (``deepspeed.checkpoint.ds_to_universal``'s): written once per checkpoint
(``ensure_universal``), cached beside it and recorded in lineage, loadable at any world size and ZeRO stage."""

from __future__ import annotations

import collections
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir
from ckpt.formats.deepspeed.zero import STATE_FILE, STATE_KEYS, UNIVERSAL_DIR, save_torch
from schemas import CheckpointManifest, FileEntry, Fingerprint
from schemas.errors import CheckpointError

log = logging.getLogger(__name__)
from ckpt.formats.deepspeed.sources import (
    IO_THREADS,
    FingerprintSums,
    Source,
    UniversalSource,
    ZeroSource,
    check_fingerprint,
    commit_dir,
    committed_universal,
    ds_version,
    open_source,
    partial_dir,
    quick_valid,
)


def write_param_universal(
    src: Source,
    root: Path,
    name: str,
    step: torch.Tensor,
    sums: FingerprintSums,
    entries: list[FileEntry],
    lock: threading.Lock,
) -> None:
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


def universal_model_states(
    template: dict[str, Any], groups: list[list[tuple[str, tuple[int, ...]]]], manifest: CheckpointManifest
) -> dict[str, Any]:
    """The model-states record DeepSpeed's universal loader reads (counters, shapes); no weights in it."""
    keep = {k: v for k, v in template.items() if k not in ("module", "optimizer") and not has_stored(v)}
    keep.update(
        {
            "module": {},
            "optimizer": None,
            "buffer_names": keep.get("buffer_names", []),
            "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups],
            "global_steps": manifest.step,
            "global_samples": manifest.samples,
            "skipped_steps": keep.get("skipped_steps", 0),
            "dp_world_size": manifest.topology.world_size,
            "mp_world_size": 1,
            "ds_version": keep.get("ds_version", ds_version()),
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.2},
        }
    )
    for k in ("lr_scheduler", "data_sampler", "random_ltd", "frozen_param_shapes", "frozen_param_fragments"):
        keep.setdefault(k, None)
    keep.setdefault("shared_params", {})
    keep.setdefault("ds_config", {})
    return keep


def has_stored(v: Any) -> bool:
    from ckpt.formats.deepspeed.zero import Opaque, StoredTensor

    if isinstance(v, StoredTensor | Opaque):
        return True
    if isinstance(v, dict):
        return any(has_stored(x) for x in v.values())
    if isinstance(v, list | tuple):
        return any(has_stored(x) for x in v)
    return False


def write_universal(
    src: Source,
    root: Path,
    manifest: CheckpointManifest,
    *,
    model_states: dict[str, Any],
    clip_grad: float,
    threads: int = IO_THREADS,
) -> tuple[list[FileEntry], Fingerprint]:
    """Write ``src`` in DeepSpeed's universal layout under ``root``; return the files and the fingerprint."""
    step = torch.tensor(src.step(), dtype=torch.float32)
    sums = FingerprintSums()
    entries: list[FileEntry] = []
    lock = threading.Lock()
    names = [n for g in src.groups for n, _ in g]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="universal") as pool:
        for f in [pool.submit(write_param_universal, src, root, n, step, sums, entries, lock) for n in names]:
            f.result()
    groups = [{**h, "params": list(range(len(g)))} for h, g in zip(src.hparams(), src.groups)]
    optimizer_state = {
        "zero_stage": manifest.run_spec.deepspeed.zero_stage,
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": clip_grad,
        "ds_version": model_states.get("ds_version", ds_version()),
        "param_groups": groups,
        # ZeRO-3's universal loader reads the step and the group hyperparameters from here
        "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups},
    }
    for rel, obj in (
        ("zero/optimizer_state.pt", optimizer_state),
        ("mp_rank_00_model_states.pt", model_states),  # ZeRO-1/2 engines read this name
        ("zero_pp_rank_0_mp_rank_00_model_states.pt", model_states),
    ):  # ZeRO-3 engines this one
        size, digest = save_torch(root / rel, obj)
        entries.append(FileEntry(path=rel, size=size, xxh3_128=digest))
    return sorted(entries, key=lambda e: e.path), sums.fingerprint(src.step())


@dataclass(frozen=True)
class UniversalResult:
    path: Path
    seconds: float
    converted: bool  # False when a committed universal/ was already there (the conversion is cached)


def ensure_universal(
    ckpt_dir: str | os.PathLike[str],
    *,
    run_dir: RunDir | None = None,
    to_world_size: int | None = None,
    threads: int = IO_THREADS,
) -> UniversalResult:
    """Make a deepspeed checkpoint loadable at any world size: ``<ckpt>/universal/``, converted once and cached.

    Records a lineage "reshard" event in ``run_dir`` (or the checkpoint's own run) when it converts."""
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    manifest = quick_valid(ckpt_dir)
    if manifest.format != "deepspeed":
        raise CheckpointError(
            f"{ckpt_dir}: a {manifest.format} checkpoint; only deepspeed checkpoints need a "
            "universal conversion (DCP reshards at load time)"
        )
    udir = ckpt_dir / UNIVERSAL_DIR
    if (udir / "manifest.json").exists():
        committed_universal(ckpt_dir)
        return UniversalResult(udir, time.perf_counter() - t0, converted=False)
    for stale in ckpt_dir.glob(f"{UNIVERSAL_DIR}.partial-*"):  # a conversion that died: never loaded, removed
        shutil.rmtree(stale, ignore_errors=True)
    src = ZeroSource(ckpt_dir, manifest)
    try:
        with partial_dir(udir) as tmp:
            template = universal_model_states(src.model_states(), src.groups, manifest)
            files, fingerprint = write_universal(
                src, tmp, manifest, model_states=template, clip_grad=src.clip_grad(), threads=threads
            )
            check_fingerprint(ckpt_dir, manifest.fingerprint, fingerprint)
            out = manifest.model_copy(
                update={
                    "reason": "converted",
                    "created_at": lineage.now_iso(),
                    "files": files,
                    "parent": ckpt_dir.name,
                    "fingerprint": fingerprint,
                    "save_seconds": time.perf_counter() - t0,
                    "async_save": False,
                }
            )
            committed = commit_dir(tmp, udir, out)
    finally:
        src.close()
    seconds = time.perf_counter() - t0
    if committed:
        log.info(
            "converted %s to the universal layout in %.2f s (%.1f MB)",
            ckpt_dir.name,
            seconds,
            sum(f.size for f in files) / 1e6,
        )
        record_reshard(run_dir, ckpt_dir, manifest, udir, to_world_size, seconds)
    return UniversalResult(udir, seconds, converted=committed)


def record_reshard(
    run_dir: RunDir | None,
    ckpt_dir: Path,
    manifest: CheckpointManifest,
    target: Path,
    to_world_size: int | None,
    seconds: float,
) -> None:
    run = run_dir or RunDir.of_checkpoint(ckpt_dir)
    if run is None:
        return
    root = run.root
    lineage.record(
        root,
        "reshard",
        f"reshard:{ckpt_dir.name}:universal",
        parent=lineage.checkpoint_event_id(manifest.step),
        step=manifest.step,
        uri=target.resolve().as_uri(),
        method="deepspeed-universal",
        from_world_size=manifest.topology.world_size,
        to_world_size=to_world_size,
        seconds=round(seconds, 3),
    )


def recompute_fingerprint(ckpt_dir: str | os.PathLike[str], manifest: CheckpointManifest) -> Fingerprint:
    """Fingerprint of a deepspeed checkpoint's stored state, one parameter at a time (validate --deep).
    ``ckpt_dir`` is a step directory, or the ``universal/`` folder cached inside one."""
    ckpt_dir = Path(ckpt_dir)
    is_universal = not (ckpt_dir / STATE_FILE).exists() and (ckpt_dir / "zero" / "optimizer_state.pt").is_file()
    src = UniversalSource(ckpt_dir) if is_universal else open_source(ckpt_dir, manifest)
    try:
        sums = FingerprintSums()
        for name, _ in (x for g in src.groups for x in g):
            for key in STATE_KEYS:
                sums.add(name, key, src.read(name, key))
        return sums.fingerprint(src.step())
    finally:
        src.close()
