"""The lineage dashboard as people read it: the lineage graph drawn as an image, the checkpoints that
exist now, and an overview of every run under a root. Pure rendering (matplotlib, no prefect), so the
CLI and tests can use it; tasks/lineage.py puts the results into Prefect artifacts.

    model = lineage_graph(read_events(run), existing={"checkpoint:step-00000020"})
    draw_lineage_graph(model, "graph.png", title="tiny-llama")
    rows = checkpoints_now(run, read_events(run))
    rows = runs_overview(scan_runs(["runs"], []))

The graph stays readable for 10 or 10,000 checkpoints and any number of segments: plain interval
checkpoints that nothing derives from are folded into the edge that passes over them ("… N checkpoints …"),
so what is drawn is the segment starts and ends, preemptions, reshards, exports, conversions and the newest
checkpoints on disk; past MAX_LANES segments the middle ones share one folded lane. The PNG is at most
1,600 pixels wide and about 1,100 high.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.commit.layout import RunDir, parse_step
from schemas import LineageEvent
from schemas.requests import RunState

LANE_COLORS = ("#1f5fbf", "#2b8a3e", "#9c36b5", "#e8590c", "#0b7285", "#5c940d")
EDGE_STYLES = {  # kind -> (color, linestyle)
    "train": ("#868e96", "-"),
    "resume": ("#2b8a3e", "--"),
    "preempted": ("#e03131", "--"),
    "failed": ("#e03131", ":"),
    "reshard": ("#e8590c", "--"),
    "folded": ("#adb5bd", ":"),
    "export": ("#7048e8", "-"),
    "publish": ("#7048e8", ":"),
    "convert": ("#0b7285", "-."),
}
OUTPUT_STYLE = {"export": ("s", "#7048e8"), "publish": ("D", "#7048e8"), "convert": ("^", "#0b7285")}
MAX_WIDTH_IN, DPI = 16.0, 100
MAX_LANES = 8  # more segments than this: the first, the last MAX_LANES - 2, and one lane for those between
MAX_ON_DISK_NODES = 6  # more plain interval checkpoints on disk than this: the older ones fold into the edges


@dataclass
class GraphNode:
    id: str
    kind: str  # checkpoint | export | publish | convert
    label: str
    x: float
    y: float
    exists: bool = True
    reason: str | None = None
    lane: int = 0
    note: str = ""  # a second line under the label (where a converted checkpoint came from)
    anchor: str = ""  # an output: the checkpoint it is drawn under


@dataclass
class GraphEdge:
    src: str
    dst: str
    kind: str  # a key of EDGE_STYLES
    label: str = ""
    folded: int = 0  # checkpoints drawn as this edge instead of as nodes


@dataclass
class GraphModel:
    nodes: list[GraphNode] = field(default_factory=list)
    edges: list[GraphEdge] = field(default_factory=list)
    lanes: list[tuple[float, str]] = field(default_factory=list)  # (y, "segment 2 · 3 ranks · preempted")
    checkpoints: int = 0  # checkpoints ever written
    folded: int = 0  # of which drawn as "… N checkpoints …" on an edge
    on_disk: int = 0  # of which exist now
    hidden_segments: int = 0  # segments sharing the one folded lane (more than MAX_LANES segments)
    folded_lane: float | None = None  # y of that lane

    def node(self, node_id: str) -> GraphNode:
        return next(n for n in self.nodes if n.id == node_id)

    def checkpoint_nodes(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind == "checkpoint"]


def _segment(e: LineageEvent) -> int:
    return int(e.data.get("segment") or 0)


def _output_kind(e: LineageEvent) -> str | None:
    """export / publish, or convert for a reshard that wrote another checkpoint (a format conversion, a DeepSpeed
    universal checkpoint); None for the rest (a DCP reshard happens at load time: the resume edge shows it)."""
    if e.kind in ("export", "publish"):
        return e.kind
    return "convert" if e.kind == "reshard" and e.uri else None


def lineage_graph(
    events: list[LineageEvent],
    existing: set[str] | None = None,
    *,
    max_lanes: int = MAX_LANES,
    max_on_disk: int = MAX_ON_DISK_NODES,
) -> GraphModel:
    """Nodes, edges and lanes (one per segment) of a run's lineage; ``existing``: ids of checkpoints on disk.

    Drawn as nodes: where each segment starts and ends, checkpoints something derives from (an export, a
    conversion, a validation), any other than a plain interval one (an emergency checkpoint at a preemption),
    and the newest ``max_on_disk`` plain ones on disk. The rest fold into the edge that passes over them
    ("… N checkpoints …"). With more than ``max_lanes`` segments, the middle ones share one lane and only their
    exported or on-disk checkpoints are nodes: the figure stays the same size for any run length."""
    latest: dict[str, LineageEvent] = {}
    for e in events:  # a re-recorded id shows its latest details
        latest[e.id] = e
    existing = existing or set()
    ckpts = sorted((e for e in latest.values() if e.kind == "checkpoint"), key=lambda c: (c.step or 0, c.time))
    derived = {e.parent for e in latest.values() if e.parent and e.kind != "checkpoint"}
    outputs = {e.parent for e in latest.values() if e.parent and _output_kind(e)}
    # a segment the ranks refused before its first step trained nothing: no lane (status and the resume flow skip it)
    segments = {
        int(k.split(":")[1]): e
        for k, e in latest.items()
        if e.kind == "segment"
        and k.startswith("segment:")
        and k.split(":")[1].isdigit()
        and e.data.get("status") != "refused"
    }
    by_segment: dict[int, list[LineageEvent]] = {}
    for c in ckpts:
        by_segment.setdefault(_segment(c), []).append(c)
    seg_index = sorted(set(segments) | set(by_segment))
    hidden = set(seg_index[1 : len(seg_index) - (max_lanes - 2)]) if len(seg_index) > max(max_lanes, 3) else set()

    def world_size(s: int) -> Any:
        ev = segments.get(s)
        return (ev.data.get("world_size") if ev else None) or next(
            (c.data.get("world_size") for c in by_segment.get(s, [])), "?"
        )

    def status(s: int) -> str:  # recorded when a segment ends
        return str(segments[s].data.get("status", "in progress")) if s in segments else "in progress"

    model = GraphModel(
        checkpoints=len(ckpts), on_disk=sum(1 for c in ckpts if c.id in existing), hidden_segments=len(hidden)
    )
    lane_of: dict[int, int] = {}
    for s in seg_index:
        if s in hidden and model.folded_lane is not None:
            lane_of[s] = lane_of[min(hidden)]
            continue
        lane_of[s] = len(model.lanes)
        y = float(-lane_of[s])
        if s in hidden:
            model.folded_lane = y
            counts: dict[str, int] = {}
            for h in hidden:
                counts[status(h)] = counts.get(status(h), 0) + 1
            sizes = sorted({str(world_size(h)) for h in hidden})
            model.lanes.append(
                (
                    y,
                    f"segments {min(hidden)}–{max(hidden)} folded · {len(hidden)} segments · "
                    f"{'/'.join(sizes)} ranks · " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
                )
            )
        else:
            by = str(segments[s].data.get("by") or "") if s in segments else ""
            who = f" · by {by.split(' ', 1)[0]}" if by else ""  # who launched it: train-and-export, automation, ...
            model.lanes.append((y, f"segment {s} · {world_size(s)} ranks · {status(s)}{who}"))

    keep: set[str] = set()
    bounds: set[str] = set()
    for s, group in by_segment.items():
        if s in hidden:
            keep.update(c.id for c in group if c.id in outputs or c.id in existing)
        else:
            keep.update(
                c.id for c in group if c.data.get("reason") != "interval" or c.id in derived or c.id in existing
            )
            bounds.update((group[0].id, group[-1].id))
    keep |= bounds
    plain_on_disk = [
        c.id
        for c in ckpts
        if c.id in keep
        and c.id in existing
        and c.id not in bounds
        and c.data.get("reason") == "interval"
        and c.id not in derived
    ]
    keep -= set(plain_on_disk[: max(len(plain_on_disk) - max_on_disk, 0)])  # the newest ones stay nodes

    kept = [c for c in ckpts if c.id in keep]
    edges: dict[str, GraphEdge] = {}
    for c in kept:
        parent, n, on_disk, hops = c.parent, 0, 0, 0
        while parent in latest and parent not in keep and hops < len(latest):  # hops: a cycle cannot hang it
            n, on_disk, hops = n + 1, on_disk + (parent in existing), hops + 1
            parent = latest[parent].parent
        if parent is None or parent not in keep:
            continue
        p = latest[parent]
        sp, sc = _segment(p), _segment(c)
        crossed = [s for s in seg_index if sp < s < sc]
        kind, label = "train", ""
        if any(s in hidden for s in crossed):
            kind, label = "folded", f"… {len(crossed)} segments · {n} checkpoints …"
        elif sp != sc:
            a, b = p.data.get("world_size"), c.data.get("world_size")
            kind = "reshard" if a != b else "resume"
            label = f"reshard {a}→{b}" if a != b else "resume"
            # how the segment just before this one ended (a failed segment may have written no checkpoint)
            here = seg_index.index(sc)
            cause = status(seg_index[here - 1]) if here > 0 else None
            if cause in ("preempted", "failed") and kind == "resume":
                kind, label = cause, f"resume after {cause}"
            elif cause in ("preempted", "failed"):
                label += f" after {cause}"
            if n:
                label += f" · {n} folded"
        elif n:
            label = f"… {n} checkpoint{'s' if n != 1 else ''}{f' ({on_disk} on disk)' if on_disk else ''} …"
        model.folded += n
        edges[c.id] = GraphEdge(parent, c.id, kind, label, n)

    x = 0.0
    for c in kept:  # left to right by step; a folded edge gets room for its label
        e = edges.get(c.id)
        x += 1.0 if e and e.kind == "folded" else (0.5 if e and e.folded else 0.0)
        lane = lane_of.get(_segment(c), 0)
        note = ""
        if c.data.get("source"):  # a checkpoint converted from another run's
            parts = str(c.data["source"]).rstrip("/").split("/")
            note = "from " + "/".join(parts[-3::2] if len(parts) >= 3 else parts[-1:])
        model.nodes.append(
            GraphNode(
                c.id, "checkpoint", f"{c.step}", x, float(-lane), c.id in existing, c.data.get("reason"), lane, note
            )
        )
        x += 1.0
    model.edges.extend(edges[c.id] for c in kept if c.id in edges)
    _add_outputs(model, latest)
    return model


def _output_label(e: LineageEvent, kind: str) -> str:
    if kind == "convert":
        method = str(e.data.get("method") or "")
        label = "→ " + (
            method.removeprefix("convert-to-")
            if method.startswith("convert-to-")
            else "universal"
            if "universal" in method
            else (method or Path(e.uri or e.id).name)
        )
    else:
        label = str(e.data.get("dtype") or e.data.get("target") or e.id)
    return label if len(label) <= 26 else "…" + label[-25:]  # a URL's tail says where it went


def _add_outputs(model: GraphModel, latest: dict[str, LineageEvent]) -> None:
    """Exports and conversions of a checkpoint stacked below-right of it, each export's publishes right under it."""
    placed = {n.id: n for n in model.nodes}
    rows: dict[str, int] = {}  # checkpoint id -> output rows stacked under it
    publishes: dict[str, list[LineageEvent]] = {}
    for e in latest.values():
        if e.kind == "publish" and e.parent:
            publishes.setdefault(e.parent, []).append(e)

    def place(e: LineageEvent, kind: str, anchor: GraphNode, parent: str) -> None:
        row = rows.get(anchor.id, 0)
        rows[anchor.id] = row + 1
        node = GraphNode(
            e.id,
            kind,
            _output_label(e, kind),
            anchor.x + (0.55 if kind == "publish" else 0.3),
            anchor.y - 0.4 - 0.27 * row,
            True,
            None,
            anchor.lane,
            anchor=anchor.id,
        )
        model.nodes.append(node)
        model.edges.append(GraphEdge(parent, e.id, kind))
        if kind == "export":
            for p in publishes.get(e.id, []):
                place(p, "publish", anchor, e.id)

    for kind in ("export", "convert"):
        for e in latest.values():
            if _output_kind(e) == kind and e.parent in placed:
                place(e, kind, placed[e.parent], e.parent)


def draw_lineage_graph(model: GraphModel, out_path: str | Path, *, title: str) -> Path:
    """The graph as a PNG at most MAX_WIDTH_IN * DPI pixels wide (and, with at most MAX_LANES lanes, about
    1,100 pixels high), whatever the run's length."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    cols = max((n.x for n in model.nodes), default=0) + 1
    rows = max(len(model.lanes), 1)
    fig = Figure(figsize=(min(MAX_WIDTH_IN, max(8.0, 3.5 + 1.2 * cols)), 1.8 + 1.1 * rows), dpi=DPI)
    ax = fig.add_subplot()
    for y, text in model.lanes:
        folded = y == model.folded_lane
        ax.axhspan(
            y - 0.5, y + 0.5, color="#fff9db" if folded else ("#f1f3f5" if int(-y) % 2 == 0 else "#ffffff"), zorder=0
        )
        ax.text(
            -0.9,
            y + 0.42,
            text,
            fontsize=8,
            color="#495057",
            va="center",
            ha="left",
            style="italic" if folded else "normal",
        )
    pos = {n.id: n for n in model.nodes}
    px_per_col = fig.get_figwidth() * DPI / (cols + 1)
    for e in model.edges:
        a, b = pos[e.src], pos[e.dst]
        color, style = EDGE_STYLES.get(e.kind, EDGE_STYLES["train"])
        ax.annotate(
            "",
            xy=(b.x, b.y),
            xytext=(a.x, a.y),
            zorder=1,
            arrowprops={"arrowstyle": "-|>", "color": color, "linestyle": style, "lw": 1.3, "shrinkA": 9, "shrinkB": 9},
        )
        label = e.label
        if e.kind == "train" and e.folded and 5.5 * len(label) + 30 > (b.x - a.x) * px_per_col:
            label = f"+{e.folded}"  # a short edge: the long form would run over the nodes
        if label:
            at = 0.5 if a.y == b.y else 0.6  # a lane change: nearer the child, clear of the parent's step label
            ax.text(
                a.x + at * (b.x - a.x),
                a.y + at * (b.y - a.y) + 0.1,
                label,
                fontsize=7,
                color=color,
                ha="center",
                zorder=3,
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
            )
    goes_down = {e.src for e in model.edges if pos[e.dst].y < pos[e.src].y}
    for n in model.nodes:
        lane_color = LANE_COLORS[n.lane % len(LANE_COLORS)]
        if n.kind == "checkpoint":
            face = lane_color if n.exists else "white"
            edge = "#e03131" if n.reason == "preempted" else (lane_color if n.exists else "#adb5bd")
            ax.scatter([n.x], [n.y], s=260, c=[face], edgecolors=[edge], linewidths=2.2, zorder=2)
            above = n.id in goes_down and not n.note  # an edge leaves downwards: the label goes above the node
            ax.text(
                n.x,
                n.y + (0.2 if above else -0.2),
                f"step {n.label}" + (f"\n{n.note}" if n.note else ""),
                fontsize=7,
                ha="center",
                va="bottom" if above else "top",
                color="#212529" if n.exists else "#868e96",
                zorder=3,
            )
        else:
            marker, color = OUTPUT_STYLE.get(n.kind, OUTPUT_STYLE["export"])
            ax.scatter([n.x], [n.y], s=110, marker=marker, c=[color], zorder=2)
            ax.text(n.x + 0.12, n.y, n.label, fontsize=7, ha="left", va="center", color=color, zorder=3)
    legend = [
        Line2D([], [], marker="o", ls="", color=LANE_COLORS[0], markersize=9, label="checkpoint on disk"),
        Line2D(
            [],
            [],
            marker="o",
            ls="",
            markerfacecolor="white",
            markeredgecolor="#adb5bd",
            markersize=9,
            label="retired (deleted by retention)",
        ),
        Line2D(
            [],
            [],
            marker="o",
            ls="",
            markerfacecolor="white",
            markeredgecolor="#e03131",
            markersize=9,
            label="emergency (preemption)",
        ),
        Line2D([], [], marker="s", ls="", color="#7048e8", label="export (◆ publish)"),
        Line2D([], [], marker="^", ls="", color="#0b7285", label="converted copy"),
        *[
            Line2D([], [], color=EDGE_STYLES[k][0], ls=EDGE_STYLES[k][1], label=text)
            for k, text in (
                ("train", "train"),
                ("resume", "planned resume"),
                ("preempted", "resume after preemption"),
                ("reshard", "reshard"),
                ("folded", "folded checkpoints"),
            )
        ],
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=5, fontsize=7, frameon=False)
    ax.set_xlim(-1, cols)
    ax.set_ylim(min([-(rows - 1) - 0.8, *(n.y - 0.4 for n in model.nodes)]), 0.7)
    ax.axis("off")
    folded = f"; {model.folded} folded into edges (… N …)" if model.folded else ""
    ax.set_title(
        f"{title} — {model.checkpoints} checkpoint{'s' if model.checkpoints != 1 else ''} written, "
        f"{model.on_disk} on disk{folded}",
        fontsize=9,
    )
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
    """One row per committed checkpoint on disk now (storage first, then the memory tier's snapshots): step, tier,
    world size, backend, size, validity as last checked, where it was exported and published."""
    from ckpt.commit.manifest import read_manifest
    from ckpt.memtier.tier import owned_memory_dirs

    rd = RunDir.at(run_dir)
    rows = []
    snaps, seen = [], set()
    for mem in owned_memory_dirs(rd):  # a run on several nodes: one row per snapshot, from the first node's copy
        for p in mem.committed():
            if p.name not in seen:
                seen.add(p.name)
                snaps.append(p)
    for path, tier in [*((p, "storage") for p in rd.committed()), *((p, "memory") for p in snaps)]:
        step = parse_step(path.name) or 0
        ck = f"checkpoint:{path.name}"
        row: dict[str, Any] = {
            "step": step,
            "tier": tier,
            "world_size": "",
            "backend": "",
            "reason": "",
            "size": "",
            "validity": "",
            "exported": "",
            "published": "",
            "path": str(path),
        }
        try:
            m = read_manifest(path)
            row.update(
                world_size=m.topology.world_size,
                backend=m.format,
                reason=m.reason,
                size=human_bytes(sum(f.size for f in m.files)),
            )
        except Exception as e:  # noqa: BLE001 - shown in the row: the table is how a person finds the bad one
            if not path.is_dir():  # retired by the run's retention since it was listed: not on disk now
                continue
            row["validity"] = f"manifest unreadable: {str(e).splitlines()[0][:80]}"
        checks = [e for e in events if e.kind == "validate" and e.parent == ck]
        if not row["validity"]:
            if checks:
                ok = checks[-1].data.get("valid")
                row["validity"] = f"{'valid' if ok else 'INVALID'} (deep, {checks[-1].time[:16].replace('T', ' ')})"
            elif tier == "memory":
                row["validity"] = "hashed while written (memory snapshot)"
            elif rd.verified_record(step).is_file():
                row["validity"] = "valid (background re-read)"
            else:
                row["validity"] = "not checked since commit"
        exports = [e for e in events if e.kind == "export" and e.parent == ck]
        row["exported"] = ", ".join(
            sorted({f"{e.data.get('dtype', '?')} → {Path(e.uri or e.id).name}" for e in exports})
        )
        ids = {e.id for e in exports}
        row["published"] = ", ".join(
            sorted(
                {
                    f"{e.data.get('target')}@{e.data.get('revision') or 'main'}"
                    for e in events
                    if e.kind == "publish" and e.parent in ids
                }
            )
        )
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
        rows.append(
            {
                "run": rd.root.name,
                "status": status,
                "step": s.step,
                "until_step": s.last_until_step if s.last_until_step is not None else "",
                "last_checkpoint": Path(s.checkpoint).name if s.checkpoint else "",
                "tier": s.tier or "",
                "world_size": s.world_size or "",
                "last_activity": age(now - max(stamps)) if stamps else "",
                "run_dir": str(rd.root),
            }
        )
    return rows


def markdown_rows(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    columns = columns or list(rows[0])
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    return (
        "| "
        + " | ".join(c.replace("_", " ") for c in columns)
        + " |\n|"
        + "---|" * len(columns)
        + "\n"
        + "".join("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |\n" for r in rows)
    )
