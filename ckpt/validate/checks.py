"""Is a step directory a whole, trustworthy checkpoint? (``shardkeeper validate``)

Quick checks (no tensor bytes read): the manifest parses; every listed path is a plain relative name
confined to the directory, a regular file reached without symlinks, of the recorded size; the file list
is exactly what the format references (DCP: ``.metadata``'s storage files; DeepSpeed: one file per rank
of the recorded world size) with nothing unlisted beside it; the directory name, the manifest's step,
format and topology, and the files' rank numbers agree. Deep checks add every byte's checksum, the
fingerprint of the stored tensors and (DCP) the stored step/tokens/samples counters.

A checkpoint that passed a full re-read of its bytes gets a verification record beside it
(``RUN_DIR/verified/step-XXXXXXXX.json``, see ``record_verified``); retention never prunes the newest one.

Re-validation is cheap (``_KNOWN``): the checks that depend only on the bytes of ``manifest.json`` and of the
files a format's layout check reads (DCP: ``.metadata``, ``layout_inputs``) -- manifest schema, path rules,
the file list against ``.metadata``, the tensor inventory, the ranks -- are remembered in this process for
the exact bytes that passed them, keyed by their SHA-256. A later quick validation re-reads and re-hashes
those files and, on a match, skips re-parsing them; everything that depends on the directory (the name, every
file's presence, type and size, nothing unlisted) is checked again every time. Only passes are remembered,
never in the run directory (a copied-in record cannot vouch for anything), and ``deep`` never uses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ckpt.commit.hashing import hash_files
from ckpt.commit.layout import RunDir, parse_step
from ckpt.commit.manifest import read_manifest
from ckpt.guards.retired import WatchedDir, dir_identity, gone_before, retired_message, was_committed
from ckpt.registry import get_format
from ckpt.validate._verified import drop_cache, is_verified, manifest_digest, record_verified
from schemas import MANIFEST_NAME, MANIFEST_SCHEMA_VERSION, CheckpointManifest, ValidationReport
from schemas.errors import CheckpointError, CheckpointRetired

# what the stages, retention, the trainer and the CLI take from here (ckpt.guards.retired and ckpt.validate._verified
# hold some)
__all__ = [
    "RANK_RE",
    "WatchedDir",
    "check_ranks",
    "check_staged",
    "checked_manifest",
    "dir_identity",
    "forget_known",
    "gone_before",
    "invalid_committed",
    "is_verified",
    "latest_valid",
    "manifest_digest",
    "record_verified",
    "reread_and_record",
    "retired_message",
    "validate",
    "was_committed",
]

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


def _check_sizes(
    ckpt_dir: Path, files: list[tuple[str, int]], path_error: Callable[[str], str | None] | None = None
) -> tuple[list[str], list[str]]:
    """Every listed file obeys the format's path rule (``path_error``), is present, a regular file reached
    without symlinks, of its recorded size; errors in manifest order. Plain names
    are lstat'ed relative to one descriptor of the directory (one syscall each: at 10^5 files this is most
    of a quick validation); nested paths component by component."""
    errors: list[str] = []
    present: list[str] = []
    try:
        dfd = os.open(ckpt_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        dfd = -1
    try:
        for rel, size in files:
            st, why = None, path_error(rel) if path_error is not None else None
            if why is not None:
                pass
            elif dfd >= 0 and "/" not in rel:
                try:
                    st = os.lstat(rel, dir_fd=dfd)
                except FileNotFoundError:
                    why = "listed in the manifest but missing; the checkpoint is incomplete"
                except OSError as e:
                    why = f"cannot be read ({e.strerror})"
                else:
                    if stat.S_ISLNK(st.st_mode):
                        why = "is a symlink; a checkpoint holds only its own regular files, copy the real file in"
                    elif not stat.S_ISREG(st.st_mode):
                        why = "is not a regular file (device, fifo, socket or directory)"
            else:
                st, why = _lstat_confined(ckpt_dir, rel)
            if why is not None or st is None:
                errors.append(f"{ckpt_dir / rel}: {why}")
            elif st.st_size != size:
                errors.append(
                    f"{ckpt_dir / rel}: {st.st_size} bytes, manifest says {size}; the file is truncated or overwritten"
                )
            else:
                present.append(rel)
    finally:
        if dfd >= 0:
            os.close(dfd)
    return errors, present


def _check_files(ckpt_dir: Path, manifest: CheckpointManifest, deep: bool) -> tuple[list[str], int]:
    errors, present = _check_sizes(
        ckpt_dir, [(e.path, e.size) for e in manifest.files], get_format(manifest.format).path_error
    )
    hashed = 0
    if deep and present and not errors:
        by_path = {ckpt_dir / e.path: e for e in manifest.files}
        for path, (size, digest) in hash_files([ckpt_dir / rel for rel in present], threads=4).items():
            hashed += size
            if size != by_path[path].size:
                errors.append(f"{path}: changed size while being read; the checkpoint is being written, retry later")
            elif digest != by_path[path].xxh3_128:
                errors.append(f"{path}: checksum {digest} != manifest {by_path[path].xxh3_128}; the file is corrupted")
    return errors, hashed


def _unlisted(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    return _unlisted_in(
        ckpt_dir, {e.path for e in manifest.files} | {MANIFEST_NAME}, get_format(manifest.format).nested
    )


def _unlisted_in(ckpt_dir: Path, listed: set[str] | frozenset[str], nested: frozenset[str]) -> list[str]:
    """Everything in the directory that the manifest does not list: files, symlinks, special files.
    DeepSpeed's ``universal/`` (a checkpoint of its own) and a conversion in progress are not part of it.
    (Listed plain files are skipped unsorted; what is left -- directories and strays -- is visited in name order.)"""
    errors: list[str] = []

    def walk(d: Path, prefix: str) -> None:
        here = listed if not prefix else {p[len(prefix) :] for p in listed if p.startswith(prefix)}
        with os.scandir(d) as it:
            rest = [e for e in it if e.name not in here or e.is_dir(follow_symlinks=False)]
        for e in sorted(rest, key=lambda e: e.name):
            rel = prefix + e.name
            if not prefix and any(e.name == n or e.name.startswith(n + ".partial-") for n in nested):
                continue
            if e.is_dir(follow_symlinks=False):
                if rel.count("/") < 3:
                    walk(Path(e.path), rel + "/")
                continue
            if rel not in listed:
                kind = "symlink" if e.is_symlink() else "file"
                errors.append(
                    f"{ckpt_dir / rel}: {kind} not listed in the manifest; something wrote into a "
                    "committed checkpoint, remove it or pick another step"
                )

    walk(ckpt_dir, "")
    return errors


# ------------------------------------------------------------------------------------------ cross-checks
def _check_name(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    return _check_step_name(ckpt_dir, manifest.step, get_format(manifest.format).nested)


def _check_step_name(ckpt_dir: Path, step: int, nested_names: frozenset[str]) -> list[str]:
    """The directory name, or for ``universal/`` its parent's, carries the step: it must be the manifest's."""
    name_step = parse_step(ckpt_dir.name)
    nested = ckpt_dir.name in nested_names
    if nested:
        name_step = parse_step(ckpt_dir.parent.name)
    if name_step is not None and name_step != step:
        return [
            f"{ckpt_dir / MANIFEST_NAME}: says step {step} inside {ckpt_dir.name}"
            f"{' of ' + ckpt_dir.parent.name if nested else ''}; the manifest "
            "belongs to another checkpoint, pick another step"
        ]
    return []


def check_ranks(ckpt_dir: Path, manifest: CheckpointManifest, ranks: dict[str, int], required: set[int]) -> list[str]:
    """Every rank number in a file name is below the recorded world size, and each rank in ``required`` wrote."""
    world = manifest.topology.world_size
    beyond = [(name, r) for name, r in ranks.items() if r >= world]
    if beyond:
        name, r = min(beyond)
        return [
            f"{ckpt_dir / name}: written by rank {r}, but the manifest's topology has world size {world}; "
            "the checkpoint is inconsistent, pick another step"
        ]
    missing = sorted(required - set(ranks.values()))
    if missing:
        return [
            f"{ckpt_dir}: no file of rank {missing[0]} though the manifest's topology has world size {world}; "
            "the checkpoint is incomplete, pick another step"
        ]
    return []


def _deep_state(ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
    try:
        now = get_format(manifest.format).recompute_fingerprint(ckpt_dir, manifest)
    except CheckpointError as e:
        return [str(e)]
    from ckpt.commit import fingerprint as fp  # torch: only once a format reader ran (a launcher starts without it)

    diffs = fp.compare(manifest.fingerprint, now, exact=False)
    if diffs:
        return [f"{ckpt_dir}: fingerprint mismatch: {diffs[0]}; the stored state is not what was trained"]
    return []


@dataclass(frozen=True)
class _Known:
    """What a quick validation derived from the exact bytes of manifest.json and of the format's layout inputs,
    when every check that depends only on those bytes passed."""

    step: int
    format: str
    files: tuple[tuple[str, int], ...]  # (path, size) of every listed file, in manifest order
    inputs: tuple[tuple[str, bytes], ...]  # (layout input, its SHA-256)


_KNOWN: OrderedDict[bytes, _Known] = OrderedDict()  # SHA-256 of manifest.json -> _Known (least recently used first)
_KNOWN_MAX_FILES = 1_000_000  # distinct (path, size) lists, ~100 MB at most: ten different 4,096-rank x 24-file lists
_KNOWN_LOCK = threading.Lock()


def _sha256(path: Path) -> tuple[bytes, bytes] | None:
    """(bytes, SHA-256) of a regular file (symlinks followed, as ``read_manifest`` does), or None when it is
    not one or cannot be read (a fifo is never read: opened non-blocking and checked first)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError:
        return None
    finally:
        os.close(fd)
    return data, hashlib.sha256(data).digest()


def _known(ckpt_dir: Path) -> tuple[_Known, bytes] | None:
    """The remembered pass for exactly the bytes now in ``ckpt_dir``'s manifest.json and layout inputs, if any,
    with those manifest bytes."""
    if ckpt_dir.name.endswith(".partial"):
        return None
    got = _sha256(ckpt_dir / MANIFEST_NAME)
    if got is None:
        return None
    with _KNOWN_LOCK:
        known = _KNOWN.get(got[1])
        if known is not None:
            _KNOWN.move_to_end(got[1])
    if known is None:
        return None
    for name, digest in known.inputs:
        now = _sha256(ckpt_dir / name)
        if now is None or now[1] != digest:
            return None
    return known, got[0]


def _remember(manifest_digest: bytes, manifest: CheckpointManifest, inputs: tuple[tuple[str, bytes], ...]) -> None:
    files = tuple((sys.intern(e.path), e.size) for e in manifest.files)
    with _KNOWN_LOCK:
        # the checkpoints of one run usually list the same files at the same sizes: one tuple for all of them
        files = next((k.files for k in _KNOWN.values() if len(k.files) == len(files) and k.files == files), files)
        _KNOWN[manifest_digest] = _Known(manifest.step, manifest.format, files, inputs)
        while len(_KNOWN) > 1 and sum({id(k.files): len(k.files) for k in _KNOWN.values()}.values()) > _KNOWN_MAX_FILES:
            _KNOWN.popitem(last=False)


def forget_known() -> None:
    """Drop every remembered pass (the next quick validation of each checkpoint parses everything again)."""
    with _KNOWN_LOCK:
        _KNOWN.clear()


def _revalidate(ckpt_dir: Path, known: _Known, t0: float) -> ValidationReport:
    """A quick validation of a checkpoint whose manifest and layout inputs are byte for byte ones that passed:
    the directory-dependent checks only."""
    fmt = get_format(known.format)
    errors = _check_step_name(ckpt_dir, known.step, fmt.nested)
    size_errors, _ = _check_sizes(ckpt_dir, list(known.files))
    errors += size_errors
    errors += _unlisted_in(ckpt_dir, {p for p, _ in known.files} | {MANIFEST_NAME}, fmt.nested)
    return ValidationReport(
        path=str(ckpt_dir),
        valid=not errors,
        deep=False,
        step=known.step,
        errors=errors,
        files_checked=len(known.files),
        bytes_checked=0,
        seconds=time.perf_counter() - t0,
    )


def _manifest_from(ckpt_dir: Path, raw: bytes) -> CheckpointManifest | None:
    """The manifest parsed from exactly ``raw`` as ``read_manifest`` parses it, or None when it would refuse
    (the caller then asks ``read_manifest`` for its one-line error)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
        if not isinstance(obj, dict) or obj.get("schema_version") != MANIFEST_SCHEMA_VERSION:
            return None
        return CheckpointManifest.model_validate(obj)
    except (ValueError, ValidationError):
        return None


def validate(ckpt_dir: str | Path, *, deep: bool = False) -> ValidationReport:
    """Check a checkpoint. Quick: manifest, paths, file list, sizes and cross-checks. Deep: also every
    byte's checksum, the stored counters and the fingerprint of the stored tensors.

    A checkpoint that a writer retires or quarantines while (or before) it is read gets a report with
    ``retired=True`` and one line saying so: never a verdict on its bytes (see ``_checked``)."""
    return _checked(Path(ckpt_dir), deep)[0]


def _retired(ckpt_dir: Path, deep: bool, t0: float, *, before: bool = False) -> ValidationReport:
    return ValidationReport(
        path=str(ckpt_dir),
        valid=False,
        deep=deep,
        retired=True,
        errors=[retired_message(ckpt_dir, before=before)],
        step=parse_step(ckpt_dir.name),
        seconds=time.perf_counter() - t0,
    )


def _checked(ckpt_dir: Path, deep: bool, *, listed: bool = False) -> tuple[ValidationReport, bytes | None]:
    """``validate``, and the bytes of the manifest its verdict is about (None when it kept none). ``listed``: the
    directory was just listed as committed, so a missing one was retired (not a wrong path)."""
    t0 = time.perf_counter()
    with WatchedDir(ckpt_dir) as watched:
        if watched.missing and (listed or was_committed(ckpt_dir)):  # not a directory it could not open
            return _retired(ckpt_dir, deep, t0, before=True), None
        try:
            report, raw = _validate_once(ckpt_dir, deep, t0)
        except Exception as e:
            if watched.vanished():
                return _retired(ckpt_dir, deep, t0), None
            if not isinstance(e, FileNotFoundError):
                raise
            where = e.filename or ckpt_dir
            return ValidationReport(
                path=str(ckpt_dir),
                valid=False,
                deep=deep,
                step=parse_step(ckpt_dir.name),
                errors=[
                    f"{where}: disappeared while being read, though its checkpoint is still "
                    "there; something deletes files inside committed checkpoints, pick "
                    "another step"
                ],
                seconds=time.perf_counter() - t0,
            ), None
        if not report.valid and watched.vanished():
            return _retired(ckpt_dir, deep, t0), None
        return report, raw


def _validate_once(ckpt_dir: Path, deep: bool, t0: float) -> tuple[ValidationReport, bytes | None]:
    if not deep:
        found = _known(ckpt_dir)
        if found is not None:
            return _revalidate(ckpt_dir, found[0], t0), found[1]
    if ckpt_dir.is_dir() and os.path.islink(ckpt_dir / MANIFEST_NAME):
        # its bytes live outside the checkpoint, where they can change after this verdict (a persist or a copy
        # would commit what was never checked): refused like any listed file that is a symlink
        return ValidationReport(
            path=str(ckpt_dir),
            valid=False,
            deep=deep,
            step=parse_step(ckpt_dir.name),
            errors=[
                f"{ckpt_dir / MANIFEST_NAME}: is a symlink; a checkpoint holds only its own "
                "regular files, copy the real file in"
            ],
            seconds=time.perf_counter() - t0,
        ), None
    # The manifest and the layout inputs are read once; the checks run on those bytes, and a pass is
    # remembered for their digests -- so only bytes that were checked can ever be vouched for.
    got = None if ckpt_dir.name.endswith(".partial") or not ckpt_dir.is_dir() else _sha256(ckpt_dir / MANIFEST_NAME)
    manifest = _manifest_from(ckpt_dir, got[0]) if got is not None else None
    if manifest is None:
        got = None
        try:
            manifest = read_manifest(ckpt_dir)
        except CheckpointError as e:
            return ValidationReport(
                path=str(ckpt_dir), valid=False, deep=deep, errors=[str(e)], seconds=time.perf_counter() - t0
            ), None
    fmt = get_format(manifest.format)
    names: tuple[str, ...] | None = getattr(fmt, "layout_inputs", None)
    errors = _check_name(ckpt_dir, manifest)
    file_errors, hashed = _check_files(ckpt_dir, manifest, deep and not errors)
    errors += file_errors
    errors += _unlisted(ckpt_dir, manifest)
    inputs: dict[str, tuple[bytes, bytes] | None] = {}
    if not errors:
        if names is None:
            errors += fmt.check_layout(ckpt_dir, manifest)
        else:
            inputs = {n: _sha256(ckpt_dir / n) for n in names}
            errors += fmt.check_layout(
                ckpt_dir,
                manifest,  # type: ignore[call-arg]
                inputs={n: v[0] for n, v in inputs.items() if v is not None},
            )
    if deep and not errors:
        errors += _deep_state(ckpt_dir, manifest)
    if not errors and got is not None and names is not None and all(v is not None for v in inputs.values()):
        _remember(got[1], manifest, tuple((n, v[1]) for n, v in inputs.items()))  # type: ignore[index]
    return ValidationReport(
        path=str(ckpt_dir),
        valid=not errors,
        deep=deep,
        step=manifest.step,
        errors=errors,
        files_checked=len(manifest.files),
        bytes_checked=hashed,
        seconds=time.perf_counter() - t0,
    ), None if got is None else got[0]


def check_staged(partial: Path, manifest: CheckpointManifest) -> list[str]:
    """The commit's last check of a ``.partial`` directory against the manifest about to be written: every
    listed file present, regular, of its hashed size; nothing unlisted; the layout the format references."""
    errors, _ = _check_files(partial, manifest, deep=False)
    errors += _unlisted(partial, manifest)
    if errors:
        return errors
    fmt = get_format(manifest.format)
    names: tuple[str, ...] | None = getattr(fmt, "layout_inputs", None)
    if names is None:
        return fmt.check_layout(partial, manifest)
    inputs = {n: _sha256(partial / n) for n in names}
    errors = fmt.check_layout(
        partial,
        manifest,  # type: ignore[call-arg]
        inputs={n: v[0] for n, v in inputs.items() if v is not None},
    )
    if not errors and all(v is not None for v in inputs.values()):
        # The commit writes exactly these bytes (ckpt.commit.manifest.write_manifest); when they parse back to this
        # manifest, the checks just run are those validate would run on them: remember the pass, so that the
        # retention right after the commit does not parse this checkpoint again. (A change of the manifest's
        # formatting only makes the key miss.)
        raw = (manifest.model_dump_json(indent=2) + "\n").encode("utf-8")
        if _manifest_from(partial, raw) == manifest:
            _remember(hashlib.sha256(raw).digest(), manifest, tuple((n, v[1]) for n, v in inputs.items()))  # type: ignore[index]
    return errors


def _manifest_of(ckpt_dir: Path, raw: bytes | None) -> CheckpointManifest | None:
    """The manifest a passing validation was about: parsed from the very bytes it checked, else read again
    (None when the checkpoint was retired meanwhile)."""
    manifest = _manifest_from(ckpt_dir, raw) if raw is not None else None
    if manifest is not None:
        return manifest
    try:
        return read_manifest(ckpt_dir)
    except CheckpointError:
        if dir_identity(ckpt_dir) is None:
            return None
        raise


def checked_manifest(ckpt_dir: str | Path, *, deep: bool = False) -> CheckpointManifest:
    """The manifest of a checkpoint that passes validation, parsed from the bytes validated (read once).
    Raises CheckpointRetired when a writer retired it, else CheckpointError naming the first problem."""
    ckpt_dir = Path(ckpt_dir)
    report, raw = _checked(ckpt_dir, deep)
    if report.retired:
        raise CheckpointRetired(report.errors[0])
    if not report.valid:
        more = f" (and {len(report.errors) - 1} more problems)" if len(report.errors) > 1 else ""
        raise CheckpointError(f"{report.errors[0]}{more}")
    manifest = _manifest_of(ckpt_dir, raw)
    if manifest is None:
        raise CheckpointRetired(retired_message(ckpt_dir))
    return manifest


def latest_valid(run_dir: RunDir) -> tuple[Path, CheckpointManifest] | None:
    """Newest committed checkpoint that passes quick validation, with the manifest validated; invalid ones
    are logged and skipped, and so (quietly) are those a writer retires meanwhile. When every one listed was
    retired while this looked, the newer ones committed meanwhile are listed again (a few times)."""
    for _ in range(3):
        retired = False
        for path in reversed(run_dir.committed()):
            report, raw = _checked(path, False, listed=True)
            manifest = _manifest_of(path, raw) if report.valid else None
            if manifest is not None:
                return path, manifest
            if report.valid or report.retired:
                log.debug("skipping %s: retired while being read", path.name)
                retired = True
            else:
                log.warning("skipping invalid checkpoint %s: %s", path.name, report.errors[0])
        if not retired:
            return None
    return None


def invalid_committed(run_dir: RunDir) -> list[tuple[Path, str]]:
    """Committed checkpoints that fail quick validation, with the first reason, oldest first (one retired
    meanwhile is not invalid: it is not listed)."""
    out = []
    for path in run_dir.committed():
        report = _checked(path, False, listed=True)[0]
        if not report.valid and not report.retired:
            out.append((path, report.errors[0]))
    return out


def reread_and_record(run_dir: RunDir, ckpt_dir: Path, *, threads: int = 2) -> str | None:
    """Re-read every byte of a committed checkpoint (cache dropped first) and compare with the manifest;
    on success write its verification record. Returns None, or the first problem found."""
    report = validate(ckpt_dir)
    if not report.valid:
        return report.errors[0]
    manifest = read_manifest(ckpt_dir)
    paths = [ckpt_dir / e.path for e in manifest.files]
    for p in paths:
        drop_cache(p)
    expected = {ckpt_dir / e.path: (e.size, e.xxh3_128) for e in manifest.files}
    for path, got in hash_files(paths, threads=threads).items():
        if got != expected[path]:
            return f"{path}: re-read after commit gives {got[0]} bytes, checksum {got[1]}; the stored bytes differ"
    record_verified(run_dir, ckpt_dir, how="reread", bytes_read=sum(s for s, _ in expected.values()))
    return None
