"""Your own DeepSpeed ZeRO loop under shardkeeper: a tiny transformers LlamaForCausalLM in a DeepSpeed engine.

On 2 CPU ranks (DeepSpeed's CPU accelerator, gloo), then resumed on 1 rank: the ZeRO-2 checkpoint written by 2
ranks is converted once to DeepSpeed's universal layout (``step-XXXXXXXX/universal/``) and loaded from there:

    shardkeeper train --script examples/deepspeed_loop.py --run-dir runs/ds --until-step 12 --nproc 2 \\
        --set backend=deepspeed --set checkpoint.interval=5
    shardkeeper train --run-dir runs/ds --until-step 20 --nproc 1
    shardkeeper export runs/ds/checkpoints/step-00000020 runs/ds/hf     # a from_pretrained folder

The batch of each step derives from (seed, step) and is split over the ranks, so the data position needs no
state and a step sees the same global batch at any world size. The loss is the mean over the global batch's
tokens whatever the world size (each rank's summed loss is scaled by world_size / global tokens; DeepSpeed
averages gradients over the ranks). ``--zero-stage 3`` partitions the parameters too.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import shardkeeper as sk

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8, help="global batch of sequences (split over the ranks)")
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
args = parser.parse_args()

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: it picks its accelerator then
import deepspeed  # noqa: E402

seg = sk.Segment()  # joins the segment; the run must say backend: deepspeed (--set backend=deepspeed)
torch.manual_seed(0)  # the same initial weights on every rank (a resume replaces them)
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
per_rank = args.batch // seg.world_size
ds_config = {
    "train_batch_size": per_rank * seg.world_size,
    "train_micro_batch_size_per_gpu": per_rank,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": args.zero_stage},
    "zero_allow_untested_optimizer": True,  # torch's AdamW: the optimizer the checkpoint's fingerprint covers
    "steps_per_print": 1 << 30,
}
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
# the warm-up sets the lr of the client AdamW, whose param groups DeepSpeed's ZeRO optimizer steps with
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
seg.track(model=engine, scheduler=sched)  # the engine brings its optimizer

for step in seg.steps(tokens_per_step=args.batch * args.seq):
    g = torch.Generator().manual_seed(1000 + step)  # this step's global batch, whatever the world size
    base = torch.randint(0, config.vocab_size, (args.batch, 1), generator=g)
    ids = (base + torch.arange(args.seq + 1) * (1 + base % 3)) % config.vocab_size
    mine = ids[seg.rank * per_rank : (seg.rank + 1) * per_rank].to(seg.device)
    logits = engine(input_ids=mine[:, :-1], use_cache=False).logits
    loss_sum = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), mine[:, 1:].reshape(-1), reduction="sum")
    global_tokens = args.batch * args.seq
    engine.backward(loss_sum * (seg.world_size / global_tokens), scale_wrt_gas=False)
    engine.step()
    sched.step()
    total = loss_sum.detach().to("cpu", torch.float64)
    dist.all_reduce(total)
    seg.log(loss=float(total) / global_tokens, lr=sched.get_last_lr()[0])
