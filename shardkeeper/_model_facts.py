"""What preflight learns about a model built from ``model.config``, kept between launches.

Checking a ``model.model_type`` + ``model.config`` means importing transformers, validating the config class and
building the model on the meta device: ~3 s of CPU on every ``shardkeeper train``, the same answer every time for
the same inputs. A successful check is kept as a small JSON file keyed by everything it depends on (the model
section, data.seq_len, the transformers and torch versions, the source of config.py, preflight.py and this
module); a later launch with the same key reads the numbers back and does not import transformers. Failures are never
kept (each refusal is computed again, with its one line). A pretrained model is always checked in full (its files may
change). Stored under ``$SHARDKEEPER_CACHE/preflight`` (default ``~/.cache/shardkeeper/preflight``); an unreadable or
malformed entry, or one whose numbers are out of bounds or disagree with what ``model.config`` states, is
ignored and rewritten. ``SHARDKEEPER_PREFLIGHT_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from schemas import RunSpec

FIELDS = ("params", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings")


@dataclass(frozen=True)
class ModelFacts:
    """The numbers the later checks read (``check_data``, ``check_memory``); used where a transformers config was."""

    params: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    max_position_embeddings: int


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _code_digest() -> str:
    """The source of the modules whose checks the facts stand for: an edited check invalidates every entry."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("config.py", "preflight.py", "_model_facts.py"):
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(name.encode())
    return h.hexdigest()[:16]


def key(spec: RunSpec) -> str | None:
    """None when the facts are not cacheable (a pretrained model, the cache turned off)."""
    if spec.model.pretrained is not None or os.environ.get("SHARDKEEPER_PREFLIGHT_CACHE", "1") == "0":
        return None
    what = {
        "model": spec.model.model_dump(mode="json"),
        "seq_len": spec.data.seq_len,
        "transformers": _version("transformers"),
        "torch": _version("torch"),
        "code": _code_digest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _dir() -> Path:
    root = os.environ.get("SHARDKEEPER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shardkeeper")
    return Path(root) / "preflight"


MAX_PARAMS = 10**13
MAX_SIZE = 2**31


def load(k: str | None, spec: RunSpec | None = None) -> ModelFacts | None:
    """The kept facts, or None (a full check) when there are none or they cannot be the check's: a number out of
    bounds (params <= 1e13, sizes <= 2**31, vocab_size >= 1), a number that differs from what ``spec``'s
    ``model.config`` states, a ``data.seq_len`` longer than the kept ``max_position_embeddings``, or an embedding
    larger than the kept parameter count (the file was edited, not written by a check)."""
    if k is None:
        return None
    try:
        raw = json.loads((_dir() / f"{k}.json").read_text(encoding="utf-8"))
        values = {f: raw[f] for f in FIELDS}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(type(v) is int and 0 <= v <= (MAX_PARAMS if f == "params" else MAX_SIZE) for f, v in values.items()):
        return None
    if values["vocab_size"] < 1 or values["params"] < values["vocab_size"] * values["hidden_size"]:
        return None
    if spec is not None:
        stated = spec.model.config
        if any(f in stated and stated[f] != values[f] for f in FIELDS[1:]):
            return None
        if values["max_position_embeddings"] and spec.data.seq_len > values["max_position_embeddings"]:
            return None  # the full check refuses it in one line
    return ModelFacts(**values)


def store(k: str | None, params: int, cfg: Any) -> None:
    """Keep what a full check found (best effort: a cache that cannot be written only costs the next launch time)."""
    if k is None:
        return
    values = {"params": int(params)}
    for f in FIELDS[1:]:
        v = getattr(cfg, f, 0)
        values[f] = int(v) if isinstance(v, int) and not isinstance(v, bool) else 0
    facts = ModelFacts(**values)
    try:
        d = _dir()
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(facts), f)
        os.replace(tmp, d / f"{k}.json")
    except OSError:
        pass
