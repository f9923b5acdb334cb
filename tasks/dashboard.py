"""The lineage dashboard as people read it: the lineage graph drawn as an image, the checkpoints that
exist now, and an overview of every run under a root. Pure rendering (matplotlib, no prefect), so the
CLI and tests can use it; tasks/lineage.py puts the results into Prefect artifacts.

    model = lineage_graph(read_events(run), existing={"checkpoint:step-00000020"})
    draw_lineage_graph(model, "graph.png", title="tiny-llama")
    rows = checkpoints_now(run, read_events(run))
    rows = runs_overview(scan_runs(["runs"], []))

The graph stays readable for 10 or 10,000 checkpoints: interval checkpoints that nothing derives from and
that no longer exist are folded into the edge that passes over them ("+N"), so what is drawn is the
segment starts and ends, preemptions, reshards, exports and the checkpoints on disk now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.layout import RunDir, parse_step
from schemas import LineageEvent
from schemas.requests import RunState

LANE_COLORS = ("#1f5fbf", "#2b8a3e", "#9c36b5", "#e8590c", "#0b7285", "#5c940d")
EDGE_STYLES = {  # kind -> (color, linestyle)
    "train": ("#868e96", "-"), "resume": ("#2b8a3e", "--"), "preempted": ("#e03131", "--"),
    "failed": ("#e03131", ":"), "reshard": ("#e8590c", "--"), "export": ("#7048e8", "-"), "publish": ("#7048e8", ":"),
}
MAX_WIDTH_IN, DPI = 16.0, 100


@dataclass
class GraphNode:
    id: str
    kind: str  # checkpoint | export | publish
    label: str
    x: float
    y: float
    exists: bool = True
    reason: str | None = None
    lane: int = 0


@dataclass
class GraphEdge:
    src: str
    dst: str
    kind: str  # a key of EDGE_STYLES
    label: str = ""


@dataclass
class GraphModel:
    nodes: list[GraphNode] = field(default_factory=list)
    edges: list[GraphEdge] = field(default_factory=list)
    lanes: list[tuple[float, str]] = field(default_factory=list)  # (y, "segment 2 · 3 ranks · preempted")
    checkpoints: int = 0  # checkpoints ever written
    folded: int = 0  # of which drawn as "+N" on an edge

    def node(self, node_id: str) -> GraphNode:
        return next(n for n in self.nodes if n.id == node_id)


def lineage_graph(events: list[LineageEvent], existing: set[str] | None = None) -> GraphModel:
    """Nodes, edges and lanes (one per segment) of a run's lineage; ``existing``: ids of checkpoints on disk."""
    latest: dict[str, LineageEvent] = {}
    for e in events:  # a re-recorded id shows its latest details
        latest[e.id] = e
    existing = existing or set()
    ckpts = [e for e in latest.values() if e.kind == "checkpoint"]
    derived = {e.parent for e in latest.values() if e.parent and e.kind != "checkpoint"}
    keep = {c.id for c in ckpts if c.data.get("reason") != "interval" or c.id in derived or c.id in existing}
    by_segment: dict[int, list[LineageEvent]] = {}
    for c in ckpts:
        by_segment.setdefault(int(c.data.get("segment", 0)), []).append(c)
    for group in by_segment.values():  # where each segment starts and ends
        group.sort(key=lambda c: (c.step or 0, c.time))
        keep.update((group[0].id, group[-1].id))
    segments = {e.id: e for e in latest.values() if e.kind == "segment" and e.id.startswith("segment:")}
    seg_index = sorted({int(s.split(":")[1]) for s in segments} | {int(c.data.get("segment", 0)) for c in ckpts})
    lane_of = {s: i for i, s in enumerate(seg_index)}
    model = GraphModel(checkpoints=len(ckpts))
    for s in seg_index:
        ev = segments.get(f"segment:{s}")
        ws = ev.data.get("world_size") if ev else next((c.data.get("world_size") for c in ckpts
                                                        if c.data.get("segment") == s), "?")
        status = ev.data.get("status", "in progress") if ev else "in progress"  # recorded when a segment ends
        model.lanes.append((float(-lane_of[s]), f"segment {s} · {ws} ranks · {status}"))
    kept = sorted((c for c in ckpts if c.id in keep), key=lambda c: (c.step or 0, c.time))
    for x, c in enumerate(kept):
        lane = lane_of.get(int(c.data.get("segment", 0)), 0)
        model.nodes.append(GraphNode(c.id, "checkpoint", f"{c.step}", float(x), float(-lane), c.id in existing,
                                     c.data.get("reason"), lane))
    seg_status = {int(k.split(":")[1]): v.data.get("status") for k, v in segments.items()}
    for c in kept:
        parent, folded = c.parent, 0
        while parent in latest and parent not in keep:
            parent, folded = latest[parent].parent, folded + 1
        if parent is None or parent not in keep:
            continue
        model.folded += folded
        p = latest[parent]
        kind, label = "train", ""
        if p.data.get("segment") != c.data.get("segment"):
            a, b = p.data.get("world_size"), c.data.get("world_size")
            kind = "reshard" if a != b else "resume"
            label = f"reshard {a}→{b}" if a != b else "resume"
            # how the segment just before this one ended (a failed segment may have written no checkpoint)
            here = seg_index.index(int(c.data.get("segment", 0)))
            cause = seg_status.get(seg_index[here - 1]) if here > 0 else None
            if cause in ("preempted", "failed") and kind == "resume":
                kind, label = cause, f"resume after {cause}"
            elif cause in ("preempted", "failed"):
                label += f" after {cause}"
        if folded:
            label = f"{label} +{folded}".strip()
        model.edges.append(GraphEdge(parent, c.id, kind, label))
    _add_outputs(model, latest)
    return model


def _add_outputs(model: GraphModel, latest: dict[str, LineageEvent]) -> None:
    """Exports below their checkpoint, publishes below their export."""
    placed = {n.id: n for n in model.nodes}
    for kind, below in (("export", 0.45), ("publish", 0.9)):
        for e in (e for e in latest.values() if e.kind == kind and e.parent in placed):
            parent = placed[e.parent]
            siblings = sum(1 for n in model.nodes if n.kind == kind and abs(n.x - parent.x) < 0.5)
            label = str(e.data.get("dtype") or e.data.get("target") or e.id)
            label = label if len(label) <= 26 else "…" + label[-25:]  # a URL's tail says where it went
            node = GraphNode(e.id, kind, label, parent.x + 0.25 * siblings, parent.y - below, True, None, parent.lane)
            model.nodes.append(node)
            placed[e.id] = node
            model.edges.append(GraphEdge(e.parent, e.id, kind))


def draw_lineage_graph(model: GraphModel, out_path: str | Path, *, title: str) -> Path:
    """The graph as a PNG at most MAX_WIDTH_IN * DPI pixels wide, whatever the run's length."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    cols = max((n.x for n in model.nodes), default=0) + 1
    rows = max(len(model.lanes), 1)
    fig = Figure(figsize=(min(MAX_WIDTH_IN, max(8.0, 3.5 + 1.2 * cols)), 1.8 + 1.1 * rows), dpi=DPI)
    ax = fig.add_subplot()
    for y, text in model.lanes:
        ax.axhspan(y - 0.5, y + 0.5, color="#f1f3f5" if int(-y) % 2 == 0 else "#ffffff", zorder=0)
        ax.text(-0.9, y + 0.32, text, fontsize=8, color="#495057", va="center", ha="left")
    pos = {n.id: n for n in model.nodes}
    for e in model.edges:
        a, b = pos[e.src], pos[e.dst]
        color, style = EDGE_STYLES.get(e.kind, EDGE_STYLES["train"])
        ax.annotate("", xy=(b.x, b.y), xytext=(a.x, a.y), zorder=1,
                    arrowprops={"arrowstyle": "-|>", "color": color, "linestyle": style, "lw": 1.3,
                                "shrinkA": 9, "shrinkB": 9})
        if e.label:
            ax.text(a.x + 0.55 * (b.x - a.x), a.y + 0.55 * (b.y - a.y) + 0.1, e.label, fontsize=7, color=color,
                    ha="center", zorder=3, bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    for n in model.nodes:
        lane_color = LANE_COLORS[n.lane % len(LANE_COLORS)]
        if n.kind == "checkpoint":
            face = lane_color if n.exists else "white"
            edge = "#e03131" if n.reason == "preempted" else (lane_color if n.exists else "#adb5bd")
            ax.scatter([n.x], [n.y], s=260, c=[face], edgecolors=[edge], linewidths=2.2, zorder=2)
            ax.text(n.x, n.y - 0.27, f"step {n.label}", fontsize=7, ha="center", va="top",
                    color="#212529" if n.exists else "#868e96", zorder=3)
        else:
            marker = "s" if n.kind == "export" else "D"
            ax.scatter([n.x], [n.y], s=120, marker=marker, c=["#7048e8"], zorder=2)
            ax.text(n.x + 0.12, n.y, n.label, fontsize=7, ha="left", va="center", color="#5f3dc4", zorder=3)
    legend = [
        Line2D([], [], marker="o", ls="", color=LANE_COLORS[0], markersize=9, label="checkpoint on disk"),
        Line2D([], [], marker="o", ls="", markerfacecolor="white", markeredgecolor="#adb5bd", markersize=9,
               label="retired (deleted by retention)"),
        Line2D([], [], marker="o", ls="", markerfacecolor="white", markeredgecolor="#e03131", markersize=9,
               label="emergency (preemption)"),
        Line2D([], [], marker="s", ls="", color="#7048e8", label="export / publish (◆)"),
        *[Line2D([], [], color=EDGE_STYLES[k][0], ls=EDGE_STYLES[k][1], label=k)
          for k in ("train", "resume", "preempted", "reshard")],
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=7, frameon=False)
    ax.set_xlim(-1, cols)
    ax.set_ylim(min([-(rows - 1) - 0.8, *(n.y - 0.4 for n in model.nodes)]), 0.7)
    ax.axis("off")
    folded = f"; {model.folded} interval checkpoints folded into edges (+N)" if model.folded else ""
    ax.set_title(f"{title} — {model.checkpoints} checkpoint{'s' if model.checkpoints != 1 else ''} written, "
                 f"{sum(1 for n in model.nodes if n.kind == 'checkpoint' and n.exists)} on disk{folded}", fontsize=9)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


# ----------------------------------------------------------------------------- tables
def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def age(seconds: float) -> str:
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def checkpoints_now(run_dir: str | Path, events: list[LineageEvent]) -> list[dict[str, Any]]:
    """One row per committed checkpoint on disk now: step, world size, backend, size, validity as last checked,
    where it was exported and published."""
    from ckpt.manifest import read_manifest

    rd = RunDir.at(run_dir)
    rows = []
    for path in rd.committed():
        step = parse_step(path.name) or 0
        ck = f"checkpoint:{path.name}"
        row: dict[str, Any] = {"step": step, "world_size": "", "backend": "", "reason": "", "size": "", "validity": "",
                               "exported": "", "published": "", "path": str(path)}
        try:
            m = read_manifest(path)
            row.update(world_size=m.topology.world_size, backend=m.format, reason=m.reason,
                       size=human_bytes(sum(f.size for f in m.files)))
        except Exception as e:  # noqa: BLE001 - shown in the row: the table is how a person finds the bad one
            row["validity"] = f"manifest unreadable: {str(e).splitlines()[0][:80]}"
        checks = [e for e in events if e.kind == "validate" and e.parent == ck]
        if not row["validity"]:
            if checks:
                ok = checks[-1].data.get("valid")
                row["validity"] = f"{'valid' if ok else 'INVALID'} (deep, {checks[-1].time[:16].replace('T', ' ')})"
            elif rd.verified_record(step).is_file():
                row["validity"] = "valid (background re-read)"
            else:
                row["validity"] = "not checked since commit"
        exports = [e for e in events if e.kind == "export" and e.parent == ck]
        row["exported"] = ", ".join(sorted({f"{e.data.get('dtype', '?')} → {Path(e.uri or e.id).name}" for e in exports}))
        ids = {e.id for e in exports}
        row["published"] = ", ".join(sorted({f"{e.data.get('target')}@{e.data.get('revision') or 'main'}"
                                             for e in events if e.kind == "publish" and e.parent in ids}))
        rows.append(row)
    return rows


def runs_overview(states: list[RunState], now: float | None = None) -> list[dict[str, Any]]:
    """One row per run: status (running / preempted / failed / completed / cancelled / interrupted / new),
    step and target, last checkpoint, world size, last activity."""
    now = time.time() if now is None else now
    rows = []
    for s in states:
        rd = RunDir.at(s.run_dir)
        stamps = [p.stat().st_mtime for p in (rd.lineage, rd.metrics, rd.segments) if p.exists()]
        status = "running" if s.locked else (s.last_status or ("new" if s.exists else "not a run"))
        rows.append({"run": rd.root.name, "status": status,
                     "step": s.step, "until_step": s.last_until_step if s.last_until_step is not None else "",
                     "last_checkpoint": Path(s.checkpoint).name if s.checkpoint else "",
                     "world_size": s.world_size or "", "last_activity": age(now - max(stamps)) if stamps else "",
                     "run_dir": str(rd.root)})
    return rows


def markdown_rows(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    columns = columns or list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return ("| " + " | ".join(c.replace("_", " ") for c in columns) + " |\n|" + "---|" * len(columns) + "\n"
            + "".join("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |\n" for r in rows))
