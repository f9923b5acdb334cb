"""A user's own training script over the tiny Llama of configs/tiny.yaml (the model of the checkpoints the tests
import), in four kinds: a plain FSDP2 loop (default), a DeepSpeed ZeRO-2 engine (``--deepspeed``), a Hugging Face
Trainer (``--trainer``, on DeepSpeed with ``--deepspeed``) and an Accelerate loop (``--accelerate``, the model
sharded with ``fully_shard`` as examples/accelerate_fsdp.py does on CPU).

Two recipes, both AdamW over the model initialised under ``torch.manual_seed(0)``, gradient norm clipped at 1.0
(DeepSpeed's default), a constant learning rate, and a step's gradient and loss that do not depend on the world size:

- the loops' default (tests/test_import.py's sources): one fixed (2, 16) draw per step, the same on every rank,
  weight decay 0.1;
- ``--global-batch N`` (tests/compose.py's, the only one the Trainer and Accelerate kinds train): a global batch of N
  sequences per step, the step's rows of one fixed table split over the ranks in order (what a sequential sampler
  shards), weight decay 0 (so the Trainer's decay / no-decay groups change nothing). Any kind continues any other
  kind's (or tool's) checkpoint of this recipe onto the same losses within float rounding, at 1, 2, 3 or 6 ranks
  for N = 6.

    shardkeeper train --script tests/scripts/llama_loop.py --run-dir RUN --until-step 6 --nproc 3 [-- --deepspeed]

--deepspeed       a DeepSpeed ZeRO-2 engine (the run needs backend deepspeed); with --trainer, the Trainer's
--trainer         shardkeeper.integrations.transformers.Trainer (sequential sampler, constant schedule)
--accelerate      an Accelerator-prepared optimizer, scheduler and loader, tracked with
                  shardkeeper.integrations.accelerate
--global-batch N  the table recipe above (the Trainer and Accelerate kinds: 6 unless given)
--resume-from P   the Trainer's train(resume_from_checkpoint=P) (another tool's checkpoint, imported into the run)
--max-steps N     the Trainer's max_steps (the run's whole length; default 64)
--bf16            FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32); DeepSpeed bf16
--intermediate N  the MLP width (128 is the checkpoints'; another one is another model)
--scheduler       track a LambdaLR scheduler (constant 1.0 below step 1000, then 0.5)
--extra NAME...   track one more stateful object per name (an imported checkpoint or another kind
                  of run lacks them)
--plain-bf16      a plain module in bfloat16, not sharded (another dtype than an fp32 checkpoint's)
--tied            tie lm_head to the input embeddings (tie_word_embeddings)
--lr, --wd        AdamW's learning rate and weight decay (default 1e-2, and 0.1 or 0 as the recipe says)

``main(argv, run_dir, until_step)`` runs it in-process (tests/harness.spawn), without a launcher.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

BATCH = 6  # the global batch: sequences per step, whatever the world size
SEQ = 16
STEPS = 64  # the table holds this many steps of data
LR = 1e-2


class Counter:
    """A tracked object with state and no way to derive it from a step."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = int(sd["n"])


def tiny_llama(intermediate: int = 128, tied: bool = False) -> Any:
    """The model of configs/tiny.yaml, initialised the same on every rank and in every kind."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def table(batch: int = BATCH) -> Any:
    """The table recipe's data: STEPS * ``batch`` token sequences; step s trains rows [s * batch, (s + 1) * batch)."""
    import torch

    return torch.randint(0, 256, (STEPS * batch, SEQ), generator=torch.Generator().manual_seed(1))


def rows_of(data: Any, step: int, rank: int, world: int, batch: int = BATCH) -> Any:
    """This rank's share of step ``step``'s global batch (contiguous, in rank order: a sequential sampler's shards)."""
    per = batch // world
    start = step * batch + rank * per
    return data[start : start + per]


def samples(data: Any) -> list[dict[str, Any]]:
    """The table as a dataset of ``{"input_ids", "labels"}`` rows (the Trainer's and Accelerate's loaders)."""
    return [{"input_ids": x, "labels": x} for x in data]


def deepspeed_config(per_rank: int, bf16: bool = False) -> dict[str, Any]:
    """ZeRO-2 with torch's AdamW as the client optimizer, clipping at 1.0 (DeepSpeed's default, said explicitly)."""
    return {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": bf16},
    }


# The Trainer fills the "auto" values from its TrainingArguments (batch, accumulation, max_grad_norm).
TRAINER_DEEPSPEED = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 30,
}


def trainer_args(output_dir: str, world: int, *, max_steps: int = 64, deepspeed: bool = False, **more: Any) -> Any:
    """The TrainingArguments of the recipe: the same global batch at any world size, read in order."""
    from transformers import TrainingArguments

    kw: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=BATCH // world,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to=[],
        logging_steps=1 << 20,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if deepspeed:
        kw["deepspeed"] = copy.deepcopy(TRAINER_DEEPSPEED)  # the Trainer fills it in place
    return TrainingArguments(**{**kw, **more})


def _options(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", action="store_true")
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--accelerate", action="store_true")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--extra", nargs="*", default=[])
    p.add_argument("--plain-bf16", action="store_true")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--wd", type=float, default=None)
    p.add_argument("--global-batch", type=int, default=0)
    a = p.parse_args(argv)
    if (a.trainer or a.accelerate) and not a.global_batch:
        a.global_batch = BATCH
    if a.wd is None:
        a.wd = 0.0 if a.global_batch else 0.1
    return a


def main(argv: list[str] | None = None, run_dir: str | None = None, until_step: int | None = None) -> dict[str, Any]:
    a = _options(argv)
    if a.deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from trainer.deepspeed.shm import skip_shm_op

        skip_shm_op()  # CPU ranks: DeepSpeed's shm op serves inference only (trainer.deepspeed.shm)
    import shardkeeper as sk

    seg = sk.Segment(run_dir=run_dir, until_step=until_step)
    if a.trainer:
        return _trainer(a, seg)
    if a.accelerate:
        return _accelerate(a, seg)
    return _loop(a, seg)


def _trainer(a: argparse.Namespace, seg: Any) -> dict[str, Any]:
    import tempfile

    from shardkeeper.integrations.transformers import Trainer

    scratch = tempfile.mkdtemp(prefix="llama-trainer-")  # the Trainer wants an output_dir; nothing is written there
    args = trainer_args(
        scratch,
        seg.world_size,
        max_steps=a.max_steps,
        deepspeed=a.deepspeed,
        learning_rate=a.lr,
        weight_decay=a.wd,
        per_device_train_batch_size=a.global_batch // seg.world_size,
    )
    trainer = Trainer(
        model=tiny_llama(a.intermediate, a.tied), args=args, train_dataset=samples(table(a.global_batch)), segment=seg
    )
    trainer.train(resume_from_checkpoint=a.resume_from)
    opt = trainer.optimizer
    return {
        "lr": opt.param_groups[0]["lr"],
        "weight_decay": opt.param_groups[0]["weight_decay"],
        "groups": len(opt.param_groups),
        "step": seg.step,
    }


def _accelerate(a: argparse.Namespace, seg: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard

    from shardkeeper.integrations import accelerate as sk_accelerate

    model = tiny_llama(a.intermediate, a.tied)
    for layer in model.model.layers:  # Accelerate enables its FSDP plugin on GPUs only: sharded by hand on CPU
        fully_shard(layer, mesh=seg.mesh)
    fully_shard(model, mesh=seg.mesh)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(
        samples(table(a.global_batch)), batch_size=a.global_batch // seg.world_size, shuffle=False
    )
    opt, sched, loader = accelerator.prepare(opt, sched, loader)
    sk_accelerate.track(seg, accelerator, model=model, optimizer=opt, scheduler=sched)
    batches = sk_accelerate.batches(seg, accelerator, loader)
    for _ in seg.steps(samples_per_step=a.global_batch):
        batch = next(batches)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        seg.log(loss=float(total) / seg.world_size, lr=sched.get_last_lr()[0])
    inner = opt.optimizer
    return {
        "lr": inner.param_groups[0]["lr"],
        "weight_decay": inner.param_groups[0]["weight_decay"],
        "groups": len(inner.param_groups),
        "step": seg.step,
    }


def _per_rank(a: argparse.Namespace, seg: Any) -> int:
    """Sequences per rank and step: the table recipe's share of the global batch, else the (2, 16) draw."""
    return a.global_batch // seg.world_size if a.global_batch else 2


def _loop(a: argparse.Namespace, seg: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    model = tiny_llama(a.intermediate, a.tied)
    if a.deepspeed:
        import deepspeed

        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
        model, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(_per_rank(a, seg), a.bf16))
    elif a.plain_bf16:
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if a.bf16
            else MixedPrecisionPolicy()
        )
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
    if a.global_batch:
        data = table(a.global_batch)

        def rows(step: int) -> Any:
            return rows_of(data, step, seg.rank, seg.world_size, a.global_batch)
    else:  # tests/test_import.py's batches(): one (2, 16) draw per step, the same on every rank
        g = torch.Generator().manual_seed(1)
        draws = [torch.randint(0, 256, (2, SEQ), generator=g) for _ in range(max(seg.until_step, 1))]
        rows = draws.__getitem__
    for step in seg.steps(samples_per_step=a.global_batch or 2):
        x = rows(step).to(seg.device)
        loss = model(input_ids=x, labels=x).loss
        if a.deepspeed:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as DeepSpeed's gradient_clipping
            opt.step()
            opt.zero_grad()
        if "scheduler" in tracked:
            tracked["scheduler"].step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        seg.log(loss=float(total) / seg.world_size, lr=opt.param_groups[0]["lr"])
    return {
        "lr": opt.param_groups[0]["lr"],
        "weight_decay": opt.param_groups[0]["weight_decay"],
        "groups": len(opt.param_groups),
        "step": seg.step,
    }


if __name__ == "__main__":
    main()
