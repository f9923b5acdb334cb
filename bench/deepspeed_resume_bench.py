"""DeepSpeed resume exactness, side by side in one run (tiny Llama, fp32, CPU, gloo).

    python bench/deepspeed_resume_bench.py     # ~8 min on 2 cores (+2 min the first time: DeepSpeed JIT)

For ZeRO-2 and ZeRO-3: a run resumed at step 5 at the same world size vs the uninterrupted 2-rank run
(bitwise?), and at a new world size 2->3, 2->1, 3->2 (max relative loss difference over the 20 steps
after the resume; the trainer converts to a universal checkpoint by itself). Then the cross-backend
continuation: the ZeRO-2 checkpoint at step 5 converted to DCP and continued under FSDP2, compared with
the noise between the two backends' uninterrupted runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

END, CUT = 25, 5


def plot() -> Path:
    """bench/results/deepspeed-resume.png, from the published table (drawn like resume.png)."""
    from benchlib import plot_from_table, table_rows
    from resume_bench import draw_loss_differences

    rows = table_rows("deepspeed-resume")

    def draw(fig) -> None:
        draw_loss_differences(fig, rows, lambda r: f"{r['backend']}  {r['world size']}")
        fig.axes[0].set_title("Resume at the same and another world size, DeepSpeed ZeRO")

    return plot_from_table("deepspeed-resume", draw, size=(7.5, 3.4))


def main() -> None:
    from benchlib import plot_only_requested

    if plot_only_requested():
        plot()
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    from shardkeeper.stages import convert_checkpoint
    from tests.harness import copy_run_until, metrics, new_run, spawn, tiny_spec
    from trainer.segment import run_segment

    tmp = Path(tempfile.mkdtemp(prefix="ds-resume-bench-"))
    steps = range(CUT + 1, END + 1)

    def run(name: str, world: int, spec=None, until: int = END, src: Path | None = None, seg: int = 0) -> dict:
        path = copy_run_until(src, tmp / name, CUT) if src else new_run(tmp / name, spec)
        assert spawn(run_segment, world, str(path), until, seg, timeout=900) == [0] * world, name
        return metrics(path)

    def diff(a: dict, b: dict, over: range = steps, key: str = "loss") -> float:
        return max(abs(a[s][key] - b[s][key]) / abs(a[s][key]) for s in over)

    def bitwise(a: dict, b: dict) -> bool:
        return all(a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"] for s in steps)

    rows = []
    for stage in (2, 3):
        spec = tiny_spec(**{"backend": "deepspeed", "deepspeed.zero_stage": stage})
        ref2 = run(f"z{stage}-ref2", 2, spec)
        run(f"z{stage}-ref3", 3, spec, until=CUT)
        same = run(f"z{stage}-same", 2, src=tmp / f"z{stage}-ref2", seg=1)
        rows.append(
            (f"ZeRO-{stage}", "2 -> 2", "bitwise" if bitwise(ref2, same) else f"{diff(ref2, same):.2e}", "bitwise")
        )
        for start, to in ((2, 3), (2, 1), (3, 2)):
            got = run(f"z{stage}-{start}{to}", to, src=tmp / f"z{stage}-ref{start}", seg=1)
            rows.append((f"ZeRO-{stage}", f"{start} -> {to}", f"{diff(ref2, got):.2e}", "<= 1e-6"))
        if stage == 2:
            z2 = ref2
    fsdp = run("fsdp-ref2", 2, tiny_spec())
    noise = diff(fsdp, z2, range(1, END + 1))
    cont = tmp / "z2-to-fsdp2"
    convert_checkpoint(tmp / "z2-ref2" / "checkpoints" / f"step-{CUT:08d}", "dcp", cont)
    assert spawn(run_segment, 2, str(cont), END, 0, timeout=900) == [0, 0]
    got = metrics(cont)
    rows.append(
        (
            "ZeRO-2 -> FSDP2",
            "2 -> 2",
            f"{diff(z2, got):.2e} vs ZeRO-2, {diff(fsdp, got):.2e} vs FSDP2",
            f"within the backends' noise: {noise:.2e} (uninterrupted FSDP2 vs ZeRO-2, steps 1..{END})",
        )
    )
    from benchlib import md_table, publish

    publish(
        "deepspeed-resume",
        f"Max relative loss difference against the uninterrupted 2-rank run of the same "
        f"backend, steps {CUT + 1}..{END} (global batch 12, fp32):\n\n"
        + md_table(["backend", "world size", "result", "goal"], rows),
    )
    plot()
    shutil.rmtree(tmp, ignore_errors=True)
    missed = [
        r
        for r in rows
        if r[3] == "bitwise"
        and r[2] != "bitwise"
        or r[3] == "<= 1e-6"
        and float(r[2]) > 1e-6
        or r[0] == "ZeRO-2 -> FSDP2"
        and max(diff(z2, got), diff(fsdp, got)) > max(noise, 1e-6)
    ]
    if missed:
        sys.exit(f"deepspeed_resume_bench: goal missed: {missed}")


if __name__ == "__main__":
    main()
