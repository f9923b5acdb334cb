"""Publishing to any fsspec URL (s3://, gs://, file://, memory://): data first, the marker last; a local
target by atomic rename."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import fsync_dir, fsync_file
from schemas import PublishResult
from schemas.errors import PublishError

logger = logging.getLogger(__name__)
from ckpt.publish._folder import (
    HASH_CHUNK,
    MARKER_NAME,
    ExportFolder,
    PublishedFile,
    first_line,
    load_export,
    marker_bytes,
    parse_marker,
)


def publish_to_fsspec(
    export_dir: str | os.PathLike[str], url: str, *, storage_options: dict[str, Any] | None = None
) -> PublishResult:
    """Copy an export folder to ``url/<export folder name>/``, data files first and the marker last.

    Object stores have no atomic rename, so a reader must treat a folder without a valid
    ``shardkeeper.json`` as incomplete (``read_publish_marker``). A local target is assembled in
    ``<name>.partial-<id>/`` and renamed into place when it does not exist yet.
    """
    export = load_export(export_dir)
    fs, base = url_to_fs(url, storage_options)
    dest = f"{base.rstrip('/')}/{export.name}"
    shown = fs.unstrip_protocol(dest)
    marker = marker_bytes(export, export.files)
    try:
        if fs_complete(fs, dest, export.files):
            logger.info("%s is already at %s with the same checksums: nothing to upload", export.root, shown)
            return PublishResult(target=url, url=shown, skipped=True, files=0)
        if is_local(fs) and not fs.exists(dest):
            publish_local_by_rename(export, Path(dest), marker)
        else:
            publish_in_place(fs, export, dest, marker)
    except (OSError, ValueError) as err:  # PermissionError, FileNotFoundError (no bucket), botocore's wrapped errors
        raise PublishError(
            f"cannot write {shown} ({type(err).__name__}: {first_line(err)}): check that the bucket or "
            "folder exists and that storage_options / credentials allow writing"
        ) from err
    logger.info("published %s to %s (%d files)", export.root, shown, len(export.files))
    return PublishResult(target=url, url=shown, skipped=False, files=len(export.files))


def read_publish_marker(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The marker of a published folder ``url`` (``.../step-00000100``); None means incomplete or not published."""
    fs, path = url_to_fs(url, storage_options)
    try:
        return parse_marker(fs.cat_file(f"{path.rstrip('/')}/{MARKER_NAME}"))
    except FileNotFoundError:
        return None


def url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as err:
        protocol = url.split("://", 1)[0]
        raise PublishError(
            f"{protocol}:// needs an fsspec backend that is not installed ({first_line(err)}): "
            f"pip install 's3fs' for s3://, 'gcsfs' for gs://"
        ) from err
    except (ValueError, TypeError) as err:
        raise PublishError(
            f"cannot open {url} ({type(err).__name__}: {first_line(err)}): check the URL and storage_options"
        ) from err


def is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def fs_complete(fs: Any, dest: str, files: dict[str, PublishedFile]) -> bool:
    """The marker names exactly these checksums and every file is there with its size."""
    fs.invalidate_cache(dest)
    try:
        raw = fs.cat_file(f"{dest}/{MARKER_NAME}")
    except FileNotFoundError:
        return False
    doc = parse_marker(raw)
    if doc is None:
        logger.warning("%s/%s is not a valid marker: publishing again", dest, MARKER_NAME)
        return False
    if doc["files"] != {rel: e.as_json() for rel, e in files.items()}:
        logger.info("%s holds other checksums: publishing again", dest)
        return False
    sizes = sizes_under(fs, dest)
    missing = [rel for rel, e in files.items() if sizes.get(rel) != e.size]
    if missing:
        logger.warning("%s has a marker but %s is missing or truncated: publishing again", dest, missing[0])
    return not missing


def sizes_under(fs: Any, dest: str) -> dict[str, int]:
    root = fs._strip_protocol(dest).rstrip("/")
    found = fs.find(dest, detail=True)
    return {fs._strip_protocol(p)[len(root) + 1 :]: int(info.get("size") or 0) for p, info in found.items()}


def publish_in_place(fs: Any, export: ExportFolder, dest: str, marker: bytes) -> None:
    marker_path = f"{dest}/{MARKER_NAME}"
    if fs.exists(marker_path):
        fs.rm_file(marker_path)  # from here the folder reads as incomplete until the new marker lands
    for rel in sorted(export.files):
        if is_local(fs):
            fs.makedirs(fs._parent(f"{dest}/{rel}"), exist_ok=True)
        with fs.open(f"{dest}/{rel}", "wb") as out:
            copy_verified(export, rel, out)
    sizes = sizes_under(fs, dest)
    for rel in sorted(set(sizes) - set(export.files) - {MARKER_NAME}):
        fs.rm_file(f"{dest}/{rel}")  # a shard of an older export of this name
    short = [rel for rel, e in export.files.items() if sizes.get(rel) != e.size]
    if short:
        raise PublishError(
            f"{fs.unstrip_protocol(dest)}/{short[0]} has the wrong size after upload: publish again; "
            "the marker was not written, so readers see the folder as incomplete"
        )
    fs.pipe_file(marker_path, marker)


def publish_local_by_rename(export: ExportFolder, dest: Path, marker: bytes) -> None:
    stage = dest.with_name(f"{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        for rel in sorted(export.files):
            target = stage / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                copy_verified(export, rel, out)
                out.flush()
                os.fsync(out.fileno())
        (stage / MARKER_NAME).write_bytes(marker)
        fsync_file(stage / MARKER_NAME)
        fsync_dir(stage)
        os.rename(stage, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def copy_verified(export: ExportFolder, rel: str, out: Any) -> None:
    """Copy one file of the export into ``out``, hashing the bytes as they are copied, and compare with the
    checksum and size the marker will claim (``export.files``, hashed when publishing began). The export folder
    may be written meanwhile (re-exported with --overwrite): what was copied is then not what was planned, and
    the publish is refused before any marker claims it."""
    src = export.root / rel
    planned = export.files[rel]
    h = hashlib.sha256()
    size = 0
    try:
        with open(src, "rb", buffering=0) as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise changed_error(export, rel, "it is gone") from None
    if size != planned.size or h.hexdigest() != planned.sha256:
        raise changed_error(
            export,
            rel,
            f"{size} bytes with sha256 {h.hexdigest()[:16]}... were copied, "
            f"{planned.size} bytes with sha256 {planned.sha256[:16]}... were checksummed",
        )


def changed_error(export: ExportFolder, rel: str, how: str) -> PublishError:
    return PublishError(
        f"{export.root / rel}: changed while being published ({how}); the export folder is being "
        "written (a re-export?): publish again once it is complete; no marker was written, so "
        "nothing claims this copy is whole"
    )
