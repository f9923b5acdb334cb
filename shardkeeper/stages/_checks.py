"""The run's own checks before a segment: its spec (what may change between segments), its script, its data,
its pretrained weights. train_segment runs them before anything is written or launched."""

from __future__ import annotations

import logging
from pathlib import Path

from ckpt.commit.fsutil import load_yaml
from ckpt.commit.layout import RunDir
from ckpt.validate.checks import latest_valid
from schemas import PreparedData, RunSpec, data_change
from schemas.errors import ConfigError, RunDirError, ShardkeeperError
from schemas.run import SCRIPT_UNUSED
from shardkeeper.config import dump_run_spec, spec_from_dict
from shardkeeper.stages._where import is_remote

log = logging.getLogger("shardkeeper")

# Fields of a run's RunSpec that may change between segments without breaking exact resume.
# eval only reads the model (no RNG, no state): its interval, batches or split may change too.
# performance (activation checkpointing, torch.compile, AdamW's implementation) changes how the ranks compute,
# not the model, data order or update rule: not part of the run's identity.
MUTABLE_SECTIONS = ("checkpoint", "eval", "performance", "script")
# Fields of other sections that may change too: what happens to a non-finite step (it is never applied either way),
# and the peak LR -- lowering it is the fix for a run whose loss blew up (trainer.nonfinite's line says so); the
# schedule is a pure function of the step, so the run continues from its checkpoint on the new curve.
MUTABLE_FIELDS = {"optim": ("lr", "on_nonfinite", "max_skipped")}


def prepare_run_dir(run_dir: RunDir, spec: RunSpec) -> RunSpec:
    """First segment: write run.yaml. Later ones: the run keeps its spec; only MUTABLE_SECTIONS may change
    (``check_spec_change``); the changed ones are recorded."""
    run_dir.root.mkdir(parents=True, exist_ok=True)
    old = check_spec_change(run_dir, spec)
    if old is None:
        run_dir.spec_path.write_text(dump_run_spec(spec))
        return spec
    if old.optim.lr != spec.optim.lr:
        log.warning(
            "optim.lr changes from %g to %g: the run continues from its latest checkpoint with the new peak "
            "learning rate",
            old.optim.lr,
            spec.optim.lr,
        )
    if old.model_dump(mode="json") != spec.model_dump(mode="json"):
        run_dir.spec_path.write_text(dump_run_spec(spec))
    return spec


def check_spec_change(run_dir: RunDir | str | Path, spec: RunSpec) -> RunSpec | None:
    """Can the run in ``run_dir`` continue under ``spec``? Reads only (what ``prepare_run_dir`` and a flow's or a
    deployment's request check share, so a change refused at the segment is refused at deploy time too).

    Returns the run's recorded spec (run.yaml), or None when it has none yet (a new run; checkpoints without a
    run.yaml must have been written by the same model and backend) or lives on an object store (its segment checks
    the run.yaml there).

    Raises:
        RunDirError: another model or backend, or a changed field outside MUTABLE_SECTIONS / MUTABLE_FIELDS (one
            line naming the field, the recorded and the new value); for a script run, fields it never reads
            (SCRIPT_UNUSED) are no change."""
    if not isinstance(run_dir, RunDir):
        if is_remote(run_dir):
            return None
        run_dir = RunDir.at(run_dir)
    if not run_dir.spec_path.exists():
        found = latest_valid(run_dir) if run_dir.checkpoints.is_dir() else None
        if found:  # checkpoints without run.yaml: take the spec they were written with
            _check_same_model(run_dir, found[1].run_spec, spec)
        return None
    old = spec_from_dict(load_yaml(run_dir.spec_path.read_text()) or {}, str(run_dir.spec_path))
    _check_same_model(run_dir, old, spec)
    old_d, new_d = old.model_dump(mode="json"), spec.model_dump(mode="json")
    unused = SCRIPT_UNUSED if spec.script is not None else ()
    changed = sorted(
        k
        for k in new_d
        if _fixed_part(k, new_d[k]) != _fixed_part(k, old_d[k]) and k not in MUTABLE_SECTIONS and k not in unused
    )
    if changed:
        k = changed[0]
        raise RunDirError(
            f"{run_dir.spec_path}: the run was started with a different {k} ({old_d[k]!r} there, "
            f"{new_d[k]!r} now), which cannot change for an existing run; resume with the run's own "
            "config (omit --config and that --set), or start a new --run-dir"
        )
    return old


def _fixed_part(section: str, value: object) -> object:
    """A RunSpec section without the fields that may change between segments (MUTABLE_FIELDS)."""
    if not isinstance(value, dict) or section not in MUTABLE_FIELDS:
        return value
    return {k: v for k, v in value.items() if k not in MUTABLE_FIELDS[section]}


def _check_same_model(run_dir: RunDir, old: RunSpec, new: RunSpec) -> None:
    if old.backend != new.backend:  # the checkpoints are in the run's backend's format: say how to keep it
        raise RunDirError(
            f"{run_dir.root}: holds a run of backend {old.backend} ({new.backend} in the config); "
            f"continue it with --set backend={old.backend} (or without --config: the run's run.yaml), "
            "or convert its checkpoint (shardkeeper convert) into a new --run-dir"
        )
    if old.model != new.model:
        raise RunDirError(
            f"{run_dir.root}: holds another model ({old.model!r} there, {new.model!r} in the config); "
            "use a new --run-dir for a different model"
        )


def run_record(run_dir: str | Path) -> RunSpec | None:
    """The run's record: the RunSpec in its run.yaml; None when there is none (a new run, a folder that is no run
    directory, a run on an object store) or it cannot be read (the train stage reports a broken one).

    run.yaml is where a run says what it is now, and the stages after ``train`` read it there, never from a config
    default: the train stage writes it at the start of every segment (``prepare_run_dir``, under the run lock,
    before any rank starts) with what that segment trains under -- the batch geometry or its absence (a script run
    splits its own batches), the backend, the script and its arguments, the checkpoint policy. A checkpoint's
    manifest keeps the RunSpec that wrote *that checkpoint* (what export and convert read); run.yaml is the one
    the *next* segment follows (what reshard, the flows, the schedule and the automation read). After an import
    that a script continues they differ: the imported checkpoint's manifest holds the import's config, run.yaml
    the script run."""
    if is_remote(run_dir):
        return None
    path = RunDir.at(run_dir).spec_path
    if not path.is_file():
        return None
    try:
        return spec_from_dict(load_yaml(path.read_text()) or {}, str(path))
    except (ShardkeeperError, OSError):
        return None


def keep_run_script(spec: RunSpec, run_dir: str | Path) -> RunSpec:
    """A resume without --script of a run that a script trains keeps the run's script (and its arguments)."""
    if spec.script is not None:
        return spec
    old = run_record(run_dir)
    return spec.model_copy(update={"script": old.script}) if old is not None and old.script is not None else spec


def check_resume_data(rd: RunDir, prepared: PreparedData | None) -> None:
    """A resume trains on the data the run's latest checkpoint was trained on: refused (one line naming what
    changed: the dataset's files, the tokenizer's, a setting) before anything is written or launched."""
    if prepared is None or not rd.checkpoints.is_dir():
        return
    found = latest_valid(rd)
    if found is None or found[1].data is None:
        return
    changed = data_change(found[1].data, prepared.record())
    if changed:
        raise ConfigError(
            f"{found[0]}: the run was trained on other data: {changed}; resume with the data the run "
            "started with, or start a new --run-dir"
        )


def fetch_pretrained(spec: RunSpec) -> None:
    """model.pretrained names a Hub id that is not in the cache: download it (config, weights, tokenizer files)
    unless HF_HUB_OFFLINE is set; then, or when the Hub cannot be reached, preflight's one line says what to do."""
    import os

    from ckpt.pretrained import is_hub_id, resolve
    from schemas.errors import ConfigError

    m = spec.model
    if m.pretrained is None or not is_hub_id(m.pretrained):
        return
    try:
        resolve(m, local_files_only=True)
        return
    except ConfigError:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            return
    log.info("downloading %s%s into the Hugging Face cache", m.pretrained, f" @ {m.revision}" if m.revision else "")
    resolve(m, local_files_only=False)
