"""One writer per run on an object store: a lease object ``RUN_URL/.lease``.

The local run lock (ckpt.guards.lock) guards one cache; two machines (or two caches) training the same
``s3://`` run would both upload. The lease closes that gap with the store's conditional writes:

- taken with ``PUT If-None-Match: *`` (exactly one creator wins);
- renewed in the background every ``expiry / 4`` with ``PUT If-Match: <our ETag>``, and once more right
  before each checkpoint's manifest (the commit) is written: a writer whose renewal fails has lost the
  lease and stops uploading;
- an expired lease (its holder died without releasing it) is taken over with ``PUT If-Match: <its ETag>``,
  so of two takers exactly one wins; so is, at once, a lease whose holder is a process of this host that no
  longer exists; a lease object that is not a lease document (garbage) stands for an unknown writer and is
  taken over once it expires (the local expiry after its last write);
- released at the end of the segment with ``DELETE If-Match: <our ETag>``.

Expiry is judged on the store's clock (the object's ``Last-Modified`` against the response's ``Date``),
so the machines' clocks need not agree. The document holds the owner (host, pid, a random id), when it was
acquired and renewed, and the expiry in seconds. Readers (status, lineage, validate) never take it.

No torch here: the controller uses it.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt.store.base import ObjectStoreError, explain
from schemas.errors import RunLockedError

log = logging.getLogger(__name__)

LEASE_NAME = ".lease"
EXPIRY_ENV = "SHARDKEEPER_LEASE_S"
DEFAULT_EXPIRY_S = 60.0
_LOST_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409", "404")


class LeaseLost(ObjectStoreError):
    """Another writer holds the run's lease now: this one must not upload anything more."""

    exit_code = RunLockedError.exit_code


def expiry_from_env() -> float:
    raw = os.environ.get(EXPIRY_ENV)
    if not raw:
        return DEFAULT_EXPIRY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ObjectStoreError(
            f"{EXPIRY_ENV}={raw!r}: not a positive number of seconds; unset it (default "
            f"{DEFAULT_EXPIRY_S:g}) or set e.g. {EXPIRY_ENV}=60"
        )
    return value


@dataclass(frozen=True)
class LeaseView:
    """The lease as the store holds it now."""

    doc: dict[str, Any]
    etag: str
    remaining_s: float  # seconds until it expires (store clock); <= 0: expired
    expiry_s: float = DEFAULT_EXPIRY_S  # the expiry it states (the local default when it states none or a bad one)

    def holder(self) -> str:
        owner = self.doc.get("owner") or {}
        return f"{owner.get('host', '?')} pid {owner.get('pid', '?')}"

    def holder_dead(self) -> bool:
        """Its holder is a process of this host that no longer exists (it died without releasing the lease)."""
        owner = self.doc.get("owner") or {}
        if owner.get("host") != socket.gethostname() or type(owner.get("pid")) is not int or owner["pid"] <= 0:
            return False
        if owner["pid"] == os.getpid():
            return False
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: alive (another user's)
            return False
        return False


MAX_EXPIRY_S = 86400.0
GARBAGE_OWNER = {"host": "an unknown writer", "pid": "?"}


def parse_doc(raw: bytes, default_expiry_s: float) -> tuple[dict[str, Any], float]:
    """The lease document and its expiry in seconds. A document that is not one (not JSON, or JSON of other types:
    an owner that is not ``{host: str, pid: int, id: str}``, a time that is not a string) is garbage: it stands
    for an unknown writer with the local expiry (taken over once that expires, like a holder that died). An
    expiry that is not a finite number in (0, 1 day] is the local default."""
    try:
        doc = json.loads(raw)
    except (ValueError, TypeError):
        return {"owner": dict(GARBAGE_OWNER)}, default_expiry_s
    owner = doc.get("owner") if isinstance(doc, dict) else None
    if not (
        isinstance(owner, dict)
        and isinstance(owner.get("host"), str)
        and isinstance(owner.get("id"), str)
        and type(owner.get("pid")) is int
        and all(isinstance(doc.get(k, ""), str) for k in ("acquired", "renewed"))
    ):
        return {"owner": dict(GARBAGE_OWNER)}, default_expiry_s
    expiry = doc.get("expiry_s", default_expiry_s)
    if type(expiry) not in (int, float) or not 0 < expiry <= MAX_EXPIRY_S:  # NaN and Infinity fail this too
        expiry = default_expiry_s
    return doc, float(expiry)


class RunLease:
    """The lease of one run on the store (``client``: a botocore S3 client; ``bucket``/``key``: the object)."""

    def __init__(
        self,
        url: str,
        client: Any,
        bucket: str,
        key: str,
        *,
        expiry_s: float | None = None,
        owner: dict[str, Any] | None = None,
    ):
        self.url = url
        self.client = client
        self.bucket = bucket
        self.key = key
        self.expiry_s = float(expiry_s) if expiry_s is not None else expiry_from_env()
        self.owner = owner or {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}
        self.etag: str | None = None
        self.acquired: str | None = None
        self.taken_over: LeaseView | None = None  # the expired lease acquire() took over, if any
        self.lost: str | None = None  # one line, once another writer holds the lease
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ store calls
    def read(self) -> LeaseView | None:
        """The lease on the store now, or None when there is none."""
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key)
            raw = resp["Body"].read()
        except Exception as err:  # noqa: BLE001
            if _code(err) in ("NoSuchKey", "404"):
                return None
            raise ObjectStoreError(explain(err, self.url, "read its lease")) from None
        doc, expiry = parse_doc(raw, self.expiry_s)
        return LeaseView(doc=doc, etag=resp["ETag"], remaining_s=_remaining(resp, expiry), expiry_s=expiry)

    def _put(self, doc: dict[str, Any], **condition: str) -> str | None:
        """Conditional put of the lease; its new ETag, or None when the condition did not hold."""
        try:
            return self.client.put_object(
                Bucket=self.bucket,
                Key=self.key,
                Body=json.dumps(doc).encode(),
                ContentType="application/json",
                **condition,
            )["ETag"]
        except Exception as err:  # noqa: BLE001
            if _code(err) in _LOST_CODES:
                return None
            raise ObjectStoreError(explain(err, self.url, "write its lease")) from None

    def _doc(self, **extra: Any) -> dict[str, Any]:
        now = _iso()
        return {
            "owner": self.owner,
            "acquired": self.acquired or now,
            "renewed": now,
            "expiry_s": self.expiry_s,
            **extra,
        }

    # ------------------------------------------------------------------ the protocol
    def acquire(self) -> LeaseView | None:
        """Take the lease: create it, or take over an expired one. RunLockedError (one line) while another writer
        holds it. Returns the expired lease that was taken over (None when there was none)."""
        for _ in range(4):
            there = self.read()
            if there is None:
                self.acquired = _iso()
                etag = self._put(self._doc(), IfNoneMatch="*")
            elif there.remaining_s > 0 and not there.holder_dead():  # a dead holder of this host: taken over now
                raise RunLockedError(self.refusal(there))
            else:
                self.acquired = _iso()
                etag = self._put(self._doc(taken_over_from=there.doc.get("owner")), IfMatch=there.etag)
            if etag is None:
                continue
            try:
                ours = self._still_ours(etag)
            except ObjectStoreError:  # written, but not read back: given up (else it stays until it expires)
                self._forget(etag)
                raise
            if ours:
                self.etag, self.taken_over = etag, there
                return there
        there = self.read()
        raise RunLockedError(
            self.refusal(there)
            if there
            else f"{self.url}: other writers keep taking the run's lease; train it from one machine at a time"
        )

    def _forget(self, etag: str) -> None:
        """Delete the lease this writer just wrote (conditional on its ETag), as far as the store lets it now."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=etag)
        except Exception as err:  # noqa: BLE001 - best effort: the lease then expires on its own
            log.warning("%s: the lease just written could not be deleted (%s); it expires on its own", self.url, err)

    def _still_ours(self, etag: str) -> bool:
        """Read back after a winning put: on a store whose conditional puts race (a check, then a write), the
        later of two writers is the one that holds the lease, and the earlier one sees that here."""
        there = self.read()
        return there is not None and there.etag == etag and (there.doc.get("owner") or {}).get("id") == self.owner["id"]

    def refusal(self, there: LeaseView) -> str:
        return (
            f"{self.url}: run is being trained by {there.holder()} "
            f"(lease expires in {max(1, round(there.remaining_s))} s); "
            f"wait for that segment to end, or stop it; a writer that died is taken over once its lease expires "
            f"({there.expiry_s:g} s without renewal); if you know the holder is dead, delete "
            f"{self.url.rstrip('/')}/{LEASE_NAME} and train again"
        )

    def renew(self) -> bool:
        """Extend the lease (conditional on our ETag). False, with ``lost`` set, once another writer holds it."""
        with self._lock:
            if self.lost is not None or self.etag is None:
                return False
            etag = self._put(self._doc(), IfMatch=self.etag)
            if etag is not None:
                self.etag = etag
                return True
            there = self.read()
            who = there.holder() if there else "nobody (the lease was deleted)"
            self.lost = (
                f"{self.url}: this segment lost the run's lease to {who} (taken over; a lease expires "
                f"{self.expiry_s:g} s after its last renewal); it stopped uploading to the store, its newer "
                "checkpoints stay in the local cache only; one machine may train a run at a time"
            )
            return False

    def confirm(self) -> None:
        """Renew now or raise LeaseLost: what a writer calls right before it commits anything on the store."""
        if not self.renew():
            raise LeaseLost(self.lost or f"{self.url}: the run's lease is not held")

    def start_renewing(self, on_lost: Callable[[str], None] | None = None) -> None:
        """Renew every ``expiry / 4`` in a daemon thread until ``release``; ``on_lost`` is called once if it is lost."""

        def loop() -> None:
            period = self.expiry_s / 4
            while not self._stop.wait(period):
                try:
                    if not self.renew():
                        if on_lost is not None and self.lost is not None:
                            on_lost(self.lost)
                        return
                except ObjectStoreError as e:  # the store is unreachable now: retried; commits confirm first
                    log.warning("lease renewal failed (retried): %s", e)

        self._thread = threading.Thread(target=loop, name="lease-renew", daemon=True)
        self._thread.start()

    def stop_renewing(self) -> bool:
        """Stop the renewal thread; False when a renewal still hangs on the store after the lease's expiry (the
        thread is left behind, a daemon: the lease expires on its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.expiry_s)
            if self._thread.is_alive():
                return False
        return True

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (conditional on our ETag). A store that hangs
        does not hold this up past the lease's expiry: the lease is then left to expire."""
        stopped = self.stop_renewing()
        if not (stopped and self._lock.acquire(timeout=self.expiry_s)):
            log.warning(
                "%s: a lease renewal still hangs on the store; the lease is left to expire (%g s)",
                self.url,
                self.expiry_s,
            )
            return
        try:
            if self.lost is not None or self.etag is None:
                return
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=self.etag)
            except Exception as err:  # noqa: BLE001
                if _code(err) not in _LOST_CODES:  # a store without conditional deletes: check, then delete
                    there = self.read()
                    if there is not None and there.etag == self.etag:
                        self.client.delete_object(Bucket=self.bucket, Key=self.key)
            self.etag = None
        finally:
            self._lock.release()


def _code(err: BaseException) -> str | None:
    resp = getattr(err, "response", None) or {}
    code = resp.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def _remaining(resp: dict[str, Any], expiry_s: float) -> float:
    """Seconds until a lease written at ``Last-Modified`` expires, on the store's clock (its ``Date`` header);
    this machine's clock when the store sends no date."""
    modified = resp.get("LastModified")
    date = ((resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}).get("date")
    if modified is None:
        return expiry_s
    try:
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    except (TypeError, ValueError):
        now = time.time()
    return modified.timestamp() + expiry_s - now


def _iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def lease_for(remote: Any, *, expiry_s: float | None = None) -> RunLease | None:
    """The lease of a ckpt.store.objstore.RemoteRun on ``s3://`` (None on other stores: no conditional writes there)."""
    if not remote.url.startswith("s3://"):
        log.warning(
            "%s: no lease on this store (s3:// only): make sure one machine trains this run at a time", remote.url
        )
        return None
    bucket, _, prefix = remote.base.partition("/")
    key = f"{prefix}/{LEASE_NAME}" if prefix else LEASE_NAME
    return RunLease(remote.url, remote.s3_client(), bucket, key, expiry_s=expiry_s)
