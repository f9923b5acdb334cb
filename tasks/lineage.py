"""Mirror a run's lineage (RUN_DIR/lineage.jsonl, metrics.jsonl) into Prefect artifacts for the UI.

Four artifacts per run (five with a plan), keyed by the run name so every flow run of the same run adds a version:

    <prefix>-lineage-graph  markdown: the lineage graph drawn as a PNG (segments as lanes, checkpoints on
                            disk filled, retired ones hollow, preemptions red, reshards with world sizes,
                            exports and publishes) and the "checkpoints now" table under it
    <prefix>-checkpoints    table: only the checkpoints that exist now (step, world size, backend, size,
                            validity as last checked, exported / published)
    <prefix>-loss-curve     markdown: the loss curve PNG with resume / reshard markers, preemptions apart
    <prefix>-lineage        table: every lineage event (kind, id, parent, step, details, uri; ``by`` names
                            who launched each segment: train-and-export, automation, schedule or resume)
    <prefix>-plan           markdown, for a run a train-and-export flow run started: its plan (segments,
                            export, publish), where it stands and who did each part

PNGs are embedded as data: URIs (the open-source UI draws them; it does not draw mermaid) and also
written to RUN_DIR (lineage.png, loss.png). ``mirror_runs_overview`` adds ``runs-overview-<root>``: one
row per run under a root with its status. The lineage file stays the source of truth; the artifacts are
a view that can be rebuilt at any time.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from ckpt.commit.layout import RunDir
from ckpt.commit.lineage import read_events
from ckpt.plan import PlanError, read_plan
from schemas.plan import RunPlan
from schemas.requests import LineageArtifacts
from tasks.dashboard import checkpoints_now, draw_lineage_graph, lineage_graph, markdown_rows, runs_overview
from tasks.render import (
    eval_by_step,
    loss_curve_png,
    markers,
    png_data_uri,
    read_metrics,
    segment_statuses,
    slug,
    table_rows,
)

log = logging.getLogger(__name__)

LOSS_PNG = "loss.png"
GRAPH_PNG = "lineage.png"
CHECKPOINT_COLUMNS = ["step", "tier", "world_size", "backend", "reason", "size", "validity", "exported", "published"]


def _name(run_dir: str | Path) -> str:
    """The last part of a run directory's path or URL."""
    return str(run_dir).rstrip("/").rpartition("/")[2] if "://" in str(run_dir) else Path(run_dir).resolve().name


def _local_root(run_dir: str | Path) -> Path:
    """Where a run's lineage is read from: the folder itself, or for s3://... its cache with the store's
    metadata pulled (lineage.jsonl, segments.jsonl, metrics.jsonl)."""
    if "://" in str(run_dir):
        from shardkeeper.remote import lineage_source

        return lineage_source(str(run_dir))[0].root
    return Path(run_dir).resolve()


def artifact_prefix(run_dir: str | Path, run_name: str | None = None) -> str:
    """``<run name>-<run dir name>`` as lowercase letters, digits and dashes (the dir name alone if it
    already carries the run name)."""
    dir_slug = slug(_name(run_dir))
    if not run_name:
        return dir_slug
    name_slug = slug(run_name)
    return dir_slug if dir_slug.startswith(name_slug) else slug(f"{name_slug}-{dir_slug}")


def artifact_keys(prefix: str) -> tuple[str, str, str]:
    return f"{prefix}-lineage", f"{prefix}-lineage-graph", f"{prefix}-loss-curve"


def _loss_markdown(run_dir: Path, png: Path, title: str, statuses: dict[int, str]) -> str:
    points = markers(read_metrics(run_dir), statuses)
    lines = [f"# Loss of {title}", "", f"![loss curve of {title}]({png_data_uri(png)})", ""]
    if points:
        lines += ["| resumed at step | kind | world size | after |", "|---|---|---|---|"]
        lines += [
            f"| {m.step} | {m.kind} | {m.from_world_size} → {m.to_world_size} | "
            f"{'planned' if m.cause == 'planned' else f'**{m.cause}**'} |"
            for m in points
        ]
        lines.append("")
    held_out = eval_by_step(read_metrics(run_dir))
    if held_out:
        last = max(held_out)
        lines += [
            f"Held-out loss (eval): {len(held_out)} evaluation(s), the last at step {last}: "
            f"{held_out[last]:.4f} (perplexity {math.exp(min(held_out[last], 700.0)):.2f}).",
            "",
        ]
    lines.append(f"Curve: last-written loss per step from `{run_dir / 'metrics.jsonl'}`; PNG at `{png}`.")
    return "\n".join(lines)


def _graph_markdown(png: Path, title: str, rows: list[dict], model_summary: str) -> str:
    return "\n".join(
        [
            f"# Lineage of {title}",
            "",
            f"![lineage graph of {title}]({png_data_uri(png)})",
            "",
            f"{model_summary} Lanes are segments; filled circles are checkpoints on disk now, hollow ones were "
            "retired by retention, red rings are emergency checkpoints written at a preemption; dashed edges are "
            "resumes (green: planned, red: after a preemption or failure, orange: reshard to another world size); "
            "squares are exports, diamonds publishes, triangles converted copies.",
            "",
            f"## Checkpoints now ({len(rows)})",
            "",
            markdown_rows(rows, CHECKPOINT_COLUMNS),
        ]
    )


def has_lineage(run_dir: str) -> bool:
    """Has the run recorded any lineage yet (a failure before its first segment has none)?"""
    return RunDir.at(run_dir).has_lineage()


@task(name="mirror-lineage", cache_policy=NO_CACHE)
def mirror_lineage(run_dir: str, run_name: str | None = None) -> LineageArtifacts:
    """Create (a new version of) the graph, checkpoints-now, loss-curve and event-table artifacts of a run."""
    root = _local_root(run_dir)
    events = read_events(root)
    prefix = artifact_prefix(run_dir, run_name)
    table_key, graph_key, loss_key = artifact_keys(prefix)
    checkpoints_key = f"{prefix}-checkpoints"
    title = f"{run_name} ({_name(run_dir)})" if run_name else _name(run_dir)
    now = checkpoints_now(root, events)
    model = lineage_graph(
        events, existing={f"checkpoint:{Path(r['path']).name}{'@memory' if r['tier'] == 'memory' else ''}" for r in now}
    )
    graph_png = draw_lineage_graph(model, root / GRAPH_PNG, title=title)
    summary = (
        f"{model.checkpoints} checkpoint{'s' if model.checkpoints != 1 else ''} written, {len(now)} on disk now"
        + (f"; {model.folded} are folded into the edges (… N checkpoints …)." if model.folded else ".")
        + (f" The {model.hidden_segments} middle segments share one (yellow) lane." if model.hidden_segments else "")
    )
    create_markdown_artifact(
        _graph_markdown(graph_png, title, now, summary),
        key=graph_key,
        description=f"Lineage graph of {title} and the checkpoints that exist now",
    )
    create_table_artifact(
        [{k: r[k] for k in [*CHECKPOINT_COLUMNS, "path"]} for r in now],
        key=checkpoints_key,
        description=f"Checkpoints of {title} on disk now",
    )
    statuses = segment_statuses(events)
    png = loss_curve_png(root, root / LOSS_PNG, title=title, statuses=statuses)
    if png is not None:
        create_markdown_artifact(
            _loss_markdown(root, png, title, statuses),
            key=loss_key,
            description=f"Loss curve of {title}; resumes after preemptions marked apart",
        )
    create_table_artifact(
        table_rows(events),
        key=table_key,
        description=f"Every lineage event of {title}: checkpoints, resumes, reshards, exports, publishes",
    )
    plan_key = _plan_artifact(root, f"{prefix}-plan", title)
    get_run_logger().info(
        "lineage of %s: %d events, %d checkpoints on disk, mirrored to artifacts %s, %s, %s%s",
        root,
        len(events),
        len(now),
        graph_key,
        checkpoints_key,
        table_key,
        f", {loss_key}" if png else "",
    )
    return LineageArtifacts(
        table_key=table_key,
        graph_key=graph_key,
        checkpoints_key=checkpoints_key,
        loss_key=loss_key if png else None,
        loss_png=str(png) if png else None,
        graph_png=str(graph_png),
        events=len(events),
        plan_key=plan_key,
    )


def plan_markdown(plan: RunPlan, title: str) -> str:
    """The plan as people read it: where it stands, and who did each part (who launched each segment, who
    exported, who published)."""

    def row(*cells: object) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [
        f"# Plan of {title}",
        "",
        f"**{plan.status}**: {plan.where()}." + (f" {plan.note}." if plan.note else ""),
        "",
        f"Started by {plan.started_by.line()} at {plan.created}; last change {plan.updated}.",
        "",
        "| part | where | until step | status | ended at step | by |",
        "|---|---|---|---|---|---|",
    ]
    for i, (seg, done) in enumerate(zip(plan.segments, plan.progress)):
        where = (
            (f"{seg.nodes} x {seg.nproc}" if seg.nodes > 1 else f"{seg.nproc}")
            + " ranks"
            + (f" via {seg.launcher}" if seg.launcher != "local" else "")
        )
        lines.append(
            row(
                f"segment {i}",
                where,
                seg.until_step,
                done.status,
                done.end_step or "-",
                "; then ".join(d.line() for d in done.by) or "-",
            )
        )
    parts = [("export", f"{plan.export.dtype}, shards of {plan.export.max_shard_size}", plan.exported)]
    if plan.publish is not None:
        parts.append(
            (
                "publish",
                plan.publish.target + (f" @ {plan.publish.revision}" if plan.publish.revision else ""),
                plan.published,
            )
        )
    for name, what, done in parts:
        lines.append(
            row(
                name,
                what,
                "-",
                f"done: {done.out}" if done else "pending",
                done.step if done else "-",
                done.by.line() if done else "-",
            )
        )
    lines += ["", "The plan's record: `plan.json` in the run directory (schemas.plan.RunPlan)."]
    return "\n".join(lines)


def _plan_artifact(root: Path, key: str, title: str) -> str | None:
    """The ``<prefix>-plan`` markdown artifact when the run has a plan; None without one (or an unreadable one:
    the resume reports that)."""
    try:
        plan = read_plan(root)
    except PlanError as e:
        log.warning("%s", e)
        return None
    if plan is None:
        return None
    create_markdown_artifact(
        plan_markdown(plan, title), key=key, description=f"Plan of {title}: segments, export, publish, and who did each"
    )
    return key


@task(name="runs-overview", cache_policy=NO_CACHE)
def mirror_runs_overview(roots: list[str], run_dirs: list[str] | None = None) -> str:
    """A table artifact ``runs-overview-<root>``: every run under ``roots`` (and ``run_dirs``) with its status,
    step, last checkpoint and last activity. Returns the key."""
    from shardkeeper.stages import scan_runs

    states = scan_runs(roots, run_dirs or [])
    rows = runs_overview([s for s in states if s.exists])
    key = f"runs-overview-{slug('-'.join(_name(r) for r in roots) or 'runs')}"
    create_table_artifact(
        rows,
        key=key,
        description=f"Runs under {', '.join(roots) or ', '.join(run_dirs or [])}: "
        "status (running / preempted / failed / completed / cancelled), step, last checkpoint",
    )
    get_run_logger().info("runs overview: %d runs -> artifact %s", len(rows), key)
    return key
