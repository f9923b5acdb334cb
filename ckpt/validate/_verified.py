"""Verification records: ``RUN_DIR/verified/step-XXXXXXXX.json`` says every byte of one commit of a checkpoint was
read back and matched its manifest (ckpt.validate.checks.reread_and_record writes one after a commit, a resume's
hashing after a load); retention never prunes the newest verified checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import xxhash

from ckpt.commit.fsutil import atomic_write_json, mkdir_durable
from ckpt.commit.layout import RunDir, parse_step
from ckpt.commit.manifest import read_manifest
from schemas import MANIFEST_NAME


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
    atomic_write_json(
        path,
        {
            "step": manifest.step,
            "manifest_xxh3_128": manifest_digest(ckpt_dir),
            "how": how,
            "bytes": bytes_read,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
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


def drop_cache(path: Path) -> None:
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
