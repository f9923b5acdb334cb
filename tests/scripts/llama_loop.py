"""A user's own loop over the tiny Llama of configs/tiny.yaml (the model tests/test_import.py's sources train), for the
tests that continue checkpoints other kinds of run wrote: FSDP2 (default) or a DeepSpeed ZeRO-2 engine, AdamW over
one group, gradient norm clipped at 1.0 (DeepSpeed's default), the batches of tests/test_import.py (one fixed
sequence per step, the same on every rank: a step's gradient and loss do not depend on the world size).

    shardkeeper train --script tests/scripts/llama_loop.py --run-dir RUN --until-step 6 --nproc 3 [-- --deepspeed]

--deepspeed       a DeepSpeed ZeRO-2 engine (the run needs backend deepspeed)
--bf16            FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); DeepSpeed bf16
--intermediate N  the MLP width (128 is the checkpoints'; another one is another model)
--scheduler       track a LambdaLR scheduler (constant 1.0 below step 1000, then 0.5)
--extra NAME ...  track objects (these names) that have state but no start_at_step (a checkpoint of another kind
                  of run lacks them)
--plain-bf16      a plain module in bfloat16, not sharded (another dtype than an fp32 checkpoint's)
--tied            tie lm_head to the input embeddings (tie_word_embeddings)
--lr, --wd        AdamW's learning rate and weight decay (the sources': 1e-2, 0.1)

``main(argv, run_dir, until_step)`` runs it in-process (tests/harness.spawn), without a launcher.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


class Counter:
    """A tracked object with state and no way to derive it from a step."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = int(sd["n"])


def main(argv: list[str] | None = None, run_dir: str | None = None, until_step: int | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--extra", nargs="*", default=[])
    p.add_argument("--plain-bf16", action="store_true")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--wd", type=float, default=0.1)
    a = p.parse_args(argv)
    if a.deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from trainer.ds_shm import skip_shm_op

        skip_shm_op()  # CPU ranks: DeepSpeed's shm op serves inference only (trainer.ds_shm)
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import shardkeeper as sk

    seg = sk.Segment(run_dir=run_dir, until_step=until_step)
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=a.intermediate,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=a.tied)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if a.deepspeed:
        import deepspeed

        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30, "bf16": {"enabled": a.bf16}}
        model, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    elif a.plain_bf16:
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 else \
            MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=seg.mesh, mp_policy=mp)
        fully_shard(model, mesh=seg.mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)  # over the sharded parameters
    tracked: dict[str, Any] = {}
    if a.scheduler:
        tracked["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 1000 else 0.5)
    for name in a.extra:
        tracked[name] = Counter()
    seg.track(model=model, optimizer=None if a.deepspeed else opt, **tracked)
    g = torch.Generator().manual_seed(1)  # tests/test_import.py's batches(): one (2, 16) draw per step
    batches = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(max(seg.until_step, 1))]
    for step in seg.steps(samples_per_step=2):
        x = batches[step].to(seg.device)
        loss = model(input_ids=x, labels=x).loss
        if a.deepspeed:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as DeepSpeed does by default (gradient_clipping)
            opt.step()
            opt.zero_grad()
        if "scheduler" in tracked:
            tracked["scheduler"].step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        seg.log(loss=float(total) / seg.world_size, lr=opt.param_groups[0]["lr"])
    return {"lr": opt.param_groups[0]["lr"], "weight_decay": opt.param_groups[0]["weight_decay"],
            "groups": len(opt.param_groups), "step": seg.step}


if __name__ == "__main__":
    main()
