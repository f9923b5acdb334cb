"""Data whose global sample order depends only on (seed, step), never on the world size.

Sample g of the run (g = step * global_batch + j) is window ``perm_e[g mod n]`` of the token
stream, with epoch e = g // n and ``perm_e`` a permutation seeded by (seed, e). A rank takes the
contiguous slice of the step's global batch that belongs to it, so the union over ranks of what
step s trains on is the same at 1, 2, 3 or 4 ranks, and the loader's position is just the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from schemas import DataSpec, PreparedSplit
from schemas.errors import ConfigError

if TYPE_CHECKING:  # the controller's preflight reads token files without importing torch (~2 s)
    import torch

IGNORE = -100  # label of a position that is not a training target (cross_entropy's ignore_index)

_PHRASES = 512
_PHRASE_LEN = 16


def synthetic_corpus(seed: int, n_tokens: int, vocab_size: int) -> np.ndarray:
    """A deterministic, learnable corpus: random phrases from a fixed phrase book, concatenated."""
    rng = np.random.Generator(np.random.PCG64([seed, 0x5EED]))
    book = rng.integers(0, vocab_size, size=(_PHRASES, _PHRASE_LEN), dtype=np.int64)
    picks = rng.integers(0, _PHRASES, size=(n_tokens + _PHRASE_LEN - 1) // _PHRASE_LEN)
    return book[picks].reshape(-1)[:n_tokens]


def open_tokens(spec: DataSpec, seed: int, vocab_size: int, prepared: PreparedSplit | None = None) -> np.ndarray:
    if spec.source == "synthetic":
        return synthetic_corpus(seed, spec.synthetic_tokens, vocab_size)
    if spec.source == "dataset":
        return open_prepared(prepared)[0]
    return open_token_file(Path(spec.path or ""), spec.dtype)


def open_prepared(prepared: PreparedSplit | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The token file (and chat target mask) the controller prepared, as read-only memmaps."""
    if prepared is None:
        raise ConfigError(
            "data.source dataset: the ranks received no prepared data; start the segment with "
            "shardkeeper train (it tokenizes the dataset first; see shardkeeper prepare-data)"
        )
    path = Path(prepared.path)
    size = path.stat().st_size if path.is_file() else -1
    if size != prepared.tokens * np.dtype(prepared.dtype).itemsize or prepared.tokens == 0:
        raise ConfigError(
            f"{path}: the prepared token file is missing or not its recorded size ({prepared.tokens} "
            f"{prepared.dtype} tokens); the data cache must be on storage every rank sees "
            "(SHARDKEEPER_DATA_CACHE); rerun shardkeeper prepare-data"
        )
    tokens = np.memmap(path, dtype=np.dtype(prepared.dtype), mode="r")
    mask = None
    if prepared.mask_path is not None:
        mpath = Path(prepared.mask_path)
        if not mpath.is_file() or mpath.stat().st_size != prepared.tokens:
            raise ConfigError(
                f"{mpath}: the prepared target mask is missing or truncated; rerun shardkeeper prepare-data"
            )
        mask = np.memmap(mpath, dtype=np.uint8, mode="r")
    return tokens, mask


def open_token_file(path: Path, dtype: str) -> np.ndarray:
    """The token file as a read-only 1-D memmap; a ConfigError naming the file when it cannot be one.
    Cheap (no pass over the data), so every rank can afford it; the controller also runs ``scan_token_ids``."""
    if not path.exists():
        raise ConfigError(
            f"data.path {path}: no such token file (relative paths resolve from {Path.cwd()}); "
            "point data.path at a .bin or .npy file"
        )
    if not path.is_file():
        raise ConfigError(f"data.path {path}: is a directory, not a token file; point data.path at a .bin or .npy file")
    if path.suffix == ".npy":
        return _open_npy(path)
    item = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % item:
        raise ConfigError(
            f"data.path {path}: {size} bytes is not a whole number of {dtype} tokens ({item} bytes each); "
            "the file is truncated or data.dtype is wrong"
        )
    if size == 0:
        raise ConfigError(f"data.path {path}: the token file is empty; tokenize a corpus into it first")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


def _open_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(
            f"data.path {path}: not a readable .npy array ({' '.join(str(e).split())}); "
            "save the token ids with numpy.save"
        ) from None
    if arr.dtype.kind not in "ui":
        raise ConfigError(
            f"data.path {path}: holds {arr.dtype} values, not integer token ids; "
            "save the ids as uint16, uint32, int32 or int64"
        )
    if arr.ndim != 1:
        raise ConfigError(
            f"data.path {path}: a {arr.ndim}-D array of shape {tuple(arr.shape)}; save the ids as one flat 1-D array"
        )
    return arr


def scan_token_ids(tokens: np.ndarray, path: str, vocab_size: int, chunk: int = 1 << 24) -> None:
    """Every id must be in [0, vocab_size): one chunked pass over the memmap (bounded memory).
    An id out of range would otherwise surface as 'index out of range in self' inside the embedding."""
    for start in range(0, len(tokens), chunk):
        block = np.asarray(tokens[start : start + chunk])
        bad = (block >= vocab_size) | (block < 0) if block.dtype.kind == "i" else block >= vocab_size
        if bad.any():
            at = int(np.argmax(bad))
            raise ConfigError(
                f"data.path {path}: token id {int(block[at])} at position {start + at} is outside the "
                f"model's vocabulary (model.config.vocab_size {vocab_size}); tokenize with the model's "
                "tokenizer or raise model.config.vocab_size"
            )


def _rows(
    tokens: np.ndarray, mask: np.ndarray | None, starts: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of the windows starting at ``starts``; labels are -100 where the mask says "not a target"."""
    block = np.stack([np.asarray(tokens[w : w + seq_len + 1], dtype=np.int64) for w in starts])
    inputs, labels = block[:, :-1], block[:, 1:].copy()
    if mask is not None:
        m = np.stack([np.asarray(mask[w + 1 : w + seq_len + 1]) for w in starts])
        labels[m == 0] = IGNORE
    import torch

    return torch.from_numpy(np.ascontiguousarray(inputs)), torch.from_numpy(labels)


def _targets(mask: np.ndarray | None, starts: list[int], seq_len: int) -> int:
    if mask is None:
        return len(starts) * seq_len
    return int(sum(int(np.count_nonzero(mask[w + 1 : w + seq_len + 1])) for w in starts))


class GlobalOrderLoader:
    """Yields the (inputs, labels) micro-batches of one rank for a given step. With a target ``mask`` (chat
    data: 1 on assistant tokens) the labels of other positions are -100 (ignored by the loss)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, global_batch: int, mask: np.ndarray | None = None):
        self.tokens = tokens
        self.mask = mask
        self.seq_len = seq_len
        self.seed = seed
        self.global_batch = global_batch
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(
                f"data: {len(tokens)} tokens are shorter than one sample of data.seq_len {seq_len}; "
                "use a longer token file or a smaller data.seq_len"
            )
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _window(self, g: int) -> int:
        epoch, pos = divmod(g, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[pos])

    def starts(self, step: int, start: int, count: int) -> list[int]:
        """Token offsets of samples [start, start+count) of the step's global batch: a function of (seed, step)."""
        base = step * self.global_batch + start
        return [self._window(g) * self.seq_len for g in range(base, base + count)]

    def samples(self, step: int, start: int, count: int) -> torch.Tensor:
        """Samples [start, start+count) of the step's global batch, as a [count, seq_len+1] int64 tensor."""
        import torch

        return torch.from_numpy(
            np.stack(
                [
                    np.asarray(self.tokens[w : w + self.seq_len + 1], dtype=np.int64)
                    for w in self.starts(step, start, count)
                ]
            )
        )

    def targets(self, step: int) -> int:
        """Label positions that count in the loss over the step's *global* batch (every rank computes the same)."""
        return _targets(self.mask, self.starts(step, 0, self.global_batch), self.seq_len)

    def rank_batches(
        self, step: int, rank: int, world: int, micro: int | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        local = self.global_batch // world
        micro = micro or local
        return [
            _rows(self.tokens, self.mask, self.starts(step, rank * local + m, micro), self.seq_len)
            for m in range(0, local, micro)
        ]


class HeldOutLoader:
    """The held-out batches: batch b is windows [b*B, (b+1)*B) of the eval token file in file order (modulo
    its window count), so evaluation sees the same samples at every step and every world size."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, mask: np.ndarray | None = None):
        self.tokens, self.mask, self.seq_len, self.batch = tokens, mask, seq_len, batch
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(
                f"eval.split: {len(tokens)} tokens are shorter than one sample of data.seq_len {seq_len}; "
                "use a larger held-out split or a smaller data.seq_len"
            )

    def starts(self, b: int, start: int, count: int) -> list[int]:
        return [((b * self.batch + i) % self.n_windows) * self.seq_len for i in range(start, start + count)]

    def targets(self, b: int) -> int:
        return _targets(self.mask, self.starts(b, 0, self.batch), self.seq_len)

    def rank_batch(self, b: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self.batch // world
        return _rows(self.tokens, self.mask, self.starts(b, rank * local, local), self.seq_len)
