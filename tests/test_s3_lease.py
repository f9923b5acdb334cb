"""One writer per run on s3:// (ckpt.guards.lease) against the real S3-protocol server of tests/test_s3.py: a second
machine (another cache) is refused in one line before it trains, a renewed lease outlives its first expiry, a
dead holder's lease is taken over (and the takeover is in the lineage), a writer that lost its lease uploads
nothing more, and of concurrent takers exactly one wins. No training launch: the holder is a child process.

    .venv/bin/python -m pytest tests/test_s3_lease.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from schemas.errors import RunLockedError
from tests.harness import tiny_spec
from tests.s3_server import ROOT, _cli, _new_bucket

pytest_plugins = ["tests.s3_server"]  # the S3 server fixtures (s3_endpoint, cache), shared with test_s3

TINY = str(ROOT / "configs" / "tiny.yaml")

EXPIRY = 2.0  # seconds: short, so a dead holder is taken over within the test


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh local cache for this test (pytest's own ``cache`` fixture is shadowed in this module only)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SHARDKEEPER_CACHE", str(path))
    return path


def _lease(url: str, expiry: float = EXPIRY):  # noqa: ANN202
    from ckpt.guards.lease import lease_for
    from ckpt.store.objstore import RemoteRun

    return lease_for(RemoteRun(url), expiry_s=expiry)


def _wait_expired(url: str, timeout: float = 15.0) -> None:
    probe = _lease(url)
    deadline = time.monotonic() + timeout
    while (view := probe.read()) is not None and view.remaining_s > 0:
        assert time.monotonic() < deadline, "the lease did not expire"
        time.sleep(0.2)


def _holder(url: str, cache_dir: Path) -> subprocess.Popen:
    """Another machine: its own cache, takes the run's lease and renews it until killed."""
    code = textwrap.dedent(f"""
        import time
        from ckpt.guards.lease import lease_for
        from ckpt.store.objstore import RemoteRun
        lease = lease_for(RemoteRun({url!r}))
        lease.acquire()
        lease.start_renewing()
        print("HELD", time.time(), flush=True)
        time.sleep(300)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SHARDKEEPER_CACHE": str(cache_dir),
        "SHARDKEEPER_LEASE_S": str(EXPIRY),
    }
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)


def test_second_writer_refused_in_one_line_renewal_outlives_expiry_dead_holder_taken_over_and_loser_stops(
    s3_endpoint: str, cache: Path, tmp_path: Path
) -> None:
    from ckpt.commit.lineage import read_events
    from ckpt.guards.lease import LEASE_NAME, LeaseLost
    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror

    bucket = _new_bucket()
    url = f"s3://{bucket}/run"
    holder = _holder(url, tmp_path / "cache-a")
    try:
        line = holder.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("HELD"), line
        held_at = float(line.split()[1])
        # Another machine trains the same run: refused in one line (exit 3, like a locked local run) before
        # anything is trained or pulled into its cache; by then the lease has outlived its first expiry (renewed).
        time.sleep(max(0.0, held_at + EXPIRY + 0.5 - time.time()))
        other = tmp_path / "cache-b"
        res = _cli(
            "train",
            "--config",
            TINY,
            "--run-dir",
            url,
            "--nproc",
            "1",
            "--until-step",
            "2",
            cache=other,
            env={"SHARDKEEPER_LEASE_S": str(EXPIRY)},
        )
        assert time.time() - held_at > EXPIRY
        assert res.returncode == 3, res.stderr[-2000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {url}: run is being trained by "), lines
        assert f" pid {holder.pid} (lease expires in " in lines[0]
        local = other / "s3" / bucket / "run"
        assert not any((local / n).exists() for n in ("run.yaml", "segments.jsonl", "metrics.jsonl", "checkpoints"))
        from shardkeeper.stages import run_state

        assert run_state(
            url
        ).locked  # readers see the run as being trained (status, the resume flow), without the lease
        # The holder dies without releasing: refused until the lease expires, then taken over (logged in lineage).
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    mirror = Mirror(RemoteRun(url), tiny_spec(), is_valid=lambda p: True)
    mirror.lease.expiry_s = EXPIRY
    _wait_expired(url)
    mirror.start()
    try:
        taken = [e for e in read_events(mirror.remote.local) if e.data.get("action") == "lease-takeover"]
        assert len(taken) == 1 and taken[0].data["previous_pid"] == holder.pid, taken
        # This writer stops renewing (a stalled machine); a third one takes the expired lease over.
        mirror.lease.stop_renewing()
        _wait_expired(url)
        third = _lease(url)
        assert third.acquire() is not None
        # The stalled writer finds out at its next renewal or commit, and uploads nothing more.
        with pytest.raises(LeaseLost, match=f"lost the run's lease to .* pid {os.getpid()}"):
            mirror.remote.commit_guard()
        assert mirror.lease_lost and "stopped uploading" in mirror.lease_lost
        with pytest.raises(LeaseLost):
            mirror.sync()
    finally:
        with pytest.raises(LeaseLost):
            mirror.finish()
    # ... and leaves the new holder's lease alone.
    doc = json.loads(RemoteRun(url).fs.cat_file(f"{bucket}/run/{LEASE_NAME}"))
    assert doc["owner"]["id"] == third.owner["id"]
    third.release()
    assert third.read() is None
    assert not run_state(url).locked


def test_concurrent_takers_of_an_expired_lease_exactly_one_wins(s3_endpoint: str, cache: Path) -> None:
    url = f"s3://{_new_bucket()}/run"
    for _ in range(3):
        dead = _lease(url, expiry=1.0)
        dead.acquire()  # never renewed, never released: a holder that died
        _wait_expired(url)
        # The takers' own leases last 30 s: on a loaded machine a taker whose read comes more than a short expiry
        # after the winner's write would rightly take over the winner's (expired) lease as well.
        takers = [_lease(url, expiry=30.0) for _ in range(3)]
        barrier = threading.Barrier(len(takers))
        won: list[int] = []
        refused: list[str] = []

        def take(i: int) -> None:
            barrier.wait()  # noqa: B023
            try:
                takers[i].acquire()  # noqa: B023
                won.append(i)  # noqa: B023
            except RunLockedError as e:
                refused.append(str(e))  # noqa: B023

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(takers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, (won, refused)
        assert len(refused) == len(takers) - 1 and all("run is being trained by" in r for r in refused), refused
        holder = takers[won[0]].read()
        assert holder is not None and holder.doc["owner"]["id"] == takers[won[0]].owner["id"]
        assert holder.doc["taken_over_from"] is not None
        takers[won[0]].release()  # the next round starts from another dead holder


def test_typed_garbage_lease_refused_in_one_line_and_dead_local_holder_taken_over_at_once(
    s3_endpoint: str, cache: Path
) -> None:
    """A lease object of JSON but not a lease (an owner that is a string, an Infinity expiry) is an unknown
    writer's: refused in one line (exit 3) until it expires, like non-JSON garbage; a lease whose holder is a
    process of this host that is gone is taken over at once, and says whose it was."""
    from ckpt.guards.lease import LEASE_NAME

    url = f"s3://{_new_bucket()}/run"
    me = _lease(url, expiry=30.0)
    for garbage in (
        b'{"owner": "x"}',
        b'{"owner": {"host": "h", "pid": 1, "id": "a"}, "expiry_s": Infinity}',
        b"[1, 2]",
        b"not json",
    ):
        me.client.put_object(Bucket=me.bucket, Key=me.key, Body=garbage)
        with pytest.raises(RunLockedError) as err:
            me.acquire()
        line = str(err.value)
        assert "\n" not in line and "run is being trained by " in line and "(30 s without renewal)" in line, line
        assert f"delete {url}/{LEASE_NAME} and train again" in line
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = _lease(url, expiry=30.0)
    dead.owner = {**dead.owner, "pid": gone.pid}
    me.client.delete_object(Bucket=me.bucket, Key=me.key)
    dead.acquire()  # never released: its process is gone now
    taken = me.acquire()  # long before it expires
    assert taken is not None and taken.remaining_s > 0 and taken.doc["owner"]["pid"] == gone.pid
    doc = me.read()
    assert doc is not None and doc.doc["owner"]["id"] == me.owner["id"]
    assert doc.doc["taken_over_from"]["pid"] == gone.pid
    me.release()


def test_another_machine_resumes_an_s3_run_without_its_config(s3_endpoint: str, cache: Path) -> None:
    """The run's run.yaml is on the store: a machine whose cache never saw the run takes the spec from there (a
    resume needs no --config); a URL whose store holds no run.yaml is still a new run that needs one."""
    from shardkeeper.config import train_spec
    from tests.s3_server import _client

    bucket = _new_bucket()
    spec = tiny_spec(name="from-the-store")
    _client().put_object(Bucket=bucket, Key="run1/run.yaml", Body=spec.model_dump_json().encode())
    got = train_spec(None, None, f"s3://{bucket}/run1")
    assert got.name == "from-the-store" and got == spec
    with pytest.raises(Exception, match="--config: required for a new run"):
        train_spec(None, None, f"s3://{bucket}/run2")


def test_a_start_that_fails_after_taking_the_lease_holds_nothing(
    s3_endpoint: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror whose start fails once it holds the lease (here: the takeover's lineage line cannot be written, a
    full disk) gives up the lease, its renewal thread, the cache pin and the upload thread: the next writer takes
    the run at once instead of waiting out the lease."""
    import errno

    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror

    url = f"s3://{_new_bucket()}/run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = _lease(url, expiry=30.0)
    dead.owner = {**dead.owner, "pid": gone.pid}
    dead.acquire()  # a dead holder on this host: taken over at once, and the takeover is recorded

    def full(self: Mirror, taken: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Mirror, "_record_takeover", full)
    mirror = Mirror(RemoteRun(url), tiny_spec(), is_valid=lambda p: True, poll_s=3600)
    with pytest.raises(OSError, match="No space left"):
        mirror.start()
    assert mirror.lease is not None and mirror.lease.etag is None
    assert _lease(url).read() is None, "the lease stays on the store"
    renewing = mirror.lease._thread
    assert renewing is not None and not renewing.is_alive(), "the lease is still renewed"
    assert mirror._thread is not None, "the start failed after the upload thread began"
    mirror._thread.join(timeout=5)
    assert not mirror._thread.is_alive(), "the upload thread still polls"
    assert not mirror.pin._lock.held
    mirror.release()  # again: nothing to give up, nothing raised
    assert _lease(url).acquire() is None  # free: taken without waiting for an expiry


class _StoreError(Exception):
    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class _FakeStore:
    """A fake S3 client (a store that hangs or fails on cue cannot be made of the real server): records deletes."""

    def __init__(self) -> None:
        self.gets = 0
        self.deleted: list[dict] = []
        self.hang = threading.Event()  # set: a put blocks until ``go`` is set
        self.go = threading.Event()

    def get_object(self, **kw):  # noqa: ANN003, ANN201
        self.gets += 1
        if self.gets == 1:
            raise _StoreError("NoSuchKey")
        raise _StoreError("SlowDown")  # the read-back fails

    def put_object(self, **kw):  # noqa: ANN003, ANN201
        if self.hang.is_set():
            self.go.wait(30)
        return {"ETag": '"e1"'}

    def delete_object(self, **kw):  # noqa: ANN003, ANN201
        self.deleted.append(kw)


def test_with_a_fake_store_a_lease_written_but_not_read_back_is_deleted_again() -> None:
    """acquire's put lands, its read-back fails: the one-line store error comes out and the lease just written is
    deleted (conditional on its ETag), not left to block the next segment until it expires."""
    from ckpt.guards.lease import RunLease
    from ckpt.store.base import ObjectStoreError

    store = _FakeStore()
    lease = RunLease("s3://b/run", store, "b", "run/lease.json", expiry_s=5)
    with pytest.raises(ObjectStoreError):
        lease.acquire()
    assert store.deleted == [{"Bucket": "b", "Key": "run/lease.json", "IfMatch": '"e1"'}]
    assert lease.etag is None


def test_with_a_fake_store_release_does_not_hang_on_a_renewal_that_hangs() -> None:
    """A renewal stuck on the store: release returns after the lease's expiry at most, deletes nothing (the renewal
    may yet land), and the lease is left to expire."""
    from ckpt.guards.lease import RunLease

    store = _FakeStore()
    lease = RunLease("s3://b/run", store, "b", "run/lease.json", expiry_s=0.4)
    lease.etag = '"e0"'  # held
    store.hang.set()
    lease.start_renewing()
    time.sleep(0.3)  # the first renewal (every expiry / 4) is under way, and hangs
    t = time.monotonic()
    lease.release()
    took = time.monotonic() - t
    store.go.set()
    assert took < 2.0, f"release took {took:.1f} s"
    assert store.deleted == []
