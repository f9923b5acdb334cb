"""The pretrained model a run starts from (``model.pretrained``): where its files are, what tensors its
safetensors files hold, reading one rank's rows of a tensor straight into that rank's shard, and the record
(``schemas.BaseModelRecord``) a checkpoint keeps of it.

Used by the controller (preflight: the folder, config.json, the weight files, the tokenizer), by the ranks
(the first segment of a run reads its shards of every weight with ``read_rows``, or its ZeRO-3 partitions
with ``read_elements``: no rank ever holds the whole model) and by the export (which tokenizer files to carry). No
transformers import: config.json and the safetensors headers are plain JSON; ``huggingface_hub`` only resolves Hub ids
through its cache.

Reading: a safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, data offsets)
and the raw little-endian tensor bytes. Rows ``[start, end)`` of a row-major tensor are one contiguous byte
range, so a rank's Shard(0) slice is read with ``preadv`` straight into its local tensor's memory when the
dtypes agree (no temporary, no mmap: nothing of the file stays mapped in the rank), or in 16 MiB pieces
cast with ``copy_`` when the file is bf16/fp16 and the masters fp32.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import pread_full
from schemas import BaseModelRecord, ModelSpec
from schemas.errors import ConfigError

WEIGHTS_SINGLE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# What a tokenizer folder may hold (fast and slow tokenizers, chat templates): carried into exports.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
PIECE = 16 << 20
TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def is_hub_id(source: str) -> bool:
    """ORG/NAME that is not an existing local path (a relative folder 'runs/base' wins over a Hub id)."""
    return bool(HUB_ID_RE.match(source)) and not Path(source).expanduser().exists()


def resolve(spec: ModelSpec, *, local_files_only: bool = True) -> tuple[Path, str | None]:
    """The local folder of ``spec.pretrained`` and, for a Hub id, the commit it resolved to.

    A local folder is taken as is. A Hub id goes through huggingface_hub's cache (``snapshot_download``;
    with ``local_files_only`` nothing is downloaded). Raises a one-line ConfigError naming the fix."""
    source = spec.pretrained
    if source is None:
        raise ConfigError("model.pretrained is not set")
    path = Path(source).expanduser()
    if path.exists() or not HUB_ID_RE.match(source):
        if not path.exists():
            raise ConfigError(
                f"model.pretrained {source}: no such folder (and not a Hub id ORG/NAME); pass a "
                "save_pretrained folder or a Hub model id"
            )
        if not path.is_dir():
            raise ConfigError(
                f"model.pretrained {source}: is a file, not a folder; pass the save_pretrained folder "
                "that holds config.json and the *.safetensors files"
            )
        if spec.revision is not None:
            raise ConfigError(
                f"model.revision {spec.revision}: only applies to a Hub id, and model.pretrained "
                f"{source} is a local folder; remove model.revision"
            )
        return path, None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    rev = f" at revision {spec.revision}" if spec.revision else ""
    try:
        folder = Path(
            snapshot_download(
                source, revision=spec.revision, allow_patterns=patterns, local_files_only=local_files_only
            )
        )
    except LocalEntryNotFoundError:
        from huggingface_hub.constants import HF_HUB_CACHE

        how = (
            "not in the Hugging Face cache"
            if local_files_only
            else "not in the Hugging Face cache and the Hub is unreachable (offline?)"
        )
        raise ConfigError(
            f"model.pretrained {source}{rev}: {how} ({HF_HUB_CACHE}); download it first with "
            f"`hf download {source}{' --revision ' + spec.revision if spec.revision else ''}` "
            "or pass a local save_pretrained folder"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ConfigError(
            f"model.pretrained {source}{rev}: {type(e).__name__} on the Hub; check the id and "
            "revision (and HF_TOKEN for a gated or private model)"
        ) from None
    except OSError as e:  # network errors are OSErrors (requests / httpx)
        raise ConfigError(
            f"model.pretrained {source}{rev}: cannot be fetched ({' '.join(str(e).split())[:200]}); "
            "download it first with `hf download` or pass a local folder"
        ) from None
    return folder, folder.name if len(folder.name) == 40 else spec.revision


def read_config(folder: Path, source: str) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise ConfigError(
            f"model.pretrained {source}: {path} is missing; the folder must be a save_pretrained "
            "folder (config.json + model*.safetensors)"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}: not a readable JSON config ({' '.join(str(e).split())[:200]}); re-save the model "
            "with save_pretrained"
        ) from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ConfigError(f"{path}: has no model_type; re-save the model with save_pretrained")
    return cfg


def weight_files(folder: Path, source: str) -> list[Path]:
    """The safetensors files of the folder (the single file, or every shard the index names)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"{index}: not a valid safetensors index ({type(e).__name__}); re-save the model with save_pretrained"
            ) from None
        for n in names:
            if "/" in n or n in ("", ".", "..") or not (folder / n).is_file():
                raise ConfigError(
                    f"{index}: names {n}, which is missing from {folder}; download or copy every shard of the model"
                )
        return [folder / n for n in names]
    if (folder / WEIGHTS_SINGLE).is_file():
        return [folder / WEIGHTS_SINGLE]
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        return [folder / n for n in others]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ConfigError(
            f"model.pretrained {source}: {folder} has only PyTorch .bin/.pt weights; convert them to "
            "safetensors (load the model and save_pretrained(..., safe_serialization=True))"
        )
    raise ConfigError(
        f"model.pretrained {source}: {folder} holds no model weights (model.safetensors or "
        f"{WEIGHTS_INDEX}); pass the folder save_pretrained wrote"
    )


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    file: Path
    dtype: str  # safetensors dtype code (F32, BF16, ...)
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    end: int

    @property
    def row_bytes(self) -> int:
        n = ST_DTYPES[self.dtype]
        for d in self.shape[1:]:
            n *= d
        return n


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path}: too short to be a safetensors file; re-download or re-save the model")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ConfigError(f"{path}: safetensors header of {n} bytes is implausible; the file is corrupted")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ConfigError(
                f"{path}: the safetensors header is not JSON; the file is corrupted, re-download it"
            ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: the safetensors header is not a mapping; the file is corrupted")
    header["__data_start__"] = 8 + n
    return header


def tensor_index(files: Iterable[Path]) -> dict[str, StoredTensor]:
    """Every tensor of the weight files, checked against the file sizes (nothing is read but headers)."""
    out: dict[str, StoredTensor] = {}
    for path in files:
        header = read_header(path)
        start = header.pop("__data_start__")
        header.pop("__metadata__", None)
        size = path.stat().st_size
        for name, info in header.items():
            try:
                dtype, shape, (b, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ConfigError(
                    f"{path}: tensor {name} has a malformed header entry; the file is corrupted"
                ) from None
            if dtype not in ST_DTYPES:
                raise ConfigError(
                    f"{path}: tensor {name} has dtype {dtype}, which shardkeeper does not read; "
                    "re-save the model in float32, bfloat16 or float16"
                )
            numel = 1
            for d in shape:
                numel *= d
            if e - b != numel * ST_DTYPES[dtype] or start + e > size or b < 0:
                raise ConfigError(
                    f"{path}: tensor {name} ({dtype} {list(shape)}) does not fit its byte range; the "
                    "file is truncated or corrupted, re-download it"
                )
            if name in out:
                raise ConfigError(f"{path}: tensor {name} is also in {out[name].file.name}; the weight files overlap")
            out[name] = StoredTensor(name, path, dtype, shape, start + b, start + e)
    return out


def find_tensor(index: dict[str, StoredTensor], name: str, tied: dict[str, str]) -> StoredTensor | None:
    """The stored tensor of model parameter ``name``: itself, or the one it is tied to (save_pretrained keeps
    one of a tied pair: usually model.embed_tokens.weight for lm_head.weight)."""
    if name in index:
        return index[name]
    for a, b in tied.items():
        if name == a and b in index:
            return index[b]
        if name == b and a in index:
            return index[a]
    return None


def same_bytes(a: StoredTensor, b: StoredTensor, piece: int = 16 << 20) -> bool:
    """Do two stored tensors hold the same dtype, shape and bytes? (Read piece by piece; stops at a difference.)"""
    if (a.dtype, a.shape, a.end - a.begin) != (b.dtype, b.shape, b.end - b.begin):
        return False
    if (a.file, a.begin) == (b.file, b.begin):
        return True
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        done, total = 0, a.end - a.begin
        while done < total:
            n = min(piece, total - done)
            if os.pread(fa.fileno(), n, a.begin + done) != os.pread(fb.fileno(), n, b.begin + done):
                return False
            done += n
    return True


def tied_conflict(index: dict[str, StoredTensor], tied: dict[str, str]) -> tuple[str, str] | None:
    """A tied pair whose both names the files hold with different values: one parameter cannot be both (which one
    transformers keeps depends on its version), so the caller refuses rather than pick one silently."""
    for a, b in tied.items():
        if a in index and b in index and not same_bytes(index[a], index[b]):
            return a, b
    return None


def read_rows(t: StoredTensor, start: int, end: int, out: Any) -> int:
    """Read rows ``[start, end)`` of ``t`` (dim 0; a 0-d tensor is one row) into the contiguous CPU tensor ``out``
    of that shape, casting when the dtypes differ. Returns bytes read."""
    nbytes = (end - start) * t.row_bytes if t.shape else t.end - t.begin
    return _read_range(t, t.begin + start * t.row_bytes, nbytes, out, f"rows {start}:{end}")


def read_elements(t: StoredTensor, start: int, count: int, out: Any) -> int:
    """Read elements ``[start, start + count)`` of ``t`` flattened (row-major) into the contiguous CPU tensor ``out``
    of ``count`` elements, casting when the dtypes differ: a ZeRO-3 partition is such a range of the flattened
    parameter. Returns bytes read."""
    size = ST_DTYPES[t.dtype]
    if start < 0 or count < 0 or t.begin + (start + count) * size > t.end:
        raise ValueError(f"{t.name}: elements {start}:{start + count} are outside its {(t.end - t.begin) // size}")
    return _read_range(t, t.begin + start * size, count * size, out, f"elements {start}:{start + count}")


def _read_range(t: StoredTensor, offset: int, nbytes: int, out: Any, what: str) -> int:
    """``nbytes`` of ``t``'s file from ``offset`` into ``out`` (preadv straight into its memory when the dtypes
    agree, else 16 MiB pieces cast with ``copy_``)."""
    import torch

    src_dtype = getattr(torch, TORCH_DTYPES[t.dtype])
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("reading weights needs a contiguous CPU tensor")
    if out.numel() * src_dtype.itemsize != nbytes:
        raise ValueError(f"{t.name}: {what} are {nbytes} bytes, the destination holds {out.numel()} elements")
    if nbytes == 0:
        return 0
    fd = os.open(t.file, os.O_RDONLY)
    try:
        if out.dtype == src_dtype:
            _pread_into(fd, memoryview(out.view(torch.uint8).reshape(-1).numpy()), offset, t.file)
        else:
            flat = out.reshape(-1)
            per = max(1, PIECE // src_dtype.itemsize)
            buf = torch.empty(min(per, flat.numel()), dtype=src_dtype)
            done = 0
            while done < flat.numel():
                n = min(per, flat.numel() - done)
                piece = buf[:n]
                _pread_into(fd, memoryview(piece.view(torch.uint8).numpy()), offset + done * src_dtype.itemsize, t.file)
                flat[done : done + n].copy_(piece)
                done += n
    finally:
        os.close(fd)
    return nbytes


def first_nonfinite(tensors: Iterable[StoredTensor], piece: int = PIECE) -> tuple[StoredTensor, int, float] | None:
    """The first NaN/Inf element among ``tensors`` (floating ones): (tensor, flat index, value), or None. The tensors
    are read in ``piece``-byte pieces into two reused buffers (nothing else is held): a thread reads the next piece
    while this one is checked with one multiply and one sum (``x * 0`` is 0 for every finite x, NaN for NaN/Inf)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    pieces = []  # (tensor, first element, elements)
    for t in tensors:
        if t.dtype in FLOAT_DTYPES and t.end > t.begin:
            size = ST_DTYPES[t.dtype]
            numel, per = (t.end - t.begin) // size, max(1, piece // size)
            pieces += [(t, i, min(per, numel - i)) for i in range(0, numel, per)]
    if not pieces:
        return None
    bufs = [torch.empty(max(piece, 8), dtype=torch.uint8) for _ in range(2)]

    def read(k: int) -> Any:
        t, first, n = pieces[k]
        size = ST_DTYPES[t.dtype]
        raw = bufs[k % 2][: n * size]
        with open(t.file, "rb", buffering=0) as f:
            _pread_into(f.fileno(), memoryview(raw.numpy()), t.begin + first * size, t.file)
        return raw.view(getattr(torch, TORCH_DTYPES[t.dtype]))

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nonfinite-scan") as pool:
        ahead = pool.submit(read, 0)
        for k, (t, first, _) in enumerate(pieces):
            chunk = ahead.result()
            if k + 1 < len(pieces):
                ahead = pool.submit(read, k + 1)  # into the other buffer
            if not math.isfinite(float((chunk * 0).sum())):
                at = int((~torch.isfinite(chunk)).nonzero()[0, 0])
                return t, first + at, float(chunk[at])
    return None


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    if not pread_full(fd, view, offset):
        raise ConfigError(f"{path}: ended early while reading weights; the file is truncated, re-download it")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def hub_commit_sha(path: Path) -> str | None:
    """A Hub cache snapshot file is a link to blobs/<sha256> for LFS files: the name is the content's sha256."""
    try:
        target = Path(os.readlink(path)).name if path.is_symlink() else ""
    except OSError:
        return None
    return target if re.fullmatch(r"[0-9a-f]{64}", target) else None


def base_model_record(spec: ModelSpec, folder: Path, resolved_revision: str | None) -> BaseModelRecord:
    """What a checkpoint records of the base model: source, revision, and the sha256 of every weight file
    (the Hub cache's blob name when it is one; else hashed, ~1-2 GB/s) and of config/tokenizer files."""
    source = spec.pretrained or ""
    files = weight_files(folder, source)
    weights = {p.name: (hub_commit_sha(p) or sha256_file(p)) for p in files}
    small = {
        n: sha256_file(folder / n) for n in (CONFIG, GENERATION_CONFIG, *TOKENIZER_FILES) if (folder / n).is_file()
    }
    hub_id = source if is_hub_id(source) else spec.base_model_id
    return BaseModelRecord(
        source=source,
        revision=spec.revision,
        resolved_revision=resolved_revision,
        local_path=str(folder.resolve()),
        hub_id=hub_id,
        weights=weights,
        weights_bytes=sum(p.stat().st_size for p in files),
        files=small,
    )


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]


def pretrained_tokenizer_path(spec: Any) -> Path | None:
    """Where a run's tokenizer comes from when ``data.tokenizer`` is not set: the pretrained model's folder
    (resolved through the Hub cache, nothing downloaded), or None for a run from random weights or a folder
    without tokenizer files. ``spec`` is a RunSpec. The hook for the data path (tokenizer-driven datasets)."""
    explicit = getattr(getattr(spec, "data", None), "tokenizer", None)
    if explicit:
        return Path(explicit)
    model = spec.model
    if model.pretrained is None:
        return None
    folder, _ = resolve(model, local_files_only=True)
    return folder if tokenizer_files(folder) else None
