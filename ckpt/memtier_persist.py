"""Persisting the memory tier (``ckpt.memtier``) to storage (no torch needed): the copy of a snapshot's files into a
storage ``.partial`` (hashed on the way, so a byte that changed in memory is never persisted; the ranks do this for
a storage checkpoint taken with the memory tier on), and the controller's persist of a snapshot newer than
storage after a segment died.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import xxhash

from ckpt.fsutil import fsync_dir, fsync_file, mkdir_durable
from ckpt.layout import RunDir, parse_step
from ckpt.memtier import MEMORY, STORAGE, memory_dirs, memory_run_dir, owner_problem, snapshot_event_id
from ckpt.memtier_nodes import NODES_DIR
from schemas import MANIFEST_NAME, CheckpointManifest, FileEntry, RunSpec

log = logging.getLogger("ckpt.memtier")  # the name these lines had before they moved here

_CHUNK = 8 << 20


def copy_verified(src: Path, dst: Path, files: list[FileEntry],
                  copy: Callable[[Path, Path], tuple[int, str]] | None = None) -> str | None:
    """Copy ``files`` from snapshot ``src`` into ``dst`` (a storage ``.partial``), hashing the bytes written and
    fsyncing each file: one line when a file's size or checksum differs from the snapshot's manifest (nothing
    changed in memory is ever persisted), None when all copied. ``copy(src, dst) -> (size, xxh3-128)``: how one
    file is copied (the ranks pass the O_DIRECT hashing stream's, ``ckpt.formats.direct_io.copy_file``); by
    default buffered."""
    for f in files:
        s, d = src / f.path, dst / f.path
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            size, digest = (copy or _copy_buffered)(s, d)
        except OSError as e:
            return f"{s}: could not be persisted to {dst} ({e.strerror or e}); nothing was committed from it"
        if (size, digest) != (f.size, f.xxh3_128):
            return f"{s}: differs from its snapshot's manifest (size or checksum); the snapshot is not persisted"
    return None


def _copy_buffered(s: Path, d: Path) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(s, "rb") as fin, open(d, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, h.hexdigest()


def persist_snapshot(snapshot: Path, run_dir: RunDir) -> Path:
    """One process (the controller): copy a validated snapshot's files into the storage ``.partial``, then its
    manifest, rename, fsync the parent: the storage checkpoint of the same step. Raises OSError/ValueError on a
    failure (the ``.partial`` is removed; nothing is committed)."""
    from ckpt.manifest import read_manifest

    manifest = read_manifest(snapshot)
    step = manifest.step
    partial, final = run_dir.partial(step), run_dir.checkpoint(step)
    if partial.exists():
        shutil.rmtree(partial)
    mkdir_durable(partial)
    try:
        problem = copy_verified(snapshot, partial, manifest.files)
        if problem:
            raise ValueError(problem)
        tmp = partial / (MANIFEST_NAME + ".tmp")
        shutil.copyfile(snapshot / MANIFEST_NAME, tmp)
        fsync_file(tmp)
        os.rename(tmp, partial / MANIFEST_NAME)
        fsync_dir(partial)
        if final.exists():
            from ckpt.fsutil import quarantine

            quarantine(final, "a snapshot of the same step is persisted")
        os.rename(partial, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def newest_snapshot(mem: RunDir, run_dir: RunDir) -> tuple[Path | None, str | None]:
    """The newest committed snapshot of this run, or (None, why not) -- another run's, none at all."""
    if not mem.checkpoints.is_dir():
        return None, None
    committed = mem.committed()
    if not committed:
        return None, None
    problem = owner_problem(mem, run_dir)
    if problem:
        return None, problem
    return committed[-1], None


def persist_newer(spec: RunSpec, run_dir: RunDir) -> tuple[Path | None, str | None]:
    """The controller, after its segment's ranks exited (any outcome) or before a segment starts: a memory
    snapshot newer than storage's newest valid checkpoint is validated (every checksum) and persisted to
    storage, with its lineage event. Returns (the new storage checkpoint, None), (None, one line why a snapshot
    was not persisted), or (None, None) when there is nothing newer."""
    from ckpt import lineage
    from ckpt.validate import latest_valid, validate

    snaps, problem = [], None
    for mem in memory_dirs(memory_run_dir(spec, run_dir)):  # a run on several nodes: each node's copy seen here
        snap, why = newest_snapshot(mem, run_dir)
        if snap is not None and (mem.root.parent.name != NODES_DIR or _whole(snap)):  # part of one: not persistable
            snaps.append(snap)
        problem = problem or why
    if not snaps:
        return None, (f"memory snapshot not persisted: {problem}; storage's checkpoint is the resume point"
                      if problem else None)
    found = latest_valid(run_dir)
    stored = found[1].step if found else -1
    step = max(parse_step(s.name) or 0 for s in snaps)
    if step <= stored:
        return None, None
    report = None
    for snap in (s for s in snaps if parse_step(s.name) == step):  # the first whole, valid copy of the newest
        report = validate(snap, deep=True)
        if report.valid:
            break
    assert report is not None
    if not report.valid:
        return None, (f"memory snapshot {snap} not persisted: {report.errors[0]}; storage's "
                      f"{found[0].name if found else 'start of the run'} is the resume point")
    try:
        final = persist_snapshot(snap, run_dir)
    except (OSError, ValueError) as e:
        return None, f"memory snapshot {snap} not persisted: {e}"
    from ckpt.manifest import read_manifest

    manifest: CheckpointManifest = read_manifest(final)
    lineage.record(run_dir, "checkpoint", lineage.checkpoint_event_id(step), parent=snapshot_event_id(step),
                   step=step, uri=final.as_uri(), reason=manifest.reason, world_size=manifest.topology.world_size,
                   segment=manifest.segment, tier=STORAGE, persisted_from=MEMORY, persisted_by="launcher",
                   bytes=sum(f.size for f in manifest.files))
    log.info("persisted the memory snapshot %s to storage (%s)", snap.name, final)
    return final, None


def _whole(snap: Path) -> bool:
    """A node's copy holds every file of its manifest (with more than two nodes it holds only some until a restore)."""
    from ckpt.manifest import read_manifest

    try:
        return all((snap / f.path).is_file() for f in read_manifest(snap).files)
    except Exception:  # noqa: BLE001 - an unreadable manifest: validated (and said) as any other copy
        return True
