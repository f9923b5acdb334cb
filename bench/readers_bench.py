"""Readers beside a writer: status, scan, lineage, validate (quick and deep) and export, called over and over
against a run whose writer commits a checkpoint and retires one at every step, locally and on s3://.

    python bench/readers_bench.py                  # ~3-5 min on 2 cores: 1 training launch, moto_server for s3
    python bench/readers_bench.py --calls 100 --no-s3 --cli 0   # a quick look

The writer (tests/reliability/livewriter.py) copies real checkpoints of a 3-step run (2 ranks, a checkpoint
every step) into ``step-XXXXXXXX.partial/``, renames them into place, appends their lineage events, and retires
the oldest as retention does (rename to ``.deleting``, rmtree; every 4th by quarantine, ``.invalid-<time>``),
keeping 2. On s3:// (a moto_server on 127.0.0.1) it pushes them with ``RemoteRun.push_checkpoint`` and applies
the store's retention (manifest first) after every push. The readers run in this process, one call after the
other, in a loop bounded by ``--calls`` per reader and ``--seconds`` per target; ``--cli`` more through the
``shardkeeper`` command. Counted per reader:

- failures: an exception other than CheckpointRetired out of a reader (export and convert raise that, one line,
  when the checkpoint went while they read it) -- for the CLI, a non-zero exit that is not a one-line "retired";
- tracebacks: a traceback or "internal error" printed (CLI) or an exception that is no ShardkeeperError;
- wrong verdicts: a validation that is neither valid nor retired, a status whose checkpoint and step disagree;
- lineage: validate events recorded for a vanished checkpoint (``valid=false``), exports done but not recorded;
- retired: answers that said, correctly, that the checkpoint was retired while read.

Prints a markdown table and keeps it as bench/results/readers.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchlib import md_table, publish  # noqa: E402

READERS = ("status", "scan", "lineage", "validate", "validate --deep", "export")


def train_source(work: Path) -> Path:
    from shardkeeper.config import load_run_spec
    from shardkeeper.stages import plan_topology, train_segment

    spec = load_run_spec(ROOT / "configs" / "tiny.yaml", ["checkpoint.interval=1", "checkpoint.keep_last=10"])
    run = work / "source"
    res = train_segment(spec, run, plan_topology(spec, 2, device="cpu"), 3)
    if res.status != "completed":
        sys.exit(f"training the source run failed: {res.failure}")
    return run


class Tally:
    def __init__(self) -> None:
        self.rows: dict[str, Counter[str]] = {}

    def add(self, reader: str, what: str, n: int = 1) -> None:
        self.rows.setdefault(reader, Counter())[what] += n

    def call(self, reader: str, fn: Any, *, verdict: bool = False) -> Any:
        """``fn()``, counted; ``verdict``: the caller counts the answer (valid or retired) itself."""
        from schemas.errors import CheckpointRetired, ShardkeeperError

        self.add(reader, "calls")
        try:
            out = fn()
            if not verdict:
                self.add(reader, "valid")
            return out
        except CheckpointRetired:
            self.add(reader, "retired")
        except ShardkeeperError as e:
            self.add(reader, "failures")
            self.note(reader, e)
        except Exception as e:  # noqa: BLE001 - counted: a reader that raises this prints a traceback
            self.add(reader, "failures")
            self.add(reader, "tracebacks")
            self.note(reader, e)
        return None

    def note(self, reader: str, e: BaseException) -> None:
        if self.rows[reader]["failures"] <= 3:
            print(f"  {reader}: {type(e).__name__}: {e}", file=sys.stderr)
            if not hasattr(e, "exit_code"):
                traceback.print_exception(e, limit=4, file=sys.stderr)


# ------------------------------------------------------------------------------------------ local
def local_readers(source: Path, work: Path, args: argparse.Namespace, tally: Tally) -> dict[str, int]:
    from ckpt.commit.lineage import read_events
    from shardkeeper import stages
    from tests.reliability.livewriter import LiveWriter, new_live_run, templates_of

    run = new_live_run(source, work / "runs" / "live")
    rng = random.Random(0)
    exports = 0
    with LiveWriter(run, templates_of(source), keep=2, quarantine_every=4, pause_s=args.pause) as writer:
        t0 = time.monotonic()
        for i in range(args.calls):
            if time.monotonic() - t0 > args.seconds:
                break
            st = tally.call("status", lambda: stages.run_state(run))
            if st is not None and (st.checkpoint is None or Path(st.checkpoint).name != f"step-{st.step:08d}"):
                tally.add("status", "wrong verdicts")
            tally.call("scan", lambda: stages.scan_runs(str(run.parent), []))
            tally.call("lineage", lambda: read_events(run))
            # quick validation of any step, committed or not at the moment; the slower readers take the newest
            # one status reported (what a user does), which the writer retires two commits later
            path = run / "checkpoints" / f"step-{rng.randint(1, 3):08d}"
            newest = Path(st.checkpoint) if st is not None and st.checkpoint else path
            for reader, deep, every, target in (
                ("validate", False, 1, path),
                ("validate --deep", True, args.deep_every, newest),
            ):
                if i % every:
                    continue
                report = tally.call(reader, lambda: stages.validate_checkpoint(target, deep=deep), verdict=True)  # noqa: B023
                if report is not None:
                    tally.add(reader, "retired" if report.retired else "valid" if report.valid else "wrong verdicts")
            if i % args.export_every == 0:
                out = work / "exports" / f"e{i}"
                if tally.call("export", lambda: stages.export_and_record(newest, out)) is not None:  # noqa: B023
                    exports += 1
                shutil.rmtree(out, ignore_errors=True)
        seconds = time.monotonic() - t0
    events = read_events(run)
    tally.add("validate --deep", "lineage", sum(e.kind == "validate" and not e.data.get("valid") for e in events))
    tally.add("export", "lineage", exports - sum(e.kind == "export" for e in events))
    cli_readers(run, work, args, tally, source)
    return {
        "committed": writer.committed,
        "retired": writer.retired,
        "quarantined": writer.quarantined,
        "seconds": round(seconds),
    }


def cli_readers(run: Path, work: Path, args: argparse.Namespace, tally: Tally, source: Path) -> None:
    from tests.reliability.livewriter import LiveWriter, templates_of

    if not args.cli:
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    calls = [
        ["status", str(run)],
        ["validate", str(run / "checkpoints" / "step-00000002")],
        ["lineage", str(run)],
        ["export", str(run / "checkpoints" / "step-00000003"), str(work / "cli-export")],
    ]
    shutil.rmtree(run / "checkpoints")  # a fresh writer: it starts from an empty checkpoints/
    (run / "checkpoints").mkdir()
    with LiveWriter(run, templates_of(source), keep=2, pause_s=args.pause):
        for i in range(args.cli):
            cmd = calls[i % len(calls)]
            shutil.rmtree(work / "cli-export", ignore_errors=True)
            p = subprocess.run(
                [sys.executable, "-m", "shardkeeper", *cmd],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
                timeout=300,
            )
            reader = f"CLI {cmd[0]}"
            tally.add(reader, "calls")
            err = p.stderr
            if "Traceback" in err or "internal error" in err:
                tally.add(reader, "tracebacks")
            if "corrupted" in err or "check the path" in err:
                tally.add(reader, "wrong verdicts")
            if p.returncode == 0:
                tally.add(reader, "valid")
            elif p.returncode == 4 and "retired" in err and len(err.strip().splitlines()) == 1:
                tally.add(reader, "retired")
            else:
                tally.add(reader, "failures")
                print(f"  {reader}: exit {p.returncode}: {err.strip()[-300:]}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ s3
def start_moto() -> tuple[subprocess.Popen, str] | None:
    binary = Path(sys.executable).with_name("moto_server")
    exe = str(binary) if binary.exists() else shutil.which("moto_server")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    return None


class S3Writer(threading.Thread):
    """Pushes the templates in turn to ``url`` and retires the oldest push as the store's retention does
    (``RemoteRun.apply_retention``: the manifest first, then the files), keeping 2."""

    def __init__(self, url: str, templates: dict[int, Path], cache: Path) -> None:
        super().__init__(name="s3-writer", daemon=True)
        from ckpt.store.objstore import RemoteRun

        self.remote = RemoteRun(url, cache=cache)
        self.templates = templates
        self.pushed = self.retired = 0
        self.error: BaseException | None = None
        self.halt = threading.Event()
        for name in ("run.yaml", "lineage.jsonl", "segments.jsonl"):
            src = next(iter(templates.values())).parent.parent / name
            self.remote.fs.pipe_file(self.remote.key(name), src.read_bytes())

    def run(self) -> None:
        from ckpt.commit import lineage

        try:
            steps = sorted(self.templates)
            live: list[int] = []
            i = 0
            while not self.halt.is_set():
                step = steps[i % len(steps)]
                i += 1
                self.remote.push_checkpoint(self.templates[step])
                self.pushed += 1
                live.append(step)
                # the lineage names every checkpoint the writer committed (what the trainer records)
                self.remote.fs.pipe_file(
                    self.remote.key("lineage.jsonl"),
                    self.remote.fs.cat_file(self.remote.key("lineage.jsonl"))
                    + (
                        lineage.LineageEvent(
                            id=lineage.checkpoint_event_id(step), kind="checkpoint", time=lineage.now_iso(), step=step
                        ).model_dump_json()
                        + "\n"
                    ).encode(),
                )
                while len(live) > 2:
                    self.retire(live.pop(0))
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def retire(self, step: int) -> None:
        from ckpt.commit.layout import step_dir_name
        from schemas import MANIFEST_NAME

        rel = f"checkpoints/{step_dir_name(step)}"
        names = sorted(self.remote.checkpoint_objects().get(step, {}))
        self.remote.fs.rm_file(self.remote.key(f"{rel}/{MANIFEST_NAME}"))
        rest = [self.remote.key(f"{rel}/{n}") for n in names if n != MANIFEST_NAME]
        if rest:
            self.remote.fs.rm(rest)
        self.retired += 1


def s3_readers(source: Path, work: Path, args: argparse.Namespace, tally: Tally) -> dict[str, int] | None:
    started = start_moto()
    if started is None:
        print("moto_server not found: s3 rows skipped (pip install 'moto[server]')", file=sys.stderr)
        return None
    proc, endpoint = started
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": endpoint,
        "SHARDKEEPER_CACHE": str(work / "reader-cache"),
    }
    os.environ.update(env)
    try:
        import boto3

        from ckpt.commit.layout import RunDir
        from ckpt.commit.lineage import read_events
        from ckpt.store.objstore import cache_dir
        from shardkeeper import stages
        from tests.reliability.livewriter import templates_of

        bucket = f"readers-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/run"
        writer = S3Writer(url, templates_of(source), work / "writer-cache")
        writer.start()
        rng = random.Random(1)
        t0 = time.monotonic()
        n = max(1, args.calls // args.s3_fraction)
        for i in range(n):
            if time.monotonic() - t0 > args.seconds or writer.error is not None:
                break
            st = tally.call("s3 status", lambda: stages.run_state(url))
            if st is not None and st.checkpoint is not None and not st.checkpoint.endswith(f"step-{st.step:08d}"):
                tally.add("s3 status", "wrong verdicts")
            tally.call("s3 scan", lambda: stages.scan_runs(f"s3://{bucket}", []))
            ckpt = f"{url}/checkpoints/step-{rng.randint(1, 3):08d}"
            report = tally.call("s3 validate", lambda: stages.validate_checkpoint(ckpt), verdict=True)  # noqa: B023
            if report is not None:
                tally.add("s3 validate", "retired" if report.retired else "valid" if report.valid else "wrong verdicts")
                if not report.valid and not report.retired:
                    print(f"  s3 validate: {report.errors[0]}", file=sys.stderr)
            if i % args.deep_every == 0:
                report = tally.call(
                    "s3 validate --deep",
                    lambda: stages.validate_checkpoint(ckpt, deep=True),  # noqa: B023
                    verdict=True,
                )
                if report is not None:
                    tally.add(
                        "s3 validate --deep",
                        "retired" if report.retired else "valid" if report.valid else "wrong verdicts",
                    )
        seconds = time.monotonic() - t0
        writer.halt.set()
        writer.join(60)
        if writer.error is not None:
            print(f"  s3 writer failed: {writer.error!r}", file=sys.stderr)
        events = read_events(RunDir.at(cache_dir(url)))
        tally.add(
            "s3 validate --deep", "lineage", sum(e.kind == "validate" and not e.data.get("valid") for e in events)
        )
        return {"committed": writer.pushed, "retired": writer.retired, "quarantined": 0, "seconds": round(seconds)}
    finally:
        proc.terminate()
        proc.wait(10)
        for k in env:
            os.environ.pop(k, None)


# ------------------------------------------------------------------------------------------ main
COLUMNS = ("calls", "valid", "retired", "failures", "tracebacks", "wrong verdicts", "lineage")


def table(tally: Tally) -> str:
    rows = []
    for reader, c in tally.rows.items():
        rows.append([reader, *(c[k] for k in COLUMNS)])
    total = [sum(r[i] for r in rows) for i in range(1, len(COLUMNS) + 1)]
    rows.append(["**all**", *(f"**{t}**" for t in total)])
    return md_table(
        [
            "reader",
            "calls",
            "valid / ok",
            "retired (said so)",
            "failures",
            "tracebacks",
            "wrong verdicts",
            "lineage entries for vanished / missing",
        ],
        rows,
        "lrrrrrrr",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--calls",
        type=int,
        default=300,
        help="loop iterations against the local run (each: status, "
        "scan, lineage, validate; --deep and export every few)",
    )
    ap.add_argument("--seconds", type=float, default=120.0, help="bound on each loop's time")
    ap.add_argument("--deep-every", type=int, default=3)
    ap.add_argument("--export-every", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds the writer waits after each commit+retire")
    ap.add_argument("--cli", type=int, default=8, help="CLI calls (status, validate, lineage, export in turn)")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--s3-fraction", type=int, default=6, help="s3 iterations: --calls divided by this")
    ap.add_argument("--source", type=Path, help="a run with committed checkpoints at steps 1-3 (else trained here)")
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    import logging

    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="readers-bench-") as tmp:
        work = Path(tmp)
        source = args.source or train_source(work)
        tally = Tally()
        local = local_readers(source, work, args, tally)
        s3 = None if args.no_s3 else s3_readers(source, work / "s3", args, tally)
    writers = [
        f"local: {local['committed']} commits, {local['retired']} retired, {local['quarantined']} quarantined "
        f"in {local['seconds']} s of in-process reading"
    ]
    if s3 is not None:
        writers.append(
            f"s3:// (moto_server on 127.0.0.1): {s3['committed']} pushes, {s3['retired']} retired by the "
            f"store's retention in {s3['seconds']} s"
        )
    body = (
        "Readers against a live writer that commits a checkpoint and retires one at every step (a copy of a "
        "real 3-step tiny run's checkpoints; retention's rename + rmtree, every 4th quarantined). "
        + "; ".join(writers)
        + ". Counts per reader; a correct answer is a valid result or a one-line "
        '"retired" (the checkpoint went while it was read); the rule is 0 in the last four columns.\n\n' + table(tally)
    )
    publish("readers", body)


if __name__ == "__main__":
    main()
