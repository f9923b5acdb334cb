"""Another tool's checkpoint adopted as the first committed checkpoint of a run, with the model it must fit described
either by a config (``shardkeeper import``: ``shardkeeper.importing``) or by the live objects of a segment
(``resume_from``: the Hugging Face Trainer's ``train(resume_from_checkpoint=PATH)``).

What both share: the target (``TargetModel``: parameter names and global shapes, optimizer groups and settings,
export record), the check that the source holds exactly its tensors (the first that differs is named), the
manifest, the streamed commit (``ckpt.formats.foreign.commit``: written into ``.partial``, hashed, renamed last)
and the lineage events (``imported``, then its ``checkpoint``).

``resume_from`` runs inside the segment, after ``seg.track`` and before ``seg.steps()``: the launcher already holds
the run lock. Rank 0 decides and, when it imports, converts while the other ranks wait; every rank then learns the
outcome (one broadcast) and raises the same one line on a refusal. What it does with ``path``:

- a committed checkpoint of this run: nothing (the run resumes from its newest valid checkpoint, said in one line);
- another tool's checkpoint (whatever ``shardkeeper import`` reads, ``ckpt.formats.foreign.readers``) while the run has
no
  checkpoint: imported as the run's first one, which ``seg.steps()`` then resumes;
- another tool's checkpoint while the run has checkpoints: the run's newest valid one wins (one line says so);
- anything else (no such path, another run's checkpoint, a layout not understood, another model): refused in
  one line that says what works instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir
from schemas import CheckpointManifest, ClusterTopology, DtypePolicy, Fingerprint, HFModelRecord, RunSpec
from schemas.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    from ckpt.formats.foreign.readers import ForeignSource
    from trainer.api.segment import Segment
    from trainer.checkpointer.core import Checkpointer

log = logging.getLogger("shardkeeper.checkpoint")

Named = list[tuple[str, tuple[int, ...]]]  # (parameter name, global shape)


@dataclass(frozen=True)
class TargetModel:
    """What an import needs of the model it adopts the checkpoint for."""

    params: Named  # model.parameters() order (an HF Trainer optimizer.pt names its parameters by position in it)
    groups: list[Named]  # the optimizer's param groups
    hparams: list[dict[str, Any]]  # per group, without "params"
    hf_model: HFModelRecord | None  # the export record (None: not a transformers model)
    tied: dict[str, str]  # tied name -> its source
    called: str = "the config's model"  # how refusals name it
    fix: str = "import it with the config of the model that wrote it"  # what a refusal says to do


def check_source(foreign: ForeignSource, target: TargetModel) -> None:
    """The source holds exactly the target's tensors, shapes included; else CheckpointError naming the first."""
    from ckpt.formats.foreign.readers import first_mismatch

    problem = first_mismatch(foreign, target.params, target.tied, model=target.called)
    if problem:
        raise CheckpointError(f"{foreign.path}: {problem}; {target.fix}")


def template_manifest(
    spec: RunSpec, target: TargetModel, step: int, *, fmt: str, samples: int, tokens: int, dtype_policy: DtypePolicy
) -> CheckpointManifest:
    """The manifest of the adopted checkpoint, less what the writer fills in (files, tensors, model signature,
    fingerprint): a conversion (one process, reason ``converted``, no parent) at ``step`` of ``spec``'s run."""
    from trainer.checkpointer.common import code_version

    return CheckpointManifest(
        format=fmt,
        run_name=spec.name,
        step=step,
        tokens=tokens,
        samples=samples,  # type: ignore[arg-type]
        segment=0,
        reason="converted",
        created_at=lineage.now_iso(),
        files=[],
        tensors=[],
        model_signature="",
        topology=ClusterTopology(nodes=1, procs_per_node=1, device_type="cpu", backend="gloo", launcher="local"),
        dtype_policy=dtype_policy,
        parent=None,
        code_version=code_version(),
        fingerprint=Fingerprint(model={}, optim={}, optim_step=0.0),
        run_spec=spec,
        hf_model=target.hf_model,
    )


def commit_adopted(
    foreign: ForeignSource, target: TargetModel, template: CheckpointManifest, out: Path
) -> CheckpointManifest:
    """Stream ``foreign`` into the committed checkpoint ``out`` in ``template.format`` (DCP, or DeepSpeed's
    universal layout); nothing is left at ``out`` unless it is committed."""
    from ckpt.formats.deepspeed.sources import IO_THREADS
    from ckpt.formats.foreign.commit import Adopted, commit_dcp, commit_deepspeed

    adopted = Adopted(foreign, target.groups, target.hparams, model=target.called, fix=target.fix)
    commit = commit_dcp if template.format == "dcp" else commit_deepspeed
    return commit(adopted, template, out, threads=IO_THREADS)  # the conversions' memory bound


def record_import(
    rd: RunDir, src: Path, foreign: ForeignSource, out: Path, manifest: CheckpointManifest, seconds: float
) -> None:
    """Lineage: the import (source path and layout) and the checkpoint it committed, its child."""
    import_id = f"import:{out.name}"
    lineage.record(
        rd,
        "imported",
        import_id,
        step=manifest.step,
        uri=foreign.path.resolve().as_uri(),
        layout=foreign.layout,
        source=str(src),
        format=manifest.format,
        seconds=round(seconds, 3),
    )
    lineage.record(
        rd,
        "checkpoint",
        lineage.checkpoint_event_id(manifest.step),
        parent=import_id,
        step=manifest.step,
        uri=out.resolve().as_uri(),
        reason="imported",
        format=manifest.format,
        world_size=1,
    )


# ------------------------------------------------------------------------------------------ from inside a segment
def describe_live(ckpt: Checkpointer) -> TargetModel:
    """The tracked model and optimizer as an import target: canonical parameter names, global shapes, the
    optimizer's groups and settings, the export record."""
    from ckpt.commit.identity import canonical

    groups = ckpt.named_param_groups()
    settings = [{k: v for k, v in g.items() if k != "params"} for g in ckpt.optimizer.param_groups]
    shapes = ckpt.param_shapes()
    record = ckpt.hf_model
    return TargetModel(
        params=[(canonical(n), s) for n, s in shapes],
        groups=groups,
        hparams=settings,
        hf_model=record,
        tied=dict(record.tied) if record is not None else {},
        called="this run's model",
        fix="pass a checkpoint of this model, or build the model that wrote it",
    )


def resume_from(
    seg: Segment,
    path: str | Path,
    *,
    samples_per_step: int = 0,
    tokens_per_step: int = 0,
    what: str = "resume_from_checkpoint",
) -> None:
    """Make ``path`` the run's starting point before ``seg.steps()`` loads (see the module docstring). Every rank
    calls it after ``seg.track``; ``samples_per_step``/``tokens_per_step`` give an imported checkpoint its counters
    (its step times them). ``what`` names the argument in the lines it writes.

    Raises:
        UsageError: ``path`` is not there, is another run's shardkeeper checkpoint, the run holds only unfinished
            or set-aside checkpoints, or the import refused it (a layout not understood, another model, damaged
            files): bad input, nothing committed (the segment ends 'refused').
        CheckpointError: the import failed otherwise (a full disk, ...); nothing was committed.
    """
    ckpt = seg._ckpt
    if ckpt is None:
        raise UsageError(f"{what}: nothing is tracked yet; call seg.track(...) first")
    outcome: list[Any] = [None]
    if seg.is_rank0:
        try:
            outcome[0] = _rank0(seg, ckpt, Path(path), samples_per_step, tokens_per_step, what)
        except (UsageError, CheckpointError) as e:  # refused before anything was committed: bad input (exit 2)
            outcome[0] = ("UsageError", str(e))
        except Exception as e:  # noqa: BLE001 - the other ranks wait at the broadcast: they raise it too
            outcome[0] = (
                "CheckpointError",
                f"{what}={str(path)!r}: the import failed ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}); nothing was committed",
            )
    dist.broadcast_object_list(outcome, src=0, group=seg.env.ctrl_group)
    if isinstance(outcome[0], tuple):
        kind, message = outcome[0]
        raise (UsageError if kind == "UsageError" else CheckpointError)(message)


def _rank0(
    seg: Segment, ckpt: Checkpointer, path: Path, samples_per_step: int, tokens_per_step: int, what: str
) -> None:
    from ckpt.validate.checks import latest_valid

    rd = seg.run_dir
    shown = f"{what}={str(path)!r}"
    if not path.exists():
        raise UsageError(
            f"{shown}: no such file or directory; pass another tool's checkpoint folder (e.g. "
            "out/checkpoint-500), or leave it out to resume the run's newest valid checkpoint"
        )
    newest = latest_valid(rd) if rd.checkpoints.is_dir() else None
    if (path / "manifest.json").is_file():  # a shardkeeper checkpoint
        if path.resolve().parent == rd.checkpoints.resolve():
            if newest is not None and newest[0].name == path.name:
                log.info("%s: the run's newest valid checkpoint; resuming from it", shown)
            else:  # the newest valid one wins: an older one would fork the run's lineage
                log.warning(
                    "%s is a checkpoint of this run: resuming from the run's newest valid checkpoint (%s)",
                    shown,
                    newest[0].name if newest else "none is valid",
                )
            return
        raise UsageError(
            f"{shown}: a checkpoint of another shardkeeper run ({path.resolve().parent.parent}); continue "
            f"that run with shardkeeper train --run-dir {path.resolve().parent.parent}, or train this one "
            "without it"
        )
    committed = rd.committed()
    if committed:
        log.warning(
            "%s: not imported, the run already has checkpoints; resuming from its newest valid one (%s)",
            shown,
            newest[0].name if newest else committed[-1].name,
        )
        return
    leftovers = rd.partials() + rd.quarantined()
    if leftovers:  # as shardkeeper import: a run directory that held checkpoints is not a new run
        raise UsageError(
            f"{shown}: not imported, {rd.root} holds {leftovers[-1].name} (an unfinished or set-aside "
            "checkpoint); import into a new run: pass another --run-dir"
        )
    _import_here(seg, ckpt, path, samples_per_step, tokens_per_step)


def _import_here(seg: Segment, ckpt: Checkpointer, path: Path, samples_per_step: int, tokens_per_step: int) -> None:
    """Rank 0: import ``path`` as the run's first checkpoint, the target described by the live objects."""
    from ckpt.formats.foreign.readers import open_foreign

    t0 = time.perf_counter()
    target = describe_live(ckpt)
    foreign = open_foreign(path, expect=lambda: target.params)
    try:
        check_source(foreign, target)
        foreign.verify()
        step = foreign.global_step
        template = template_manifest(
            seg.spec,
            target,
            step,
            fmt=ckpt.FORMAT,
            samples=step * samples_per_step,
            tokens=step * tokens_per_step,
            dtype_policy=ckpt.dtype_policy(),
        )
        out = seg.run_dir.checkpoint(step)
        manifest = commit_adopted(foreign, target, template, out)
        record_import(seg.run_dir, path, foreign, out, manifest, time.perf_counter() - t0)
    finally:
        foreign.close()
    log.info(
        "imported %s (%s, step %d) into %s in %.2f s; resuming from it",
        foreign.path,
        foreign.layout,
        step,
        out,
        time.perf_counter() - t0,
    )


__all__ = [
    "TargetModel",
    "check_source",
    "commit_adopted",
    "describe_live",
    "record_import",
    "resume_from",
    "template_manifest",
]
