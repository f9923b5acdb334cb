"""What a saved training state is made of, once for every backend, format and the export.

- ``MOMENTS``: the AdamW moment names (the optimizer state a checkpoint keeps per parameter).
- ``elastic_seed``/``elastic_rng_state``: the RNG reseed rule of a resume at another world size, where no
  per-rank RNG state can carry over: every rank reseeds from (seed, step, rank), so the continuation is still
  a function of the checkpoint alone.
- ``tied_weights``: which state_dict names transformers ties to another (e.g. lm_head.weight ->
  model.embed_tokens.weight), across the transformers versions we support. Duck-typed: no transformers import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MOMENTS: tuple[str, str] = ("exp_avg", "exp_avg_sq")

_STEP_PRIME = 7919  # spreads consecutive steps' seeds apart


def elastic_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed a rank takes after an elastic resume (or a conversion that has no RNG state to carry)."""
    return seed + _STEP_PRIME * step + rank


def reseed(seed: int, step: int, rank: int) -> None:
    """Reseed this process's CPU generator (and CUDA's, through torch.manual_seed) by the elastic rule."""
    import torch

    torch.manual_seed(elastic_seed(seed, step, rank))


def elastic_rng_state(seed: int, step: int, rank: int = 0) -> torch.Tensor:
    """The CPU RNG state a rank would have right after ``reseed(seed, step, rank)``."""
    import torch

    return torch.Generator().manual_seed(elastic_seed(seed, step, rank)).get_state()


def tied_weights(model: Any, config: Any | None = None) -> dict[str, str]:
    """Tied state_dict name -> the name it is tied to; empty when the model ties nothing."""
    config = config if config is not None else getattr(model, "config", None)
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: {tied name: source}, empty when untied
    if tied is None:  # older transformers: a list of names tied to the input embeddings
        names = getattr(model, "_tied_weights_keys", None) or []
        emb = model.get_input_embeddings()
        source = next((f"{n}.weight" for n, m in model.named_modules() if m is emb), "")
        tied = {t: source for t in names} if getattr(config, "tie_word_embeddings", False) else {}
    return {str(k): str(v) for k, v in tied.items()}
