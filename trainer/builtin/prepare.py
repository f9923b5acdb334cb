"""A dataset (local json/jsonl/parquet/text/csv files or a Hub dataset) -> a cached, memory-mapped token file.

The controller runs this once, before any rank starts (``shardkeeper train`` through ``preflight``, or
``shardkeeper prepare-data`` alone); the ranks only open the files it names (``schemas.seam.SegmentLaunch.data``).

* **Content key.** sha256 over (the split's files: name + sha256 of each, only those the datasets library
  reads for that split, so editing validation.jsonl leaves the training key alone; the tokenizer's files: name +
  sha256 of each; the settings that decide the tokens: format, column, split, EOS policy, this module's
  ``PREP_VERSION``). The cache entry ``$SHARDKEEPER_DATA_CACHE/<key>/`` (default
  ``~/.cache/shardkeeper/data``) holds ``tokens.bin`` (raw uint16/uint32 ids), for chat data ``mask.bin``
  (uint8, 1 where the token is a training target) and ``meta.json`` (a ``schemas.PreparedSplit``). An entry
  is written into a temporary folder and renamed into place, so a half-written one is never used.
* **Parallel.** ``datasets.Dataset.map(batched=True, num_proc=N)`` with a progress bar; N is
  ``SHARDKEEPER_DATA_PROC`` or the CPUs this process may use (one per 1000 rows at most).
* **Text** rows: ``tokenizer(text)`` (with the tokenizer's own BOS if it adds one) + EOS when
  ``data.append_eos`` and the tokenizer has one; documents are concatenated (packing).
* **Chat** rows: the conversation rendered by the tokenizer's chat template (``apply_chat_template``,
  ``tokenize=False``) and tokenized once; a token is a target when it starts inside an assistant turn, i.e.
  between the rendering of the messages before it with the generation prompt and the rendering that includes
  it (so the turn's end-of-turn tokens are targets and the generation prompt is not). Conversations are
  concatenated like documents (packing: a training window may span two conversations, and its labels are
  -100 outside assistant turns). A template whose renderings are not prefixes of each other is refused.

Bad input is refused with one line naming the file or field and the fix, before anything is tokenized:
a dataset or tokenizer that is not there (a Hub id when the Hub cannot be reached), a missing column, an
empty split, a chat row without an assistant turn, a tokenizer larger than the model's embeddings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from schemas import DataSpec, PreparedData, PreparedSplit, RunSpec
from schemas.errors import ConfigError

log = logging.getLogger("shardkeeper")

PREP_VERSION = 1
DATA_EXTS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text", ".csv": "csv"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
ROWS_PER_WORKER = 1000  # fewer rows than this per worker: starting the worker costs more than it saves


def cache_root() -> Path:
    env = os.environ.get("SHARDKEEPER_DATA_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardkeeper" / "data"


def data_workers(rows: int, requested: int | None = None) -> int:
    if requested is None:
        raw = os.environ.get("SHARDKEEPER_DATA_PROC", "")
        if raw and not (raw.isdigit() and int(raw) >= 1):
            raise ConfigError(f"SHARDKEEPER_DATA_PROC={raw!r}: must be a positive integer; unset it to use every CPU")
        requested = int(raw) if raw else len(os.sched_getaffinity(0))
    return max(1, min(requested, -(-rows // ROWS_PER_WORKER)))


# --------------------------------------------------------------------------------------------- sources
def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _looks_local(src: str) -> bool:
    return src.startswith((".", "/", "~")) or Path(src).suffix.lower() in DATA_EXTS or src.count("/") > 1


_SHA_MEMO: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime_ns) -> sha256, per process


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file; remembered for this process while its inode, size and mtime stay (preflight runs once
    per planned topology, and a flow checks every segment)."""
    st = path.stat()
    memo = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if memo in _SHA_MEMO:
        return _SHA_MEMO[memo]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    _SHA_MEMO[memo] = h.hexdigest()
    return _SHA_MEMO[memo]


def _digest(named: list[tuple[str, str]]) -> str:
    return hashlib.sha256(json.dumps(named).encode()).hexdigest()


def tokenizer_source(spec: RunSpec) -> tuple[str, str | None, str]:
    """(folder or Hub id, revision, the field it came from): data.tokenizer, else the pretrained model's."""
    if spec.data.tokenizer:
        return spec.data.tokenizer, None, "data.tokenizer"
    pretrained = getattr(spec.model, "pretrained", None)
    if pretrained:
        return str(pretrained), getattr(spec.model, "revision", None), "model.pretrained (data.tokenizer unset)"
    raise ConfigError(
        "data.tokenizer: not set, and there is no model.pretrained to take the tokenizer from; set "
        "data.tokenizer to a tokenizer folder (tokenizer.json, tokenizer_config.json) or a Hub id"
    )


def tokenizer_dir(src: str, revision: str | None, field: str) -> Path:
    """The local folder of the tokenizer: ``src`` itself, or the Hub snapshot of its tokenizer files."""
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(
                f"{field} {src}: is a file; point it at the folder holding tokenizer.json / tokenizer_config.json"
            )
        if not tokenizer_files(p):
            raise ConfigError(
                f"{field} {src}: no tokenizer files in it ({', '.join(TOKENIZER_FILES[:3])}, ...); "
                "save one there with tokenizer.save_pretrained or point at another folder"
            )
        return p
    if _looks_local(src):
        raise ConfigError(
            f"{field} {src}: no such folder (relative paths resolve from {Path.cwd()}); point it at a "
            "tokenizer folder or a Hub id"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src, revision=revision, allow_patterns=[*TOKENIZER_FILES, "*.tiktoken"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: all one line
        raise ConfigError(
            f"{field} {src!r}: not a local folder, and the Hugging Face Hub cannot provide it "
            f"({_one_line(e)}); give a local tokenizer folder, or run once with network access"
        ) from None


def tokenizer_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and (f.name in TOKENIZER_FILES or f.suffix == ".tiktoken"))


def tokenizer_sha256(folder: Path) -> str:
    return _digest([(f.name, sha256_file(f)) for f in tokenizer_files(folder)])


def dataset_files(src: str) -> tuple[str, list[Path], Path] | None:
    """(builder, files, root) of a local dataset; None for a Hub dataset id."""
    p = Path(src).expanduser()
    if p.is_file():
        builder = DATA_EXTS.get(p.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"data.dataset {src}: unsupported file type {p.suffix or '(none)'}; use "
                f"{'/'.join(sorted(DATA_EXTS))} files or a folder of them"
            )
        return builder, [p], p.parent
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix.lower() in DATA_EXTS
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise ConfigError(
                f"data.dataset {src}: a folder without data files ({'/'.join(sorted(DATA_EXTS))}); "
                "put the dataset's files there or point at one file"
            )
        builders = {DATA_EXTS[f.suffix.lower()] for f in files}
        if len(builders) > 1:
            raise ConfigError(
                f"data.dataset {src}: mixes {' and '.join(sorted(builders))} files; keep one format per folder"
            )
        return builders.pop(), files, p
    if p.exists():
        raise ConfigError(f"data.dataset {src}: neither a file nor a folder; point it at the dataset's files")
    if _looks_local(src):
        raise ConfigError(
            f"data.dataset {src}: no such file or folder (relative paths resolve from {Path.cwd()}); "
            "point it at a .jsonl/.json/.parquet/.txt file, a folder of them, or a Hub dataset id"
        )
    return None


def split_files(local: tuple[str, list[Path], Path], src: str, split: str) -> list[Path]:
    """The files of a local dataset that ``split`` reads (its base name: 'train[:90%]' -> 'train'): for a folder,
    those the datasets library assigns to that split by their names (train*.jsonl, validation*.jsonl, ...), so
    the training data's key does not cover the held-out files (eval may change between segments); every file
    for a single file, for a folder without split names, or for a split name the folder does not have."""
    _, files, root = local
    if Path(src).expanduser().is_file():
        return files
    from datasets.data_files import DataFilesDict, get_data_patterns

    base = split.split("[", 1)[0].split("+", 1)[0].strip()
    try:
        by_split = DataFilesDict.from_patterns(get_data_patterns(str(root)), base_path=str(root))
    except Exception:  # noqa: BLE001 - let load_split say what is wrong with the folder
        return files
    named = {str(k): {Path(f).resolve() for f in v} for k, v in by_split.items()}
    if base not in named:
        return files
    return [f for f in files if f.resolve() in named[base]]


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets' own logging and its bars for loading (the tokenization keeps its bar)."""
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
        datasets.logging.set_verbosity(level)


def empty_split(field: str, split: str, src: str) -> str:
    return (
        f"{field} {split!r}: selects 0 rows of {src}; set {field} to a split or slice that has rows (e.g. "
        "'validation', 'train[90%:]'), or add rows to that split's file"
    )


def load_split(src: str, split: str, local: tuple[str, list[Path], Path] | None, field: str):
    """The split as a ``datasets.Dataset``; one line for a Hub id that cannot be reached or an unknown split."""
    import datasets

    if local is None and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        from huggingface_hub import HfApi

        try:  # one request: datasets itself retries an unreachable Hub for ~25 s before it says so
            HfApi().dataset_info(src)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"data.dataset {src!r}: not a local file or folder, and the Hugging Face Hub cannot "
                f"provide it ({_one_line(e)}); give local files, or run online once (then HF_HUB_OFFLINE=1 "
                "uses the cached copy)"
            ) from None
    try:
        with _quiet_datasets():
            if local is None:
                return datasets.load_dataset(src, split=split)
            builder, files, root = local
            if Path(src).expanduser().is_file():
                return datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]}, split=split)
            return datasets.load_dataset(str(root), split=split)
    except ValueError as e:
        msg = _one_line(e)
        if (
            "corresponds to no data" in msg
        ):  # a slice of no rows, e.g. 'validation[:0]': the field's fault, not the file's
            raise ConfigError(empty_split(field, split, src)) from None
        if "split" in msg.lower():
            raise ConfigError(
                f"{field} {split!r}: {src} has no such split ({msg}); name one of its splits (a single "
                "file is split 'train'; slices such as 'train[:90%]' work)"
            ) from None
        raise ConfigError(f"data.dataset {src}: cannot be read as a dataset ({msg}); fix the file") from None
    except Exception as e:  # noqa: BLE001 - malformed JSON, parquet, ... surface as many exception types
        raise ConfigError(
            f"data.dataset {src}: cannot be read as a dataset ({type(e).__name__}: {_one_line(e)}); fix the file"
        ) from None


# --------------------------------------------------------------------------------------------- tokenize
def load_tokenizer(folder: Path, field: str):
    from transformers import AutoTokenizer

    try:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        finally:
            hf_logging.set_verbosity(level)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{field} {folder}: transformers cannot load this tokenizer ({_one_line(e)}); fix its files"
        ) from None


def _tokenize_text(batch: dict[str, list], *, tokenizer: Any, column: str, eos: int | None) -> dict[str, list]:
    texts = ["" if t is None else str(t) for t in batch[column]]
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:  # what tokenizer(texts) does for a fast tokenizer, without building a BatchEncoding
        ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)]
    else:
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    if eos is not None:
        ids = [x if x and x[-1] == eos else [*x, eos] for x in ids]
    return {"input_ids": ids}


def chat_sample(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Token ids of one conversation as the chat template renders it, and its target mask (1 = assistant)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses an empty history: the turn starts the text
            if i:
                raise
            before = ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation, so "
                "assistant turns cannot be located; use a template without history-dependent rewrites"
            )
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(b > a and any(s <= a < e for s, e in spans)) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _tokenize_chat(batch: dict[str, list], *, tokenizer: Any, column: str) -> dict[str, list]:
    ids, masks = [], []
    for messages in batch[column]:
        i, m = chat_sample(tokenizer, messages)
        ids.append(i)
        masks.append(m)
    return {"input_ids": ids, "mask": masks}


def check_conversations(ds: Any, column: str, where: str, unit: str = "row") -> None:
    """Every row is a non-empty list of {role, content} with at least one assistant turn. A bad row is named
    1-based: ``unit`` "line" for one JSON-lines file (its line number), "row" otherwise (the split's N-th row)."""
    for start in range(0, len(ds), 1000):
        for j, conv in enumerate(ds[start : start + 1000][column]):
            row = f"{unit} {start + j + 1}"  # 1-based, as an editor counts lines
            if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ConfigError(
                    f"{where} {row}: data.messages_column {column!r} is not a list of "
                    "{role, content} messages; fix that row"
                )
            if not any(m.get("role") == "assistant" for m in conv):
                roles = ", ".join(str(m.get("role")) for m in conv)
                raise ConfigError(
                    f"{where} {row}: a conversation without an assistant turn (roles: {roles}); "
                    "nothing in it would be trained on: add the assistant's reply or drop the row"
                )


# --------------------------------------------------------------------------------------------- prepare
def settings_of(data: DataSpec, split: str) -> dict[str, Any]:
    column = data.text_column if data.format == "text" else data.messages_column
    out: dict[str, Any] = {"version": PREP_VERSION, "format": data.format, "split": split, "column": column}
    if data.format == "text":
        out["append_eos"] = data.append_eos
    return out


def content_key(dataset_sha: str, tokenizer_sha: str, settings: dict[str, Any]) -> str:
    blob = json.dumps({"dataset": dataset_sha, "tokenizer": tokenizer_sha, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached_split(key: str, dataset: str | None = None, tokenizer: str | None = None) -> PreparedSplit | None:
    """The cache entry of ``key`` when it is whole (meta.json readable, files of the recorded size); ``dataset``
    and ``tokenizer`` name where the same content is found now (the key does not depend on paths)."""
    entry = cache_root() / key
    try:
        meta = PreparedSplit.model_validate_json((entry / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tokens = entry / "tokens.bin"
    mask = entry / "mask.bin"
    item = np.dtype(meta.dtype).itemsize
    if meta.key != key or not tokens.is_file() or tokens.stat().st_size != meta.tokens * item:
        return None
    if meta.mask_path is not None and (not mask.is_file() or mask.stat().st_size != meta.tokens):
        return None
    return meta.model_copy(
        update={
            "path": str(tokens.resolve()),
            "mask_path": str(mask.resolve()) if meta.mask_path is not None else None,
            "cached": True,
            "seconds": 0.0,
            "dataset": dataset or meta.dataset,
            "tokenizer": tokenizer or meta.tokenizer,
        }
    )


def check_vocab(prep: PreparedSplit, vocab_size: int | None, field: str) -> None:
    """The tokenizer and the ids must fit the model's embeddings (model.config.vocab_size)."""
    if vocab_size is None:
        return
    if prep.vocab_size > vocab_size:
        raise ConfigError(
            f"{field} {prep.tokenizer}: the tokenizer has {prep.vocab_size} tokens but the model's "
            f"embeddings hold {vocab_size} (model.config.vocab_size); use the model's own tokenizer or "
            f"set model.config.vocab_size >= {prep.vocab_size}"
        )
    if prep.max_id >= vocab_size:
        raise ConfigError(
            f"data.dataset {prep.dataset} [{prep.split}]: token id {prep.max_id} is outside the model's "
            f"vocabulary (model.config.vocab_size {vocab_size}); tokenize with the model's tokenizer "
            "or raise model.config.vocab_size"
        )


def prepare_split(
    spec: RunSpec,
    split: str,
    *,
    vocab_size: int | None = None,
    num_proc: int | None = None,
    split_field: str = "data.split",
    progress: bool = True,
) -> PreparedSplit:
    """Tokenize one split of data.dataset into the cache (or find it there); see the module docstring."""
    data = spec.data
    assert data.dataset is not None
    tok_src, revision, tok_field = tokenizer_source(spec)
    tok_dir = tokenizer_dir(tok_src, revision, tok_field)
    local = dataset_files(data.dataset)
    settings = settings_of(data, split)
    tok_sha = tokenizer_sha256(tok_dir)
    compat: list[str] = []
    if local is not None:
        named = {f: (f.relative_to(local[2]).as_posix(), sha256_file(f)) for f in local[1]}
        mine = split_files(local, data.dataset, split)
        ds_sha = _digest([named[f] for f in mine])
        key = content_key(ds_sha, tok_sha, settings)
        if len(mine) < len(local[1]):  # keys before PREP_VERSION 1's split-only rule covered every file of the folder
            compat = [content_key(_digest(list(named.values())), tok_sha, settings)]
        hit = cached_split(key, data.dataset, tok_src)
        if hit is not None:
            check_vocab(hit, vocab_size, tok_field)
            return hit.model_copy(update={"compat_keys": compat})
    ds = load_split(data.dataset, split, local, split_field)
    if local is None:  # a Hub dataset: the datasets library's fingerprint of the split stands for its files
        ds_sha = hashlib.sha256(str(getattr(ds, "_fingerprint", "")).encode()).hexdigest()
        key = content_key(ds_sha, tok_sha, settings)
        hit = cached_split(key, data.dataset, tok_src)
        if hit is not None:
            check_vocab(hit, vocab_size, tok_field)
            return hit
    where = f"data.dataset {data.dataset} [{split}]"
    if len(ds) == 0:
        raise ConfigError(empty_split(split_field, split, data.dataset))
    column = settings["column"]
    if column not in ds.column_names:
        which = "data.text_column" if data.format == "text" else "data.messages_column"
        raise ConfigError(
            f"{where}: no column {column!r} (columns: {', '.join(ds.column_names)}); set {which} to "
            "the column that holds the " + ("text" if data.format == "text" else "conversations")
        )
    tokenizer = load_tokenizer(tok_dir, tok_field)
    n_vocab = len(tokenizer)
    pre = PreparedSplit(
        key=key,
        dataset=data.dataset,
        split=split,
        tokenizer=tok_src,
        dataset_sha256=ds_sha,
        tokenizer_sha256=tok_sha,
        settings=settings,
        path="",
        dtype="uint16",
        tokens=0,
        rows=len(ds),
        targets=0,
        max_id=-1,
        vocab_size=n_vocab,
        compat_keys=compat,
    )
    check_vocab(pre, vocab_size, tok_field)  # before tokenizing: a tokenizer larger than the embeddings
    if data.format == "chat":
        one_jsonl = (
            local is not None and len(local[1]) == 1 and local[1][0].suffix.lower() == ".jsonl" and "[" not in split
        )
        check_conversations(ds, column, where, "line" if one_jsonl else "row")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"{tok_field} {tok_src}: the tokenizer has no chat template (chat_template in "
                "tokenizer_config.json or chat_template.jinja); add one or use data.format: text"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                f"{tok_field} {tok_src}: data.format chat needs a fast tokenizer (tokenizer.json) for "
                "token offsets; save the tokenizer with tokenizers' fast backend"
            )
    return _tokenize_and_store(ds, tokenizer, pre, data, num_proc, progress, vocab_size, tok_field)


def _tokenize_and_store(
    ds: Any,
    tokenizer: Any,
    pre: PreparedSplit,
    data: DataSpec,
    num_proc: int | None,
    progress: bool,
    vocab_size: int | None,
    tok_field: str,
) -> PreparedSplit:
    import datasets

    t0 = time.perf_counter()
    chat = data.format == "chat"
    workers = data_workers(len(ds), num_proc)
    if chat:
        fn, kwargs = _tokenize_chat, {"tokenizer": tokenizer, "column": pre.settings["column"]}
    else:
        eos = tokenizer.eos_token_id if data.append_eos else None
        fn, kwargs = _tokenize_text, {"tokenizer": tokenizer, "column": pre.settings["column"], "eos": eos}
    if not progress:
        datasets.disable_progress_bars()
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    if workers > 1:  # one process per CPU already: the tokenizer's own thread pool would oversubscribe them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        mapped = ds.map(
            fn,
            batched=True,
            batch_size=ROWS_PER_WORKER,
            num_proc=workers if workers > 1 else None,
            fn_kwargs=kwargs,
            remove_columns=ds.column_names,
            load_from_cache_file=False,
            new_fingerprint=pre.key[:32],
            desc=f"tokenizing {Path(pre.dataset).name} [{pre.split}] on {workers} process(es)",
        )
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the worker's error (template, text type) as one line
        raise ConfigError(
            f"data.dataset {pre.dataset} [{pre.split}]: tokenization failed ({type(e).__name__}: "
            f"{_one_line(e)}); fix the data or the tokenizer"
        ) from None
    finally:
        if not progress:
            datasets.enable_progress_bars()
        if parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    dtype = np.uint16 if pre.vocab_size <= 1 << 16 else np.uint32
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{pre.key[:16]}-", dir=root))
    tmp.chmod(0o755)  # a shared cache: other users' ranks read it
    try:
        n, targets, max_id = _write_columns(mapped, tmp, dtype, chat)
        final = root / pre.key
        out = pre.model_copy(
            update={
                "path": str((final / "tokens.bin").resolve()),
                "mask_path": str((final / "mask.bin").resolve()) if chat else None,
                "dtype": np.dtype(dtype).name,
                "tokens": n,
                "targets": targets if chat else n,
                "max_id": max_id,
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
        check_vocab(out, vocab_size, tok_field)
        # compat_keys depend on the folder's other files, not on this entry's content: not cached
        (tmp / "meta.json").write_text(out.model_dump_json(indent=2, exclude={"compat_keys"}), encoding="utf-8")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, final)
        except OSError:  # another process committed the same key first: same content, use theirs
            if cached_split(pre.key) is None:
                raise
        else:
            tmp = None  # type: ignore[assignment]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "tokenized %s [%s]: %d rows -> %d tokens in %.1f s on %d process(es); cached at %s",
        pre.dataset,
        pre.split,
        pre.rows,
        out.tokens,
        out.seconds,
        workers,
        final,
    )
    return out


def _write_columns(mapped: Any, folder: Path, dtype: Any, chat: bool) -> tuple[int, int, int]:
    """Concatenate the mapped input_ids (and mask) columns into tokens.bin (mask.bin), chunk by chunk."""
    table = mapped.data.table if hasattr(mapped.data, "table") else mapped.data
    n = targets = 0
    max_id = -1
    with (
        open(folder / "tokens.bin", "wb") as tf,
        open(folder / "mask.bin", "wb") if chat else contextlib.nullcontext() as mf,
    ):
        for batch in table.to_batches(max_chunksize=1 << 14):  # ids and mask of the same rows, side by side
            flat = batch.column("input_ids").flatten().to_numpy(zero_copy_only=False)
            if flat.size:
                max_id = max(max_id, int(flat.max()))
                if int(flat.min()) < 0:
                    raise ConfigError("the tokenizer produced a negative token id; fix the tokenizer")
            tf.write(flat.astype(dtype, copy=False).tobytes())
            n += int(flat.size)
            if chat and mf is not None:
                m = batch.column("mask").flatten().to_numpy(zero_copy_only=False).astype(np.uint8)
                if m.size != flat.size:
                    raise RuntimeError(f"mask of {m.size} values for {flat.size} tokens")
                mf.write(m.tobytes())
                targets += int(m.sum())
    return n, targets, max_id


def prepare_data(
    spec: RunSpec, *, vocab_size: int | None = None, num_proc: int | None = None, progress: bool = True
) -> PreparedData | None:
    """Train split (and eval split when ``spec.eval``) of a ``data.source: dataset`` run; None for other sources."""
    if spec.data.source != "dataset":
        return None
    train = prepare_split(spec, spec.data.split, vocab_size=vocab_size, num_proc=num_proc, progress=progress)
    ev = None
    if spec.eval is not None:
        ev = prepare_split(
            spec, spec.eval.split, vocab_size=vocab_size, num_proc=num_proc, split_field="eval.split", progress=progress
        )
        check_eval_size(spec, ev)
    return PreparedData(train=train, eval=ev)


def check_eval_size(spec: RunSpec, ev: PreparedSplit) -> None:
    """The held-out split must hold eval.batches distinct batches: fewer samples would be scored several times
    over (HeldOutLoader wraps around) and eval_tokens would count the repeats."""
    assert spec.eval is not None
    seq_len, batch = spec.data.seq_len, spec.eval_batch()
    windows = max(0, (ev.tokens - 1) // seq_len)
    need = spec.eval.batches * batch
    if windows >= need:
        return
    if windows < batch:
        fix = (
            f"set eval.batch_size to at most {windows} (dividing the world size)"
            if windows
            else "use a larger split or a smaller data.seq_len"
        )
    else:
        fix = f"set eval.batches to {windows // batch} or less"
    raise ConfigError(
        f"eval.split {ev.split!r}: {ev.tokens} tokens hold {windows} samples of data.seq_len {seq_len}, "
        f"but eval.batches {spec.eval.batches} x {batch} samples need {need} (the same samples would be "
        f"scored again); {fix}, or give eval.split more rows"
    )
