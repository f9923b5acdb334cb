"""Run directories and exports on s3:// against a real S3-protocol server on loopback (moto_server, started
once per session as a subprocess; credentials and endpoint through the standard AWS variables).

Two training launches through the real CLI: 2 ranks to step 4 (a checkpoint every step, keep_last 2) on
``s3://BUCKET/run``, then 1 rank to step 5 from a fresh cache (the resume pulls the newest committed
checkpoint); the session's ``tiny_run`` (2 ranks, steps 0 -> 5, uninterrupted) is the reference.

    .venv/bin/python -m pytest tests/test_s3.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.harness import free_port, mark_preempted, max_rel, metrics, stop_process, tiny_spec
from tests.s3_server import _cli, _cli_start, _client, _keys, _moto_server, _new_bucket, _steps

pytest_plugins = ["tests.s3_server"]  # its fixtures (s3_endpoint: one server per session, shared with test_s3_lease)

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
FIRST, END = 4, 5  # END: conftest's TINY_RUN_STEPS, the reference's last step
CKPT_SETS = ["--set", "checkpoint.interval=1", "--set", "checkpoint.keep_last=2"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh local cache for this test (pytest's own ``cache`` fixture is shadowed in this module only)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SHARDKEEPER_CACHE", str(path))
    return path


# ------------------------------------------------------------------------------------------ the shared run
@pytest.fixture(scope="module")
def s3_run(s3_endpoint: str, tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``s3://BUCKET/run``: 2 ranks to step 4 (cache A), then 1 rank to step 5 from a fresh cache (B)."""
    bucket = _new_bucket()
    url = f"s3://{bucket}/run"
    base = tmp_path_factory.mktemp("s3run")
    launch = _cli_start(
        "train",
        "--config",
        TINY,
        "--run-dir",
        url,
        "--nproc",
        "2",
        "--until-step",
        str(FIRST),
        *CKPT_SETS,
        cache=base / "cache-a",
    )
    out, err = launch.communicate(timeout=300)
    first = subprocess.CompletedProcess(launch.args, launch.returncode, out, err)
    assert first.returncode == 0, first.stderr[-3000:]
    after_first = _steps(bucket, "run")
    second = _cli(
        "train",
        "--config",
        TINY,
        "--run-dir",
        url,
        "--nproc",
        "1",
        "--until-step",
        str(END),
        *CKPT_SETS,
        cache=base / "cache-b",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    return {
        "bucket": bucket,
        "url": url,
        "base": base,
        "first": first,
        "second": second,
        "ref": tiny_run,
        "after_first": after_first,
    }


def test_save_to_s3_leaves_manifest_committed_checkpoints_and_keep_last(s3_run: dict[str, Any]) -> None:
    bucket = s3_run["bucket"]
    assert "checkpoint s3://" in s3_run["first"].stderr + s3_run["first"].stdout
    # the watcher thread uploaded checkpoints while the segment trained, not only at its end
    uploaded = [
        int(line.split("/checkpoints/step-")[1][:8])
        for line in s3_run["first"].stderr.splitlines()
        if "uploaded s3://" in line
    ]
    assert uploaded and min(uploaded) < FIRST, s3_run["first"].stderr[-2000:]
    # keep_last 2 on the store after each segment: the newest step and one older one (the uploader skips those
    # committed during another's upload: which one depends on the timing), each whole with its manifest
    assert len(s3_run["after_first"]) == 2 and max(s3_run["after_first"]) == FIRST, s3_run["after_first"]
    steps = _steps(bucket, "run")
    assert sorted(steps) == [FIRST, END]
    import xxhash

    client = _client()
    for step, names in steps.items():
        prefix = f"run/checkpoints/step-{step:08d}/"
        manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
        assert names == {"manifest.json"} | {f["path"] for f in manifest["files"]}
        for f in manifest["files"]:
            body = client.get_object(Bucket=bucket, Key=prefix + f["path"])["Body"].read()
            assert (len(body), xxhash.xxh3_128(body).hexdigest()) == (f["size"], f["xxh3_128"])
    assert {"run/run.yaml", "run/lineage.jsonl", "run/metrics.jsonl", "run/segments.jsonl"} <= set(
        _keys(bucket, "run/")
    )
    assert "run/.lease" not in _keys(
        bucket, "run/"
    )  # each segment released the run's lease (ckpt.guards.lease) at its end


def test_resume_at_another_world_size_from_a_fresh_cache_matches_the_local_reference(s3_run: dict[str, Any]) -> None:
    cache_b = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run"
    got, ref = metrics(cache_b), metrics(s3_run["ref"])
    assert [got[s]["world_size"] for s in range(1, END + 1)] == [2] * FIRST + [1] * (END - FIRST)
    # steps 1-4 came from the store's metrics.jsonl (cache B never trained them): same launch shape, bitwise
    assert [got[s]["loss"] for s in range(1, FIRST + 1)] == [ref[s]["loss"] for s in range(1, FIRST + 1)]
    rel = max_rel(ref, got, range(FIRST + 1, END + 1))
    assert rel <= 1e-6, f"2 -> 1 resume from s3: max relative loss difference {rel:.3e}"
    events = [json.loads(x) for x in (cache_b / "lineage.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["kind"] == "resume"][-1]
    assert resume["parent"] == f"checkpoint:step-{FIRST:08d}" and resume["data"]["to_world_size"] == 1


def test_validate_status_lineage_export_on_the_s3_uri(
    s3_run: dict[str, Any], cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardkeeper.cli import main

    url, bucket = s3_run["url"], s3_run["bucket"]
    # step END was uploaded and nobody read it back from the store: committed, not called verified
    assert main(["status", url, "--json"]) == 0
    (state,) = json.loads(capsys.readouterr().out)
    assert state["step"] == END and state["reread"] is False
    assert main(["status", url]) == 0
    flat = " ".join(re.sub(r"[│┃]", " ", capsys.readouterr().out).split())  # the table's cells, unwrapped
    assert f"step-{END:08d} (committed, not re-read)" in flat, flat
    assert main(["validate", f"{url}/checkpoints/step-{END:08d}", "--deep"]) == 0
    assert f"valid (deep): {url}/checkpoints/step-{END:08d} step {END}" in capsys.readouterr().out
    assert main(["status", url, "--json"]) == 0
    (state,) = json.loads(capsys.readouterr().out)
    assert state["checkpoint"] == f"{url}/checkpoints/step-{END:08d}" and state["step"] == END
    assert state["reread"] is True  # the deep validation downloaded and hashed every object
    assert state["world_size"] == 1 and state["last_status"] == "completed"
    assert (
        main(["export", f"{url}/checkpoints/step-{END:08d}", f"{url}/exports/step-{END:08d}", "--dtype", "bfloat16"])
        == 0
    )
    exported = _keys(bucket, f"run/exports/step-{END:08d}/")
    assert {k.rsplit("/", 1)[1] for k in exported} >= {"config.json", "model.safetensors", "shardkeeper.json"}
    capsys.readouterr()
    assert main(["lineage", url, "--json"]) == 0
    kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
    assert kinds.count("segment") == 2 and "export" in kinds and "validate" in kinds
    exp = [
        json.loads(line) for line in _client().get_object(Bucket=bucket, Key="run/lineage.jsonl")["Body"].iter_lines()
    ]
    assert [e["uri"] for e in exp if e["kind"] == "export"] == [f"{url}/exports/step-{END:08d}"]


def _plant_torn(bucket: str, src: int, dst: int) -> None:
    """Step ``dst`` with every file of step ``src`` but no manifest: an upload killed before its commit."""
    client = _client()
    for key in _keys(bucket, f"run/checkpoints/step-{src:08d}/"):
        if not key.endswith("manifest.json"):
            client.copy_object(
                Bucket=bucket,
                Key=key.replace(f"step-{src:08d}", f"step-{dst:08d}"),
                CopySource={"Bucket": bucket, "Key": key},
            )


def test_checkpoint_without_manifest_is_never_listed_loaded_or_valid(
    s3_run: dict[str, Any], cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpt.store.objstore import RemoteRun
    from schemas.errors import CheckpointError
    from shardkeeper.cli import main
    from shardkeeper.stages import run_state

    bucket = _new_bucket()  # a copy of the run, so the shared one stays as it was
    client = _client()
    for key in _keys(s3_run["bucket"], "run/"):
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": s3_run["bucket"], "Key": key})
    _plant_torn(bucket, END, END + 1)
    url = f"s3://{bucket}/run"
    remote = RemoteRun(url)
    assert remote.committed_steps() == [END - 1, END]
    assert run_state(url).step == END
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        remote.pull_checkpoint(END + 1)
    assert not remote.local.checkpoint(END + 1).exists()
    assert main(["validate", f"{url}/checkpoints/step-{END + 1:08d}"]) == 4
    err = capsys.readouterr().err
    assert "not a committed checkpoint" in err and len(err.strip().splitlines()) == 1
    # a segment resuming here pulls step 6, not the torn 7
    from shardkeeper.remote import Mirror

    m = Mirror(remote, tiny_spec(), is_valid=lambda p: True, poll_s=3600)
    m.start()
    m._stop.set()
    try:
        # the newest whole one and the next older (the ranks' fallback), never the torn one
        assert [p.name for p in remote.local.committed()] == [f"step-{END - 1:08d}", f"step-{END:08d}"]
    finally:  # its lease renewed in a thread until released (else it outlives the test, and the S3 server)
        m.release()
    # a corrupted object under a manifest: refused at download, nothing lands in the cache
    key = next(k for k in _keys(bucket, f"run/checkpoints/step-{END - 1:08d}/") if k.endswith(".distcp"))
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(CheckpointError, match="corrupted"):  # the cache holds a good copy: fresh checks the store
        remote.pull_checkpoint(END - 1, fresh=True)
    shutil.rmtree(remote.local.checkpoint(END - 1))
    with pytest.raises(CheckpointError, match="corrupted"):
        remote.pull_checkpoint(END - 1)
    assert not remote.local.checkpoint(END - 1).exists()


def test_a_long_lived_reader_sees_a_manifest_that_landed_after_it_listed_the_step(
    s3_run: dict[str, Any], cache: Path
) -> None:
    """A reader that listed a step mid-upload (no manifest yet) takes it once its manifest lands: s3fs keeps the
    listing of each step directory, and its cat_file consults it (a stale one said "missing" forever)."""
    from ckpt.store.objstore import RemoteRun

    bucket = _new_bucket()
    client = _client()
    for key in _keys(s3_run["bucket"], "run/checkpoints/"):
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": s3_run["bucket"], "Key": key})
    done = f"run/checkpoints/step-{END:08d}/manifest.json"
    client.delete_object(Bucket=bucket, Key=done)  # step END mid-upload: its files, no manifest yet
    reader = RemoteRun(f"s3://{bucket}/run")
    assert reader.latest_committed()[0] == END - 1
    client.copy_object(Bucket=bucket, Key=done, CopySource={"Bucket": s3_run["bucket"], "Key": done})
    assert reader.latest_committed()[0] == END


def test_sigkill_during_upload_leaves_no_committed_checkpoint(s3_run: dict[str, Any], cache: Path) -> None:
    """A real upload process killed after its first file landed: no manifest, so nothing is committed."""
    from ckpt.store.objstore import RemoteRun

    src = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run" / "checkpoints" / f"step-{END:08d}"
    bucket = _new_bucket()
    url = f"s3://{bucket}/killed"
    child = textwrap.dedent(f"""
        import threading, time
        import ckpt.store.objstore as o
        real, lock, calls = o.put_object, threading.Lock(), []
        def slow(client, bucket, key, path):
            with lock:
                calls.append(key)
                first = len(calls) == 1
            if not first:
                time.sleep(60)  # every later file hangs: the kill lands mid-upload
            real(client, bucket, key, path)
            print("PUT", key, flush=True)
        o.put_object = slow
        o.RemoteRun({url!r}).push_checkpoint({str(src)!r})
        print("DONE", flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("PUT"), line
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    landed = _keys(bucket, "killed/")
    assert landed and not any(k.endswith("manifest.json") for k in landed)
    remote = RemoteRun(url)
    assert remote.committed_steps() == [] and remote.latest_committed() is None
    from shardkeeper.stages import validate_checkpoint

    report = validate_checkpoint(f"{url}/checkpoints/step-{END:08d}")
    assert not report.valid and "not a committed checkpoint" in report.errors[0]
    # the next push of the same checkpoint completes it, manifest last and conditional
    assert remote.push_checkpoint(src) is True
    assert remote.committed_steps() == [END]
    assert remote.push_checkpoint(src) is False  # the same commit is there: nothing uploaded


def test_push_writes_manifest_last_with_a_conditional_put_and_refuses_another_commit(
    s3_run: dict[str, Any], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.store.objstore import ObjectStoreError, RemoteRun

    src = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run" / "checkpoints" / f"step-{END:08d}"
    bucket = _new_bucket()
    remote = RemoteRun(f"s3://{bucket}/r")
    calls: list[tuple[str, Any, Any]] = []
    real_put, real_pipe = remote.put_files, remote.fs.pipe_file
    monkeypatch.setattr(
        remote, "put_files", lambda ps, rels: (calls.append(("put", rels, None)), real_put(ps, rels))[1]
    )
    monkeypatch.setattr(
        remote.fs, "pipe_file", lambda p, d, **kw: (calls.append(("pipe", p, kw.get("mode"))), real_pipe(p, d, **kw))[1]
    )
    remote.commit_guard = lambda: calls.append(("guard", None, None))  # the run's lease: before the files, the commit
    assert remote.push_checkpoint(src) is True
    assert [c[0] for c in calls] == ["guard", "put", "guard", "pipe"]
    assert calls[-1][1].endswith("/manifest.json") and calls[-1][2] == "create"
    assert not any(p.endswith("manifest.json") for p in calls[1][1])
    # another commit of the same step (another writer): refused before any file is overwritten
    other = cache / "other" / f"step-{END:08d}"
    shutil.copytree(src, other)
    doc = json.loads((other / "manifest.json").read_text())
    doc["save_seconds"] = doc["save_seconds"] + 1.0
    (other / "manifest.json").write_text(json.dumps(doc))
    calls.clear()
    with pytest.raises(ObjectStoreError, match="another commit of this step"):
        remote.push_checkpoint(other)
    assert not any(c[0] == "put" for c in calls)


def test_remote_retention_deletes_the_manifest_first(
    s3_endpoint: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.store.objstore import RemoteRun

    bucket = _new_bucket()
    client = _client()
    for step in (1, 2, 3, 4):
        for name in ("__0_0.distcp", ".metadata", "manifest.json"):
            client.put_object(Bucket=bucket, Key=f"r/checkpoints/step-{step:08d}/{name}", Body=b"x" * step)
    client.put_object(Bucket=bucket, Key="r/checkpoints/step-00000002.5/junk", Body=b"?")  # not a step dir
    client.delete_object(Bucket=bucket, Key="r/checkpoints/step-00000002/manifest.json")  # an interrupted upload
    remote = RemoteRun(f"s3://{bucket}/r")
    order: list[str] = []
    real_rm_file, real_rm = remote.fs.rm_file, remote.fs.rm
    monkeypatch.setattr(remote.fs, "rm_file", lambda p, **kw: (order.append(p), real_rm_file(p, **kw))[1])
    monkeypatch.setattr(remote.fs, "rm", lambda ps, **kw: (order.extend(ps), real_rm(ps, **kw))[1])
    assert remote.apply_retention(keep_last=2, keep_every=None) == [1, 2]
    assert order[0].endswith("step-00000001/manifest.json")
    assert sorted(o.rsplit("/", 2)[-2] for o in order[1:3]) == ["step-00000001"] * 2
    assert all("step-00000002/manifest.json" not in o for o in order)
    assert sorted(_steps(bucket, "r")) == [3, 4]


# ------------------------------------------------------------------------------------------ bad input
def _train(url: str) -> Any:
    from shardkeeper.stages import plan_topology, train_segment

    spec = tiny_spec()
    return train_segment(spec, url, plan_topology(spec, 1, device="cpu"), 2)


def test_unreachable_endpoint_is_one_line(s3_endpoint: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt.store.objstore import ObjectStoreError

    bucket = _new_bucket()
    closed = f"http://127.0.0.1:{free_port()}"
    res = _cli("lineage", f"s3://{bucket}/run", cache=cache, env={"AWS_ENDPOINT_URL": closed})  # imports no torch
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: s3://{bucket}/run: cannot read it: the endpoint {closed} is unreachable")
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreError, match=f"cannot write there: the endpoint {closed} is unreachable") as err:
        _train(f"s3://{bucket}/run")
    assert "\n" not in str(err.value) and time.monotonic() - t0 < 30
    assert not list(cache.rglob("run.yaml"))


def test_missing_bucket_and_missing_credentials_are_one_line_errors(
    s3_endpoint: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.store.objstore import ObjectStoreError, RemoteRun

    with pytest.raises(ObjectStoreError) as err:
        _train("s3://no-such-bucket-sk/run")
    assert "bucket no-such-bucket-sk does not exist" in str(err.value) and "\n" not in str(err.value)
    # a bucket that exists and names "bucket": a fresh run's missing run.yaml is not a missing bucket
    named = f"sk-bucket-{uuid.uuid4().hex[:8]}"
    _client().create_bucket(Bucket=named)
    fresh = RemoteRun(f"s3://{named}/run")
    fresh.check_writable()
    assert fresh.pull_meta() == [] and fresh.latest_committed() is None
    bucket = _new_bucket()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(cache / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cache / "none"))
    with pytest.raises(ObjectStoreError, match="no credentials found.*set AWS_ACCESS_KEY_ID"):
        _train(f"s3://{bucket}/run")
    monkeypatch.undo()
    assert _keys(bucket) == {} and not list(cache.rglob("run.yaml"))


def test_bucket_without_write_permission_is_a_one_line_error_and_nothing_is_written(
    s3_endpoint: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second moto_server that enforces IAM: a user allowed only to read and list."""
    import boto3

    from ckpt.store.objstore import ObjectStoreError

    proc, endpoint = _moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "4"})  # these 4 calls, then IAM is enforced
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="read-only-sk")
        iam = boto3.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="ro",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        with pytest.raises(ObjectStoreError) as err:
            _train("s3://read-only-sk/run")
        msg = str(err.value)
        assert "permission denied" in msg and "s3:PutObject" in msg and "\n" not in msg
        reader = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key["AccessKeyId"],
            aws_secret_access_key=key["SecretAccessKey"],
        )
        listed = reader.list_objects_v2(Bucket="read-only-sk")
        assert listed.get("KeyCount", 0) == 0
        assert not list(cache.rglob("run.yaml"))
    finally:
        stop_process(proc)


# ------------------------------------------------------------------------------------------ the flows on s3
def test_flows_train_export_and_resume_runs_on_s3(s3_endpoint: str, prefect_server: object, cache: Path) -> None:
    """train-and-export with run_dir=s3://... (two world sizes, export beside the run on the store, lineage
    artifacts from the store's metadata), then the resume flow scanning an s3:// root resumes the one preempted
    run there and leaves the completed one alone."""
    from ckpt.store.objstore import RemoteRun
    from flows.resume import resume
    from flows.train_and_export import train_and_export
    from shardkeeper.stages import run_state

    bucket = _new_bucket()
    done, cut = f"s3://{bucket}/runs/done", f"s3://{bucket}/runs/cut"
    summary = train_and_export(
        config=str(TINY),
        run_dir=done,
        backoff_s=0,
        segments=[{"nproc": 2, "until_step": 3}, {"nproc": 1, "until_step": 5}],
    )
    assert summary.run_dir == done and summary.final_checkpoint == f"{done}/checkpoints/step-00000005"
    assert summary.segments[1].reshard is not None and summary.segments[1].reshard.to_world_size == 1
    assert summary.export.out_dir == f"{done}/exports/step-00000005"
    assert "runs/done/exports/step-00000005/model.safetensors" in "".join(_keys(bucket, "runs/done/exports/"))
    assert summary.artifacts.events > 0 and not (ROOT / "s3:").exists()
    # A run on the store whose last segment was preempted (its metadata says so; its checkpoint is whole).
    proc = _cli("train", "--config", str(TINY), "--run-dir", cut, "--nproc", "2", "--until-step", "2", cache=cache)
    assert proc.returncode == 0, proc.stderr
    mark_preempted(cache / "s3" / bucket / "runs" / "cut", until_step=4)  # appended: the merge keeps it
    RemoteRun(cut).push_meta()
    items = {i.run_dir: i for i in resume(roots=[f"s3://{bucket}/runs"], nproc=1, backoff_s=0).items}
    assert items[done].action == "skipped-done", items[done]
    assert items[cut].action == "resumed" and "step 2 -> 4 on 1 ranks" in items[cut].reason, items[cut]
    assert run_state(cut).step == 4


# ------------------------------------------------------------------------------------------ a stop on a slow link
def _throttled_mirror(s3_run: dict[str, Any], url: str, steps: tuple[int, ...], poll_s: float = 3600) -> tuple:
    """The new s3:// run ``url`` reached through a 500 KB/s link, its cache holding the shared run's ``steps``, its
    Mirror started: (proxy, remote, mirror)."""
    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror
    from tests.throttle import ThrottledProxy

    src = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run" / "checkpoints"
    proxy = ThrottledProxy(os.environ["AWS_ENDPOINT_URL"], rate=500_000)
    remote = RemoteRun(url, storage_options={"endpoint_url": proxy.url})
    for step in steps:
        shutil.copytree(src / f"step-{step:08d}", remote.local.checkpoint(step))
    mirror = Mirror(remote, tiny_spec(), is_valid=lambda p: True, poll_s=poll_s)
    mirror.start()
    return proxy, remote, mirror


def test_upload_after_a_stop_is_the_newest_only_and_a_second_signal_gives_it_up(
    s3_run: dict[str, Any], cache: Path
) -> None:
    """After a preemption the uploader pushes the newest checkpoint the store lacks, not every older one; on a slow
    link (tests/throttle.py, 500 KB/s) a second SIGTERM gives the upload up at once: no manifest on the store (not a
    checkpoint there), the checkpoint stays in the cache, one line says so, and the next segment uploads it."""
    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror, abandoned_uploads

    bucket = _new_bucket()
    url = f"s3://{bucket}/stopped"
    proxy, remote, mirror = _throttled_mirror(s3_run, url, (FIRST, END))  # two checkpoints the store lacks
    mirror.stopped(grace_s=60)
    prefix = f"stopped/checkpoints/step-{END:08d}/"
    seen: list[float] = []

    def second_signal() -> None:  # once the newest checkpoint's first objects landed: its upload is in flight
        deadline = time.monotonic() + 30
        while not _keys(bucket, prefix) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda *_: pytest.fail("the SIGTERM reached the test's own handler"))
    try:
        import threading

        threading.Thread(target=second_signal, daemon=True).start()
        t0 = time.monotonic()
        mirror.finish()
        took = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen and time.monotonic() - seen[0] < 2.0 and took < 8, took  # a whole upload takes ~3.5 s here
    line = mirror.gave_up or ""  # the CLI prints it in the segment's line (the result's note; exit code unchanged)
    assert (
        line.startswith(
            f"SIGTERM received again; gave up the upload of {url}/checkpoints/step-{END:08d}: the "
            "store has no manifest for it"
        )
        and "\n" not in line
    ), line
    assert f"the next `shardkeeper train --run-dir {url}` here uploads it" in line, line
    from schemas import ClusterTopology, SegmentResult
    from shardkeeper.remote import remote_result

    res = remote_result(
        remote,
        SegmentResult(
            run_dir=str(remote.local.root),
            status="preempted",
            exit_code=75,
            segment=0,
            start_step=0,
            end_step=END,
            seconds=1.0,
            topology=ClusterTopology(),
            checkpoint=str(remote.local.checkpoint(END)),
            note="stopped",
        ),
        mirror,
    )
    assert (res.exit_code, res.checkpoint, res.note) == (75, str(remote.local.checkpoint(END)), f"stopped; {line}")
    assert abandoned_uploads() == [f"{url}/checkpoints/step-{END:08d}"]  # the CLI exits at once, not after it
    # its requests in flight end; nothing more is put, never a manifest; the older checkpoint was never started
    for t in [t for t in threading.enumerate() if t.name == "ckpt-upload-at-stop"]:
        t.join(30)
    landed = _keys(bucket, "stopped/")
    assert not any(k.endswith("manifest.json") for k in landed) and "stopped/.lease" not in landed
    assert {k.rsplit("/", 2)[-2] for k in landed if "/checkpoints/" in k} <= {f"step-{END:08d}"}, landed
    assert RemoteRun(url).committed_steps() == [] and remote.local.checkpoint(END).is_dir()
    # the next segment on this cache uploads it (the direct link: no waiting), then the milestones the store lacks
    nxt = Mirror(RemoteRun(url), tiny_spec(**{"checkpoint.keep_every": FIRST}), is_valid=lambda p: True, poll_s=3600)
    nxt.start()
    nxt.stopped(grace_s=60)  # a stop again: the newest first, then the keep_every milestone (step 4)
    nxt.finish()
    assert nxt.uploaded == [END, FIRST] and RemoteRun(url).committed_steps() == [FIRST, END]
    proxy.close()


def test_upload_after_a_stop_gives_up_past_its_grace(
    s3_run: dict[str, Any], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the stop's grace (SHARDKEEPER_STOP_UPLOAD_S) the upload is given up the same way."""
    from ckpt.store.objstore import RemoteRun

    url = f"s3://{_new_bucket()}/late"
    proxy, remote, mirror = _throttled_mirror(s3_run, url, (END,))
    monkeypatch.setenv("SHARDKEEPER_STOP_UPLOAD_S", "1")
    mirror.stopped(grace_s=60)
    t0 = time.monotonic()
    mirror.finish()
    assert time.monotonic() - t0 < 2.5
    assert (mirror.gave_up or "").startswith(
        f"not done within the stop's 1 s; gave up the upload of {url}/checkpoints/"
    )
    assert RemoteRun(url).committed_steps() == [] and remote.local.checkpoint(END).is_dir()
    proxy.close()


def test_a_second_signal_while_the_ranks_stop_gives_the_upload_up(s3_run: dict[str, Any], cache: Path) -> None:
    """Ctrl-C twice: the second one reaches the launcher (the ranks are still committing), not the upload's own
    handler; it still counts as the second signal, so the upload after the stop is given up at once."""
    from ckpt.store.objstore import RemoteRun
    from launch.local import _install_signal_handlers, _Supervisor

    url = f"s3://{_new_bucket()}/twice"
    proxy, remote, mirror = _throttled_mirror(s3_run, url, (END,))

    class Launch:  # the local launcher's handler, as during the ranks' stop
        signal = None
        on_signal = _Supervisor.on_signal

        def request_stop(self, reason: str) -> None:
            pass

    previous = _install_signal_handlers(Launch())  # type: ignore[arg-type]
    try:
        os.kill(os.getpid(), signal.SIGINT)  # stops the segment
        os.kill(os.getpid(), signal.SIGINT)  # the second: the user wants out
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
    mirror.stopped(grace_s=60, by_signal=True)
    t0 = time.monotonic()
    mirror.finish()
    assert time.monotonic() - t0 < 2.0  # a whole upload takes ~3.5 s here
    assert (mirror.gave_up or "").startswith(f"SIGINT received again; gave up the upload of {url}/checkpoints/"), (
        mirror.gave_up
    )
    assert RemoteRun(url).committed_steps() == [] and remote.local.checkpoint(END).is_dir()
    proxy.close()


def test_a_given_up_upload_names_the_newest_checkpoint_the_store_lacks(
    s3_run: dict[str, Any], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped while an older checkpoint was going up (a newer one committed meanwhile, at the stop): the line names
    the newest one, the one the next segment uploads, not the one that happened to be in flight."""
    from ckpt.store.objstore import RemoteRun

    src = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run" / "checkpoints"
    url = f"s3://{_new_bucket()}/older"
    proxy, remote, mirror = _throttled_mirror(s3_run, url, (FIRST,), poll_s=0.02)
    deadline = time.monotonic() + 10
    while mirror.in_flight != FIRST and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.in_flight == FIRST
    shutil.copytree(src / f"step-{END:08d}", remote.local.checkpoint(END))  # the stop's checkpoint
    monkeypatch.setenv("SHARDKEEPER_STOP_UPLOAD_S", "0.5")
    mirror.stopped(grace_s=60)
    mirror.finish()
    assert (mirror.gave_up or "").startswith(
        f"not done within the stop's 0.5 s; gave up the upload of "
        f"{url}/checkpoints/step-{END:08d}: the store has no manifest"
    ), mirror.gave_up
    import threading

    for t in [t for t in threading.enumerate() if t.name == "ckpt-upload-at-stop"] + [mirror._thread]:
        if t is not None:
            t.join(30)  # its requests in flight end (before the forwarder goes)
    assert RemoteRun(url).committed_steps() == []  # given up: no manifest for what was in flight either
    proxy.close()


def test_a_link_slower_than_the_commits_still_gets_the_runs_metadata_up(s3_run: dict[str, Any], cache: Path) -> None:
    """Checkpoints committed during each upload keep the uploader busy; between two of them the run's metadata
    (run.yaml first of all: without it the store's run is a new one to another machine) goes up, and the store's
    retention runs."""
    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror
    from tests.throttle import ThrottledProxy

    run = s3_run["base"] / "cache-b" / "s3" / s3_run["bucket"] / "run"
    bucket = _new_bucket()
    url = f"s3://{bucket}/busy"
    proxy = ThrottledProxy(os.environ["AWS_ENDPOINT_URL"], rate=500_000)
    remote = RemoteRun(url, storage_options={"endpoint_url": proxy.url})
    remote.local.root.mkdir(parents=True)
    shutil.copy(run / "run.yaml", remote.local.root / "run.yaml")
    shutil.copytree(run / "checkpoints" / f"step-{FIRST:08d}", remote.local.checkpoint(FIRST))
    mirror = Mirror(remote, tiny_spec(), is_valid=lambda p: True, poll_s=0.02)
    mirror.start()
    try:
        deadline = time.monotonic() + 10
        while mirror.in_flight != FIRST and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.copytree(run / "checkpoints" / f"step-{END:08d}", remote.local.checkpoint(END))  # during the upload
        while mirror.in_flight != END and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mirror.in_flight == END  # the same pass goes on to the newer one...
        assert "busy/run.yaml" in _keys(bucket, "busy/")  # ...once the metadata went up
    finally:
        mirror.finish()
        proxy.close()
    assert RemoteRun(url).committed_steps() == [FIRST, END]


@pytest.mark.parametrize("value", ["soon", "nan", "-5"])
def test_a_bad_stop_upload_budget_is_one_line_before_the_segment(
    s3_endpoint: str, cache: Path, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHARDKEEPER_STOP_UPLOAD_S is read when the segment's uploader is set up, not after its training (a stop
    there failed with a bare ValueError, or never timed out for nan)."""
    from ckpt.store.objstore import RemoteRun
    from schemas.errors import ConfigError
    from shardkeeper.remote import Mirror

    monkeypatch.setenv("SHARDKEEPER_STOP_UPLOAD_S", value)
    with pytest.raises(ConfigError, match=rf"^SHARDKEEPER_STOP_UPLOAD_S={value!r}: not a number of seconds \(>= 0\); "):
        Mirror(RemoteRun(f"s3://{_new_bucket()}/budget"), tiny_spec(), is_valid=lambda p: True, lease=False)
