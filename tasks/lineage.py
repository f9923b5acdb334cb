"""Mirror a run's lineage (RUN_DIR/lineage.jsonl, metrics.jsonl) into Prefect artifacts for the UI.

Three artifacts per run, keyed by the run name so every flow run of the same run adds a version:

    <prefix>-lineage        table: one row per event (kind, id, parent, step, details, uri)
    <prefix>-lineage-graph  markdown: mermaid graph of events and parents, and the same table
    <prefix>-loss-curve     markdown: the loss curve PNG (embedded as a data: URI, which the Prefect
                            3.8 UI renders) with resume and reshard markers; the PNG is also written
                            to RUN_DIR/loss.png

The lineage file stays the source of truth; the artifacts are a view that can be rebuilt at any time.
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ckpt.layout import RunDir
from ckpt.lineage import read_events
from tasks.render import lineage_markdown, loss_curve_png, markers, png_data_uri, read_metrics, slug, table_rows
from schemas.requests import LineageArtifacts

log = logging.getLogger(__name__)

LOSS_PNG = "loss.png"


def artifact_prefix(run_dir: str | Path, run_name: str | None = None) -> str:
    """``<run name>-<run dir name>`` as lowercase letters, digits and dashes (the dir name alone if it
    already carries the run name)."""
    dir_slug = slug(Path(run_dir).resolve().name)
    if not run_name:
        return dir_slug
    name_slug = slug(run_name)
    return dir_slug if dir_slug.startswith(name_slug) else slug(f"{name_slug}-{dir_slug}")


def artifact_keys(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}-lineage", f"{prefix}-lineage-graph", f"{prefix}-loss-curve"


def _loss_markdown(run_dir: Path, png: Path, title: str) -> str:
    points = markers(read_metrics(run_dir))
    lines = [f"# Loss of {title}", "", f"![loss curve of {title}]({png_data_uri(png)})", ""]
    if points:
        lines += ["| resumed at step | kind | world size |", "|---|---|---|"]
        lines += [f"| {m.step} | {m.kind} | {m.from_world_size} → {m.to_world_size} |" for m in points]
        lines.append("")
    lines.append(f"Curve: last-written loss per step from `{run_dir / 'metrics.jsonl'}`; PNG at `{png}`.")
    return "\n".join(lines)


def has_lineage(run_dir: str) -> bool:
    """Has the run recorded any lineage yet (a failure before its first segment has none)?"""
    return RunDir.at(run_dir).has_lineage()


@task(name="mirror-lineage", cache_policy=NO_CACHE)
def mirror_lineage(run_dir: str, run_name: str | None = None) -> LineageArtifacts:
    """Create (a new version of) the table, graph and loss-curve artifacts of a run."""
    root = Path(run_dir).resolve()
    events = read_events(root)
    prefix = artifact_prefix(root, run_name)
    table_key, graph_key, loss_key = artifact_keys(prefix)
    title = f"{run_name} ({root.name})" if run_name else root.name
    create_table_artifact(table_rows(events), key=table_key,
                          description=f"Lineage events of {title}: checkpoints, resumes, reshards, exports, publishes")
    create_markdown_artifact(lineage_markdown(events, title=f"Lineage of {title}"), key=graph_key,
                             description=f"Lineage graph of {title} (mermaid source; paste into mermaid.live to draw)")
    png = loss_curve_png(root, root / LOSS_PNG, title=title)
    if png is not None:
        create_markdown_artifact(_loss_markdown(root, png, title), key=loss_key,
                                 description=f"Loss curve of {title} with resume and reshard markers")
    get_run_logger().info("lineage of %s: %d events mirrored to artifacts %s, %s%s", root, len(events), table_key,
                          graph_key, f", {loss_key}" if png else "")
    return LineageArtifacts(table_key=table_key, graph_key=graph_key, loss_key=loss_key if png else None,
                            loss_png=str(png) if png else None, events=len(events))
