"""Is a step directory a whole, trustworthy checkpoint? (``shardkeeper validate``)

Quick checks (no tensor bytes read): the manifest parses; every listed path is a plain relative name
confined to the directory, a regular file reached without symlinks, of the recorded size; the file list
is exactly what the format references (DCP: ``.metadata``'s storage files; DeepSpeed: one file per rank
of the recorded world size) with nothing unlisted beside it; the directory name, the manifest's step,
format and topology, and the files' rank numbers agree. Deep checks add every byte's checksum, the
fingerprint of the stored tensors and (DCP) the stored step/tokens/samples counters.

A checkpoint that passed a full re-read of its bytes gets a verification record beside it
(``RUN_DIR/verified/step-XXXXXXXX.json``, see ``record_verified``); retention never prunes the newest one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from pathlib import Path

import xxhash

from ckpt import fingerprint as fp
from schemas.errors import CheckpointError
from ckpt.fsutil import atomic_write_json, mkdir_durable
from ckpt.hashing import hash_files
from ckpt.layout import RunDir, parse_step
from ckpt.registry import get_format
from ckpt.manifest import read_manifest
from schemas import MANIFEST_NAME, CheckpointManifest, ValidationReport

log = logging.getLogger(__name__)

RANK_RE = re.compile(r"(?:^|_)rank_(\d+)")  # zero_pp_rank_N_..., rng_rank_0000N.pt, __N_0.distcp: see formats


# ------------------------------------------------------------------------------------------ paths
def _lstat_confined(ckpt_dir: Path, rel: str) -> tuple[os.stat_result | None, str | None]:
    """lstat ``rel`` component by component: every parent a real directory, the file a regular file,
    no symlink anywhere (a symlink could point outside the checkpoint). (stat, None) or (None, why)."""
    cur = ckpt_dir
    parts = rel.split("/")
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return None, "listed in the manifest but missing; the checkpoint is incomplete"
        except OSError as e:
            return None, f"cannot be read ({e.strerror})"
        if stat.S_ISLNK(st.st_mode):
            return None, "is a symlink; a checkpoint holds only its own regular files, copy the real file in"
        last = i == len(parts) - 1
        if not last and not stat.S_ISDIR(st.st_mode):
            return None, f"{cur.name} is not a directory"
        if last and not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file (device, fifo, socket or directory)"
    return st, None


def _check_files(ckpt_dir: Path, manifest: CheckpointManifest, deep: bool) -> tuple[list[str], int]:
    errors: list[str] = []
    present: list[Path] = []
    for entry in manifest.files:
        path = ckpt_dir / entry.path
        why = get_format(manifest.format).path_error(entry.path)
        st = None
        if why is None:
            st, why = _lstat_confined(ckpt_dir, entry.path)
        if why is not None or st is None:
            errors.append(f"{path}: {why}")
            continue
        if st.st_size != entry.size:
            errors.append(f"{path}: {st.st_size} bytes, manifest says {entry.size}; the file is truncated or overwritten")
            continue
        present.append(path)
    hashed = 0
    if deep and present and not errors:
        by_path = {ckpt_dir / e.path: e for e in manifest.files}
        for path, (size, digest) in hash_files(present, threads=4).items():
            hashed += size
            if size != by_path[path].size:
                errors.append(f"{path}: changed size while being read; the checkpoint is being written, retry later")
            elif digest != by_path[path].xxh3_128:
                errors.append(f"{path}: checksum {digest} != manifest {by_path[path].xxh3_128}; the file is corrupted")
    return errors, hashed


def _unlisted(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    """Everything in the directory that the manifest does not list: files, symlinks, special files.
    DeepSpeed's ``universal/`` (a checkpoint of its own) and a conversion in progress are not part of it."""
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    nested = get_format(manifest.format).nested
    errors: list[str] = []

    def walk(d: Path, prefix: str) -> None:
        with os.scandir(d) as it:
            for e in sorted(it, key=lambda e: e.name):
                rel = prefix + e.name
                if not prefix and any(e.name == n or e.name.startswith(n + ".partial-") for n in nested):
                    continue
                if e.is_dir(follow_symlinks=False):
                    if rel.count("/") < 3:
                        walk(Path(e.path), rel + "/")
                    continue
                if rel not in listed:
                    kind = "symlink" if e.is_symlink() else "file"
                    errors.append(f"{ckpt_dir / rel}: {kind} not listed in the manifest; something wrote into a "
                                  "committed checkpoint, remove it or pick another step")

    walk(ckpt_dir, "")
    return errors


# ------------------------------------------------------------------------------------------ cross-checks
def _check_name(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    """The directory name, or for ``universal/`` its parent's, carries the step: it must be the manifest's."""
    name_step = parse_step(ckpt_dir.name)
    nested = ckpt_dir.name in get_format(manifest.format).nested
    if nested:
        name_step = parse_step(ckpt_dir.parent.name)
    if name_step is not None and name_step != manifest.step:
        return [f"{ckpt_dir / MANIFEST_NAME}: says step {manifest.step} inside {ckpt_dir.name}"
                f"{' of ' + ckpt_dir.parent.name if nested else ''}; the manifest "
                "belongs to another checkpoint, pick another step"]
    return []


def check_ranks(ckpt_dir: Path, manifest: CheckpointManifest, ranks: dict[str, int], required: set[int]) -> list[str]:
    """Every rank number in a file name is below the recorded world size, and each rank in ``required`` wrote."""
    world = manifest.topology.world_size
    for name, r in sorted(ranks.items()):
        if r >= world:
            return [f"{ckpt_dir / name}: written by rank {r}, but the manifest's topology has world size {world}; "
                    "the checkpoint is inconsistent, pick another step"]
    missing = sorted(required - set(ranks.values()))
    if missing:
        return [f"{ckpt_dir}: no file of rank {missing[0]} though the manifest's topology has world size {world}; "
                "the checkpoint is incomplete, pick another step"]
    return []


def _deep_state(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    try:
        now = get_format(manifest.format).recompute_fingerprint(ckpt_dir, manifest)
    except CheckpointError as e:
        return [str(e)]
    diffs = fp.compare(manifest.fingerprint, now, exact=False)
    if diffs:
        return [f"{ckpt_dir}: fingerprint mismatch: {diffs[0]}; the stored state is not what was trained"]
    return []


def validate(ckpt_dir: str | Path, *, deep: bool = False) -> ValidationReport:
    """Check a checkpoint. Quick: manifest, paths, file list, sizes and cross-checks. Deep: also every
    byte's checksum, the stored counters and the fingerprint of the stored tensors."""
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        return ValidationReport(path=str(ckpt_dir), valid=False, deep=deep, errors=[str(e)], seconds=time.perf_counter() - t0)
    errors = _check_name(ckpt_dir, manifest)
    file_errors, hashed = _check_files(ckpt_dir, manifest, deep and not errors)
    errors += file_errors
    errors += _unlisted(ckpt_dir, manifest)
    if not errors:
        errors += get_format(manifest.format).check_layout(ckpt_dir, manifest)
    if deep and not errors:
        errors += _deep_state(ckpt_dir, manifest)
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


def check_staged(partial: Path, manifest: CheckpointManifest) -> list[str]:
    """The commit's last check of a ``.partial`` directory against the manifest about to be written: every
    listed file present, regular, of its hashed size; nothing unlisted; the layout the format references."""
    errors, _ = _check_files(partial, manifest, deep=False)
    errors += _unlisted(partial, manifest)
    if not errors:
        errors += get_format(manifest.format).check_layout(partial, manifest)
    return errors


def latest_valid(run_dir: RunDir) -> tuple[Path, CheckpointManifest] | None:
    """Newest committed checkpoint that passes quick validation; invalid ones are logged and skipped."""
    for path in reversed(run_dir.committed()):
        report = validate(path)
        if report.valid:
            return path, read_manifest(path)
        log.warning("skipping invalid checkpoint %s: %s", path.name, report.errors[0])
    return None


def invalid_committed(run_dir: RunDir) -> list[tuple[Path, str]]:
    """Committed checkpoints that fail quick validation, with the first reason, oldest first."""
    out = []
    for path in run_dir.committed():
        report = validate(path)
        if not report.valid:
            out.append((path, report.errors[0]))
    return out


# ------------------------------------------------------------------------------------------ verification records
def manifest_digest(ckpt_dir: Path) -> str:
    """xxh3-128 of manifest.json: binds a verification record to one commit (a re-commit at the same step differs)."""
    return xxhash.xxh3_128((ckpt_dir / MANIFEST_NAME).read_bytes()).hexdigest()


def record_verified(run_dir: RunDir, ckpt_dir: Path, *, how: str, bytes_read: int) -> Path:
    """Write ``RUN_DIR/verified/step-XXXXXXXX.json``: every byte of the checkpoint was read back and matched
    the manifest's checksums at ``time`` (``how``: "load", the resume's hashing, or "reread", the
    re-read after commit). {step, manifest_xxh3_128, how, bytes, time}."""
    manifest = read_manifest(ckpt_dir)
    path = run_dir.verified_record(manifest.step)
    mkdir_durable(path.parent)
    atomic_write_json(path, {"step": manifest.step, "manifest_xxh3_128": manifest_digest(ckpt_dir), "how": how,
                             "bytes": bytes_read, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return path


def is_verified(run_dir: RunDir, ckpt_dir: Path) -> bool:
    """True if a verification record exists for exactly this commit of ``ckpt_dir``."""
    step = parse_step(ckpt_dir.name)
    if step is None:
        return False
    try:
        rec = json.loads(run_dir.verified_record(step).read_text(encoding="utf-8"))
        return isinstance(rec, dict) and rec.get("manifest_xxh3_128") == manifest_digest(ckpt_dir)
    except (OSError, ValueError):
        return False


def _drop_cache(path: Path) -> None:
    """Ask the kernel to drop the (clean, fsynced) cached pages, so the re-read comes from the device."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def reread_and_record(run_dir: RunDir, ckpt_dir: Path, *, threads: int = 2) -> str | None:
    """Re-read every byte of a committed checkpoint (cache dropped first) and compare with the manifest;
    on success write its verification record. Returns None, or the first problem found."""
    report = validate(ckpt_dir)
    if not report.valid:
        return report.errors[0]
    manifest = read_manifest(ckpt_dir)
    paths = [ckpt_dir / e.path for e in manifest.files]
    for p in paths:
        _drop_cache(p)
    expected = {ckpt_dir / e.path: (e.size, e.xxh3_128) for e in manifest.files}
    for path, got in hash_files(paths, threads=threads).items():
        if got != expected[path]:
            return f"{path}: re-read after commit gives {got[0]} bytes, checksum {got[1]}; the stored bytes differ"
    record_verified(run_dir, ckpt_dir, how="reread", bytes_read=sum(s for s, _ in expected.values()))
    return None
