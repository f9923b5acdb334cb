"""Checkpoint push to s3:// vs a raw multipart put of the same bytes, against the same S3-protocol server.

Trains one step of a ~46M-parameter Llama on 2 ranks into a local run directory (a ~0.55 GB checkpoint:
fp32 weights + AdamW moments, 4 DCP files + .metadata), starts a moto_server on loopback, then alternates
(after one warm-up of each, not counted):

* raw: boto3's managed transfer (``S3Transfer.upload_file``: multipart, 16 MiB parts, 8 threads) of the
  checkpoint's files, all files submitted at once to one transfer manager: the put itself, nothing else;
* shardkeeper: ``RemoteRun.push_checkpoint`` (ckpt/store/objstore.py) of the same committed checkpoint: the files
  through s3fs (multipart, parallel), the listing that checks every size, then the manifest with a
  conditional put.

Each rep writes under a fresh prefix, deleted (untimed) before the next. Prints a markdown table.

    .venv/bin/python bench/s3_bench.py              # ~2 min on 2 cores
    .venv/bin/python bench/s3_bench.py --reps 5 --endpoint http://127.0.0.1:9000   # your own S3 server
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchlib import fmt  # noqa: E402

MODEL_SETS = [
    "model.config.vocab_size=32000",
    "model.config.hidden_size=512",
    "model.config.intermediate_size=1408",
    "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=8",
    "model.config.num_key_value_heads=8",
]
PART = 16 << 20
THREADS = 8


def make_checkpoint(work: Path) -> Path:
    run = work / "run"
    sets = [a for s in MODEL_SETS for a in ("--set", s)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir",
            str(run),
            "--nproc",
            "2",
            "--until-step",
            "1",
            "--device",
            "cpu",
            *sets,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (ckpt,) = sorted((run / "checkpoints").glob("step-*"))
    return ckpt


def start_moto() -> tuple[subprocess.Popen, str]:
    binary = Path(sys.executable).with_name("moto_server")
    exe = str(binary) if binary.exists() else shutil.which("moto_server")
    if exe is None:
        sys.exit("moto_server not found: pip install 'moto[server]' (or pass --endpoint)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    for _ in range(300):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("moto_server did not start")


def raw_put(client, bucket: str, prefix: str, ckpt: Path) -> None:
    from boto3.s3.transfer import S3Transfer, TransferConfig

    cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
    transfer = S3Transfer(client, config=cfg)
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    with ThreadPoolExecutor(max_workers=len(files)) as pool:  # every file in flight at once, as the push does
        list(pool.map(lambda p: transfer.upload_file(str(p), bucket, f"{prefix}/{p.name}"), files))


def clear(client, bucket: str) -> None:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--endpoint", help="an S3 endpoint to use instead of a moto_server started here")
    ap.add_argument("--work", type=Path, help="folder for the checkpoint (default: a temporary one)")
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    work = args.work or Path(tempfile.mkdtemp(prefix="s3bench-"))
    os.environ["SHARDKEEPER_CACHE"] = str(work / "cache")
    ckpt = make_checkpoint(work)
    nbytes = sum(p.stat().st_size for p in ckpt.iterdir())
    nfiles = sum(1 for _ in ckpt.iterdir())
    proc, endpoint = (None, args.endpoint) if args.endpoint else start_moto()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        import boto3

        from ckpt.store.objstore import RemoteRun

        client = boto3.client("s3")
        bucket = f"s3bench-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        samples: dict[str, list[float]] = {"raw": [], "push": []}

        def rep(kind: str, count: bool) -> None:
            prefix = f"{kind}-{uuid.uuid4().hex[:8]}"
            remote = RemoteRun(f"s3://{bucket}/{prefix}")  # clients made before the clock starts, as for raw
            remote.s3_client()
            t0 = time.perf_counter()
            if kind == "raw":
                raw_put(client, bucket, f"{prefix}/checkpoints/{ckpt.name}", ckpt)
            else:
                remote.push_checkpoint(ckpt)
            dt = time.perf_counter() - t0
            if count:
                samples[kind].append(dt)
            print(f"{kind}: {dt:.2f} s{'' if count else ' (warm-up)'}", file=sys.stderr, flush=True)
            clear(client, bucket)

        rep("raw", False)
        rep("push", False)
        for _ in range(args.reps):
            rep("raw", True)
            rep("push", True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    gbs = {k: [nbytes / 1e9 / s for s in v] for k, v in samples.items()}
    import statistics

    ratio = statistics.median(gbs["push"]) / statistics.median(gbs["raw"])
    from benchlib import md_table, publish

    publish(
        "s3",
        f"S3 checkpoint push, GB/s: median (min–max) of {args.reps} alternated reps after a warm-up, "
        f"{'moto_server on loopback' if proc else endpoint}, checkpoint {nbytes / 1e9:.2f} GB in {nfiles} files:"
        "\n\n"
        + md_table(
            ["upload of the same checkpoint", "GB/s", "seconds", "vs raw"],
            [
                [
                    f"raw multipart put (boto3 S3Transfer, {PART >> 20} MiB parts, {THREADS} threads, "
                    "all files at once)",
                    fmt(gbs["raw"], 3),
                    fmt(samples["raw"]),
                    "1.00×",
                ],
                [
                    "shardkeeper push (files, size check, manifest last with If-None-Match)",
                    fmt(gbs["push"], 3),
                    fmt(samples["push"]),
                    f"{ratio:.2f}×",
                ],
            ],
            "lrrr",
        )
        + f"\n\nGoal: push ≥ 0.8× raw: {'met' if ratio >= 0.8 else 'NOT met'} ({ratio:.2f}×)",
    )


if __name__ == "__main__":
    main()
