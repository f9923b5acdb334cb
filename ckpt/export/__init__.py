"""Export a committed checkpoint (DCP or DeepSpeed) to a folder ``AutoModelForCausalLM.from_pretrained`` loads.

    from ckpt.export import export_checkpoint
    export_checkpoint("runs/demo/checkpoints/step-00000020", "runs/demo/exports/step-00000020", dtype="bfloat16")

(or ``shardkeeper export CKPT OUT --dtype bfloat16``). The folder holds ``config.json``,
``generation_config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``), a short ``README.md`` (a model card; for a fine-tune its YAML header names
``base_model`` with ``base_model_relation: finetune``) and, when the run had a tokenizer (its base model's, or
``data.tokenizer``), the tokenizer files: ``AutoTokenizer.from_pretrained`` loads the folder too.

How it works, and why:

* Checked before anything is written: the options, the output folder, the checkpoint (quick
  validation: manifest, every file present at its size), every model chunk's record inside the
  ``.distcp`` files, the tensor names/shapes/dtypes against the manifest's inventory (recorded from
  the transformers model at save). Checked before the commit: the CRC-32 of every model byte against
  its zip record, computed from the bytes as they are copied (one read of the model bytes, not two;
  each zip entry once, a DeepSpeed partition however many parameters it holds). shardkeeper's own DCP
  saves record no CRC-32 (the manifest's xxh3-128 of each file covers every byte): the files holding
  such entries are hashed whole against the manifest in a background thread while the copy runs
  (``ckpt.export._digests``; skipped with ``deep``, which checked every file first). On a mismatch the
  hidden folder is removed and nothing is published.
* Streaming with bounded memory: DCP's default writer stores each chunk as a ``torch.save`` zip whose
  ``data/<key>`` entry is the raw storage, stored uncompressed. The exporter parses the zip and the
  tiny pickle (with an allow-list; nothing is executed) to find those bytes and streams them in
  16 MiB pieces (``preadv`` into reused buffers; cast pieces are cast with torch's ``copy_``)
  straight into the safetensors file. (mmap views were tried: no faster, and their page faults
  contend with the import thread for the process's memory-map lock.)
  Chunks that split a tensor by rows (FSDP2) stream without ever assembling the tensor; other
  layouts (2-D sharding, strided records) assemble one tensor at a time. Peak memory is a few pieces,
  plus one tensor in the assembled case: far below one output shard + 0.5 GB.
* DeepSpeed ZeRO checkpoints export in the same single pass: a parameter's fp32 master weight is a
  few element ranges of the ranks' flat partitions inside the ``*_optim_states.pt`` zips (the layout
  ``ckpt.formats.deepspeed.zero.ZeroShards`` knows, ZeRO 1/2/3; or one ``universal/zero/<name>/fp32.pt`` each).
  Those ranges are the tensor's chunks, streamed in order; the header keeps the real shape. Each
  partition's storage entry is CRC-checked once, however many parameters it holds. The tensors are
  bit for bit those of ``deepspeed.utils.zero_to_fp32``.
* Speed: writing and SHA-256 hashing run in two threads that release the GIL; the file is written
  with O_DIRECT through an aligned staging buffer where the file system takes it (the page cache would
  only hold a copy nobody reads back, and filling it costs more than the disk write on this project's
  VMs). transformers is not imported at all when the manifest holds the ``hf_model`` record the trainer
  wrote at save (config.json and generation_config.json as save_pretrained writes them, and the tied
  names): names and shapes are then the manifest inventory's, which the files are checked against.
  For older checkpoints without it, importing transformers (seconds) and building the model on the
  meta device run in a background thread from the start, with the cyclic GC paused while it creates
  its long-lived objects. When the RunSpec declares ``tie_word_embeddings: false`` nothing can be a
  tied copy, so the copy does not wait for it; the names and shapes are then checked against the
  transformers model before the commit (they were already checked against the manifest before
  writing). Otherwise the check comes first.
* Bit-exactness: the bytes are the storage bytes ``torch.load`` would give; casts round to nearest
  even, as ``tensor.to(dtype)`` does.
* Byte reproducibility: tensors keep the checkpoint's order (the model's state_dict order), headers
  are compact JSON with sorted names and a fixed ``__metadata__``, and no file carries a time or path.
* Atomicity: everything is written into a hidden sibling folder, every file and the folder are
  fsynced, then the folder is renamed to ``out_dir`` and the parent fsynced. On any failure the
  sibling is removed, so a folder named ``out_dir`` is always complete. Without ``overwrite`` the rename
  never replaces anything (``renameat2(RENAME_NOREPLACE)``, under a lock on the parent folder): of two
  exports into one new folder, the second fails with "already exists" and the first stays whole.
* Readers beside a writer: the manifest is read once, validated, and what the export reports (the step)
  comes from it. A checkpoint that training's retention retires while it is exported fails the export with
  CheckpointRetired (one line: pick a newer step), never as a corrupted checkpoint or a bad path; files
  opened before it went are read to the end (their bytes stay until closed), so an export that got them
  all completes -- except from a memory snapshot: the next snapshot overwrites a retired one's files in place
  (ckpt.memtier.recycle.recycle renames the dir first), so an export of a snapshot that went before every byte was
  read fails as retired.
* A tensor larger than ``max_shard_size`` is written alone in its own shard (with a warning), as
  ``save_pretrained`` does, rather than refused: a model must remain exportable whatever the limit.
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
    """Export a committed DCP or deepspeed checkpoint to ``out_dir`` in the ``from_pretrained`` layout.

    ``dtype`` is the published dtype of floating tensors (integer/bool tensors keep theirs);
    ``max_shard_size`` bounds each safetensors file (bytes, or '5GB' / '500MB' / '2GiB'); a tensor
    larger than that is written alone in its own file; ``overwrite`` replaces an existing ``out_dir``
    (atomically, once the new export is complete); ``progress`` shows a rich progress bar; ``deep``
    also checks every checksum in the manifest first, and for DCP the fingerprint (the model bytes are
    always CRC-checked, as they are copied, before the commit). A deepspeed checkpoint is read in one pass where
    DeepSpeed stored its fp32 master weights. ``tokenizer_from``: where the tokenizer files come from (a folder; None:
    the run's ``data.tokenizer`` or its base model's folder, see ``ckpt.export._tokenizer``; False: none).
    Raises ExportError (options, output folder, model mismatch) or CheckpointError
    (the checkpoint), each with a one-line message naming the fix.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
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
