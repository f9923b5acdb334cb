"""The fuzzer's seed corpus (``tests/reliability/fuzz_seed/``) and the copies the fuzzer mutates.

Regenerate the committed corpus (three segments of the model in ``fuzz_seed/config.yaml``, in-process gloo
ranks, ~1 min on 2 cores; ~0.4 MB)::

    python -m tests.reliability.fuzz_corpus

What it holds, each the real output of the product's own writers:

* ``dcp/``: a run directory (``run.yaml``) with the FSDP2 checkpoint ``step-00000002`` of two ranks (every tensor
  in two chunks, the 1-element-per-rank norms included);
* ``deepspeed/``: the DeepSpeed ZeRO-2 checkpoint ``step-00000002`` of two ranks (its native ``*_optim_states.pt``
  and ``mp_rank_00_model_states.pt``, manifest and state file);
* ``memory/``: a one-rank run whose rank died right after the memory snapshot of step 3 (memory tier on, storage
  holds step 2; a snapshot is only loaded at the world size that wrote it, and the fuzzer resumes on one rank):
  ``run/`` (``run.yaml``, ``.run-id``, ``checkpoints/step-00000002``) and ``shm/`` (``tier.json``,
  ``checkpoints/step-00000003``). Absolute paths in it are rewritten when a copy is made (``memory_copy``).

The copies the fuzzer mutates are made from it here: a plain ``dcp.save`` folder of another tool, an HF
Trainer/DeepSpeed ``checkpoint-N/`` as ``shardkeeper import`` reads it, a run directory for a resume.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

SEED = Path(__file__).resolve().parent / "fuzz_seed"
CONFIG = SEED / "config.yaml"
DCP_STEP, DS_STEP, SNAP_STEP = 2, 2, 3
MEMORY_STORED_STEP = 2


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# ------------------------------------------------------------------------------------------ copies to mutate
def dcp_run_copy(dst: Path) -> Path:
    """A run directory holding the seed's DCP checkpoint (for validate --deep and a resume). Returns the run dir."""
    shutil.copytree(SEED / "dcp", dst)
    return dst


def dcp_ckpt(run: Path) -> Path:
    return run / "checkpoints" / step_name(DCP_STEP)


def plain_dcp_copy(dst: Path) -> Path:
    """The seed's DCP checkpoint as a plain ``dcp.save({"model": ..., "optimizer": ...})`` folder of another tool:
    the same ``.distcp`` files, the optimizer keys another tool's ``get_state_dict`` gives, no manifest."""
    from tests.reliability.corrupt import plain_dcp_source

    return plain_dcp_source(SEED / "dcp" / "checkpoints" / step_name(DCP_STEP), dst)


def ds_ckpt_copy(dst: Path) -> Path:
    """The seed's DeepSpeed checkpoint as shardkeeper committed it (manifest included), in a run directory."""
    shutil.copytree(SEED / "deepspeed", dst)
    return dst / "checkpoints" / step_name(DS_STEP)


def trainer_copy(dst: Path) -> Path:
    """The seed's DeepSpeed checkpoint as a Hugging Face Trainer leaves it with DeepSpeed on: ``checkpoint-N/``
    holding ``latest``, ``global_stepN/`` (the engine's files), ``zero_to_fp32.py``, ``trainer_state.json`` and
    the files import never opens (an rng state, the scheduler). Returns ``checkpoint-N/``."""
    src = SEED / "deepspeed" / "checkpoints" / step_name(DS_STEP)
    out = dst / f"checkpoint-{DS_STEP}"
    tag = out / f"global_step{DS_STEP}"
    tag.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.endswith(("_optim_states.pt", "_model_states.pt")):
            shutil.copy(f, tag / f.name)
    (out / "latest").write_text(tag.name)
    (out / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script, copied by the engine (never run here)\n")
    (out / "trainer_state.json").write_text(json.dumps({"global_step": DS_STEP, "log_history": []}))
    (out / "rng_state_0.pth").write_bytes(b"never opened by import")
    (out / "scheduler.pt").write_bytes(b"never opened by import")
    return out


def memory_copy(dst: Path) -> tuple[Path, Path]:
    """The seed's crashed memory-tier run under ``dst`` (``run/``, ``shm/``), its absolute paths (run.yaml's and the
    snapshot manifest's memory_dir, tier.json's run directory, ``.memory-dirs``) pointing at the copy. Returns
    (run dir, memory dir)."""
    from ckpt.commit.fsutil import dump_yaml, load_yaml

    shutil.copytree(SEED / "memory", dst)
    run, shm = dst / "run", dst / "shm"
    spec = load_yaml((run / "run.yaml").read_text())
    spec["checkpoint"]["memory_dir"] = str(shm)
    (run / "run.yaml").write_text(dump_yaml(spec))
    owner = json.loads((shm / "tier.json").read_text())
    (shm / "tier.json").write_text(json.dumps({**owner, "run_dir": str(run)}))
    (run / ".memory-dirs").write_text(f"{shm}\n")
    snap = shm / "checkpoints" / step_name(SNAP_STEP)
    raw = json.loads((snap / "manifest.json").read_text())
    raw["run_spec"]["checkpoint"]["memory_dir"] = str(shm)
    (snap / "manifest.json").write_text(json.dumps(raw))
    return run, shm


# ------------------------------------------------------------------------------------------ regeneration
def _segment(run: Path, spec: object, until: int, env: dict[str, str] | None = None, world: int = 2) -> None:
    from ckpt.commit.layout import RunDir
    from shardkeeper.stages import prepare_run_dir
    from tests.harness import spawn
    from trainer.segment import run_segment

    prepare_run_dir(RunDir.at(run), spec)  # type: ignore[arg-type]
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        assert spawn(run_segment, world, str(run), until, 0, timeout=900) == [0] * world
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _keep(src_run: Path, dst: Path, names: list[str], steps: list[int]) -> None:
    dst.mkdir(parents=True)
    for name in names:
        if (src_run / name).exists():
            shutil.copy(src_run / name, dst / name)
    (dst / "checkpoints").mkdir()
    for step in steps:
        shutil.copytree(src_run / "checkpoints" / step_name(step), dst / "checkpoints" / step_name(step))


def regenerate() -> None:
    """Write the three seeds from scratch into ``fuzz_seed/`` (the config stays)."""
    from shardkeeper.config import load_run_spec

    with tempfile.TemporaryDirectory(prefix="fuzz-seed-") as tmp:
        t = Path(tmp)
        spec = load_run_spec(CONFIG)
        _segment(t / "dcp", spec, DCP_STEP)
        ds_spec = load_run_spec(CONFIG, ["backend=deepspeed", "deepspeed.zero_stage=2"])
        _segment(
            t / "ds",
            ds_spec,
            DS_STEP,
            {
                "DS_ACCELERATOR": "cpu",
                "TORCH_EXTENSIONS_DIR": os.environ.get(
                    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")
                ),
            },
        )
        mem_spec = load_run_spec(CONFIG, ["checkpoint.memory_interval=1", f"checkpoint.memory_dir={t / 'shm'}"])
        _segment(t / "mem", mem_spec, SNAP_STEP, world=1)  # a snapshot is loaded at the world size that wrote it
        for sub in ("dcp", "deepspeed", "memory"):
            shutil.rmtree(SEED / sub, ignore_errors=True)
        _keep(t / "dcp", SEED / "dcp", ["run.yaml"], [DCP_STEP])
        _keep(t / "ds", SEED / "deepspeed", ["run.yaml"], [DS_STEP])
        # the ranks died right after the snapshot of step 3: storage holds step 2, memory step 3
        _keep(t / "mem", SEED / "memory" / "run", ["run.yaml", ".run-id"], [MEMORY_STORED_STEP])
        shm = SEED / "memory" / "shm"
        (shm / "checkpoints").mkdir(parents=True)
        shutil.copy(t / "shm" / "tier.json", shm / "tier.json")
        shutil.copytree(t / "shm" / "checkpoints" / step_name(SNAP_STEP), shm / "checkpoints" / step_name(SNAP_STEP))
    total = sum(p.stat().st_size for p in SEED.rglob("*") if p.is_file())
    print(f"wrote {SEED} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    regenerate()
