"""An Accelerate FSDP2 script under shardkeeper (the seed-000 scenario: sharded checkpoints, resume at another world
size, no loss spike): a tiny transformers LlamaForCausalLM, an Accelerator-prepared optimizer, LR scheduler and
data loader, ``shardkeeper.Segment`` in place of ``accelerator.save_state``/``load_state``.

On 2 CPU ranks, then resumed on 1 rank (DCP reshards the model and AdamW states at load) and exported:

    shardkeeper train --script examples/accelerate_fsdp.py --run-dir runs/acc --until-step 12 --nproc 2 \\
        --set checkpoint.interval=4
    shardkeeper train --run-dir runs/acc --until-step 30 --nproc 1
    shardkeeper export runs/acc/checkpoints/step-00000030 runs/acc/hf      # a from_pretrained folder

On GPUs Accelerate's own FSDP2 plugin shards the model (``accelerator.prepare(model, ...)``). Accelerate enables
FSDP on GPUs only, so on CPU the model is sharded by hand with ``fully_shard`` on the segment's mesh, and the
Accelerator prepares the optimizer, scheduler and loader; shardkeeper tracks both the same way. The lines that
differ from a plain Accelerate script are marked ``# shardkeeper``.
"""

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from transformers import LlamaConfig, LlamaForCausalLM

import shardkeeper as sk  # shardkeeper
from shardkeeper.integrations import accelerate as sk_accelerate  # shardkeeper

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8, help="global batch of sequences (split over the ranks)")
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--samples", type=int, default=96, help="dataset size (96 / 8 = 12 steps per epoch)")
parser.add_argument("--total-steps", type=int, default=100, help="the LR schedule's length")
args = parser.parse_args()

seg = sk.Segment()  # shardkeeper: joins the segment (process group, run dir, --until-step) before the Accelerator


class Tokens(torch.utils.data.Dataset):
    """Deterministic token sequences: sample i is the same on every rank and in every segment."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1234)
        base = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (base + torch.arange(seq) * (1 + base % 3)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)  # the same initial weights on every rank, and the seed of the loader's sampler
config = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
model = LlamaForCausalLM(config)
on_gpu = torch.cuda.is_available()
plugin = None
if on_gpu:
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        state_dict_type="SHARDED_STATE_DICT",
    )
else:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=seg.mesh)
    fully_shard(model, mesh=seg.mesh)
accelerator = Accelerator(
    fsdp_plugin=plugin,
    cpu=not on_gpu,
    step_scheduler_with_optimizer=False,  # shardkeeper: one scheduler step per optimizer step
    dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
)  # shardkeeper
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=args.total_steps, pct_start=0.1)
loader = torch.utils.data.DataLoader(
    Tokens(args.samples, args.seq, config.vocab_size),
    batch_size=args.batch // seg.world_size,
    shuffle=True,
    drop_last=True,
)
if on_gpu:
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
else:
    opt, sched, loader = accelerator.prepare(opt, sched, loader)
sk_accelerate.track(seg, accelerator, model=model, optimizer=opt, scheduler=sched)  # shardkeeper
batches = sk_accelerate.batches(seg, accelerator, loader)  # shardkeeper: the data position follows from the step

for step in seg.steps(samples_per_step=args.batch):  # shardkeeper: instead of range(...) and load_state  # noqa: B007
    batch = next(batches)
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    seg.log(loss=float(total) / seg.world_size, lr=sched.get_last_lr()[0])  # shardkeeper: metrics.jsonl
