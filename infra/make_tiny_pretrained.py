"""Make a local "pretrained" model folder to fine-tune, since nothing can be downloaded here: a Llama built with
transformers (random weights, a fixed seed), saved with ``save_pretrained`` (safetensors), a byte-level BPE
tokenizer trained with the ``tokenizers`` library on a small generated corpus, with a chat template, and a
generation config.

    python -m infra.make_tiny_pretrained runs/tiny-base                 # ~1 MB, what configs/tiny-finetune.yaml uses
    python -m infra.make_tiny_pretrained /tmp/llama-1b --size 1b        # 1.24B parameters, ~5 GB fp32 (the bench)
    python -m infra.make_tiny_pretrained OUT --tied --shard-size 100KB  # tied embeddings, sharded weight files

The folder then looks like a Hub download: config.json, generation_config.json, model.safetensors (or
model-0000i-of-0000n.safetensors + model.safetensors.index.json), tokenizer.json, tokenizer_config.json,
chat_template.jinja (and special_tokens_map.json where the transformers version writes one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SIZES = {
    # vocab_size is set from the tokenizer for "tiny"; the others keep a Llama-3 vocabulary
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "100m": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        vocab_size=32000,
    ),
    "500m": dict(
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        vocab_size=32000,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        vocab_size=128256,
    ),  # Llama-3.2-1B's shape
}
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = (
    "the model learns from data and a checkpoint keeps every shard of its state so that training resumes "
    "on any number of ranks without a spike in the loss while the tokenizer splits text into pieces"
).split()


def corpus(lines: int = 2000) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]


def make_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make(
    out: Path,
    size: str = "tiny",
    *,
    tied: bool = False,
    shard_size: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_vocab: int = 320,
) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = make_tokenizer(tokenizer_vocab)
    dims = dict(SIZES[size])
    dims.setdefault("vocab_size", max(len(tokenizer), 256))
    cfg = AutoConfig.for_model(
        "llama",
        **dims,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        max_new_tokens=64,
    )
    out.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kw)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    (out / "MADE_BY.json").write_text(
        json.dumps(
            {"by": "infra.make_tiny_pretrained", "size": size, "params": n, "tied": tied, "seed": seed, "dtype": dtype}
        )
        + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.make_tiny_pretrained", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder to write (created)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--tied", action="store_true", help="tie lm_head to the input embeddings")
    ap.add_argument("--shard-size", default=None, help="save_pretrained max_shard_size, e.g. 100KB or 2GB")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out = make(a.out, a.size, tied=a.tied, shard_size=a.shard_size, seed=a.seed, dtype=a.dtype)
    print(
        f"wrote {out}: {json.loads((out / 'MADE_BY.json').read_text())['params']:,} parameters "
        f"({', '.join(sorted(p.name for p in out.iterdir()))})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
