"""Persisting the memory tier (``ckpt.memtier.tier``) to storage (no torch needed): the copy of a snapshot's files into
a
storage ``.partial`` (hashed on the way, so a byte that changed in memory is never persisted; the ranks do this for
a storage checkpoint taken with the memory tier on), and the controller's persist of a snapshot newer than
storage after a segment died, and between segments: the snapshots of memory dirs the run no longer uses
(``between_segments``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import xxhash

from ckpt.commit.fsutil import fsync_dir, fsync_file, mkdir_durable
from ckpt.commit.layout import RunDir, parse_step
from ckpt.memtier.nodes import NODES_DIR, node_dirs
from ckpt.memtier.tier import (
    DIRS_NAME,
    LOCK_NAME,
    MEMORY,
    OWNER_NAME,
    STORAGE,
    TierLock,
    forget,
    identity,
    memory_dirs,
    memory_root,
    memory_run_dir,
    owner_problem,
    recorded_roots,
    set_aside,
    snapshot_event_id,
    tier_root,
    written_by_other_run,
)
from schemas import MANIFEST_NAME, CheckpointManifest, FileEntry, RunSpec

_CHUNK = 8 << 20


def copy_verified(
    src: Path, dst: Path, files: list[FileEntry], copy: Callable[[Path, Path], tuple[int, str]] | None = None
) -> str | None:
    """Copy ``files`` from snapshot ``src`` into ``dst`` (a storage ``.partial``), hashing the bytes written and
    fsyncing each file. Returns one line when the snapshot let the copy down -- a file gone from memory (or no
    longer a regular file), or one whose size or checksum differs from the snapshot's manifest: nothing changed in
    memory is ever persisted, the caller commits nothing -- and None when all copied. Raises OSError when the copy
    failed otherwise (storage: a full disk, an I/O error). ``copy(src, dst) -> (size, xxh3-128)``: how one file is
    copied (the ranks pass the O_DIRECT hashing stream's, ``ckpt.formats.dcp.direct_io.copy_file``); by default
    buffered."""
    for f in files:
        s, d = src / f.path, dst / f.path
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            size, digest = (copy or _copy_buffered)(s, d)
        except OSError as e:
            if os.path.isfile(s) and not os.path.islink(s):
                raise
            return f"{s}: gone from memory ({e.strerror or e})"
        if (size, digest) != (f.size, f.xxh3_128):
            return f"{s}: differs from its snapshot's manifest (size or checksum)"
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
    from ckpt.commit.manifest import read_manifest

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
            from ckpt.commit.fsutil import quarantine

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


def persist_newer(spec: RunSpec, run_dir: RunDir, mems: list[RunDir] | None = None) -> tuple[Path | None, list[str]]:
    """The controller, after its segment's ranks exited (any outcome) or before a segment starts: the newest memory
    snapshot of this run newer than storage's newest valid checkpoint is validated (every checksum, the
    fingerprint) and persisted to storage, with its lineage event; when one fails, the next older one newer than
    storage is tried. One whose bytes are not those committed (torn, tampered) is set aside (never usable); one
    whose bytes are whole but whose state does not read back or check out (a reader's error, a fingerprint
    mismatch) is kept, for a segment whose own checks may load it. A snapshot another run wrote (its manifest's run
    id) is set aside, never persisted. ``mems``: the memory dirs to look in (default: the
    spec's). Returns the new storage checkpoint (or None) and one warning line per thing not done."""
    from ckpt.commit import lineage
    from ckpt.commit.manifest import read_manifest
    from ckpt.validate.checks import latest_valid

    mems = memory_dirs(memory_run_dir(spec, run_dir)) if mems is None else mems
    found = latest_valid(run_dir)
    stored = found[1].step if found else -1
    resume_point = f"storage's {found[0].name}" if found else "the start of the run"
    snaps, lines = _newer_snapshots(mems, run_dir, stored)
    refused: list[tuple[Path, str, bool]] = []
    for snap in snaps:
        why, changed = _unpersistable(snap)
        if why is None:
            try:
                final = persist_snapshot(snap, run_dir)
            except Exception as e:  # noqa: BLE001 - gone or changed meanwhile, a full disk: one line, the next one
                why, changed = " ".join(str(e).split())[:400], not isinstance(e, OSError)
            else:
                manifest: CheckpointManifest = read_manifest(final)
                step = manifest.step
                lineage.record(
                    run_dir,
                    "checkpoint",
                    lineage.checkpoint_event_id(step),
                    parent=snapshot_event_id(step),
                    step=step,
                    uri=final.as_uri(),
                    reason=manifest.reason,
                    world_size=manifest.topology.world_size,
                    segment=manifest.segment,
                    tier=STORAGE,
                    persisted_from=MEMORY,
                    persisted_by="launcher",
                    bytes=sum(f.size for f in manifest.files),
                )
                if refused:
                    lines.append(_refused(spec, run_dir, refused, f"{snap.name} was persisted instead"))
                return final, lines
        refused.append((snap, why, changed))
    if refused:
        lines.append(_refused(spec, run_dir, refused, f"{resume_point} is the resume point"))
    return None, lines


def _refused(spec: RunSpec, run_dir: RunDir, refused: list[tuple[Path, str, bool]], then: str) -> str:
    """One line for the snapshots newer than storage not persisted (the newest named); those whose bytes changed
    are set aside."""
    for snap, _why, changed in refused[1:]:
        if changed:
            try:
                set_aside(snap)
            except OSError:  # gone meanwhile
                pass
    more = f" (and {len(refused) - 1} older one(s), likewise)" if len(refused) > 1 else ""
    return _refused_line(spec, run_dir, *refused[0], f"{then}{more}")


def _newer_snapshots(mems: list[RunDir], run_dir: RunDir, stored: int) -> tuple[list[Path], list[str]]:
    """This run's committed snapshots newer than step ``stored`` in ``mems`` (newest first; a node's copy only when
    whole), and a line for each memory dir or snapshot that is another run's (such a snapshot is set aside)."""
    snaps, lines = [], []
    for mem in mems:
        committed = mem.committed() if mem.checkpoints.is_dir() else []
        problem = owner_problem(mem, run_dir) if committed else None
        if problem:
            lines.append(f"memory snapshot not persisted: {problem}; storage's checkpoint is the resume point")
            continue
        for snap in committed:
            other = _other_run(snap, run_dir)
            if other:
                try:
                    where = f"set aside as {set_aside(snap).name}"
                except OSError as e:
                    where = f"left in place ({e.strerror or e})"
                lines.append(f"memory snapshot {snap} refused: {other}; {where}, never persisted nor resumed")
            elif (parse_step(snap.name) or 0) > stored and (mem.root.parent.name != NODES_DIR or _whole(snap)):
                snaps.append(snap)  # with several nodes, part of a snapshot is not persistable
    return sorted(snaps, key=lambda p: parse_step(p.name) or 0, reverse=True), lines


def _other_run(snap: Path, run_dir: RunDir) -> str | None:
    from ckpt.commit.manifest import read_manifest

    try:
        return written_by_other_run(read_manifest(snap), run_dir)
    except Exception:  # noqa: BLE001 - an unreadable manifest: refused by the validation, as any torn snapshot
        return None


def _unpersistable(snap: Path) -> tuple[str | None, bool]:
    """(None, False) when the snapshot passes deep validation; else its first problem in one line (a reader's own
    failure included: it is named, not raised) and whether its bytes are not those committed."""
    from ckpt.validate.checks import validate

    try:
        report = validate(snap, deep=True)
    except Exception as e:  # noqa: BLE001 - a failure of the validation itself: the snapshot is kept, the cause said
        return f"its deep validation failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})", False
    return (None, False) if report.valid else (report.errors[0], _bytes_changed(snap))


def _bytes_changed(snap: Path) -> bool:
    """After a failed deep validation (rare, so hashed again here): whether the snapshot's files are not the bytes
    its manifest committed (a file missing, of another size or checksum, the manifest unreadable)."""
    from ckpt.commit.hashing import hash_files
    from ckpt.commit.manifest import read_manifest

    try:
        files = read_manifest(snap).files
        got = hash_files([snap / f.path for f in files], threads=4)
    except Exception:  # noqa: BLE001 - a manifest or file gone or unreadable: not the snapshot committed
        return True
    return any(got.get(snap / f.path) != (f.size, f.xxh3_128) for f in files)


def _refused_line(spec: RunSpec, run_dir: RunDir, snap: Path, why: str, changed: bool, then: str) -> str:
    """The launcher's one line for the newest snapshot it could not persist: why, and what became of it -- set aside
    when its bytes changed, else kept, with how to use it."""
    from ckpt.commit.manifest import read_manifest

    if changed:
        try:
            return f"memory snapshot {snap} not persisted: {why}; set aside as {set_aside(snap).name}; {then}"
        except OSError:  # gone meanwhile
            return f"memory snapshot {snap} not persisted: {why}; {then}"
    mem = RunDir(snap.parent.parent)
    root = tier_root(mem)
    try:
        world = f" at world size {read_manifest(snap).topology.world_size}"
    except Exception:  # noqa: BLE001 - gone or unreadable: no world size to name
        world = ""
    if root == memory_root(spec, run_dir):
        use = f"a segment{world} with this memory tier resumes from it if it passes every check"
    else:
        use = (
            f"to try it, run a segment{world} with checkpoint.memory_interval set and checkpoint.memory_dir "
            f"{root} (the ranks load it only if it passes every check)"
        )
    return f"memory snapshot {snap} not persisted: {why}; it is kept ({use}); {then}"


def between_segments(spec: RunSpec, run_dir: RunDir) -> list[str]:
    """The train stage, under the run lock, before a segment starts and after its ranks exited: the run gets its id
    if it has none (an older run's next segment); snapshots of this run newer than storage are persisted
    (``persist_newer``) from every memory dir of the run visible here -- the segment's own, and those its earlier
    segments claimed (the memory tier is off now, or set to another checkpoint.memory_dir); such an earlier dir
    is then removed (``reclaim``) once nothing in it is newer than storage. Returns the lines to show."""
    from ckpt.validate.checks import latest_valid

    identity(run_dir, create=True)
    current = memory_root(spec, run_dir)
    roots = []
    for root in tier_roots(spec, run_dir):
        if root == current or os.path.lexists(root):
            roots.append(root)
        elif root in recorded_roots(run_dir):  # removed by hand (or the node rebooted): nothing to look into
            forget(run_dir, root)
    if not any(os.path.lexists(root) for root in roots):  # no memory tier here (the common case): nothing to read
        return []
    # an earlier segment's memory dir that another run claimed since is that run's: not looked into
    mems = [
        m
        for root in roots
        for m in memory_dirs(RunDir(root))
        if root == current or (m.root / OWNER_NAME).is_file() and owner_problem(m, run_dir) is None
    ]
    final, warnings = persist_newer(spec, run_dir, mems)
    lines = [f"warning: {w}" for w in warnings]
    if final is not None:
        lines.append(f"persisted the memory snapshot {final.name} to storage: {final}")
    found = latest_valid(run_dir)
    stored = found[1].step if found else -1
    for root in roots:
        if root != current:
            try:
                line = reclaim(root, run_dir, stored, current)
            except OSError as e:  # e.g. the run's list could not be rewritten: tried again at the next segment
                line = f"warning: the memory tier {root} is no longer used but could not be removed ({e.strerror or e})"
            if line:
                lines.append(line)
    return lines


def tier_roots(spec: RunSpec, run_dir: RunDir) -> list[Path]:
    """The memory tier roots of this run to look in: the segment's own (if on), those its segments claimed
    (``RUN_DIR/.memory-dirs``), the default one for the run if it exists; for a run without that list (its
    segments ran an earlier version and claimed a memory dir), also the one its newest storage checkpoint was
    written with. Another spelling of the segment's own dir (a symlink to it) is not listed apart."""
    from ckpt.memtier.tier import DEFAULT_ROOT, LEGACY_ID_NAME, default_dir_name

    current = memory_root(spec, run_dir)
    roots = recorded_roots(run_dir)
    default = DEFAULT_ROOT / default_dir_name(spec, run_dir)
    if default.is_dir():
        roots.append(default)
    if not (run_dir.root / DIRS_NAME).exists() and (run_dir.root / LEGACY_ID_NAME).exists():
        from ckpt.validate.checks import latest_valid

        found = latest_valid(run_dir)
        before = memory_root(found[1].run_spec, run_dir) if found else None
        if before is not None:
            roots.append(before)
    if current is None:
        return list(dict.fromkeys(roots))
    return [current, *dict.fromkeys(r for r in roots if not _same_dir(r, current))]


def _same_dir(a: Path, b: Path) -> bool:
    """Whether two paths name one directory (the same path, or through a symlink)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compared as resolved
        return a.resolve() == b.resolve()


def reclaim(root: Path, run_dir: RunDir, stored: int, current: Path | None) -> str | None:
    """Remove a memory tier of this run that is no longer its memory dir (``current``: the segment's, None when
    off), when every dir of it is this run's, no live segment holds it, and nothing in it is newer than storage's
    step ``stored`` (else it is kept: ``persist_newer`` said why). Only what the memory tier created goes (its
    snapshots, tier.json, tier.lock, node dirs; the directory itself once empty). Returns a line, or None when
    nothing was removed. A root that no longer is a memory tier of this run is dropped from the run's list."""
    mems = [m for m in memory_dirs(RunDir(root)) if (m.root / OWNER_NAME).is_file()]
    if not mems:
        if not (root / OWNER_NAME).exists() and not node_dirs(root):
            forget(run_dir, root)
        return None
    locks = []
    try:
        for mem in mems:
            if owner_problem(mem, run_dir) is not None:  # another run's now: no longer one of this run's
                forget(run_dir, root)
                return None
            lock = TierLock(mem)
            if not lock.acquire():
                return None  # a live segment writes there
            locks.append(lock)
            if any((parse_step(s.name) or 0) > stored for s in mem.committed()):
                return None
        for mem in sorted(mems, key=lambda m: len(m.root.parts), reverse=True):  # node dirs before the root
            shutil.rmtree(mem.checkpoints, ignore_errors=True)
            for name in (OWNER_NAME, LOCK_NAME):
                (mem.root / name).unlink(missing_ok=True)
            _rmdir(mem.root)
        _rmdir(root / NODES_DIR)
        _rmdir(root)
    finally:
        for lock in locks:
            lock.release()
    forget(run_dir, root)
    now = f"now {current}" if current is not None else "the memory tier is off"
    return (
        f"removed the memory tier {root}: no longer this run's checkpoint.memory_dir ({now}); storage holds its steps"
    )


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty (something the memory tier did not create) or gone: left as it is
        pass


def _whole(snap: Path) -> bool:
    """A node's copy holds every file of its manifest (with more than two nodes it holds only some until a restore)."""
    from ckpt.commit.manifest import read_manifest

    try:
        return all((snap / f.path).is_file() for f in read_manifest(snap).files)
    except Exception:  # noqa: BLE001 - an unreadable manifest: validated (and said) as any other copy
        return True
