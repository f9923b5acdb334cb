"""Data whose global sample order depends only on (seed, step), never on the world size.

Sample g of the run (g = step * global_batch + j) is window ``perm_e[g mod n]`` of the token
stream, with epoch e = g // n and ``perm_e`` a permutation seeded by (seed, e). A rank takes the
contiguous slice of the step's global batch that belongs to it, so the union over ranks of what
step s trains on is the same at 1, 2, 3 or 4 ranks, and the loader's position is just the step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from schemas import DataSpec

_PHRASES = 512
_PHRASE_LEN = 16


def synthetic_corpus(seed: int, n_tokens: int, vocab_size: int) -> np.ndarray:
    """A deterministic, learnable corpus: random phrases from a fixed phrase book, concatenated."""
    rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
    book = rng.integers(0, vocab_size, size=(_PHRASES, _PHRASE_LEN), dtype=np.int64)
    picks = rng.integers(0, _PHRASES, size=(n_tokens + _PHRASE_LEN - 1) // _PHRASE_LEN)
    return book[picks].reshape(-1)[:n_tokens]


def open_tokens(spec: DataSpec, seed: int, vocab_size: int) -> np.ndarray:
    if spec.source == "synthetic":
        return synthetic_corpus(seed, spec.synthetic_tokens, vocab_size)
    path = Path(spec.path or "")
    if not path.is_file():
        raise FileNotFoundError(f"data.path {path}: no such token file; point it at a .bin or .npy file")
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=np.dtype(spec.dtype), mode="r")


class GlobalOrderLoader:
    """Yields the (inputs, labels) micro-batches of one rank for a given step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, global_batch: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.global_batch = global_batch
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"token stream of {len(tokens)} tokens is shorter than one sample of seq_len {seq_len}")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _window(self, g: int) -> int:
        epoch, pos = divmod(g, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[pos])

    def samples(self, step: int, start: int, count: int) -> torch.Tensor:
        """Samples [start, start+count) of the step's global batch, as a [count, seq_len+1] int64 tensor."""
        base = step * self.global_batch + start
        rows = []
        for g in range(base, base + count):
            w = self._window(g) * self.seq_len
            rows.append(np.asarray(self.tokens[w : w + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def rank_batches(self, step: int, rank: int, world: int, micro: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        local = self.global_batch // world
        micro = micro or local
        out = []
        for m in range(0, local, micro):
            block = self.samples(step, rank * local + m, micro)
            out.append((block[:, :-1].contiguous(), block[:, 1:].contiguous()))
        return out
