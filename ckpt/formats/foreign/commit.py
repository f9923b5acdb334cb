"""Commit another tool's checkpoint as a shardkeeper checkpoint, streamed one tensor at a time by the same
writers as the conversions (``ckpt.formats.deepspeed.convert``):

* ``commit_dcp``: a 1-rank DCP save of whole tensors (the fsdp2 backend loads it at any world size), produced one
  tensor at a time by ``StreamingSavePlanner`` and written by the trainer's hashing O_DIRECT writer
  (``ckpt.formats.dcp.direct_io``: no page-cache copy of every byte, hashed on the way);
* ``commit_deepspeed``: DeepSpeed's universal layout (``write_universal``), which engines load at any world size
  and ZeRO stage; the first save of the continued run writes native ZeRO shards again.

Either is written into a ``.partial`` sibling, every file hashed and fsynced, ``manifest.json`` last, renamed,
parent fsynced (``commit_dir``); the fingerprint is summed from the tensors as they stream through. The
source is seen through ``Adopted``: the target model's optimizer groups and hyperparameters, and each tensor
checked against the target shape and cast to fp32 (master weights stay fp32).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ckpt.commit import identity, lineage
from ckpt.commit.manifest import write_manifest
from ckpt.commit.state import elastic_rng_state
from ckpt.formats.dcp.direct_io import HashingDirectWriter
from ckpt.formats.dcp.reader import save_in_process
from ckpt.formats.deepspeed.convert import StreamingSavePlanner, dcp_files, dcp_state, producer
from ckpt.formats.deepspeed.sources import (
    IO_THREADS,
    FingerprintSums,
    check_target,
    commit_dir,
    inventory,
    partial_dir,
    tied_of,
)
from ckpt.formats.deepspeed.universal import universal_model_states, write_universal
from ckpt.formats.deepspeed.zero import STATE_FILE, UNIVERSAL_DIR, rng_file, write_hashed
from ckpt.formats.foreign.readers import ForeignSource
from schemas import CheckpointManifest, FileEntry, TensorEntry
from schemas.errors import CheckpointError


class Adopted:
    """A foreign checkpoint as ``deepspeed_sources.Source``: the target's optimizer groups (names, shapes) and
    hyperparameters; tensors read from the source, checked against the target shape, in fp32."""

    def __init__(
        self,
        src: ForeignSource,
        groups: list[list[tuple[str, tuple[int, ...]]]],
        hparams: list[dict[str, Any]],
        *,
        model: str = "the config's model",
        fix: str = "import it with the config of the model that wrote it",
    ):
        self.src = src
        self._model, self._fix = model, fix  # how the target model is called, and what to do, in a refusal
        self.groups = groups
        self._hparams = hparams
        self._shape = {n: s for g in groups for n, s in g}
        self._step = float(src.optim_step())

    def read(self, name: str, key: str) -> torch.Tensor:
        t = self.src.read(name, key)
        if tuple(t.shape) != self._shape[name]:
            raise CheckpointError(
                f"{self.src.path}: {key} of {name} is {list(t.shape)}, {self._model} has "
                f"{list(self._shape[name])}; {self._fix}"
            )
        t = t.to(torch.float32).contiguous()
        # StreamingSavePlanner frees each tensor's storage once written: a tensor over memory it does not own
        # (read through a numpy view) is copied into one it does
        return t if t.untyped_storage().resizable() else t.clone()

    def step(self) -> float:
        return self._step

    def hparams(self) -> list[dict[str, Any]]:
        return [dict(h) for h in self._hparams]

    def close(self) -> None:
        pass


def commit_dcp(
    src: Adopted, template: CheckpointManifest, out_dir: Path, *, threads: int = IO_THREADS
) -> CheckpointManifest:
    """``src`` as a committed DCP checkpoint at ``out_dir`` (``template``: the manifest less files, tensors and
    fingerprint). Returns the committed manifest."""
    t0 = time.perf_counter()
    check_target(out_dir)
    rng = elastic_rng_state(template.run_spec.seed, template.step)
    # FSDP2's state dict holds both names of a tied pair: so does the checkpoint (the source's values twice)
    tied = tied_of(template, {n for g in src.groups for n, _ in g})
    sd, lazy = dcp_state(src, template, rng, model_only=False, tied=tied)
    sums = FingerprintSums()
    produce = producer(src, lazy, sums)

    with partial_dir(out_dir) as tmp:
        # max(2, ...): see StreamingSavePlanner
        writer = HashingDirectWriter(tmp, sync_files=True, thread_count=max(2, threads), overwrite=False)
        save_in_process(sd, writer, StreamingSavePlanner(produce))
        tensors = inventory(src.groups, tied=tied)
        out = template.model_copy(
            update={
                "format": "dcp",
                "created_at": lineage.now_iso(),
                "files": dcp_files(tmp, writer.digests),
                "tensors": tensors,
                "model_signature": _signature(tensors, template),
                "fingerprint": sums.fingerprint(src.step()),
                "save_seconds": time.perf_counter() - t0,
            }
        )
        if not commit_dir(tmp, out_dir, out):
            raise CheckpointError(f"{out_dir}: appeared while importing; nothing was overwritten")
    return out


def commit_deepspeed(
    src: Adopted, template: CheckpointManifest, out_dir: Path, *, threads: int = IO_THREADS
) -> CheckpointManifest:
    """``src`` as a committed deepspeed checkpoint at ``out_dir`` holding the universal layout only."""
    t0 = time.perf_counter()
    check_target(out_dir)
    spec = template.run_spec
    target = template.model_copy(update={"format": "deepspeed"})
    with partial_dir(out_dir) as tmp:
        (tmp / UNIVERSAL_DIR).mkdir()
        states = universal_model_states({}, src.groups, target)
        ufiles, fingerprint = write_universal(
            src,
            tmp / UNIVERSAL_DIR,
            target,
            model_states=states,
            clip_grad=spec.optim.grad_clip or 0.0,
            threads=threads,
        )
        tensors = inventory(src.groups)
        common = {
            "created_at": lineage.now_iso(),
            "tensors": tensors,
            "fingerprint": fingerprint,
            "model_signature": _signature(tensors, target),
        }
        write_manifest(
            tmp / UNIVERSAL_DIR,
            target.model_copy(update={**common, "files": ufiles, "save_seconds": time.perf_counter() - t0}),
        )
        files = _state_files(tmp, target)
        out = target.model_copy(update={**common, "files": files, "save_seconds": time.perf_counter() - t0})
        if not commit_dir(tmp, out_dir, out):
            raise CheckpointError(f"{out_dir}: appeared while importing; nothing was overwritten")
    return out


def _signature(tensors: list[TensorEntry], template: CheckpointManifest) -> str:
    return identity.signature(tensors, template.hf_model.tied if template.hf_model is not None else None)


def _state_files(tmp: Path, manifest: CheckpointManifest) -> list[FileEntry]:
    """The counters (layout "universal") and rank 0's RNG state, seeded by the elastic rule: the other tool's RNG
    states are not carried over (their files are never unpickled)."""
    spec = manifest.run_spec
    state = {
        "step": manifest.step,
        "tokens": manifest.tokens,
        "samples": manifest.samples,
        "schedule_last_step": manifest.step - 1,
        "zero_stage": spec.deepspeed.zero_stage,
        "world_size": 1,
        "layout": "universal",
    }
    text = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    rng = elastic_rng_state(spec.seed, manifest.step)
    entries = []
    for name, fill in ((STATE_FILE, lambda f: f.write(text)), (rng_file(0), lambda f: torch.save({"cpu": rng}, f))):
        size, digest = write_hashed(tmp / name, fill)
        entries.append(FileEntry(path=name, size=size, xxh3_128=digest, rank=0))
    return entries


__all__ = ["Adopted", "commit_deepspeed", "commit_dcp"]
