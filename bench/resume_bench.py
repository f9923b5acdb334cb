"""Resume exactness figures, side by side in one run (tiny Llama, CPU, gloo).

    python bench/resume_bench.py     # ~3 min on 2 cores
    python bench/resume_bench.py --plot-only   # redraw bench/results/resume.png from the published table

fp32: same-size resume vs an uninterrupted run (bitwise?), and 4->2, 4->3, 2->4 (max relative loss
difference over the 20 steps after the resume). bf16 compute: same-size resume, and 2->3 compared with
the noise between two uninterrupted runs at 2 and 3 ranks.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

END, CUT = 25, 5


def draw_loss_differences(fig, rows: list[dict[str, str]], label: str) -> None:
    """One bar per resume row: its max relative loss difference (log scale), bitwise rows at the axis floor, the
    1e-6 goal as a line. ``label`` names a row from its cells."""
    from benchlib import numbers

    floor = 1e-10
    ax = fig.add_subplot()
    names = [label(r) for r in rows]
    values = [floor if r["result"].startswith("bitwise") else numbers(r["result"])[0] or floor for r in rows]
    bars = ax.barh(names, values, color=["#2e7d32" if v == floor else "#3f51b5" for v in values])
    for i, (bar, r) in enumerate(zip(bars, rows)):
        text = "bitwise" if r["result"].startswith("bitwise") else r["result"].split(" ")[0]
        ax.annotate(
            text,
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
        if "noise" in r["goal"]:  # compared with the noise between two uninterrupted runs, not with 1e-6
            noise = numbers(r["goal"].split(":")[-1])[0]
            if noise <= 0:
                continue
            ax.plot([noise], [i], marker="|", markersize=16, color="#e65100")
            ax.annotate(
                "noise of two uninterrupted runs",
                (noise, i),
                xytext=(0, 9),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color="#e65100",
            )
    ax.axvline(1e-6, color="grey", ls=":", lw=1)
    ax.annotate("goal ≤ 1e-6", (1e-6, -0.5), xytext=(3, -8), textcoords="offset points", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(floor, 1e-3)
    ax.invert_yaxis()
    ax.set_xlabel("max relative loss difference vs the uninterrupted run (log; bitwise = 0)")


def plot() -> Path:
    """bench/results/resume.png, from the published table."""
    from benchlib import plot_from_table, table_rows

    rows = table_rows("resume")

    def draw(fig) -> None:
        draw_loss_differences(fig, rows, lambda r: f"{r['compute']}  {r['world size']}")
        fig.axes[0].set_title("Resume at the same and another world size, FSDP2")

    return plot_from_table("resume", draw, size=(7.5, 2.8))


def main() -> None:
    from benchlib import plot_only_requested

    if plot_only_requested():
        plot()
        return
    from tests.harness import copy_run_until, metrics, new_run, spawn, tiny_spec
    from trainer.segment import run_segment

    tmp = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    steps = range(CUT + 1, END + 1)

    def run(name: str, world: int, spec, until: int = END, src: Path | None = None, seg: int = 0) -> dict:
        path = copy_run_until(src, tmp / name, CUT) if src else new_run(tmp / name, spec)
        assert spawn(run_segment, world, str(path), until, seg) == [0] * world
        return metrics(path)

    def diff(a: dict, b: dict, key: str = "loss") -> float:
        return max(abs(a[s][key] - b[s][key]) / abs(a[s][key]) for s in steps)

    def bitwise(a: dict, b: dict) -> bool:
        return all(a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"] for s in steps)

    rows = []
    fp32 = tiny_spec()
    ref2 = run("ref2", 2, fp32)
    ref4_cut = tmp / "ref4"
    new_run(ref4_cut, fp32)
    assert spawn(run_segment, 4, str(ref4_cut), CUT, 0) == [0] * 4
    same = run("same", 2, fp32, src=tmp / "ref2", seg=1)
    rows.append(("fp32", "2 -> 2", "bitwise" if bitwise(ref2, same) else f"{diff(ref2, same):.2e}", "bitwise"))
    for start, to in ((4, 2), (4, 3), (2, 4)):
        src = ref4_cut if start == 4 else tmp / "ref2"
        got = run(f"r{start}{to}", to, fp32, src=src, seg=1)
        rows.append(("fp32", f"{start} -> {to}", f"{diff(ref2, got):.2e}", "<= 1e-6"))
    bf16 = tiny_spec(**{"precision.compute": "bf16"})
    b2 = run("b2", 2, bf16)
    b3 = run("b3", 3, bf16)
    noise = diff(b2, b3)
    bsame = run("bsame", 2, bf16, src=tmp / "b2", seg=1)
    b23 = run("b23", 3, bf16, src=tmp / "b2", seg=1)
    rows.append(("bf16", "2 -> 2", "bitwise" if bitwise(b2, bsame) else f"{diff(b2, bsame):.2e}", "bitwise"))
    rows.append(("bf16", "2 -> 3", f"{diff(b2, b23):.2e}", f"noise 2 vs 3 uninterrupted: {noise:.2e}"))
    from benchlib import md_table, publish

    publish(
        "resume",
        f"Max relative loss difference against the uninterrupted 2-rank run, steps {CUT + 1}..{END} "
        "(global batch 12):\n\n" + md_table(["compute", "world size", "result", "goal"], rows),
    )
    plot()
    shutil.rmtree(tmp, ignore_errors=True)
    missed = [r for r in rows if r[3] == "bitwise" and r[2] != "bitwise" or r[3] == "<= 1e-6" and float(r[2]) > 1e-6]
    if missed:
        sys.exit(f"resume_bench: goal missed: {missed}")


if __name__ == "__main__":
    main()
