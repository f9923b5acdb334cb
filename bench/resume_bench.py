"""Resume exactness figures, side by side in one run (tiny Llama, CPU, gloo).

    python bench/resume_bench.py     # ~3 min on 2 cores

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


def main() -> None:
    from tests.harness import spawn
    from tests.harness import copy_run_until, metrics, new_run, tiny_spec
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

    publish("resume", f"Max relative loss difference against the uninterrupted 2-rank run, steps {CUT + 1}..{END} "
            "(global batch 12):\n\n" + md_table(["compute", "world size", "result", "goal"], rows))
    shutil.rmtree(tmp, ignore_errors=True)
    missed = [r for r in rows if r[3] == "bitwise" and r[2] != "bitwise"
              or r[3] == "<= 1e-6" and float(r[2]) > 1e-6]
    if missed:
        sys.exit(f"resume_bench: goal missed: {missed}")


if __name__ == "__main__":
    main()
