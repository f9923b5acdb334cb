"""Run directories and exports on ``s3://`` (any fsspec URL): the controller side of ckpt.store.objstore.

A segment on ``--run-dir s3://bucket/prefix`` trains into the local cache of that URL (the ranks write a
normal run directory at local-disk speed, under the unchanged commit protocol) while ``Mirror`` pushes the
newest checkpoint the store lacks as it commits (a watcher thread: a preemption loses at most the upload in flight;
on a link slower than the commits the ones committed meanwhile are skipped, and the one in flight is pinned in the
cache, ckpt.guards.pin, so the ranks' retention keeps it until it is up), then the run's metadata, and applies the
retention policy on the store (manifest first). Before the segment it takes the run's lease on the store
(ckpt.guards.lease: one writer per run, whatever machine or cache it trains from) and pulls the newest committed remote
checkpoint when the cache lacks it: that is how a segment on another machine, or at another world size, resumes.
A segment that loses its lease stops uploading and ends with one line. The read-only stages (validate, status,
lineage, export) materialize in the cache what they need; nothing is read from a remote step directory without
its manifest.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir, parse_step
from ckpt.guards.lease import LeaseLost, lease_for
from ckpt.guards.pin import Pin
from ckpt.store.base import reread_on_store
from ckpt.store.objstore import ObjectStoreError, RemoteRun, is_remote, iter_runs
from schemas import RunSpec, SegmentResult, ValidationReport
from schemas.errors import CheckpointError, CheckpointRetired, ShardkeeperError
from schemas.requests import RunState, last_placement, last_segment
from shardkeeper._remote_stop import STOP_UPLOAD_ENV, UploadAbandoned, _abandoned, _stop_budget, abandoned_uploads

log = logging.getLogger("shardkeeper")

POLL_ENV = "SHARDKEEPER_UPLOAD_POLL_S"
_CKPT_URL = re.compile(r"^(?P<run>.+)/checkpoints/(?P<name>step-\d{8})/?$")

__all__ = [
    "Mirror",
    "ObjectStoreError",
    "export_remote",
    "is_remote",
    "lineage_source",
    "materialize_checkpoint",
    "open_for_training",
    "run_state_remote",
    "validate_remote",
    "STOP_UPLOAD_ENV",
    "UploadAbandoned",
    "abandoned_uploads",
]


# ------------------------------------------------------------------------------------------ training
def open_for_training(url: str) -> RemoteRun:
    """The remote run and its cache; fails with one line (and writes nothing) unless the store is reachable,
    the credentials work, the bucket exists and these credentials may write under the prefix."""
    remote = RemoteRun(url)
    remote.check_writable()
    return remote


class Mirror:
    """Under the run lock, around one segment: ``start`` pulls what the cache lacks and starts the uploader
    thread; ``finish`` stops it and pushes whatever committed meanwhile, then the metadata.

    After a stop (``stopping``: the segment was preempted or cancelled) ``finish`` is bounded as a preemptible
    machine needs: it uploads the newest valid checkpoint the store lacks, then the ``keep_every`` milestones it
    lacks, within ``stop_grace_s``; a stop signal meanwhile (the second one) gives up at once. A checkpoint given
    up on gets no manifest on the store (its objects are not a checkpoint there), stays in the cache, and the next
    segment on this cache uploads it; the segment keeps its exit code."""

    def __init__(
        self,
        remote: RemoteRun,
        spec: RunSpec,
        *,
        is_valid: Callable[[Path], bool],
        poll_s: float | None = None,
        lease: bool = True,
    ):
        self.remote = remote
        self.lease = lease_for(remote) if lease else None
        self.spec = spec
        self.is_valid = is_valid
        self.poll_s = float(os.environ.get(POLL_ENV, "1.0")) if poll_s is None else poll_s
        self.remote_newest = -1
        self.uploaded: list[int] = []
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.remote_steps: set[int] = set()  # committed on the store (as of start, and what this segment pushed)
        self.stopping = False
        self.stop_grace_s = 60.0
        _stop_budget()  # checked now: a bad value is one line before the segment, not after its training
        self._signals_at_start = 0  # stop signals received before this segment's (launch.early.received_stop)
        self._signals_at_stop = 0  # ... and with the one that stopped it: any more gives the stop's upload up
        self._giving_up = threading.Event()
        self.in_flight: int | None = None  # the step being uploaded now (pinned in the cache: retention keeps it)
        self.pin = Pin(remote.local.root, "upload")
        self.gave_up: str | None = None  # one line, when a stop's upload was given up (the segment result's note)

    def __enter__(self) -> Mirror:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(raise_errors=exc_type is None)

    @property
    def lease_lost(self) -> str | None:
        """One line once another writer took the run's lease: nothing more is uploaded."""
        return self.lease.lost if self.lease is not None else None

    def start(self) -> None:
        from launch.early import pending_stop, received_stop

        # a signal still pending (it came before the launch) is the one that stops this segment: not counted before it
        self._signals_at_start = len(received_stop) - len(pending_stop)
        r = self.remote
        taken = None
        r.commit_guard = self._guard
        if self.lease is not None:  # before anything is pulled or written: a second writer is refused here
            taken = self.lease.acquire()
        try:
            if self.lease is not None:
                self.lease.start_renewing()
            self._start()
            if taken is not None:
                self._record_takeover(taken)
        except BaseException:  # nothing held past a failed start: no pin, lease, renewal or upload thread
            self._stop.set()
            self.release()
            raise

    def release(self) -> None:
        """Give up the cache pin and the run's lease (its renewal thread stopped), uploading nothing: what
        ``finish`` does last, and ``start`` when it fails. Safe to call again."""
        try:
            self.pin.release()
        finally:
            if self.lease is not None:
                self.lease.release()

    def _guard(self) -> None:
        """Before a checkpoint's files and before its manifest: nothing more once the upload was given up, and the
        run's lease renewed (ckpt.guards.lease)."""
        if self._giving_up.is_set():
            raise UploadAbandoned()
        self._confirm()

    def _record_takeover(self, taken: Any) -> None:
        """An expired lease was taken over (its holder died without releasing it): logged and in the lineage."""
        owner = taken.doc.get("owner") or {}
        why = "its process is gone" if taken.remaining_s > 0 else f"expired {-taken.remaining_s:.0f} s ago"
        log.warning(
            "%s: took over the run's lease of %s (%s, last renewed %s)",
            self.remote.url,
            taken.holder(),
            why,
            taken.doc.get("renewed", "?"),
        )
        lineage.record(
            self.remote.local,
            "segment",
            f"lease-takeover:{int(time.time())}:{self.lease.owner['id'][:8]}",
            status="lease-takeover",
            action="lease-takeover",
            previous_host=owner.get("host"),
            previous_pid=owner.get("pid"),
            previous_renewed=taken.doc.get("renewed"),
            expired_s=round(-taken.remaining_s, 1),
            holder_dead=taken.remaining_s > 0,
            host=self.lease.owner["host"],
            pid=self.lease.owner["pid"],
        )

    def _start(self) -> None:
        r = self.remote
        r.sweep_pulls()
        self.pin.acquire()
        r.pull_meta()
        objects = r.checkpoint_objects()
        committed = r.committed_steps(objects)
        self.remote_newest = committed[-1] if committed else -1
        self.remote_steps = set(committed)
        local = [s for s in self._local_steps() if self.is_valid(r.local.checkpoint(s))]
        newest_local = local[-1] if local else -1
        # The newest whole remote checkpoint the cache lacks, and the next older whole one: if the ranks refuse
        # the newest (it loads wrong: they set it aside), they fall back to that one instead of finding none.
        pulled = 0
        for step in reversed(committed):
            if step <= newest_local or pulled == 2:
                break
            try:
                r.pull_checkpoint(step)
                pulled += 1
            except CheckpointError as e:
                log.warning("not resuming from %s: %s", r.checkpoint_uri(step), e)
        self._thread = threading.Thread(target=self._loop, name="ckpt-upload", daemon=True)
        self._thread.start()

    def _local_steps(self) -> list[int]:
        return [parse_step(p.name) or 0 for p in self.remote.local.committed()]

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except (LeaseLost, UploadAbandoned):
                return  # another writer holds the run now, or the stop's upload was given up (finish says so)
            except Exception as e:  # noqa: BLE001 - retried at the next poll and at the end of the segment
                if str(e) != self.last_error:  # once per distinct problem, not once per poll
                    log.warning("upload to %s failed (retried): %s", self.remote.url, e)
                self.last_error = str(e)

    def _milestone(self, step: int) -> bool:
        every = self.spec.checkpoint.keep_every
        return bool(every) and step % every == 0

    def _next(self, tried: set[int]) -> int | None:
        """The next checkpoint to push: the newest valid one newer than the store's newest, then the ``keep_every``
        milestones the store lacks, newest first. Older ones committed meanwhile are skipped (the store's retention
        would retire them anyway): on a link slower than the commits the store still gets the newest each time."""
        local = [s for s in self._local_steps() if s not in tried]
        newer = [s for s in local if s > self.remote_newest]
        milestones = [s for s in local if s < self.remote_newest and self._milestone(s) and s not in self.remote_steps]
        for step in [*reversed(newer), *reversed(milestones)]:  # a newer one not valid: the next older one
            tried.add(step)
            if self.is_valid(self.remote.local.checkpoint(step)):
                return step
        return None

    def sync(self) -> list[int]:
        """Push the checkpoints the store lacks (``_next``); then metadata and retention. Returns the steps pushed.
        The uploader thread stops between checkpoints once ``finish`` began."""
        with self._lock:
            pushed: list[int] = []
            if self.lease_lost:
                raise LeaseLost(self.lease_lost)
            tried: set[int] = set()
            newer = False  # the last one pushed was newer than the store's newest (flushed right after it)
            while True:
                if self._stop.is_set() and threading.current_thread() is self._thread:
                    break  # finish pushes the rest (bounded, after a stop)
                step = self._next(tried)
                if step is None:
                    break
                path = self.remote.local.checkpoint(step)
                self.pin.set(step)  # before the first byte: the ranks' retention keeps it until it is up
                self.in_flight = step
                try:
                    if not path.is_dir():
                        raise FileNotFoundError(path)  # pruned between its choice and its pin
                    self.remote.push_checkpoint(path)
                except (LeaseLost, UploadAbandoned):
                    raise
                except Exception:  # noqa: BLE001
                    if path.exists() or (path.parent / f"{path.name}.partial").exists():
                        raise
                    # removed by the local retention before its pin took effect (a newer one follows): not an error
                    log.info("%s left the cache before its upload (retention); skipped", path.name)
                    continue
                finally:
                    self.in_flight = None
                    self.pin.clear()
                newer = step > self.remote_newest
                self.remote_newest = max(self.remote_newest, step)
                self.remote_steps.add(step)
                pushed.append(step)
                self.uploaded.append(step)
                if newer:  # on a link slower than the commits this loop does not end: the metadata goes up now
                    self._flush()
            if pushed and not newer:
                self._flush()
            return pushed

    def _flush(self) -> None:  # after a checkpoint went up: the run's metadata, then the store's retention
        self._guard()  # given up (the lease may be released already): neither metadata nor retention
        self.remote.push_meta()
        self._guard()
        self.remote.apply_retention(
            keep_last=self.spec.checkpoint.keep_last,
            keep_every=self.spec.checkpoint.keep_every,
            protect={self.remote_newest},
        )

    def _confirm(self) -> None:
        if self.lease is not None:
            self.lease.confirm()

    def stopped(self, grace_s: float | None = None, *, by_signal: bool = False) -> None:
        """The segment was stopped (preempted, cancelled; ``by_signal``: by a stop signal to this process):
        ``finish`` uploads only what matters, within the grace (``SHARDKEEPER_STOP_UPLOAD_S``, else ``grace_s``: the
        launcher's stop grace). Any stop signal beyond the one that stopped it, whichever handler took it (the
        launcher's while the ranks stopped), gives the upload up."""
        budget = _stop_budget()
        self.stop_grace_s = budget if budget is not None else (grace_s if grace_s is not None else self.stop_grace_s)
        self.stopping = True
        self._signals_at_stop = self._signals_at_start + (1 if by_signal else 0)

    def _drain(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.sync()
        self._guard()
        self.remote.push_meta()

    def _drain_bounded(self) -> None:
        """``_drain`` in a thread of its own, given up past the deadline or at a stop signal: the signal handlers
        of the main thread are this call's meanwhile (every signal after the one that stopped the segment)."""
        import signal

        from launch.early import STOP_SIGNALS, received_stop

        result: list[BaseException | None] = []

        def run() -> None:
            try:
                self._drain()
                result.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                result.append(e)

        why: list[str] = []
        if len(received_stop) > self._signals_at_stop:  # one came after the one that stopped it, before this call
            why.append(f"{signal.Signals(received_stop[-1]).name} received again")

        def on_signal(signum: int, _frame: object) -> None:
            if not why:
                why.append(f"{signal.Signals(signum).name} received again")

        previous = (
            {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
            if threading.current_thread() is threading.main_thread()
            else {}
        )
        worker = threading.Thread(target=run, name="ckpt-upload-at-stop", daemon=True)
        deadline = time.monotonic() + self.stop_grace_s
        try:
            if not why:
                worker.start()
            while worker.is_alive() and not why:
                worker.join(min(0.1, max(0.0, deadline - time.monotonic())))
                if worker.is_alive() and time.monotonic() >= deadline and not why:
                    why.append(f"not done within the stop's {self.stop_grace_s:g} s")
        finally:
            for sig, prev in previous.items():
                signal.signal(sig, prev)  # type: ignore[arg-type]
        if worker.ident is None or worker.is_alive():  # (a signal after it ended changes nothing)
            self._giving_up.set()  # from here no file or manifest put begins (one already begun completes whole)
            self._gave_up(why[0], worker)
            return
        if result and result[0] is not None:
            raise result[0]

    def _gave_up(self, why: str, worker: threading.Thread) -> None:
        r = self.remote
        step = self.in_flight
        if worker.ident is not None:
            worker.join(0.5)
        # the one that matters: the newest the store lacks (the stop's own checkpoint, committed during an older
        # one's upload, is what the next segment uploads), else the one that was in flight
        step = next((s for s in reversed(self._local_steps()) if s > self.remote_newest), step)
        if step is not None and step in self.remote_steps:  # its manifest was already on its way: whole there
            self.gave_up = (
                f"{why}; {r.checkpoint_uri(step)} was uploaded whole; gave up the rest: it stays in the "
                f"cache {r.local.root} and the next `shardkeeper train --run-dir {r.url}` here uploads it"
            )
        else:
            what = (
                f"the upload of {r.checkpoint_uri(step)}: the store has no manifest for it (not a checkpoint there); it"
                if step is not None
                else f"the upload of the segment's metadata to {r.url}: it"
            )
            self.gave_up = (
                f"{why}; gave up {what} stays in the cache {r.local.root} and the next "
                f"`shardkeeper train --run-dir {r.url}` here uploads it"
            )
        log.debug("%s", self.gave_up)  # (the CLI prints it once, in the segment's line)
        if worker.is_alive():  # its requests still in flight: a process that exits must not wait for them
            _abandoned.append(r.checkpoint_uri(step) if step is not None else r.url)

    def finish(self, *, raise_errors: bool = True) -> None:
        self._stop.set()
        try:
            if self.stopping:
                self._drain_bounded()
            else:
                self._drain()
        except LeaseLost as e:
            if raise_errors:
                raise LeaseLost(str(e)) from None
            log.error("%s", e)
        except ShardkeeperError as e:
            msg = (
                f"{e}; the segment's checkpoints stay in the cache {self.remote.local.root} and the next "
                f"`shardkeeper train --run-dir {self.remote.url}` uploads them"
            )
            if raise_errors:
                raise ObjectStoreError(msg) from None
            log.error("%s", msg)
        finally:
            self.release()


def remote_result(remote: RemoteRun, result: SegmentResult, mirror: Mirror | None = None) -> SegmentResult:
    """The segment's result with the store's URLs in place of cache paths; after a stop whose upload was given up,
    its checkpoint is the cache's (the store lacks it) and the note says so."""
    if mirror is not None and mirror.gave_up:
        note = f"{result.note}; {mirror.gave_up}" if result.note else mirror.gave_up
        return result.model_copy(update={"run_dir": remote.url, "note": note})
    return result.model_copy(update={"run_dir": remote.url, "checkpoint": remote.local_to_uri(result.checkpoint)})


# ------------------------------------------------------------------------------------------ readers
def split_checkpoint_url(url: str) -> tuple[RemoteRun, int]:
    m = _CKPT_URL.match(url)
    if not m:
        raise ShardkeeperError(f"{url}: not a checkpoint URL; use RUN_URL/checkpoints/step-XXXXXXXX")
    return RemoteRun(m.group("run")), parse_step(m.group("name")) or 0


def reread_url(url: str) -> bool:
    """Whether the store's objects of this checkpoint were read back and matched since its upload."""
    remote, step = split_checkpoint_url(url)
    return reread_on_store(remote, step)


def materialize_checkpoint(url: str, *, fresh: bool = False) -> tuple[RemoteRun, Path]:
    """Download a committed remote checkpoint (and its run's metadata) into the cache; CheckpointError if the
    store holds no manifest for it or its objects do not match the manifest. ``fresh``: check the store's
    objects even when the cache holds the same commit (what a deep validation of a URL means)."""
    remote, step = split_checkpoint_url(url)
    remote.pull_meta()
    return remote, remote.pull_checkpoint(step, fresh=fresh)


def validate_remote(url: str, *, deep: bool, validate: Callable[..., ValidationReport]) -> ValidationReport:
    """Validate a checkpoint on the store: a manifest there (else it is not a checkpoint), every object of its
    size and checksum (checked while downloading), then the local checks (``deep``: fingerprint too)."""
    t0 = time.perf_counter()
    try:
        remote, local = materialize_checkpoint(url, fresh=deep)
    except CheckpointError as e:  # CheckpointRetired: the store's retention took it; a verdict on nothing
        return ValidationReport(
            path=url,
            valid=False,
            deep=deep,
            errors=[str(e)],
            retired=isinstance(e, CheckpointRetired),
            seconds=time.perf_counter() - t0,
        )
    report = validate(local, deep=deep)
    errors = [e.replace(str(local), url) for e in report.errors]
    if deep and not report.retired and remote.local.has_lineage():
        lineage.record(
            remote.local,
            "validate",
            f"validate:{local.name}:{int(time.time())}",
            parent=f"checkpoint:{local.name}",
            step=report.step,
            valid=report.valid,
            errors=errors[:3],
            uri=url,
        )
        _push_meta_quietly(remote)
    return report.model_copy(update={"path": url, "errors": errors, "seconds": time.perf_counter() - t0})


def _push_meta_quietly(remote: RemoteRun) -> None:
    try:
        remote.push_meta()
    except ShardkeeperError as e:  # a reader may lack write permission: the event stays in the cache
        log.warning("lineage event kept in the cache only: %s", e)


def run_state_remote(url: str, *, is_locked: Callable[[Path], bool]) -> RunState:
    """RunState of a run on the store: the newest remote checkpoint with a manifest and all its objects, and whether
    anyone read its objects back since the upload (a resume's download, a deep validation: ckpt.store.base)."""
    from ckpt.commit.fsutil import read_jsonl

    remote = RemoteRun(url)
    remote.check_readable()
    remote.pull_meta()
    found = remote.latest_committed()
    rd = remote.local
    lease = lease_for(remote, expiry_s=1.0) if remote.url.startswith("s3://") else None
    held = (
        lease is not None and (view := lease.read()) is not None and view.remaining_s > 0
    )  # another machine trains it
    if not rd.spec_path.exists() and found is None:
        return RunState(run_dir=url, exists=False, locked=held)
    locked = is_locked(rd.root) or held
    records = read_jsonl(rd.segments)
    last_status, last_until_step = last_segment(records, locked=locked)
    return RunState(
        run_dir=url,
        exists=True,
        checkpoint=remote.checkpoint_uri(found[0]) if found else None,
        step=found[0] if found else 0,
        world_size=found[1].topology.world_size if found else None,
        last_status=last_status,
        last_until_step=last_until_step,
        locked=locked,
        reread=reread_on_store(remote, found[0]) if found else None,
        **last_placement(records),
    )


def remote_run_urls(url: str) -> list[str]:
    """``url`` itself when it is a run directory on the store, else the run directories directly under it."""
    remote = RemoteRun(url)
    remote.check_readable()
    if remote.fs.exists(remote.key("run.yaml")) or remote.committed_steps():
        return [remote.url]
    return list(iter_runs(url))


def lineage_source(url: str) -> tuple[RunDir, int]:
    """The cache of a remote run with its metadata pulled, and how many committed checkpoints the store holds."""
    remote = RemoteRun(url)
    remote.check_readable()
    remote.pull_meta()
    return remote.local, len(remote.committed_steps())


def export_remote(
    ckpt: str,
    out: str,
    *,
    export: Callable[..., Any],
    dtype: str,
    max_shard_size: str | int,
    overwrite: bool,
    progress: bool,
) -> Any:
    """Export a checkpoint where either side is on the store: the checkpoint is materialized in the cache,
    the export written locally, and an ``out`` on the store is published there through ckpt.publish's fsspec
    target (files first, its marker last: a reader sees an incomplete export as none)."""
    from ckpt.publish.fsspec_target import publish_to_fsspec
    from ckpt.store.objstore import cache_dir, open_fs

    remote, local_ckpt = materialize_checkpoint(ckpt) if is_remote(ckpt) else (None, Path(ckpt))
    if is_remote(out):
        name = out.rstrip("/").rsplit("/", 1)[-1]
        if not name or "://" in name:
            raise ShardkeeperError(f"{out}: name the export folder, e.g. s3://bucket/run/exports/step-00000020")
        fs, base = open_fs(out)
        if fs.exists(f"{base.rstrip('/')}/shardkeeper.json") and not overwrite:
            raise ShardkeeperError(f"{out}: an export is already published there; pass --overwrite to replace it")
        local_out = cache_dir(out)
        overwrite = True  # the cache copy of an export is ours to replace
    else:
        local_out = Path(out)
    res = export(
        local_ckpt, local_out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, progress=progress
    )
    uri = out if is_remote(out) else Path(res.out_dir).resolve().as_uri()
    if is_remote(out):
        publish_to_fsspec(local_out, out.rstrip("/").rsplit("/", 1)[0])
    root = remote.local if remote is not None else RunDir.of_checkpoint(local_ckpt)
    if root is not None and root.spec_path.exists():
        lineage.record(
            root,
            "export",
            f"export:{Path(res.out_dir).name}:{res.dtype}",
            parent=f"checkpoint:{local_ckpt.name}",
            step=parse_step(local_ckpt.name),
            uri=uri,
            dtype=res.dtype,
            num_shards=res.num_shards,
            bytes=res.total_bytes,
            seconds=round(res.seconds, 2),
        )
        if remote is not None:
            _push_meta_quietly(remote)
    return res.model_copy(update={"out_dir": out}) if is_remote(out) else res
