"""The run's own checks before a segment: its spec (what may change between segments), its script, its data,
its pretrained weights. train_segment runs them before anything is written or launched."""

from __future__ import annotations

import logging
from pathlib import Path

from ckpt.fsutil import load_yaml
from ckpt.layout import RunDir
from ckpt.validate import latest_valid
from schemas import PreparedData, RunSpec, data_change
from schemas.errors import ConfigError, RunDirError, ShardkeeperError
from shardkeeper.config import dump_run_spec, spec_from_dict
from shardkeeper.stages.where import is_remote

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
    """First segment: write run.yaml. Later ones: the run keeps its spec; only MUTABLE_SECTIONS may change."""
    run_dir.root.mkdir(parents=True, exist_ok=True)
    if not run_dir.spec_path.exists():
        found = latest_valid(run_dir)
        if found:  # checkpoints without run.yaml: take the spec they were written with
            _check_same_model(run_dir, found[1].run_spec, spec)
        run_dir.spec_path.write_text(dump_run_spec(spec))
        return spec
    old = spec_from_dict(load_yaml(run_dir.spec_path.read_text()) or {}, str(run_dir.spec_path))
    _check_same_model(run_dir, old, spec)
    old_d, new_d = old.model_dump(mode="json"), spec.model_dump(mode="json")
    changed = sorted(k for k in new_d if _fixed_part(k, new_d[k]) != _fixed_part(k, old_d[k]) and k not in MUTABLE_SECTIONS)
    if changed:
        k = changed[0]
        raise RunDirError(f"{run_dir.spec_path}: the run was started with a different {k} ({old_d[k]!r} vs {new_d[k]!r}); "
                          "resume with the run's own config, or start a new --run-dir")
    if old.optim.lr != spec.optim.lr:
        log.warning("optim.lr changes from %g to %g: the run continues from its latest checkpoint with the new peak "
                    "learning rate", old.optim.lr, spec.optim.lr)
    if old_d != new_d:
        run_dir.spec_path.write_text(dump_run_spec(spec))
    return spec


def _fixed_part(section: str, value: object) -> object:
    """A RunSpec section without the fields that may change between segments (MUTABLE_FIELDS)."""
    if not isinstance(value, dict) or section not in MUTABLE_FIELDS:
        return value
    return {k: v for k, v in value.items() if k not in MUTABLE_FIELDS[section]}


def _check_same_model(run_dir: RunDir, old: RunSpec, new: RunSpec) -> None:
    if old.model != new.model or old.backend != new.backend:
        what = "backend" if old.backend != new.backend else "model"
        o = getattr(old, what)
        n = getattr(new, what)
        raise RunDirError(f"{run_dir.root}: holds another {what} ({o!r} there, {n!r} in the config); "
                          "use a new --run-dir for a different model")


def keep_run_script(spec: RunSpec, run_dir: str | Path) -> RunSpec:
    """A resume without --script of a run that a script trains keeps the run's script (and its arguments)."""
    if spec.script is not None or is_remote(run_dir):
        return spec
    path = RunDir.at(run_dir).spec_path
    if not path.is_file():
        return spec
    try:
        old = spec_from_dict(load_yaml(path.read_text()) or {}, str(path))
    except ShardkeeperError:
        return spec  # prepare_run_dir reports a broken run.yaml
    return spec.model_copy(update={"script": old.script}) if old.script is not None else spec


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
        raise ConfigError(f"{found[0]}: the run was trained on other data: {changed}; resume with the data the run "
                          "started with, or start a new --run-dir")


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
