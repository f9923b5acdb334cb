"""What every use of an object store needs: which paths are store URLs, the local cache that mirrors one,
opening its filesystem (bounded timeouts), one line for what went wrong there, a manifest read from its bytes,
the S3 upload calls, the run directories under a URL, and the store's re-read records. ckpt.store.objstore's RemoteRun
mirrors
a run with them.

No torch here: the controller and the CLI's read-only commands use it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from schemas import MANIFEST_SCHEMA_VERSION, CheckpointManifest
from schemas.errors import CheckpointError, ShardkeeperError

CACHE_ENV = "SHARDKEEPER_CACHE"
VERIFIED_DIR = "verified"  # RUN_URL/verified/step-XXXXXXXX.json: the store's objects of that commit were read back

log = logging.getLogger(__name__)


class ObjectStoreError(ShardkeeperError):
    """The store cannot be used as asked (unreachable, no credentials, no bucket, no permission)."""


def is_remote(path: str | os.PathLike[str] | None) -> bool:
    """True for a URL with a protocol other than file:// (``s3://bucket/prefix``)."""
    text = str(path or "")
    return "://" in text and not text.startswith("file://")


def cache_root() -> Path:
    return Path(
        os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardkeeper"
    )


def cache_dir(url: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The local directory that mirrors ``url``: ``<cache>/<protocol>/<bucket>/<prefix>``."""
    protocol, rest = url.split("://", 1)
    parts = [p for p in rest.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ObjectStoreError(f"{url}: not a usable run directory URL; use {protocol}://BUCKET/PREFIX")
    return (Path(cache) if cache else cache_root()).joinpath(protocol, *parts)


def missing_bucket(err: BaseException) -> bool:
    """The store said the bucket does not exist (NoSuchBucket, on the error or the ClientError it was translated
    from) -- not a missing key whose path happens to name a bucket ("my-bucket/run/run.yaml")."""
    e: BaseException | None = err
    for _ in range(5):
        if e is None:
            break
        if (getattr(e, "response", None) or {}).get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        e = e.__cause__ or e.__context__
    text = str(err).lower()
    return "nosuchbucket" in text or "specified bucket does not exist" in text


def explain(err: BaseException, url: str, action: str) -> str:
    """One line for what went wrong talking to the store, naming the fix."""
    name = type(err).__name__
    text = " ".join(str(err).split())[:200]
    code = (getattr(err, "response", None) or {}).get("Error", {}).get("Code")  # botocore's ClientError
    if code == "NoSuchBucket" or (isinstance(err, FileNotFoundError) and missing_bucket(err)):
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return f"{url}: cannot {action}: bucket {bucket} does not exist ({text}); create it first or fix the URL"
    if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem"):
        err = PermissionError(text)
    elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return (
            f"{url}: cannot {action}: the store refused the credentials ({text}); check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (or AWS_PROFILE)"
        )
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"
    if name in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"):
        return (
            f"{url}: cannot {action}: no credentials found ({text}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        )
    if name in (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ClientConnectorError",
        "ServerDisconnectedError",
    ) or isinstance(err, (ConnectionError, TimeoutError)):
        return (
            f"{url}: cannot {action}: the endpoint {endpoint} is unreachable ({text}); "
            "check AWS_ENDPOINT_URL and the network"
        )
    if isinstance(err, PermissionError):
        need = (
            "s3:PutObject, s3:DeleteObject and s3:ListBucket"
            if action.startswith("write")
            else "s3:GetObject and s3:ListBucket"
        )
        return f"{url}: cannot {action}: permission denied ({text}); give these credentials {need} on the bucket"
    return f"{url}: cannot {action} ({name}: {text}); check the URL, the credentials and AWS_ENDPOINT_URL"


# No request to the store waits forever: a stalled endpoint becomes an error after these (botocore Config).
STALL_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 120, "retries": {"max_attempts": 4, "mode": "standard"}}


def open_fs(url: str, storage_options: dict[str, Any] | None = None, *, probe: bool = False) -> tuple[Any, str]:
    """(filesystem, path without protocol). ``probe``: a fresh instance that fails fast (one attempt,
    short connect timeout), so an unreachable endpoint is reported in seconds, not after minutes of retries."""
    import fsspec

    options = dict(storage_options or {})
    if probe:
        options["skip_instance_cache"] = True
        if url.startswith("s3://"):
            options.setdefault(
                "config_kwargs", {"connect_timeout": 5, "read_timeout": 20, "retries": {"max_attempts": 1}}
            )
    elif url.startswith("s3://"):  # a stalled endpoint fails the request (and is retried a bounded number of times)
        options.setdefault("config_kwargs", dict(STALL_TIMEOUTS))
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as err:
        raise ObjectStoreError(
            f"{url}: needs an fsspec backend that is not installed ({err}); pip install s3fs"
        ) from None
    except (ValueError, TypeError) as err:
        raise ObjectStoreError(f"{url}: cannot open ({type(err).__name__}: {err}); check the URL") from None


def forget_listings(fs: Any, root: str) -> None:
    """Drop the filesystem's cached listings of ``root``, its parents and everything under it. fsspec's
    ``invalidate_cache`` leaves the subfolders', and s3fs reads them later (``cat_file`` sizes a file from its
    folder's listing): a step directory listed mid-upload would say "no manifest" long after it landed."""
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        for key in [k for k in list(cache) if k.startswith(root.rstrip("/") + "/")]:
            cache.pop(key, None)


def parse_manifest(raw: bytes, where: str) -> CheckpointManifest:
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(
            f"{where}: unreadable JSON ({e}); the checkpoint is corrupted, pick another step"
        ) from None
    if not isinstance(doc, dict) or doc.get("schema_version") != MANIFEST_SCHEMA_VERSION:
        raise CheckpointError(
            f"{where}: not a shardkeeper manifest of schema_version {MANIFEST_SCHEMA_VERSION}; pick another step"
        )
    try:
        return CheckpointManifest.model_validate(doc)
    except ValueError as e:
        raise CheckpointError(f"{where}: {' '.join(str(e).split())[:200]}; the manifest is corrupted") from None


def put_object(client: Any, bucket: str, key: str, path: Path) -> None:
    client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


def upload_part(client: Any, bucket: str, key: str, upload: str, path: Path, index: int, chunk: int) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, chunk, index * chunk)
    finally:
        os.close(fd)
    etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=index + 1, Body=data)["ETag"]
    return {"PartNumber": index + 1, "ETag": etag}


def iter_runs(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[str]:
    """URLs of the run directories directly under ``url`` (those with a run.yaml), sorted."""
    fs, base = open_fs(url, storage_options)
    base = base.rstrip("/")
    try:
        found = fs.glob(f"{base}/*/run.yaml")
    except FileNotFoundError:
        return
    except Exception as err:  # noqa: BLE001
        raise ObjectStoreError(explain(err, url, "read it")) from None
    for p in sorted(found):
        rel = fs._strip_protocol(p)[len(base) + 1 :].rsplit("/", 1)[0]
        yield f"{url.rstrip('/')}/{rel}"


def _digest(raw: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128(raw).hexdigest()


def record_reread(remote: Any, step: int, manifest_raw: bytes, nbytes: int) -> None:
    """Every object of this commit was downloaded from the store and matched its manifest's checksums: say so on
    the store (``verified/step-XXXXXXXX.json``, bound to the manifest's xxh3-128) for ``status``. Best effort: a
    reader without write permission leaves none, and the checkpoint stays 'committed, not re-read'."""
    doc = {
        "step": step,
        "manifest_xxh3_128": _digest(manifest_raw),
        "how": "download",
        "bytes": nbytes,
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        remote.fs.pipe_file(remote.key(f"{VERIFIED_DIR}/step-{step:08d}.json"), json.dumps(doc).encode())
    except Exception as err:  # noqa: BLE001
        log.debug("no re-read record for step %d on %s: %s", step, remote.url, err)


def reread_on_store(remote: Any, step: int) -> bool:
    """True if the store holds a re-read record for exactly the commit of ``step`` it holds now."""
    try:
        rec = json.loads(remote.fs.cat_file(remote.key(f"{VERIFIED_DIR}/step-{step:08d}.json")))
        manifest = remote.fs.cat_file(remote.key(f"checkpoints/step-{step:08d}/manifest.json"))
    except Exception:  # noqa: BLE001 - no record (or unreadable): not known to be re-read
        return False
    return isinstance(rec, dict) and rec.get("manifest_xxh3_128") == _digest(manifest)
