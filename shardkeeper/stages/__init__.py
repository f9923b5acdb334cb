"""The pipeline's stages as plain functions: schemas in, schemas out.

The CLI calls them directly; tasks/ wraps each in a Prefect task. Nothing here imports prefect,
and torch is imported only inside the stages that need it.

One private module per part of the pipeline, each name re-exported here (``from shardkeeper.stages import X``):
``_train`` (plan_topology, train_segment), ``_checks`` (the run's spec, script, data and pretrained weights,
checked before a segment), ``_checkpoints`` (validate, reshard, convert), ``_export`` (export, publish),
``_state`` (run_state, scan_runs); ``_where`` (local or remote run directories) serves them.
"""

from __future__ import annotations

from shardkeeper.stages._checkpoints import convert_checkpoint, reshard, validate_checkpoint
from shardkeeper.stages._checks import (
    MUTABLE_FIELDS,
    MUTABLE_SECTIONS,
    check_resume_data,
    check_spec_change,
    fetch_pretrained,
    keep_run_script,
    prepare_run_dir,
    run_record,
)
from shardkeeper.stages._export import export_and_record, publish_export
from shardkeeper.stages._state import run_dirs_under, run_state, scan_runs
from shardkeeper.stages._train import next_segment_index, plan_available_topology, plan_topology, train_segment

__all__ = [
    "MUTABLE_FIELDS",
    "MUTABLE_SECTIONS",
    "check_resume_data",
    "check_spec_change",
    "convert_checkpoint",
    "export_and_record",
    "fetch_pretrained",
    "keep_run_script",
    "next_segment_index",
    "plan_available_topology",
    "plan_topology",
    "prepare_run_dir",
    "publish_export",
    "reshard",
    "run_dirs_under",
    "run_record",
    "run_state",
    "scan_runs",
    "train_segment",
    "validate_checkpoint",
]
