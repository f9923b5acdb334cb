"""Render a run's lineage for people: rows for a table artifact, the loss curve (PNG) with markers at
resume and reshard points, and the lineage graph (PNG; its layout model and the checkpoint tables are in
tasks/dashboard.py).

    from tasks.render import lineage_graph_png, loss_curve_png, table_rows
    rows = table_rows(read_events("runs/demo"))
    loss_curve_png("runs/demo", "runs/demo/loss.png")
    lineage_graph_png(read_events("runs/demo"), "runs/demo/lineage.png", title="demo",
                      existing={"checkpoint:step-00000100"})

No prefect import: the CLI can use it, and tasks/lineage.py mirrors its output into Prefect artifacts.
"""

from __future__ import annotations

import base64
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import read_jsonl
from ckpt.commit.layout import RunDir
from schemas import LineageEvent
from tasks.dashboard import draw_lineage_graph, lineage_graph

log = logging.getLogger(__name__)

# Details worth a column: the rest stays in lineage.jsonl.
DETAIL_KEYS = (
    "reason",
    "status",
    "world_size",
    "from_world_size",
    "to_world_size",
    "method",
    "dtype",
    "num_shards",
    "target",
    "revision",
    "skipped",
    "valid",
    "until_step",
    "tier",
    "persisted_from",
    "by",
)


def slug(text: str, *, max_len: int = 60) -> str:
    """Lowercase letters, digits and dashes only (what Prefect artifact keys accept)."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (s[:max_len].rstrip("-")) or "run"


def details(event: LineageEvent) -> str:
    return ", ".join(f"{k}={event.data[k]}" for k in DETAIL_KEYS if event.data.get(k) is not None)


def table_rows(events: list[LineageEvent]) -> list[dict[str, Any]]:
    """One row per event, for a Prefect table artifact or a CSV."""
    return [
        {
            "time": e.time,
            "kind": e.kind,
            "id": e.id,
            "parent": e.parent or "",
            "step": e.step,
            "details": details(e),
            "uri": e.uri or "",
        }
        for e in events
    ]


# ----------------------------------------------------------------------------- loss curve
@dataclass(frozen=True)
class Marker:
    step: int  # the checkpoint step the next segment resumed from
    kind: str  # "resume" or "reshard" (world size changed)
    from_world_size: int
    to_world_size: int
    cause: str = "planned"  # how the segment before it ended: "preempted", "failed", "cancelled", "completed" (planned)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(RunDir.at(run_dir).metrics) if "step" in r and "loss" in r]


def loss_by_step(records: list[dict[str, Any]]) -> dict[int, float]:
    """Last-written loss per step: a resumed segment that repeats steps wins over the lost ones."""
    out: dict[int, float] = {}
    for r in records:
        out[int(r["step"])] = float(r["loss"])
    return dict(sorted(out.items()))


def eval_by_step(records: list[dict[str, Any]]) -> dict[int, float]:
    """Last-written held-out loss per step (the rows where an evaluation ran)."""
    out: dict[int, float] = {}
    for r in records:
        if r.get("eval_loss") is not None:
            out[int(r["step"])] = float(r["eval_loss"])
    return dict(sorted(out.items()))


def segment_statuses(events: list[LineageEvent]) -> dict[int, str]:
    """How each segment ended, from the lineage (``segment:N`` events)."""
    return {
        int(e.id.split(":")[1]): str(e.data.get("status"))
        for e in events
        if e.kind == "segment" and e.id.startswith("segment:") and e.id.split(":")[1].isdigit()
    }


def markers(records: list[dict[str, Any]], statuses: dict[int, str] | None = None) -> list[Marker]:
    """Where a new segment starts in metrics order: a resume, or a reshard if the world size changed; with
    ``statuses`` (segment_statuses), whether the segment before it was preempted, failed or planned."""
    found: list[Marker] = []
    prev: dict[str, Any] | None = None
    for r in records:
        if prev is not None and r.get("segment") != prev.get("segment"):
            a, b = int(prev.get("world_size", 0)), int(r.get("world_size", 0))
            cause = (statuses or {}).get(int(prev.get("segment", -1)), "planned")
            found.append(
                Marker(
                    step=int(r["step"]) - 1,
                    kind="reshard" if a != b else "resume",
                    from_world_size=a,
                    to_world_size=b,
                    cause="planned" if cause in ("completed", "planned") else cause,
                )
            )
        prev = r
    return found


def loss_curve_png(
    run_dir: str | Path, out_path: str | Path, *, title: str | None = None, statuses: dict[int, str] | None = None
) -> Path | None:
    """Write the loss curve of a run to ``out_path``; None (and nothing written) when it has no metrics.
    Resumes after a preemption or failure are drawn red, planned ones green, reshards orange."""
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
    held_out = eval_by_step(records)
    if held_out:
        ax.plot(
            list(held_out),
            list(held_out.values()),
            color="#e8590c",
            linewidth=1.2,
            marker="o",
            markersize=4,
            label="held-out loss (eval)",
        )
    top = ax.get_xaxis_transform()  # x in steps, y in axes fractions: labels sit at the top
    first_ws = int(records[0].get("world_size", 0))
    ax.text(min(curve), 0.97, f" world size {first_ws}", transform=top, fontsize=8, color="#444444", va="top")
    span = max(max(curve) - min(curve), 1)
    placed: list[int] = []
    for m in markers(records, statuses):
        color = "#e03131" if m.cause != "planned" else ("#d9480f" if m.kind == "reshard" else "#2b8a3e")
        ax.axvline(m.step, color=color, linestyle="--", linewidth=1)
        level = sum(1 for s in placed if abs(s - m.step) < 0.12 * span)  # stack labels of nearby markers
        placed.append(m.step)
        after = "" if m.cause == "planned" else f" after {m.cause}"
        text = f" {m.kind}{after} @ {m.step}\n world size {m.from_world_size}→{m.to_world_size}"
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


def lineage_graph_png(
    events: list[LineageEvent], out_path: str | Path, *, title: str, existing: set[str] | None = None
) -> Path:
    """The lineage graph of ``events`` drawn to ``out_path`` (tasks.dashboard.lineage_graph: a lane per segment,
    checkpoints in ``existing`` filled and the rest hollow, plain interval chains folded)."""
    return draw_lineage_graph(lineage_graph(events, existing), out_path, title=title)
