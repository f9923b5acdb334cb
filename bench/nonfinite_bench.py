"""Non-finite steps: does every run whose loss or gradient norm becomes NaN/Inf end non-zero, without a committed
checkpoint holding NaN/Inf? (tiny Llama from a pretrained folder, fp32, 2 CPU ranks, through shardkeeper.stages)

    python bench/nonfinite_bench.py        # ~5 min on 2 cores (11 segments)

The matrix: FSDP2 and DeepSpeed ZeRO-2 x a NaN loss or a NaN gradient norm (with a finite loss) x at the first step
or mid-run (step 4), made as in tests/test_nonfinite.py: the embedding row of one token is NaN (loss) or 3e38
(gradient), and a token file holds that token only in a sample of the chosen step. Preflight's scan of the weights
is switched off for the NaN rows (it would refuse them before any rank starts). Mid-run NaN-loss runs save every
100 steps: with the NaN in the weights from the start, a save before the bad step is refused by the commit's own
check, which one more row shows (every step saved). Plus the issue's case, lr 1e6 from random weights, per backend.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOKEN, SEQ, BATCH, SEED, UNTIL = 7, 32, 12, 1234, 6


def poisoned(base: Path, out: Path, value: float) -> Path:
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(base, out))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.weight"][TOKEN] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def token_file(path: Path, vocab: int, bad_step: int) -> Path:
    """TOKEN only in rank 0's first sample of 0-based step ``bad_step``."""
    from trainer.builtin.data import GlobalOrderLoader

    tokens = np.random.default_rng(0).integers(TOKEN + 1, vocab, size=1 << 16).astype(np.uint16)
    tokens[GlobalOrderLoader(tokens, SEQ, SEED, BATCH).starts(bad_step, 0, 1)[0] + 3] = TOKEN
    np.save(path, tokens)
    return path


def nonfinite_committed(run: Path) -> list[str]:
    """Committed checkpoints whose manifest's fingerprint holds NaN/Inf (read as raw JSON: the schema refuses them)."""
    bad = []
    for ck in sorted((run / "checkpoints").glob("step-????????")):
        try:
            fp = json.loads((ck / "manifest.json").read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            continue
        values = [*fp["model"].values(), *fp["optim"].values(), fp["optim_step"]]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            bad.append(ck.name)
    return bad


def main() -> None:
    import shardkeeper.preflight
    from infra.make_tiny_pretrained import make
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import plan_topology, train_segment

    tmp = Path(tempfile.mkdtemp(prefix="nonfinite-bench-"))
    base = make(tmp / "base", "tiny", tied=False)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    folders = {
        "loss": poisoned(base, tmp / "nan-base", float("nan")),
        "gradient": poisoned(base, tmp / "big-base", 3e38),
    }
    shardkeeper.preflight.check_finite_weights = lambda *a, **k: None  # the NaN rows are meant for the ranks

    cases = []  # (backend, cause, expected step, sets, config)
    for backend in ("fsdp2", "deepspeed"):
        for what in ("loss", "gradient"):
            for when, step in (("first step", 1), ("mid-run", 4)):
                interval = 100 if what == "loss" and when == "mid-run" else 1
                data = token_file(tmp / f"tokens-{step}.npy", vocab, step - 1)
                sets = [
                    f"model.pretrained={folders[what]}",
                    "data.source=tokens",
                    f"data.path={data}",
                    f"checkpoint.interval={interval}",
                ]
                cases.append(
                    (
                        backend,
                        f"{what} at {when} (pretrained row {'NaN' if what == 'loss' else '3e38'})",
                        step,
                        sets,
                        ROOT / "configs" / "tiny-finetune.yaml",
                    )
                )
        cases.append(
            (
                backend,
                "lr 1e6 (random weights)",
                None,
                ["optim.lr=1e6", "checkpoint.interval=1"],
                ROOT / "configs" / "tiny.yaml",
            )
        )
    cases.append(
        (
            "fsdp2",
            "NaN weights met at step 4, every step saved",
            4,
            [
                f"model.pretrained={folders['loss']}",
                "data.source=tokens",
                f"data.path={tmp / 'tokens-4.npy'}",
                "checkpoint.interval=1",
            ],
            ROOT / "configs" / "tiny-finetune.yaml",
        )
    )

    rows, good = [], 0
    for i, (backend, cause, step, sets, config) in enumerate(cases):  # noqa: B007
        ds = ["backend=deepspeed", "deepspeed.zero_stage=2"] if backend == "deepspeed" else []
        spec = load_run_spec(
            config,
            [
                f"data.seq_len={SEQ}",
                f"global_batch_size={BATCH}",
                f"seed={SEED}",
                "checkpoint.keep_last=100",
                *sets,
                *ds,
            ],
        )
        run = tmp / f"run-{i}"
        t0 = time.perf_counter()
        res = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), UNTIL, sink=lambda line: None)
        seconds = time.perf_counter() - t0
        committed = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-????????"))
        bad = nonfinite_committed(run)
        ok = res.exit_code != 0 and not bad
        good += ok
        how = (res.failure or res.note or "").split(";")[0].split(" (")[0]
        rows.append(
            (
                backend,
                cause,
                res.status,
                res.exit_code,
                how,
                ", ".join(map(str, committed)) or "none",
                ", ".join(bad) or "none",
                f"{seconds:.0f}",
                "yes" if ok else "**no**",
            )
        )
        print(rows[-1], flush=True)
    from benchlib import md_table, publish

    publish(
        "nonfinite",
        f"Runs ending non-zero without a committed non-finite checkpoint: **{good}/{len(rows)}** "
        f"(2 ranks, --until-step {UNTIL}, every segment through shardkeeper.stages.train_segment):\n\n"
        + md_table(
            [
                "backend",
                "cause",
                "status",
                "exit",
                "how it ended",
                "committed steps",
                "non-finite committed",
                "s",
                "ok",
            ],
            rows,
            "llllllllr",
        ),
    )
    shutil.rmtree(tmp, ignore_errors=True)
    if good != len(rows):
        sys.exit(f"nonfinite_bench: {len(rows) - good} run(s) ended 0 or committed a non-finite checkpoint")


if __name__ == "__main__":
    main()
