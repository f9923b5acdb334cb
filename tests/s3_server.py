"""The real S3-protocol server the s3:// tests run against (moto_server on loopback, started once per test process),
with the helpers those tests share: buckets, listings, the CLI with its own cache. The test modules load it as a
plugin (``pytest_plugins``), so its session fixture is one server for all of them in a process (each pytest-xdist
worker starts its own): s3fs caches its filesystem per set of options, and the endpoint comes from the environment,
so a second server in one process would not be reached."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


# ------------------------------------------------------------------------------------------ the server
def _moto_server(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    candidate = Path(sys.executable).with_name("moto_server")
    binary = str(candidate) if candidate.exists() else shutil.which("moto_server")
    if binary is None:
        pytest.skip("s3 tests need moto[server] (pip install 'moto[server]'): moto_server not found")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto_server did not start on port {port} (exit code {proc.poll()})")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto_server on loopback; this process's AWS variables point at it for the session."""
    pytest.importorskip("s3fs", reason="s3 tests need s3fs (pip install s3fs)")
    pytest.importorskip("boto3", reason="s3 tests need boto3 (pip install boto3)")
    proc, endpoint = _moto_server()
    mp = pytest.MonkeyPatch()
    try:
        for k, v in {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
            mp.setenv(k, v)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        yield endpoint
    finally:
        mp.undo()
        stop_process(proc)


def _client() -> Any:
    import boto3

    return boto3.client("s3")


def _new_bucket() -> str:
    bucket = f"sk-{uuid.uuid4().hex[:12]}"
    _client().create_bucket(Bucket=bucket)
    return bucket


def _keys(bucket: str, prefix: str = "") -> dict[str, int]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _steps(bucket: str, prefix: str) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for key in _keys(bucket, f"{prefix}/checkpoints/"):
        step_dir, name = key[len(prefix) + len("/checkpoints/") :].split("/", 1)
        if step_dir[5:].isdigit():
            out.setdefault(int(step_dir[5:]), set()).add(name)
    return out


def _cli(
    *args: str, cache: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    proc = _cli_start(*args, cache=cache, env=env)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cli_start(*args: str, cache: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "SHARDKEEPER_CACHE": str(cache),
        "SHARDKEEPER_UPLOAD_POLL_S": "0.05",
        "COLUMNS": "400",
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "shardkeeper", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=full_env,
    )
