"""Run directories on an object store (``s3://bucket/prefix``, any fsspec URL), mirrored through a local cache.

An object store has no atomic rename, so the commit marker on the remote side is the manifest, written
LAST (with ``If-None-Match: *`` where the store supports conditional puts). The ranks never talk to the
store: they write a normal run directory in the local cache (the hashing O_DIRECT writer and the local
commit protocol unchanged) and the controller mirrors it::

    s3://bucket/prefix/                         ~/.cache/shardkeeper/s3/bucket/prefix/  ($SHARDKEEPER_CACHE)
      run.yaml lineage.jsonl segments.jsonl       the same files (merged line by line on pull)
      metrics.jsonl
      checkpoints/step-00000020/<files>           pushed after the local commit: files (parallel, multipart),
      checkpoints/step-00000020/manifest.json     then the manifest last; pulled back only whole (every file's
                                                  size and xxh3-128 checked against the manifest)
      exports/step-00000020/...                   ckpt.publish's fsspec target (its marker last)

Rules every reader follows: a remote step directory without ``manifest.json`` is not a checkpoint (an upload
was interrupted; it is never listed, pulled or validated as good); retention deletes a checkpoint's manifest
first, then its files. Credentials and endpoint come from the standard AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ...) which botocore reads itself.

No torch here: the controller and the CLI's read-only commands use it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import fsync_dir, mkdir_durable
from ckpt.commit.hashing import hash_files
from ckpt.commit.layout import RunDir, parse_step, step_dir_name
from ckpt.store.base import (
    STALL_TIMEOUTS,
    ObjectStoreError,
    cache_dir,
    explain,
    forget_listings,
    is_remote,
    iter_runs,
    missing_bucket,
    open_fs,
    parse_manifest,
    put_object,
    record_reread,
    upload_part,
)
from schemas import MANIFEST_NAME, CheckpointManifest
from schemas.errors import CheckpointError, CheckpointRetired

__all__ = [
    "META_FILES",
    "ObjectStoreError",
    "RemoteRun",
    "cache_dir",
    "is_remote",
    "iter_runs",
    "merge_lines",
    "open_fs",
    "parse_manifest",
]  # what the controller, the CLI and the tests take from here (ckpt.store.base holds some)

log = logging.getLogger(__name__)

META_FILES = ("run.yaml", "lineage.jsonl", "segments.jsonl", "metrics.jsonl")
_JSONL = frozenset(f for f in META_FILES if f.endswith(".jsonl"))
_PULL_PREFIX = ".pull-"
_PROBE_PREFIX = ".shardkeeper-probe-"
# Multipart: 16 MiB parts, the parts of every file of a checkpoint in flight together on 8 threads.
UPLOAD_CHUNK = 16 << 20
UPLOAD_THREADS = 8


class RemoteRun:
    """One run directory on the store and its local cache. Every method that talks to the store raises
    ObjectStoreError (one line) for store-side problems and CheckpointError for a checkpoint that is not whole."""

    def __init__(
        self, url: str, *, cache: str | os.PathLike[str] | None = None, storage_options: dict[str, Any] | None = None
    ):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.base = open_fs(self.url, storage_options)
        self.base = self.base.rstrip("/")
        self.local = RunDir.at(cache_dir(self.url, cache))
        self._client: Any = None  # botocore client of put_files, made at the first upload
        self.commit_guard: Any = (
            None  # called before a checkpoint's files and its manifest are written (ckpt.guards.lease)
        )

    # ------------------------------------------------------------------ naming
    def key(self, rel: str) -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def uri(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def checkpoint_uri(self, step: int) -> str:
        return self.uri(f"checkpoints/{step_dir_name(step)}")

    def local_to_uri(self, path: str | os.PathLike[str] | None) -> str | None:
        """The remote URL of a path inside the cache (None stays None; a path outside it is returned as is)."""
        if path is None:
            return None
        try:
            return self.uri(Path(path).resolve().relative_to(self.local.root).as_posix())
        except ValueError:
            return str(path)

    def _call(self, action: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ObjectStoreError, CheckpointError):
            raise
        except FileNotFoundError as err:
            if missing_bucket(err):
                raise ObjectStoreError(explain(err, self.url, action)) from None
            raise
        except Exception as err:  # noqa: BLE001 - botocore/aiohttp errors of every kind become one line
            raise ObjectStoreError(explain(err, self.url, action)) from None

    # ------------------------------------------------------------------ access checks
    def check_writable(self) -> None:
        """Put and delete a probe object under the prefix: reachable endpoint, credentials, bucket and
        write permission in one round trip each, before anything else is written (fails fast)."""
        fs, base = open_fs(self.url, self.storage_options, probe=True)
        probe = f"{base.rstrip('/')}/{_PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        self._call("write there", fs.pipe_file, probe, b"probe")
        self._call("write there", fs.rm_file, probe)

    def check_readable(self) -> None:
        """One listing under the prefix (fails fast): endpoint, credentials, bucket and read permission."""
        fs, base = open_fs(self.url, self.storage_options, probe=True)
        try:
            self._call("read it", fs.ls, base.rstrip("/"), detail=False)
        except FileNotFoundError:
            pass  # the bucket is there, the prefix holds nothing yet

    # ------------------------------------------------------------------ listing
    def _objects(self, rel: str) -> dict[str, int]:
        """Every object under ``rel`` (relative key -> size); empty if there is none."""
        root = self.key(rel).rstrip("/")
        forget_listings(self.fs, root)
        try:
            found = self._call("list it", self.fs.find, root, detail=True)
        except FileNotFoundError:
            return {}
        return {
            self.fs._strip_protocol(p)[len(root) + 1 :]: int(info.get("size") or 0)
            for p, info in found.items()
            if self.fs._strip_protocol(p).startswith(root + "/")
        }

    def checkpoint_objects(self) -> dict[int, dict[str, int]]:
        """step -> {relative path: size} for every remote step directory, committed or not."""
        out: dict[int, dict[str, int]] = {}
        for rel, size in self._objects("checkpoints").items():
            head, _, tail = rel.partition("/")
            step = parse_step(head)
            if step is not None and tail:
                out.setdefault(step, {})[tail] = size
        return out

    def committed_steps(self, objects: dict[int, dict[str, int]] | None = None) -> list[int]:
        """Steps whose manifest is on the store (the commit marker), oldest first; the rest are ignored."""
        objects = self.checkpoint_objects() if objects is None else objects
        return sorted(s for s, files in objects.items() if MANIFEST_NAME in files)

    def manifest(self, step: int) -> CheckpointManifest:
        where = f"{self.checkpoint_uri(step)}/{MANIFEST_NAME}"
        try:
            raw = self._call(
                "read it", self.fs.cat_file, self.key(f"checkpoints/{step_dir_name(step)}/{MANIFEST_NAME}")
            )
        except FileNotFoundError:
            raise CheckpointError(
                f"{where}: missing, so {step_dir_name(step)} is not a committed checkpoint (never saved, "
                "deleted, or an upload that did not finish); pick another step"
            ) from None
        return parse_manifest(raw, where)

    def check_sizes(self, step: int, manifest: CheckpointManifest, files: dict[str, int]) -> str | None:
        """The first problem of a remote checkpoint's objects against its manifest, or None."""
        for entry in manifest.files:
            got = files.get(entry.path)
            if got is None:
                return f"{self.checkpoint_uri(step)}/{entry.path}: listed in the manifest but missing on the store"
            if got != entry.size:
                return f"{self.checkpoint_uri(step)}/{entry.path}: {got} bytes, manifest says {entry.size}"
        if manifest.step != step:
            return (
                f"{self.checkpoint_uri(step)}/{MANIFEST_NAME}: says step {manifest.step}; "
                "it belongs to another checkpoint"
            )
        return None

    def latest_committed(self) -> tuple[int, CheckpointManifest] | None:
        """Newest remote checkpoint with a manifest whose files are all there at their sizes."""
        objects = self.checkpoint_objects()
        for step in reversed(self.committed_steps(objects)):
            try:
                manifest = self.manifest(step)
            except CheckpointError as e:
                if "missing" in str(e) and not self._exists(f"checkpoints/{step_dir_name(step)}/{MANIFEST_NAME}"):
                    log.debug("skipping %s: retired since it was listed", self.checkpoint_uri(step))
                else:
                    log.warning("skipping %s: %s", self.checkpoint_uri(step), e)
                continue
            problem = self.check_sizes(step, manifest, objects[step])
            if problem is None:
                return step, manifest
            log.warning("skipping %s: %s", self.checkpoint_uri(step), problem)
        return None

    # ------------------------------------------------------------------ push
    def push_checkpoint(self, local_ckpt: str | os.PathLike[str]) -> bool:
        """Upload a locally committed checkpoint: files (parallel, multipart), a size check, the manifest last with a
        conditional put. False if the store holds this very commit; another commit of the step is refused."""
        local_ckpt = Path(local_ckpt)
        step = parse_step(local_ckpt.name)
        if step is None:
            raise CheckpointError(f"{local_ckpt}: not a step-XXXXXXXX checkpoint directory")
        raw = (local_ckpt / MANIFEST_NAME).read_bytes()
        manifest = parse_manifest(raw, str(local_ckpt / MANIFEST_NAME))
        rel_dir = f"checkpoints/{local_ckpt.name}"
        if self._same_commit_there(rel_dir, raw):
            return False
        t0 = time.perf_counter()
        names = sorted(e.path for e in manifest.files)
        if self.commit_guard is not None:  # a writer that lost the run's lease uploads nothing, not even data
            self.commit_guard()
        self._call("write there", self.put_files, [local_ckpt / n for n in names], [f"{rel_dir}/{n}" for n in names])
        landed = self._objects(rel_dir)
        problem = self.check_sizes(step, manifest, landed)
        if problem:
            raise ObjectStoreError(
                f"{problem} after the upload; the manifest was not written, so the store does not "
                "count it as a checkpoint; the next segment uploads it again"
            )
        if self.commit_guard is not None:
            self.commit_guard()
        try:
            self._call("write there", self.fs.pipe_file, self.key(f"{rel_dir}/{MANIFEST_NAME}"), raw, mode="create")
        except FileExistsError:  # raced with another writer between our check and the put
            if not self._same_commit_there(rel_dir, raw):
                raise ObjectStoreError(
                    f"{self.checkpoint_uri(step)}: another writer committed this step meanwhile; "
                    "two segments write the same run, stop one of them"
                ) from None
        except (NotImplementedError, TypeError):  # a backend without conditional writes
            self._call("write there", self.fs.pipe_file, self.key(f"{rel_dir}/{MANIFEST_NAME}"), raw)
        size = sum(e.size for e in manifest.files) + len(raw)
        dt = time.perf_counter() - t0
        log.info(
            "uploaded %s (%.1f MB in %.2f s, %.0f MB/s)",
            self.checkpoint_uri(step),
            size / 1e6,
            dt,
            size / 1e6 / max(dt, 1e-9),
        )
        return True

    def put_files(self, paths: list[Path], rels: list[str]) -> None:
        """Upload files to ``rels`` under the run: on s3:// by multipart uploads whose parts (of every file at
        once) go up from UPLOAD_THREADS threads of a botocore client (s3fs drives all its requests from one
        event-loop thread, ~0.8x the throughput here); elsewhere through fsspec's ``put``."""
        if not self.url.startswith("s3://"):
            self.fs.put([str(p) for p in paths], [self.key(r) for r in rels])
            return
        from concurrent.futures import ThreadPoolExecutor

        client = self.s3_client()
        bucket, _, prefix = self.base.partition("/")
        keys = [f"{prefix}/{r}" if prefix else r for r in rels]
        uploads: list[tuple[str, str]] = []
        try:
            with ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="s3-put") as pool:
                jobs = []  # (key, upload id or None, futures of its parts)
                for path, key in zip(paths, keys):
                    size = path.stat().st_size
                    if size < 2 * UPLOAD_CHUNK:
                        jobs.append((key, None, [pool.submit(put_object, client, bucket, key, path)]))
                        continue
                    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
                    uploads.append((key, upload))
                    parts = [
                        pool.submit(upload_part, client, bucket, key, upload, path, i, UPLOAD_CHUNK)
                        for i in range((size + UPLOAD_CHUNK - 1) // UPLOAD_CHUNK)
                    ]
                    jobs.append((key, upload, parts))
                for key, upload, futures in jobs:
                    done = [f.result() for f in futures]
                    if upload is not None:
                        client.complete_multipart_upload(
                            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done}
                        )
                        uploads.remove((key, upload))
        finally:
            for key, upload in uploads:  # an upload that failed part-way: let the store drop its parts
                try:
                    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
                except Exception:  # noqa: BLE001 - best effort; the lifecycle rules of the bucket catch the rest
                    pass
            self.fs.invalidate_cache(self.base)

    def s3_client(self) -> Any:
        """This run's botocore S3 client, configured like s3fs's (endpoint, credentials, options); made once."""
        if self._client is not None:
            return self._client
        import botocore.config
        import botocore.session

        fs = self.fs
        kwargs = dict(getattr(fs, "client_kwargs", None) or {})
        if getattr(fs, "endpoint_url", None):
            kwargs.setdefault("endpoint_url", fs.endpoint_url)
        if getattr(fs, "key", None):
            kwargs.update(aws_access_key_id=fs.key, aws_secret_access_key=fs.secret)
            if getattr(fs, "token", None):
                kwargs["aws_session_token"] = fs.token
        options = {**STALL_TIMEOUTS, **(getattr(fs, "config_kwargs", None) or {})}
        config = botocore.config.Config(max_pool_connections=UPLOAD_THREADS * 2, **options)
        self._client = botocore.session.get_session().create_client("s3", config=config, **kwargs)
        return self._client

    def _same_commit_there(self, rel_dir: str, raw: bytes) -> bool:
        try:
            there = self._call("read it", self.fs.cat_file, self.key(f"{rel_dir}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            return False
        if there == raw:
            return True
        raise ObjectStoreError(
            f"{self.uri(rel_dir)}: the store holds another commit of this step (its manifest "
            "differs); two segments wrote the same run; use a new run directory for one of them"
        )

    def push_meta(self) -> None:
        """run.yaml and the JSON-lines files: merged with what the store holds (another machine may have
        appended), then uploaded."""
        for name in META_FILES:
            path = self.local.root / name
            if not path.is_file():
                continue
            data = path.read_bytes()
            if name in _JSONL:
                try:
                    there = self._call("read it", self.fs.cat_file, self.key(name))
                except FileNotFoundError:
                    there = b""
                data = merge_lines(there, data)
            self._call("write there", self.fs.pipe_file, self.key(name), data)

    # ------------------------------------------------------------------ pull
    def pull_meta(self) -> list[str]:
        """Bring run.yaml (the store's wins when the cache has none) and the JSON-lines files (merged) into
        the cache."""
        mkdir_durable(self.local.root)
        got = []
        for name in META_FILES:
            try:
                there = self._call("read it", self.fs.cat_file, self.key(name))
            except FileNotFoundError:
                continue
            path = self.local.root / name
            if name in _JSONL:
                mine = path.read_bytes() if path.is_file() else b""
                merged = merge_lines(there, mine)
                if merged != mine:
                    _write_atomic(path, merged)
            elif not path.is_file():
                _write_atomic(path, there)
            got.append(name)
        return got

    def pull_checkpoint(self, step: int, *, fresh: bool = False) -> Path:
        """Download a committed remote checkpoint into the cache (``checkpoints/step-XXXXXXXX``): every file
        checked for size and xxh3-128 against the manifest, then the manifest written and the folder renamed
        into place. Returns the local folder (at once if the cache already holds this very commit, unless
        ``fresh``: then the store's objects are downloaded and checked anyway, as a deep validation must)."""
        try:
            raw = self._call("read it", self._read_manifest_bytes, step)
        except CheckpointError:
            if self.was_committed(step):
                raise CheckpointRetired(self.retired_message(step)) from None
            raise
        manifest = parse_manifest(raw, f"{self.checkpoint_uri(step)}/{MANIFEST_NAME}")
        final = self.local.checkpoint(step)
        cached = (final / MANIFEST_NAME).is_file() and (final / MANIFEST_NAME).read_bytes() == raw
        if cached and not fresh:
            return final
        try:
            return self._download(step, raw, manifest, final, cached)
        except (CheckpointError, ObjectStoreError, FileNotFoundError):
            # Retention on the store deletes the manifest first, then the files: a download that lost them
            # because the checkpoint was retired meanwhile says so, not that the checkpoint is broken.
            now = self._manifest_now(step)
            if now is None or (now and now != raw):
                raise CheckpointRetired(self.retired_message(step)) from None
            raise

    def _manifest_now(self, step: int) -> bytes | None:
        try:
            return self.fs.cat_file(self.key(f"checkpoints/{step_dir_name(step)}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - unsure: not taken for retired
            return b""

    def _exists(self, rel: str) -> bool:
        try:
            return bool(self.fs.exists(self.key(rel)))
        except Exception:  # noqa: BLE001
            return True

    def was_committed(self, step: int) -> bool:
        """The run's lineage (pulled into the cache) names this checkpoint: a missing manifest means retired."""
        try:
            return f'"checkpoint:{step_dir_name(step)}"'.encode() in self.local.lineage.read_bytes()
        except OSError:
            return False

    def retired_message(self, step: int) -> str:
        return (
            f"{self.checkpoint_uri(step)}: retired by the run's writer (retention on the store) while or before "
            f"it was read; pick a newer step, `shardkeeper status {self.url}` lists them"
        )

    def _download(self, step: int, raw: bytes, manifest: CheckpointManifest, final: Path, cached: bool) -> Path:
        rel_dir = f"checkpoints/{step_dir_name(step)}"
        problem = self.check_sizes(step, manifest, self._objects(rel_dir))
        if problem:
            raise CheckpointError(f"{problem}; the remote checkpoint is not whole, pick another step")
        mkdir_durable(self.local.checkpoints)
        stage = self.local.checkpoints / f"{_PULL_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        try:
            names = sorted(e.path for e in manifest.files)
            for n in names:
                (stage / n).parent.mkdir(parents=True, exist_ok=True)
            self._call(
                "read it", self.fs.get, [self.key(f"{rel_dir}/{n}") for n in names], [str(stage / n) for n in names]
            )
            expected = {stage / e.path: (e.size, e.xxh3_128) for e in manifest.files}
            for path, got in hash_files(list(expected), threads=4).items():
                if got != expected[path]:
                    rel = path.relative_to(stage).as_posix()
                    raise CheckpointError(
                        f"{self.checkpoint_uri(step)}/{rel}: downloaded {got[0]} bytes with checksum "
                        f"{got[1]}, the manifest says {expected[path][0]} bytes {expected[path][1]}; "
                        "the stored object is corrupted, pick another step"
                    )
            record_reread(self, step, raw, sum(e.size for e in manifest.files))  # every object read back: verified
            if cached:  # fresh: the store's objects match the manifest; the cache's copy stays (validated next)
                return final
            (stage / MANIFEST_NAME).write_bytes(raw)
            for path in [*expected, stage / MANIFEST_NAME]:
                _fsync(path)
            fsync_dir(stage)
            if self._holds(final, raw):  # another reader of this cache pulled the same commit meanwhile
                return final
            if final.exists():  # a different local commit of this step: the store's committed one wins
                final.rename(final.with_name(f"{final.name}.invalid-{int(time.time())}"))
            try:
                os.rename(stage, final)
            except OSError:
                if self._holds(final, raw):
                    return final
                raise
            fsync_dir(self.local.checkpoints)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        log.info("downloaded %s into %s", self.checkpoint_uri(step), final)
        return final

    @staticmethod
    def _holds(final: Path, raw: bytes) -> bool:
        try:
            return (final / MANIFEST_NAME).read_bytes() == raw
        except OSError:
            return False

    def _read_manifest_bytes(self, step: int) -> bytes:
        try:
            return self.fs.cat_file(self.key(f"checkpoints/{step_dir_name(step)}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.checkpoint_uri(step)}: no {MANIFEST_NAME} on the store, so it is not a "
                "committed checkpoint (never saved, deleted, or an upload that did not finish); "
                "pick another step"
            ) from None

    def sweep_pulls(self) -> None:
        """Remove download folders of pulls that died half-way (call under the run lock)."""
        if self.local.checkpoints.is_dir():
            for p in self.local.checkpoints.iterdir():
                if p.name.startswith(_PULL_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ retention
    def apply_retention(self, *, keep_last: int, keep_every: int | None, protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        """Keep the newest ``keep_last`` committed checkpoints, every ``keep_every``-th and ``protect``; delete the
        others: the manifest FIRST (from then on no reader counts it), then its files. Also removes step
        directories without a manifest older than the newest committed one (interrupted uploads)."""
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1: the newest checkpoint is the resume point")
        objects = self.checkpoint_objects()
        committed = self.committed_steps(objects)
        if not committed:
            return []
        keep = set(committed[-keep_last:]) | set(protect)
        if keep_every:
            keep |= {s for s in committed if s % keep_every == 0}
        newest = committed[-1]
        doomed = [s for s in committed if s not in keep]
        orphans = [s for s in objects if s not in committed and s < newest]
        for step in sorted(doomed + orphans):
            rel_dir = f"checkpoints/{step_dir_name(step)}"
            if step in doomed:
                self._call("write there", self.fs.rm_file, self.key(f"{rel_dir}/{MANIFEST_NAME}"))
            rest = [self.key(f"{rel_dir}/{n}") for n in sorted(objects[step]) if n != MANIFEST_NAME]
            if rest:
                self._call("write there", self.fs.rm, rest)
            log.info("retention: deleted %s%s", self.checkpoint_uri(step), "" if step in doomed else " (no manifest)")
        return sorted(doomed + orphans)


def merge_lines(there: bytes, mine: bytes) -> bytes:
    """The store's lines, then the local lines it lacks, in order (whole lines only: a torn last line is dropped)."""

    def lines(b: bytes) -> list[bytes]:
        parts = b.split(b"\n")
        return [ln for ln in parts[:-1] if ln.strip()]  # the text after the last newline is torn or empty

    theirs = lines(there)
    seen = set(theirs)
    extra = [ln for ln in lines(mine) if ln not in seen]
    out = theirs + extra
    return b"".join(ln + b"\n" for ln in out)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
