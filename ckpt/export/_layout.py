"""The safetensors layout: shard planning, file names, headers, the index, and writing the shards."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from schemas import CheckpointManifest

log = logging.getLogger(__name__)
from ckpt.export._model import ModelDescription, readme_text
from ckpt.export._options import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE
from ckpt.export._records import ExportTensor, Seen
from ckpt.export._sink import BufferPool, FileSink, produce, write_small_file


def plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Greedy packing in order: a new shard when the next tensor would pass ``limit``; a tensor larger
    than ``limit`` gets a shard of its own (logged), as huggingface_hub's splitter does."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > limit:
            log.warning(
                "%s is %d bytes, more than max_shard_size %d: it is written alone in its own shard", name, nbytes, limit
            )
            if current:
                shards.append(current)
            shards.append([name])
            current, used = [], 0
            continue
        if current and used + nbytes > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def data_order(tensors: list[ExportTensor]) -> list[ExportTensor]:
    # Widest dtypes first keeps every tensor aligned to its element size (safetensors' own order).
    return sorted(tensors, key=lambda t: -t.out_dtype.itemsize)


def safetensors_header(tensors: list[ExportTensor]) -> bytes:
    """8-byte little-endian length + compact JSON (fixed __metadata__, sorted names), space-padded to 8."""
    entries: dict[str, Any] = {}
    offset = 0
    for t in data_order(tensors):
        entries[t.name] = {
            "dtype": SAFETENSORS_DTYPES[t.out_dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.out_nbytes],
        }
        offset += t.out_nbytes
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    header.update(sorted(entries.items()))
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_shard(
    path: Path,
    tensors: list[ExportTensor],
    pool: BufferPool,
    on_written: Callable[[int], None] | None,
    seen: Seen | None = None,
) -> str:
    sink = FileSink(path, on_written)
    try:
        sink.put(memoryview(safetensors_header(tensors)))
        for t in data_order(tensors):
            produce(t, t.out_dtype, pool, sink.put, seen)
    except BaseException:
        sink.abort()
        raise
    return sink.finish()


def index_json(shards: list[list[ExportTensor]], names: list[str]) -> bytes:
    weight_map = {t.name: fname for fname, shard in zip(names, shards) for t in shard}
    index = {
        "metadata": {
            "total_size": sum(t.out_nbytes for s in shards for t in s),
            "total_parameters": sum(t.numel for s in shards for t in s),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


@contextmanager
def progress_bar(enabled: bool, total: int, label: str) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def write_shards(
    tmp: Path,
    ckpt_dir: Path,
    dtype: str,
    shards: list[list[ExportTensor]],
    pool: BufferPool,
    progress: bool,
    seen: Seen | None = None,
) -> dict[str, str]:
    """Write the safetensors files (and the index when there are several); return name -> sha256.
    ``seen`` is shown the source bytes as they are read."""
    names = shard_file_names(len(shards))
    hashes: dict[str, str] = {}
    total = sum(len(safetensors_header(s)) + sum(t.out_nbytes for t in s) for s in shards)
    with progress_bar(progress, total, f"export {ckpt_dir.name} ({dtype})") as advance:
        for fname, shard in zip(names, shards):
            hashes[fname] = write_shard(tmp / fname, shard, pool, advance, seen)
            log.info("wrote %s: %d tensors, %.1f MB", fname, len(shard), sum(t.out_nbytes for t in shard) / 1e6)
    if len(shards) > 1:
        hashes[INDEX_FILE] = write_small_file(tmp / INDEX_FILE, index_json(shards, names))
    return hashes


def write_model_files(
    tmp: Path,
    ckpt_dir: Path,
    manifest: CheckpointManifest,
    model: ModelDescription,
    dtype: str,
    shards: list[list[ExportTensor]],
) -> dict[str, str]:
    """config.json, generation_config.json and README.md; return name -> sha256."""
    config_json, gen_json = model.config_json, model.generation_json
    num_params = sum(t.numel for s in shards for t in s)
    readme = readme_text(ckpt_dir, manifest, model, dtype, num_params, len(shards))
    return {
        "config.json": write_small_file(tmp / "config.json", config_json.encode("utf-8")),
        "generation_config.json": write_small_file(tmp / "generation_config.json", gen_json.encode("utf-8")),
        "README.md": write_small_file(tmp / "README.md", readme),
    }


def plan_tensor_shards(tensors: list[ExportTensor], limit: int) -> list[list[ExportTensor]]:
    by_name = {t.name: t for t in tensors}
    return [[by_name[n] for n in names] for names in plan_shards([(t.name, t.out_nbytes) for t in tensors], limit)]
