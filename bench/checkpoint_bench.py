"""Checkpoint I/O figures, side by side in one run, on a >= 250M-parameter Llama-style model.

    python bench/checkpoint_bench.py            # ~3-5 min on 2 CPU cores, ~10 GB of disk under bench/out
    python bench/checkpoint_bench.py --layers 2 # quick smoke run on a small model

Measures (2 gloo ranks on CPU, fp32 weights + AdamW state):
  * ``dd oflag=direct`` write bandwidth of the same disk (the yardstick);
  * plain ``dcp.save`` and ``dcp.async_save`` of ``get_state_dict`` (what users write by hand);
  * shardkeeper's Checkpointer: sync save (fsync, checksums, manifest, commit), async save (time the
    training loop is blocked), one in-memory copy of the state (the floor for any async save),
    and load at the same world size vs a checkpoint written at another world size.
Prints a markdown table; the README's table is copied from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out" / "checkpoint"


def big_spec(layers: int):
    from schemas import RunSpec

    return RunSpec.model_validate({
        "name": "bench-270m", "global_batch_size": 4, "seed": 0,
        "model": {"model_type": "llama", "config": {
            "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 256,
            "tie_word_embeddings": False}},
        "data": {"seq_len": 16, "synthetic_tokens": 4096},
        "checkpoint": {"interval": 1000, "keep_last": 100, "io_threads": 2, "async_save": True},
    })


def _setup(layers: int, run_dir: str):
    import torch

    from ckpt.layout import RunDir
    from trainer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, model_signature, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed()
    spec = big_spec(layers)
    model = build_model(spec)
    sig = model_signature(spec.model, model)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    x = torch.randint(0, 32000, (1, 16))
    model(input_ids=x).logits.float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    rd = RunDir.at(run_dir)
    ck = DCPCheckpointer(rd, spec, model, opt, env, segment=0, signature=sig)
    return env, model, opt, ck


def _timed(fn, group) -> float:
    import torch.distributed as dist

    dist.barrier(group=group)
    t = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t


def save_worker(layers: int, run_dir: str) -> dict:
    """On each rank: plain DCP sync/async, then ours sync/async, then a same-size load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.checkpointer import TrainState

    env, model, opt, ck = _setup(layers, run_dir)
    g = env.ctrl_group
    res: dict = {}
    msd, osd = get_state_dict(model, opt)
    plain = {"model": msd, "optim": osd}
    res["dcp_sync_s"] = _timed(lambda: dcp.save(plain, checkpoint_id=f"{run_dir}/plain-sync"), g)
    blocked = {}

    def plain_async() -> None:
        t = time.perf_counter()
        fut = dcp.async_save(plain, checkpoint_id=f"{run_dir}/plain-async", process_group=env.ckpt_group)
        blocked["s"] = time.perf_counter() - t
        fut.result()

    res["dcp_async_total_s"] = _timed(plain_async, g)
    res["dcp_async_blocked_s"] = blocked["s"]
    from ckpt.formats.direct_io import _HashingDirectStream

    # with and without xxh3, alternated and best of two each (the first save of a process pays extra)
    sync, nohash = [], []
    for i in range(2):
        _HashingDirectStream.hashing = False
        nohash.append(_timed(lambda: ck.save(TrainState(step=10 + i), reason="interval", blocking=True), g))
        _HashingDirectStream.hashing = True
        sync.append(_timed(lambda: ck.save(TrainState(step=1 if i else 20), reason="interval", blocking=True), g))
        if min(sync) == sync[-1]:
            res["ours_sync_phases"] = ck.last_phases
    res["ours_nohash_s"], res["ours_sync_s"] = min(nohash), min(sync)
    ck.warm_up(TrainState(step=1))
    dist.barrier(group=g)

    def ours_async() -> None:
        t = time.perf_counter()
        ck.save(TrainState(step=2), reason="interval", blocking=False)
        blocked["ours"] = time.perf_counter() - t
        ck.wait()

    res["ours_async_total_s"] = _timed(ours_async, g)
    res["ours_async_blocked_s"] = blocked["ours"]
    res["ours_async_phases"] = ck.last_phases
    sd = ck.state_dict(TrainState(step=2))
    res["copy_s"] = _timed(lambda: _copy_state_dict(sd, ck._staged), g)
    ck.close()
    res["bytes"] = sum(f.stat().st_size for f in (Path(run_dir) / "checkpoints" / "step-00000001").iterdir())
    res["params"] = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return res


def save4_worker(layers: int, run_dir: str) -> dict:
    from trainer.checkpointer import TrainState

    env, _, _, ck = _setup(layers, run_dir)
    ck.save(TrainState(step=3), reason="interval", blocking=True)
    ck.close()
    import torch.distributed as dist

    dist.destroy_process_group()
    return {}


def load_worker(layers: int, run_dir: str) -> dict:
    """Same-size (step 2, saved at 2 ranks) and other-size (step 3, saved at 4 ranks) loads, alternated
    in one process, best of two each, so both see the same allocator and page-cache conditions."""
    env, _, _, ck = _setup(layers, run_dir)
    import torch.distributed as dist

    same, other = [], []
    for _ in range(2):
        for step, out in ((2, same), (3, other)):
            if env.is_rank0:
                drop_caches()
            out.append(_timed(lambda: ck.load(Path(run_dir) / "checkpoints" / f"step-{step:08d}"), env.ctrl_group))
    dist.destroy_process_group()
    return {"load_same_s": min(same), "load_other_s": min(other)}


def dd_bandwidth(path: Path, gb: float) -> float:
    count = int(gb * 1024 / 64)
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t
    path.unlink()
    return count * 64 * 2**20 / dt / 1e9


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16, help="decoder layers (16 -> ~272M parameters)")
    args = ap.parse_args()
    from tests.harness import spawn

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    run2, run4 = OUT / "run2", OUT / "run4"
    for d in (run2, run4):
        d.mkdir()
    gb = 3.0 if args.layers >= 8 else 0.5
    dd_before = dd_bandwidth(OUT / "dd.bin", gb)
    r = spawn(save_worker, 2, args.layers, str(run2), timeout=1800)
    spawn(save4_worker, 4, args.layers, str(run4), timeout=1800)
    shutil.copytree(run4 / "checkpoints", run2 / "checkpoints", dirs_exist_ok=True)
    drop_caches()
    loads = spawn(load_worker, 2, args.layers, str(run2), timeout=1800)
    for k in ("load_same_s", "load_other_s"):
        r[0][k] = r[1][k] = max(x[k] for x in loads)
    dd_after = dd_bandwidth(OUT / "dd.bin", gb)
    dd = (dd_before + dd_after) / 2
    a, b = r[0], r[1]
    gbytes = a["bytes"] / 1e9
    slow = lambda k: max(a[k], b[k])  # noqa: E731 - the slower rank bounds the step
    rows = [
        ("dd oflag=direct write", f"{dd:.2f} GB/s", f"before {dd_before:.2f}, after {dd_after:.2f}"),
        ("plain dcp.save (sync)", f"{gbytes / slow('dcp_sync_s'):.2f} GB/s", f"{slow('dcp_sync_s'):.2f} s"),
        ("shardkeeper save (sync, fsync+xxh3+manifest+commit)", f"{gbytes / slow('ours_sync_s'):.2f} GB/s",
         f"{slow('ours_sync_s'):.2f} s = {(gbytes / slow('ours_sync_s')) / dd:.2f}x dd; phases {json.dumps({k: round(v, 2) for k, v in a['ours_sync_phases'].items()})}"),
        ("checksumming cost (save with vs without xxh3)", f"{100 * (slow('ours_sync_s') / slow('ours_nohash_s') - 1):+.1f} %",
         f"{slow('ours_sync_s'):.2f} s vs {slow('ours_nohash_s'):.2f} s; hashed by the writing ranks while writing"),
        ("plain dcp.async_save: training blocked", f"{slow('dcp_async_blocked_s'):.2f} s",
         f"{100 * slow('dcp_async_blocked_s') / slow('dcp_sync_s'):.0f} % of plain sync save"),
        ("shardkeeper async: training blocked", f"{slow('ours_async_blocked_s'):.2f} s",
         f"{100 * slow('ours_async_blocked_s') / slow('ours_sync_s'):.1f} % of our sync save; "
         f"{slow('ours_async_blocked_s') / slow('copy_s'):.2f}x one in-memory copy ({slow('copy_s'):.2f} s)"),
        ("load, same world size (2 -> 2)", f"{slow('load_same_s'):.2f} s", "dcp.load + set_state_dict + fingerprint check"),
        ("load, other world size (4 -> 2)", f"{slow('load_other_s'):.2f} s",
         f"{slow('load_other_s') / slow('load_same_s'):.2f}x same-size load; both in one process, alternated"),
    ]
    print(f"\nmodel: {a['params'] / 1e6:.0f}M parameters; checkpoint {gbytes:.2f} GB (fp32 weights + AdamW moments), 2 ranks\n")
    print("| measure | value | notes |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    (OUT / "results.json").write_text(json.dumps({"ranks": r, "dd": [dd_before, dd_after]}, indent=2))
    shutil.rmtree(run2, ignore_errors=True)
    shutil.rmtree(run4, ignore_errors=True)


if __name__ == "__main__":
    main()
