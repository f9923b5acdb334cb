"""A run whose only checkpoint is a memory snapshot (no storage checkpoint committed yet) and whose snapshot is
corrupt: ``load_latest(restart=False)`` refuses it on its checksums, sets it aside in the memory dir, names it in one
line, and starts fresh (None), with the live model, optimizer and RNG state bitwise what they were before the call.
A memory snapshot is never loaded eagerly (trainer.checkpointer.resumer ``_try_memory``): nothing of the refused
snapshot, not even the chunks of the files that matched, reaches the live state. Two real gloo ranks (FSDP2 on CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tests.harness import spawn


def _live(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and every optimizer state tensor of this rank (its local shard), copied, with a name."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = [(name, local(p)) for name, p in model.named_parameters()]
    names = {id(p): name for name, p in model.named_parameters()}
    for p, st in opt.state.items():
        out += [(f"{names[id(p)]}:{k}", local(v)) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


def _settings(opt: torch.optim.Optimizer) -> list[dict[str, object]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _refused_snapshot_then_fresh_start(tmp: str) -> dict[str, object]:
    import torch.distributed as dist

    from ckpt.commit.layout import RunDir
    from ckpt.memtier.tier import MEMORY
    from tests.harness import tiny_spec
    from tests.reliability.corrupt import flip_byte, model_item_offset
    from trainer.checkpointer import dcp_backend
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    eager: list[bool] = []  # how each one-pass load of the resume was told to write the live state
    real = dcp_backend.load_verified

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        eager.append(kwargs["eager"])
        return real(*args, **kwargs)

    dcp_backend.load_verified = recorded
    lines = _Lines()
    logging.getLogger().addHandler(lines)

    env = init_distributed()
    root = Path(tmp)
    mem, run = root / "shm", root / "run"
    run.mkdir(exist_ok=True)
    spec = tiny_spec(**{"checkpoint.memory_interval": 2, "checkpoint.memory_dir": str(mem)})
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)

    def step() -> None:
        model(input_ids=torch.randint(0, 256, (2, 16))).logits.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # The segment that wrote it: one memory snapshot at step 2, nothing in storage.
    writer = DCPCheckpointer(RunDir.at(run), spec, model, opt, env, segment=0)
    step()
    writer.save(TrainState(step=2), reason="interval", blocking=True, tier=MEMORY)
    writer.wait()
    writer.close()
    snapshot_values = _live(model, opt)
    snap = mem / "checkpoints" / "step-00000002"
    out: dict[str, object] = {
        "snapshot committed": (snap / "manifest.json").is_file(),
        "no storage checkpoint": not list(run.glob("checkpoints/step-*")),
    }
    bad_file = ""
    if env.is_rank0:  # one byte in the middle of a model tensor's data in rank 1's file; manifest.json as it was
        path, offset = model_item_offset(snap, rank=1, longer_than=4096)
        flip_byte(path, offset, mask=0x01)
        bad_file = path.name
    box = [bad_file]
    dist.broadcast_object_list(box, src=0)
    bad_file = box[0]
    dist.barrier()

    # The live state moves on: every tensor differs from the snapshot's (a load of any of it would show).
    step()
    before = _live(model, opt)
    settings, rng = _settings(opt), torch.get_rng_state()
    out["equal to snapshot"] = [n for (n, a), (_, b) in zip(before, snapshot_values) if torch.equal(a, b)]

    # The next segment: a new Checkpointer on the same run and memory dir resumes, and may not start over.
    lines.lines.clear()
    ck = DCPCheckpointer(RunDir.at(run), spec, model, opt, env, segment=1)
    out["resumed"] = ck.load_latest(restart=False)
    after = _live(model, opt)
    out["names"] = [n for n, _ in after] == [n for n, _ in before]
    out["changed"] = [n for (n, a), (_, b) in zip(before, after) if not torch.equal(a, b)]
    out["settings kept"] = _settings(opt) == settings
    out["rng kept"] = torch.equal(torch.get_rng_state(), rng)
    out["eager"] = eager
    out["eager_load after"] = ck.eager_load
    dist.barrier()
    out["memory dir"] = sorted(
        p.name.split(".invalid-")[0] + (".invalid" if ".invalid-" in p.name else "")
        for p in (mem / "checkpoints").iterdir()
    )
    out["bad file"] = bad_file
    out["lines"] = lines.lines if env.is_rank0 else []
    ck.close()
    dist.destroy_process_group()
    return out


def test_a_corrupt_memory_snapshot_with_no_storage_checkpoint_is_refused_and_the_run_starts_fresh_untouched(
    tmp_path: Path,
) -> None:
    r0, r1 = spawn(_refused_snapshot_then_fresh_start, 2, str(tmp_path), timeout=120)
    for r in (r0, r1):
        assert r["snapshot committed"] and r["no storage checkpoint"], r
        assert r["equal to snapshot"] == [], r["equal to snapshot"]  # else a load of them could not be seen
        assert r["resumed"] is None  # nothing to resume: a fresh start, no error
        assert r["names"] is True
        assert r["changed"] == [], f"the refused snapshot reached the live state: {r['changed']}"
        assert r["settings kept"] and r["rng kept"]
        assert True not in r["eager"] and r["eager_load after"] is False  # a memory snapshot never loads eagerly
        assert r["memory dir"] == ["step-00000002.invalid"]  # set aside (quarantined), not used
    bad = r0["bad file"]
    assert bad.startswith("__1_") and bad.endswith(".distcp")
    said = [ln for ln in r0["lines"] if "memory snapshot" in ln and "not used" in ln]
    assert len(said) == 1, r0["lines"]
    assert "step-00000002" in said[0] and bad in said[0] and "checksum mismatch" in said[0], said
    moved = [ln for ln in r0["lines"] if ln.startswith("moved step-00000002 aside to step-00000002.invalid-")]
    assert len(moved) == 1, r0["lines"]
