"""The import stage: adopt a checkpoint another tool wrote as the first committed checkpoint of a shardkeeper run.

    shardkeeper import out/checkpoint-500 --config configs/my-model.yaml --run-dir runs/adopted [--step 500]
    shardkeeper train --config configs/my-model.yaml --run-dir runs/adopted --nproc 4 --until-step 1000
    shardkeeper train --script my_train.py --run-dir runs/adopted --nproc 4 --until-step 1000   # or your own script

What comes across: every parameter's fp32 weight, its AdamW moments (exp_avg, exp_avg_sq) and the optimizer step,
into the format of the config's backend (fsdp2: DCP; deepspeed: DeepSpeed's universal layout), streamed one tensor
at a time (``ckpt.formats.foreign.readers`` reads, ``trainer.api.adopt`` and ``ckpt.formats.foreign.commit`` write and
commit).
The checkpoint is recorded as if shardkeeper had trained ``step`` steps under the config: counters are ``step`` x
the config's global batch, optimizer groups and hyperparameters are the config's, RNG states are seeded by the
elastic rule. The other tool's LR scheduler, data loader position and RNG files are not read. The model is built
from the config on the meta device (the trainer's own helpers, no weights allocated) for its parameter names and
shapes and the export record: a checkpoint of another architecture is refused with the first tensor that differs.

Any kind of run whose model has these tensors continues it (``ckpt.commit.identity``): the built-in trainer with the
config, or a script (own FSDP2 or DeepSpeed loop, Hugging Face Trainer, Accelerate), which trains on with its own
optimizer settings and starts its LR scheduler at the imported step (``trainer.extras``). From inside a script,
``Trainer.train(resume_from_checkpoint=PATH)`` imports the same way, the model described by the live objects
(``trainer.api.adopt.resume_from``).

Everything is checked before anything is written; a failure after that removes what this import created.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt.commit.fsutil import load_yaml, mkdir_durable
from ckpt.commit.layout import RunDir
from ckpt.guards.lock import RunLock
from schemas import CheckpointManifest, DtypePolicy, RunSpec
from schemas.errors import RunDirError

if TYPE_CHECKING:
    from trainer.api.adopt import TargetModel

log = logging.getLogger("shardkeeper")

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ImportResult:
    """What ``import_checkpoint`` committed.

    Attributes:
        source: The folder the checkpoint was read from (the one of ``step`` when the source held several).
        layout: The source's layout as recognised (e.g. an HF Trainer ``checkpoint-N``, DeepSpeed, DCP).
        checkpoint: The committed checkpoint directory, ``RUN_DIR/checkpoints/step-XXXXXXXX``.
        format: The format it was written in: ``dcp`` (backend ``fsdp2``) or ``deepspeed``.
        step: The step the run continues from (the source's optimizer step).
        tensors: How many tensors the checkpoint's manifest lists.
        seconds: Wall time of the whole import, checks included.
    """

    source: str
    layout: str
    checkpoint: str
    format: str
    step: int
    tensors: int
    seconds: float


def describe_model(spec: RunSpec) -> TargetModel:
    """Describe the config's model as the built-in trainer builds it, without allocating its weights.

    The model is built on the meta device; its AdamW groups come from ``trainer.optim.build_optimizer``.

    Args:
        spec: The run's config (its ``model`` and ``optim`` sections are read).

    Returns:
        The parameter names and shapes in ``model.named_parameters()`` order, the optimizer's groups and their
        hyperparameters, the export record the trainer records and the tied parameters.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.api.adopt import TargetModel
    from trainer.model import hf_config, hf_model_record, params_on_meta
    from trainer.optim import build_optimizer

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config(spec.model), dtype=torch.float32)
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, spec)
    groups = [[(names[id(p)], tuple(p.shape)) for p in g["params"]] for g in optimizer.param_groups]
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    record = hf_model_record(model, spec.model)
    return TargetModel(
        params=[(n, tuple(p.shape)) for n, p in model.named_parameters()],
        groups=groups,
        hparams=hparams,
        hf_model=record,
        tied=dict(record.tied),
    )


def check_run_dir(rd: RunDir, spec: RunSpec) -> None:
    """Check that ``rd`` can take an imported checkpoint: no checkpoint yet, and any ``run.yaml`` the same run.

    Args:
        rd: The run directory (it need not exist).
        spec: The config the import is done with.

    Raises:
        RunDirError: The directory already holds a checkpoint (committed, partial or set aside), or its
            ``run.yaml`` differs from ``spec`` in a section a later segment may not change.
        ConfigError: The ``run.yaml`` there cannot be read as a config.
    """
    held = rd.committed() + rd.partials() + rd.quarantined()
    if held:
        raise RunDirError(
            f"{rd.root}: already holds checkpoints ({held[-1].name}); import starts a run, pass a new --run-dir"
        )
    if rd.spec_path.exists():
        from shardkeeper.config import spec_from_dict
        from shardkeeper.stages import MUTABLE_SECTIONS

        old = spec_from_dict(load_yaml(rd.spec_path.read_text()) or {}, str(rd.spec_path))
        a, b = old.model_dump(mode="json"), spec.model_dump(mode="json")
        changed = sorted(k for k in b if a[k] != b[k] and k not in MUTABLE_SECTIONS)
        if changed:
            raise RunDirError(
                f"{rd.spec_path}: describes another run ({changed[0]} differs from the config); pass a new --run-dir"
            )


def template_manifest(spec: RunSpec, target: TargetModel, step: int) -> CheckpointManifest:
    """Build the manifest of the imported checkpoint, less what the writer fills in.

    The writer adds the files, tensors, model signature and fingerprint.

    Args:
        spec: The config the import is done with.
        target: The config's model (``describe_model``).
        step: The optimizer step the source checkpoint is at.

    Returns:
        A manifest whose counters are ``step`` steps of the config's global batch (samples, and tokens at its
        ``data.seq_len``), with the config's dtypes and the format of its backend.
    """
    from trainer.api.adopt import template_manifest as template

    samples = step * spec.global_batch_size
    policy = DtypePolicy(compute=_DTYPE_NAMES[spec.precision.compute], reduce=_DTYPE_NAMES[spec.precision.reduce])
    return template(
        spec,
        target,
        step,
        fmt="dcp" if spec.backend == "fsdp2" else "deepspeed",
        samples=samples,
        tokens=samples * spec.data.seq_len,
        dtype_policy=policy,
    )


def import_checkpoint(
    src: str | Path, spec: RunSpec, run_dir: str | Path, *, step: int | None = None, config_name: str = "the config"
) -> ImportResult:
    """Adopt the checkpoint in ``src`` as the first checkpoint of the run ``run_dir`` trained by ``spec``.

    Everything is checked before anything is written (the source's layout and checksums, its tensors against the
    config's model, the run directory); the run lock is held while the checkpoint and ``run.yaml`` are written, and
    a failure after that removes what this import created (the run directory itself when it was new).

    Args:
        src: The folder another tool wrote: an HF Trainer or DeepSpeed ``checkpoint-N``, a folder of several, a
            DCP checkpoint.
        spec: The config of the run the checkpoint starts; its model must have the source's tensors.
        run_dir: A local run directory that holds no checkpoint yet (created if missing).
        step: Which checkpoint to take when ``src`` holds several; default: the newest.
        config_name: How refusals name the config (the CLI passes its path).

    Returns:
        What was committed: the checkpoint's path, format, step and tensor count, and the time taken.

    Raises:
        RunDirError: ``run_dir`` is a URL (``s3://...``: import locally, then train on the store), already holds
            checkpoints, or has a ``run.yaml`` of another run.
        RunLockedError: Another process holds the run's lock.
        CheckpointError: ``src`` is missing, of a layout not recognised, already a shardkeeper checkpoint, fails
            its integrity checks, or holds another model's tensors (the first that differs is named).

    Example:
        ```python
        from shardkeeper.config import load_run_spec
        from shardkeeper.importing import import_checkpoint

        spec = load_run_spec("configs/my-model.yaml")
        res = import_checkpoint("out/checkpoint-500", spec, "runs/adopted")
        print(res.checkpoint, res.step)
        ```
    """
    from concurrent.futures import ThreadPoolExecutor

    from ckpt.formats.foreign.readers import open_foreign
    from trainer.api.adopt import check_source, commit_adopted, record_import

    t0 = time.perf_counter()
    if "://" in str(run_dir):
        raise RunDirError(
            f"--run-dir {run_dir}: import writes a local run directory; import here, then train with "
            "the run directory on the store (see Run directories on S3)"
        )
    src, rd = Path(src), RunDir.at(run_dir)
    check_run_dir(rd, spec)
    targets: list[TargetModel] = []

    def expect() -> list[tuple[str, tuple[int, ...]]]:  # an optimizer.pt needs it to be opened
        if not targets:
            targets.append(describe_model(spec))
        return targets[0].params

    foreign = open_foreign(src, step=step, expect=expect)
    try:
        # the CRC pass over the source reads while transformers is imported and the model built on the meta device
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify") as pool:
            verified = pool.submit(foreign.verify)
            expect()
            target = replace(targets[0], fix=f"import it with the config of the model that wrote it, not {config_name}")
            check_source(foreign, target)
            verified.result()
        template = template_manifest(spec, target, foreign.global_step)
        with _created(rd):
            with RunLock(rd.root):
                check_run_dir(rd, spec)  # again under the lock
                out = rd.checkpoint(template.step)
                manifest = commit_adopted(foreign, target, template, out)
                record_import(rd, src, foreign, out, manifest, time.perf_counter() - t0)
                from shardkeeper.stages import prepare_run_dir

                prepare_run_dir(rd, spec)  # run.yaml last: no run.yaml without its checkpoint
    finally:
        foreign.close()
    seconds = time.perf_counter() - t0
    log.info("imported %s (%s, step %d) into %s in %.2f s", foreign.path, foreign.layout, template.step, out, seconds)
    return ImportResult(
        source=str(foreign.path),
        layout=foreign.layout,
        checkpoint=str(out),
        format=manifest.format,
        step=manifest.step,
        tensors=len(manifest.tensors),
        seconds=seconds,
    )


class _created:
    """Around the writes: on failure, remove what they created (the run directory itself when it was new)."""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self.new_root = not rd.root.exists()
        self.before = set() if self.new_root else {p.name for p in rd.root.iterdir()}

    def __enter__(self) -> None:
        mkdir_durable(self.rd.root)

    def __exit__(self, kind: type | None, *exc: object) -> None:
        if kind is None:
            return
        if self.new_root:
            shutil.rmtree(self.rd.root, ignore_errors=True)
            return
        for p in self.rd.root.iterdir():
            if p.name not in self.before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


__all__ = ["ImportResult", "describe_model", "import_checkpoint"]
