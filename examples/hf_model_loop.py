"""Your own loop over a Hugging Face transformers model, sharded with FSDP2: checkpoints export to a
``from_pretrained`` folder (the model's config is recorded in every manifest).

    shardkeeper train --script examples/hf_model_loop.py --run-dir runs/hf-own --until-step 10 --nproc 2
    shardkeeper export runs/hf-own/checkpoints/step-00000010 runs/hf-own/exports/step-00000010

A tiny Llama (random init, vocab 256) on synthetic tokens: each step's batch derives from the step, so any world
size sees the same global batch and the data position needs no state.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import shardkeeper as sk

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
parser.add_argument("--seq", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

seg = sk.Segment()
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
model = LlamaForCausalLM(config).to(seg.device)
for layer in model.model.layers:
    fully_shard(layer, mesh=seg.mesh)
fully_shard(model, mesh=seg.mesh)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
seg.track(model=model, optimizer=opt)

per_rank = args.batch // seg.world_size
for step in seg.steps(tokens_per_step=args.batch * args.seq, samples_per_step=args.batch):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)[
        seg.rank * per_rank : (seg.rank + 1) * per_rank
    ]
    tokens = tokens.to(seg.device)
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    seg.log(loss=float(total) / seg.world_size)
