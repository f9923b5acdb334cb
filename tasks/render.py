"""Render a run's lineage for people: a mermaid graph, a markdown table, rows for a table artifact,
and the loss curve (PNG) with markers at resume and reshard points.

    from tasks.render import lineage_markdown, loss_curve_png
    print(lineage_markdown(read_events("runs/demo")))
    loss_curve_png("runs/demo", "runs/demo/loss.png")

No prefect import: the CLI can use it, and tasks/lineage.py mirrors its output into Prefect artifacts.
"""

from __future__ import annotations

import base64
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.fsutil import read_jsonl
from ckpt.layout import RunDir
from schemas import LineageEvent

log = logging.getLogger(__name__)

# Details worth a column: the rest stays in lineage.jsonl.
DETAIL_KEYS = ("reason", "status", "world_size", "from_world_size", "to_world_size", "method", "dtype",
               "num_shards", "target", "revision", "skipped", "valid", "until_step")
_NODE_SHAPES = {"checkpoint": ('["', '"]'), "segment": ('(["', '"])'), "resume": ('{{"', '"}}'),
                "reshard": ('{{"', '"}}'), "export": ('[/"', '"/]'), "publish": ('[("', '")]'), "validate": ('>"', '"]')}


def slug(text: str, *, max_len: int = 60) -> str:
    """Lowercase letters, digits and dashes only (what Prefect artifact keys accept)."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (s[:max_len].rstrip("-")) or "run"


def details(event: LineageEvent) -> str:
    return ", ".join(f"{k}={event.data[k]}" for k in DETAIL_KEYS if event.data.get(k) is not None)


def table_rows(events: list[LineageEvent]) -> list[dict[str, Any]]:
    """One row per event, for a Prefect table artifact or a CSV."""
    return [{"time": e.time, "kind": e.kind, "id": e.id, "parent": e.parent or "", "step": e.step,
             "details": details(e), "uri": e.uri or ""} for e in events]


def markdown_table(events: list[LineageEvent]) -> str:
    head = "| time | kind | id | parent | step | details |\n|---|---|---|---|---|---|\n"
    cell = lambda v: str(v if v is not None else "").replace("|", "\\|")  # noqa: E731
    code = lambda v: f"`{cell(v)}`" if v else ""  # noqa: E731
    return head + "".join(f"| {cell(e.time)} | {e.kind} | {code(e.id)} | {code(e.parent)} | {cell(e.step)} "
                          f"| {cell(details(e))} |\n" for e in events)


def _keep(events: list[LineageEvent]) -> set[str]:
    """Events shown in the graph: everything but the interval checkpoints nobody derives from."""
    referenced_by_other = {e.parent for e in events if e.parent and e.kind != "checkpoint"}
    ids = [e.id for e in events]
    keep = {e.id for e in events
            if e.kind != "checkpoint" or e.data.get("reason") != "interval" or e.id in referenced_by_other}
    if ids:
        keep.add(ids[0])
    return keep


def mermaid(events: list[LineageEvent]) -> str:
    """A left-to-right mermaid flowchart of events and their parents. Chains of interval checkpoints
    are folded into one edge labelled with how many were skipped, so long runs stay readable."""
    latest: dict[str, LineageEvent] = {}
    for e in events:  # a re-recorded id (re-export, re-publish) shows its latest details
        latest[e.id] = e
    uniq = list(latest.values())
    keep = _keep(uniq)
    node = {e.id: f"n{i}" for i, e in enumerate(uniq)}
    lines = ["flowchart LR"]
    for e in uniq:
        if e.id in keep:
            left, right = _NODE_SHAPES.get(e.kind, ('["', '"]'))
            lines.append(f"  {node[e.id]}{left}{_label(e)}{right}")
    for e in uniq:
        if e.id not in keep or not e.parent:
            continue
        parent, skipped = e.parent, 0
        while parent in latest and parent not in keep:
            parent, skipped = latest[parent].parent, skipped + 1
        if parent is None or parent not in node:
            continue
        arrow = f" -. {skipped} checkpoint{'s' if skipped > 1 else ''} .-> " if skipped else " --> "
        lines.append(f"  {node[parent]}{arrow}{node[e.id]}")
    return "\n".join(lines)


def _label(e: LineageEvent) -> str:
    parts = [e.id]
    if e.kind in ("resume", "reshard") and "to_world_size" in e.data:
        parts.append(f"world size {e.data.get('from_world_size')} → {e.data.get('to_world_size')}")
    elif e.kind in ("checkpoint", "segment") and "world_size" in e.data:
        parts.append(f"world size {e.data['world_size']}" + (f", {e.data['status']}" if "status" in e.data else ""))
    elif e.kind == "export" and "dtype" in e.data:
        parts.append(str(e.data["dtype"]))
    text = "<br/>".join(parts)
    return text.replace('"', "#quot;")


def lineage_markdown(events: list[LineageEvent], *, title: str = "Lineage") -> str:
    """Markdown with the mermaid graph (a code block; GitHub and mermaid.live draw it) and the table."""
    return (f"# {title}\n\n```mermaid\n{mermaid(events)}\n```\n\n"
            f"## Events ({len(events)})\n\n{markdown_table(events)}")


# ----------------------------------------------------------------------------- loss curve
@dataclass(frozen=True)
class Marker:
    step: int  # the checkpoint step the next segment resumed from
    kind: str  # "resume" or "reshard" (world size changed)
    from_world_size: int
    to_world_size: int


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(RunDir.at(run_dir).metrics) if "step" in r and "loss" in r]


def loss_by_step(records: list[dict[str, Any]]) -> dict[int, float]:
    """Last-written loss per step: a resumed segment that repeats steps wins over the lost ones."""
    out: dict[int, float] = {}
    for r in records:
        out[int(r["step"])] = float(r["loss"])
    return dict(sorted(out.items()))


def markers(records: list[dict[str, Any]]) -> list[Marker]:
    """Where a new segment starts in metrics order: a resume, or a reshard if the world size changed."""
    found: list[Marker] = []
    prev: dict[str, Any] | None = None
    for r in records:
        if prev is not None and r.get("segment") != prev.get("segment"):
            a, b = int(prev.get("world_size", 0)), int(r.get("world_size", 0))
            found.append(Marker(step=int(r["step"]) - 1, kind="reshard" if a != b else "resume",
                                from_world_size=a, to_world_size=b))
        prev = r
    return found


def loss_curve_png(run_dir: str | Path, out_path: str | Path, *, title: str | None = None) -> Path | None:
    """Write the loss curve of a run to ``out_path``; None (and nothing written) when it has no metrics."""
    records = read_metrics(run_dir)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    curve = loss_by_step(records)
    fig = Figure(figsize=(8, 4), dpi=100)
    ax = fig.add_subplot()
    ax.plot(list(curve), list(curve.values()), color="#1f5fbf", linewidth=1.5, label="loss (last written per step)")
    top = ax.get_xaxis_transform()  # x in steps, y in axes fractions: labels sit at the top
    first_ws = int(records[0].get("world_size", 0))
    ax.text(min(curve), 0.97, f" world size {first_ws}", transform=top, fontsize=8, color="#444444", va="top")
    span = max(max(curve) - min(curve), 1)
    placed: list[int] = []
    for m in markers(records):
        color = "#d9480f" if m.kind == "reshard" else "#2b8a3e"
        ax.axvline(m.step, color=color, linestyle="--", linewidth=1)
        level = sum(1 for s in placed if abs(s - m.step) < 0.12 * span)  # stack labels of nearby markers
        placed.append(m.step)
        text = f" {m.kind} @ {m.step}\n world size {m.from_world_size}→{m.to_world_size}"
        ax.text(m.step, 0.97 - 0.11 * level, text, transform=top, fontsize=8, color=color, va="top")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or f"loss of {Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def png_data_uri(path: str | Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")
