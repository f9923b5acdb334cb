"""Export a committed checkpoint (DCP, DeepSpeed ZeRO or a memory snapshot) to a folder that
``AutoModelForCausalLM.from_pretrained`` loads: safetensors shards, config, model card and tokenizer files.

    from ckpt.export import export_checkpoint
    export_checkpoint("runs/demo/checkpoints/step-00000020", "runs/demo/exports/step-00000020", dtype="bfloat16")

How it checks, streams and commits (and what that guarantees) is in docs/concepts/export.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

from ckpt.commit.fsutil import peak_rss_bytes
from ckpt.memtier.tier import in_memory_tier
from ckpt.validate.checks import WatchedDir, gone_before, retired_message
from schemas import ExportResult
from schemas.errors import CheckpointError, CheckpointRetired

log = logging.getLogger(__name__)
from ckpt.export._collect import COLLECTORS
from ckpt.export._commit import check_free_space, check_out_dir, commit_folder, temp_dir_for, torch_threads
from ckpt.export._digests import FileDigests
from ckpt.export._layout import (
    plan_shards,
    plan_tensor_shards,
    safetensors_header,
    shard_file_names,
    write_model_files,
    write_shards,
)
from ckpt.export._model import (
    Background,
    ModelDescription,
    check_against_inventory,
    declared_untied,
    describe_model,
    described,
    model_from_record,
    name_tensors,
)
from ckpt.export._options import EXPORT_DTYPES, PIECE_BYTES, POOL_PIECES, check_checkpoint, export_dtype, parse_size
from ckpt.export._sink import BufferPool, StreamCrc, verify_entries
from ckpt.export._tokenizer import copy_tokenizer, tokenizer_source


def export_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    deep: bool = False,
    tokenizer_from: str | os.PathLike[str] | bool | None = None,
) -> ExportResult:
    """Export a committed DCP or DeepSpeed checkpoint to ``out_dir`` in the ``from_pretrained`` layout.

    Args:
        ckpt_dir: the committed checkpoint (``.../checkpoints/step-N``, a DeepSpeed tag folder or a memory snapshot).
        out_dir: the folder to create; it appears whole or not at all.
        dtype: the published dtype of floating tensors ("float32", "bfloat16", "float16"); integer and bool
            tensors keep theirs.
        max_shard_size: the bound of each safetensors file, in bytes or as "5GB" / "500MB" / "2GiB"; a larger
            tensor is written alone in its own file.
        overwrite: replace an existing ``out_dir`` once the new export is complete (the old folder is renamed
            aside, the new one renamed in, then the old one removed).
        progress: show a progress bar.
        deep: check every checksum in the manifest and the recorded fingerprint before starting. Either way no
            unchecked model byte is published: without ``deep`` the files holding model bytes are checked as they
            are copied (a record's CRC-32, or the file's xxh3-128 against the manifest).
        tokenizer_from: where the tokenizer files come from: a folder; None for the run's ``data.tokenizer`` or its
            base model's; False for none.

    Returns:
        ExportResult: the step, every file written with its SHA-256, the shard, tensor and byte counts, the time
            taken and the peak memory.

    Raises:
        ExportError: a bad option, an ``out_dir`` that exists (without ``overwrite``) or lies inside the checkpoint,
            too little free space, tensors that do not match the model, or an unusable tokenizer folder.
        CheckpointRetired: retention removed the checkpoint before its files were all opened, or a memory snapshot
            before every byte was read (pick a newer step).
        CheckpointError: the checkpoint is incomplete, corrupt or not a checkpoint.
        OSError: writing the export failed (a full disk, an I/O error); its hidden folder is removed.

    Example:
        >>> export_checkpoint("runs/demo/checkpoints/step-00000020", "out/step-20", dtype="bfloat16")  # doctest: +SKIP
    """
    # absolute and normalised (symlinks kept): '.' from inside the checkpoint still names it, run dir and step
    try:
        ckpt_dir, out_dir = Path(os.path.abspath(ckpt_dir)), Path(os.path.abspath(out_dir))
    except FileNotFoundError:  # a relative path inside a folder removed since (a retired checkpoint's)
        raise CheckpointError(
            f"{ckpt_dir}: the current directory no longer exists (a retired checkpoint?); give the checkpoint's "
            "full path"
        ) from None
    with WatchedDir(ckpt_dir) as watched:
        if gone_before(watched):
            raise CheckpointRetired(retired_message(ckpt_dir, before=True))
        try:
            return _export(
                ckpt_dir,
                out_dir,
                dtype=dtype,
                max_shard_size=max_shard_size,
                overwrite=overwrite,
                progress=progress,
                deep=deep,
                tokenizer_from=tokenizer_from,
                watched=watched,
            )
        except (CheckpointError, OSError) as e:
            # A checkpoint that the run's writer retires while it is read fails the export with whatever its
            # missing files cause: say what happened instead (files opened before it went are read to the end).
            # it went while being read, or before the directory committed meanwhile could be watched (adopt)
            if isinstance(e, CheckpointRetired) or not (watched.vanished() or gone_before(watched)):
                raise
            raise CheckpointRetired(retired_message(ckpt_dir)) from None


def _export(
    ckpt_dir: Path,
    out_dir: Path,
    *,
    dtype: str,
    max_shard_size: int | str,
    overwrite: bool,
    progress: bool,
    deep: bool,
    tokenizer_from: str | os.PathLike[str] | bool | None,
    watched: WatchedDir,
) -> ExportResult:
    t0 = time.perf_counter()
    dtype_name, out_dtype = export_dtype(dtype)
    limit = parse_size(max_shard_size)
    check_out_dir(ckpt_dir, out_dir, overwrite)
    manifest = check_checkpoint(ckpt_dir, deep)
    watched.adopt()  # committed after the export looked: the directory read from here on is watched
    tok_folder, tok_recorded = tokenizer_source(ckpt_dir, manifest, tokenizer_from)
    # The manifest's hf_model record, or else transformers builds the model on the meta device meanwhile.
    describing = model_from_record(ckpt_dir, manifest, dtype_name) or Background(
        describe_model, ckpt_dir, manifest, dtype_name
    )
    pool = BufferPool(POOL_PIECES, PIECE_BYTES)
    with ExitStack() as stack, torch_threads(1):
        found = COLLECTORS[manifest.format](ckpt_dir, manifest, stack, out_dtype)
        check_against_inventory(ckpt_dir, found.tensors, manifest, found.source)
        # entries without a CRC-32 (shardkeeper's DCP saves record none): their files against the manifest's xxh3
        digests = FileDigests(ckpt_dir, manifest, found.entries, stack, verified=deep)
        crc = StreamCrc(digests.entries) if found.crc_in_stream else None
        if crc is None:
            verify_entries(digests.entries, pool)
        by_name = name_tensors(ckpt_dir, found.tensors)
        recorded = isinstance(describing, ModelDescription)
        model = None if declared_untied(manifest) and not recorded else described(describing, ckpt_dir, by_name, pool)
        tensors = list(by_name.values())
        shards = plan_tensor_shards(tensors, limit)
        total = sum(t.out_nbytes for t in tensors)
        check_free_space(out_dir, total)
        tmp = temp_dir_for(out_dir)
        try:
            hashes = write_shards(tmp, ckpt_dir, dtype_name, shards, pool, progress, crc)
            if crc is not None:  # what the copy read, and the rest of each entry, against the zip's CRC-32
                crc.finish(pool)
            digests.finish()
            if model is None:  # the names were checked against the manifest; now also against transformers
                model = described(describing, ckpt_dir, by_name, pool)
            hashes.update(write_model_files(tmp, ckpt_dir, manifest, model, dtype_name, shards))
            if tok_folder is not None:
                hashes.update(copy_tokenizer(tmp, tok_folder, tok_recorded))
            if watched.vanished() and in_memory_tier(ckpt_dir):
                # a retired memory snapshot's files are overwritten in place by the next one
                # (ckpt.memtier.recycle.recycle, which renames the dir first): what was read after it went may be
                # the next snapshot's bytes
                raise CheckpointRetired(retired_message(ckpt_dir))
            commit_folder(tmp, out_dir, overwrite=overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    hashes = dict(sorted(hashes.items()))
    seconds = time.perf_counter() - t0
    log.info(
        "exported %s to %s: %d tensors, %.1f MB %s in %d file(s), %.2f s",
        ckpt_dir.name,
        out_dir,
        len(tensors),
        total / 1e6,
        dtype_name,
        len(shards),
        seconds,
    )
    return ExportResult(
        checkpoint=str(ckpt_dir),
        out_dir=str(out_dir),
        step=manifest.step,
        dtype=dtype_name,  # type: ignore[arg-type]
        files=hashes,
        num_shards=len(shards),
        total_bytes=total,
        num_tensors=len(tensors),
        seconds=seconds,
        peak_rss_bytes=peak_rss_bytes(),
    )


__all__ = [
    "EXPORT_DTYPES",
    "export_checkpoint",
    "export_dtype",
    "hf_name",
    "parse_size",
    "plan_shards",
    "safetensors_header",
    "shard_file_names",
]


# The package's public names (the pieces tests and benches drive directly are public in their modules).
from ckpt.export._options import INDEX_FILE, SINGLE_FILE  # noqa: E402
from ckpt.export._records import Entry, ExportTensor  # noqa: E402

__all__ = [
    "BufferPool",
    "EXPORT_DTYPES",
    "Entry",
    "ExportTensor",
    "INDEX_FILE",
    "SINGLE_FILE",
    "StreamCrc",
    "describe_model",
    "export_checkpoint",
    "export_dtype",
    "model_from_record",
    "parse_size",
    "plan_shards",
    "safetensors_header",
    "shard_file_names",
]
