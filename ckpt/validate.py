"""Is a step directory a whole, trustworthy checkpoint? (``shardkeeper validate``)"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ckpt import fingerprint as fp
from ckpt.errors import CheckpointError
from ckpt.hashing import hash_files
from ckpt.layout import RunDir
from ckpt.manifest import read_manifest
from schemas import MANIFEST_NAME, CheckpointManifest, ValidationReport

log = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")


def _check_files(ckpt_dir: Path, manifest: CheckpointManifest, deep: bool) -> tuple[list[str], int]:
    errors: list[str] = []
    present: list[Path] = []
    for entry in manifest.files:
        path = ckpt_dir / entry.path
        if not path.is_file():
            errors.append(f"{path}: listed in the manifest but missing; the checkpoint is incomplete")
            continue
        size = path.stat().st_size
        if size != entry.size:
            errors.append(f"{path}: {size} bytes, manifest says {entry.size}; the file is truncated or overwritten")
            continue
        present.append(path)
    hashed = 0
    if deep and present:
        by_path = {ckpt_dir / e.path: e for e in manifest.files}
        for path, (size, digest) in hash_files(present, threads=4).items():
            hashed += size
            if digest != by_path[path].xxh3_128:
                errors.append(f"{path}: checksum {digest} != manifest {by_path[path].xxh3_128}; the file is corrupted")
    return errors, hashed


def recompute_fingerprint(ckpt_dir: Path, manifest: CheckpointManifest):
    """Fingerprint of the state as stored on disk, one tensor at a time (DCP checkpoints)."""
    from ckpt.dcp_io import DCPTensorReader

    with DCPTensorReader(ckpt_dir) as reader:
        keys = set(reader.tensor_keys())
        model_sq = fp.sum_squares((k[len("model."):], reader.read(k)) for k in sorted(keys) if k.startswith("model."))
        optim_names = [k for k in sorted(keys) if k.startswith("optim.state.") and k.rsplit(".", 1)[-1] in MOMENTS]
        optim_sq = fp.sum_squares((k[len("optim.state."):], reader.read(k)) for k in optim_names)
        step_keys = [k for k in sorted(keys) if k.startswith("optim.state.") and k.endswith(".step")]
        step = float(reader.read(step_keys[0]).item()) if step_keys else 0.0
        # every other record too (rng, counters, steps, byte values): each is parsed with the allow-list,
        # so a checkpoint that passes --deep holds nothing a resume would refuse
        for k in sorted(keys - set(step_keys[:1]) - {k for k in keys if k.startswith("model.")} - set(optim_names)):
            reader.read(k)
        for k in reader.byte_keys():
            reader.read_bytes_value(k)
    return fp.make_fingerprint(model_sq, optim_sq, step)


def _check_pickles(ckpt_dir: Path, manifest: CheckpointManifest) -> None:
    """Parse every torch.save file of a deepspeed checkpoint with the allow-list (rng files and the files
    only DeepSpeed's own loaders read included); CheckpointError naming the first refused file."""
    from ckpt.formats.torchzip import check_file

    for entry in manifest.files:
        if entry.path.endswith(".pt"):
            check_file(ckpt_dir / entry.path)


def validate(ckpt_dir: str | Path, *, deep: bool = False) -> ValidationReport:
    """Check a checkpoint. Quick: manifest, every listed file present with its size. Deep: also
    every byte's checksum and the fingerprint of the stored tensors."""
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        return ValidationReport(path=str(ckpt_dir), valid=False, deep=deep, errors=[str(e)], seconds=time.perf_counter() - t0)
    errors, hashed = _check_files(ckpt_dir, manifest, deep)
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    for extra in sorted(p.name for p in ckpt_dir.iterdir() if p.is_file() and p.name not in listed):
        errors.append(f"{ckpt_dir / extra}: not listed in the manifest; something wrote into a committed checkpoint")
    if deep and not errors:
        try:
            if manifest.format == "deepspeed":  # ZeRO shards or a universal folder, one parameter at a time
                from ckpt.deepspeed_convert import recompute_fingerprint as recompute_deepspeed

                _check_pickles(ckpt_dir, manifest)
                now = recompute_deepspeed(ckpt_dir, manifest)
            else:
                now = recompute_fingerprint(ckpt_dir, manifest)
            diffs = fp.compare(manifest.fingerprint, now, exact=False)
            if diffs:
                errors.append(f"{ckpt_dir}: fingerprint mismatch: {diffs[0]}; the stored state is not what was trained")
        except CheckpointError as e:
            errors.append(str(e))
    return ValidationReport(
        path=str(ckpt_dir),
        valid=not errors,
        deep=deep,
        step=manifest.step,
        errors=errors,
        files_checked=len(manifest.files),
        bytes_checked=hashed,
        seconds=time.perf_counter() - t0,
    )


def latest_valid(run_dir: RunDir) -> tuple[Path, CheckpointManifest] | None:
    """Newest committed checkpoint that passes quick validation; invalid ones are logged and skipped."""
    for path in reversed(run_dir.committed()):
        report = validate(path)
        if report.valid:
            return path, read_manifest(path)
        log.warning("skipping invalid checkpoint %s: %s", path.name, report.errors[0])
    return None
