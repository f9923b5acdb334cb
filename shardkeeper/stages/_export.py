"""The export and publish stages: a checkpoint to a safetensors folder, the folder to the Hub or an fsspec
target, each recorded in the run's lineage."""

from __future__ import annotations

from pathlib import Path

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir
from shardkeeper.stages._where import is_remote


def export_and_record(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    tokenizer_from: str | Path | bool | None = None,
):
    """Checkpoint (DCP or DeepSpeed ZeRO) -> safetensors folder (ckpt.export), recorded in the run's lineage.

    A ZeRO checkpoint exports in one pass like a DCP one: each fp32 master weight streams straight from
    its byte ranges in the ``*_optim_states.pt`` partitions; no intermediate checkpoint is written."""
    from ckpt.export import export_checkpoint as _export

    if is_remote(ckpt_dir) or is_remote(out_dir):
        from shardkeeper.remote import export_remote

        return export_remote(
            str(ckpt_dir),
            str(out_dir),
            export=_export,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=progress,
        )
    ckpt_dir = Path(ckpt_dir)
    res = _export(
        ckpt_dir,
        out_dir,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        tokenizer_from=tokenizer_from,
    )
    root = RunDir.of_checkpoint(ckpt_dir)
    if root is not None:  # res.step: the manifest the export read (the checkpoint may be retired by now)
        lineage.record(
            root,
            "export",
            f"export:{Path(res.out_dir).name}:{res.dtype}",
            parent=f"checkpoint:{ckpt_dir.name}",
            step=res.step,
            uri=Path(res.out_dir).resolve().as_uri(),
            dtype=res.dtype,
            num_shards=res.num_shards,
            bytes=res.total_bytes,
            seconds=round(res.seconds, 2),
        )
    return res


def publish_export(
    export_dir: str | Path, target: str, *, revision: str | None = None, run_dir: str | Path | None = None
):
    """Export folder -> Hub repo or fsspec URL (ckpt.publish), recorded in the run's lineage."""
    from ckpt.publish import publish as _publish

    export_dir = Path(export_dir)
    root = RunDir.at(run_dir) if run_dir else RunDir.containing(export_dir)
    events = lineage.read_events(root) if root.has_lineage() else None
    res = _publish(export_dir, target, revision=revision, lineage=events)
    if events is not None:
        parents = [e.id for e in events if e.kind == "export" and e.uri == export_dir.resolve().as_uri()]
        lineage.record(
            root,
            "publish",
            f"publish:{res.target}@{res.revision or 'main'}:{export_dir.name}",
            parent=parents[-1] if parents else None,
            uri=res.url,
            target=res.target,
            revision=res.revision,
            skipped=res.skipped,
            commit=res.commit,
        )
    return res
