"""A Hugging Face Trainer script under shardkeeper: commits, resume at another world size, preemption (exit 75).

On 2 CPU ranks with DeepSpeed ZeRO-2, then resumed on 1 rank (the universal conversion runs on the way):

    shardkeeper train --script examples/hf_trainer.py --run-dir runs/hf --until-step 12 --nproc 2 \\
        --set backend=deepspeed --set checkpoint.interval=5 -- --deepspeed
    shardkeeper train --run-dir runs/hf --until-step 24 --nproc 1

Without ``--deepspeed`` the Trainer replicates the model over the ranks (DDP) and shardkeeper saves it through DCP
(one copy); with ``--fsdp`` on 2+ GPUs it shards it with FSDP2 (``fsdp_config={"fsdp_version": 2}``; Accelerate
enables FSDP on GPUs only, so on CPU ``--fsdp`` trains replicated). Either resumes at any world size:

    shardkeeper train --script examples/hf_trainer.py --run-dir runs/hf2 --until-step 12 --nproc 2
    shardkeeper train --run-dir runs/hf2 --until-step 24 --nproc 1

Starting from a checkpoint a run without shardkeeper left (the Trainer's ``checkpoint-N``, with or without
DeepSpeed): ``-- --resume-from out/checkpoint-500`` (``trainer.train(resume_from_checkpoint=...)``) imports it into
the run when the run has no checkpoint yet, then resumes it.

The lines that differ from a plain Trainer script are marked ``# shardkeeper``. ``--max-steps`` is the run's
whole length (the LR schedule); ``--until-step`` is where this segment stops. The global batch stays
``--batch`` at every world size, so a step sees the same samples on 1 or 2 ranks.
"""

import argparse
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import shardkeeper as sk  # shardkeeper
from shardkeeper.integrations.transformers import Trainer  # shardkeeper: instead of transformers.Trainer

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
parser.add_argument("--seq", type=int, default=16)
parser.add_argument("--save-steps", type=int, default=0, help="the Trainer's own save policy (0: none)")
parser.add_argument("--deepspeed", action="store_true", help="DeepSpeed ZeRO-2 (run with --set backend=deepspeed)")
parser.add_argument("--fsdp", action="store_true", help="FSDP2 through the Trainer's fsdp options (GPUs only)")
parser.add_argument(
    "--resume-from",
    default=None,
    help="another tool's checkpoint (e.g. out/checkpoint-500) to start "
    "from: imported into the run when it has no checkpoint yet",
)
args = parser.parse_args()

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator when imported

seg = sk.Segment()  # shardkeeper: joins the segment (process group, run dir, --until-step) before the model


class Tokens(torch.utils.data.Dataset):
    """Deterministic token sequences (sample i is the same on every rank and in every segment)."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1234)
        base = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (base + torch.arange(seq) * (1 + base % 3)) % vocab  # learnable: arithmetic progressions

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
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

extra: dict = {}
if args.deepspeed:
    extra["deepspeed"] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
if args.fsdp:
    extra["fsdp"] = "full_shard"
    extra["fsdp_config"] = {
        "fsdp_version": 2,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "reshard_after_forward": True,
    }

scratch = tempfile.TemporaryDirectory(prefix="hf-trainer-")  # removed when the process exits
training_args = TrainingArguments(
    output_dir=scratch.name,  # Trainer wants one; nothing is saved there: checkpoints go to the run dir
    max_steps=args.max_steps,
    per_device_train_batch_size=args.batch // seg.world_size,  # shardkeeper: the same global batch at any size
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=4,
    weight_decay=0.01,
    max_grad_norm=1.0,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    logging_steps=10,
    report_to="none",
    disable_tqdm=True,
    seed=0,
    dataloader_num_workers=0,
    use_cpu=not torch.cuda.is_available(),
    **extra,
)
trainer = Trainer(
    model=model, args=training_args, train_dataset=Tokens(512, args.seq, config.vocab_size), segment=seg
)  # shardkeeper: segment=seg
trainer.train(resume_from_checkpoint=args.resume_from)  # None: the run's newest valid checkpoint, if any
