"""Kill targets of the torture beyond one local run directory (used by ``bench/torture.py``):

- **conversion**: a 2-rank DeepSpeed checkpoint resumed on 1 rank is converted by rank 0 to
  ``step-X/universal/`` first; the segment is SIGKILLed (CLI, group, torchrun or the converting rank)
  while ``universal.partial-*`` exists. A half-converted checkpoint must never be used (``universal/``
  exists only whole: it passes ``validate --deep``), and the next resume must convert again. Every chain
  ends with an uninterrupted 1-rank segment compared bitwise with a reference that resumed the same
  checkpoint on 1 rank without a kill.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from tests.reliability.torture_lib import CONFIGS, TARGETS, Torture, read_metrics

CONVERT_BASE_STEP = 6  # the 2-rank DeepSpeed checkpoint every conversion chain resumes on 1 rank
CONVERT_END = 12  # each 1-rank segment trains to here


def _lineage_size(run_dir: Path) -> int:
    try:
        return (run_dir / "lineage.jsonl").stat().st_size
    except FileNotFoundError:
        return 0


def _reshard_since(run_dir: Path, offset: int) -> bool:
    import json

    with open(run_dir / "lineage.jsonl", "rb") as f:
        f.seek(offset)
        raw = f.read().decode("utf-8", "replace")
    for line in raw.splitlines():
        try:
            if json.loads(line).get("kind") == "reshard":
                return True
        except json.JSONDecodeError:
            pass
    return False


def convert_base(h: Torture) -> Path:
    """A 2-rank DeepSpeed run to CONVERT_BASE_STEP (once), and the 1-rank reference resumed from it."""
    if "deepspeed-ws1" in h.refs:
        return h.work / "convert-base"
    cfg2, cfg1 = CONFIGS["deepspeed"], CONFIGS["deepspeed-ws1"]
    base = h.work / "convert-base"
    t0 = time.monotonic()
    ln = h.launch(base, cfg2, CONVERT_BASE_STEP, "convert-base")
    code = ln.wait(900)
    ln.close()
    if code != 0:
        raise RuntimeError(f"conversion base run {base} exited {code}; see {ln.log_path}")
    ref = h.work / "ref-deepspeed-ws1"
    shutil.copytree(base, ref)
    ln = h.launch(ref, cfg1, CONVERT_END, "ref-deepspeed-ws1")
    code = ln.wait(900)
    ln.close()
    if code != 0 or not _reshard_since(ref, 0):  # (retention deleted the converted step-6 since)
        raise RuntimeError(f"1-rank reference {ref} exited {code} without converting; see {ln.log_path}")
    h.refs["deepspeed-ws1"] = ref
    h.ref_metrics["deepspeed-ws1"] = read_metrics(ref)
    h.log(
        f"conversion base (2 ranks to {CONVERT_BASE_STEP}) and 1-rank reference to {CONVERT_END}: "
        f"{time.monotonic() - t0:.1f} s"
    )
    return base


def convert_chain(h: Torture, index: int, n_kills: int, deadline: float) -> dict:
    """Up to ``n_kills`` launches on 1 rank killed while rank 0 converts, then an uninterrupted finish."""
    cfg = CONFIGS["deepspeed-ws1"]
    base = convert_base(h)
    run_dir = h.work / f"convert-{index}"
    shutil.copytree(base, run_dir)
    udir = run_dir / "checkpoints" / f"step-{CONVERT_BASE_STEP:08d}" / "universal"
    chain: dict[str, Any] = {"name": run_dir.name, "config": cfg.name, "kills": 0, "launches": 0}
    expected = CONVERT_BASE_STEP
    must_convert = False  # the previous launch was killed before its conversion committed
    for _ in range(n_kills):
        if time.monotonic() > deadline or (udir / "manifest.json").exists() or expected != CONVERT_BASE_STEP:
            break  # nothing left to convert in this run dir
        offset = _lineage_size(run_dir)
        expected = h.one_kill(run_dir, cfg, expected, chain, h.rng.choice(TARGETS), "convert", until=CONVERT_END)
        rec = h.stats.kills[-1]
        chain["launches"] += 1
        chain["kills"] += int(rec["killed"])
        _universal_checks(h, rec, udir, run_dir, offset, must_convert)
        must_convert = not (udir / "manifest.json").exists()
    offset = _lineage_size(run_dir)
    h.finish_chain(run_dir, cfg, expected, chain, end=CONVERT_END)
    if must_convert and expected == CONVERT_BASE_STEP:
        chain["reconverted"] = _reshard_since(run_dir, offset)
        if not chain["reconverted"]:
            h.stats.notes.append(
                f"{run_dir.name}: the finishing segment resumed a killed conversion without converting"
            )
    return chain


def _universal_checks(h: Torture, rec: dict, udir: Path, run_dir: Path, offset: int, must_convert: bool) -> None:
    """After a launch of a conversion chain: ``universal/`` is whole or absent; a launch after a killed
    conversion that loaded the checkpoint converted again."""
    from ckpt.validate.checks import validate

    rec["universal_committed"] = (udir / "manifest.json").exists()
    rec["universal_partials"] = len(list(udir.parent.glob("universal.partial-*")))
    if udir.exists():
        try:
            rep = validate(udir, deep=True)
            ok, why = rep.valid, (rep.errors[0] if rep.errors else "")
        except Exception as e:  # noqa: BLE001 - a crash of the validator on a torn file is itself a finding
            ok, why = False, f"validate raised {type(e).__name__}: {e}"
        if not ok:
            rec["torn_universal"] = why
    if rec.get("killed"):
        rec["moment"] = "convert:mid" if not rec["universal_committed"] else "convert:after-commit"
    if must_convert:  # killed at a fresh universal.partial-*, or a conversion recorded: it converted again
        rec["reconverted"] = bool(rec.get("killed")) or _reshard_since(run_dir, offset)


# --------------------------------------------------------------------------- S3 upload
CKPT_BYTES = 1.6e6  # the tiny model's FSDP2 checkpoint (2 ranks), about
S3_RATE = 800_000  # bytes/s from the CLI to the store (tests/throttle.py): a ~1.6 MB checkpoint takes ~2 s to go up


class S3Store:
    """The S3-protocol server tests/test_s3.py uses (moto_server on loopback), one bucket for the torture.
    Its AWS variables are set in this process too (the in-process listing checks use them, straight to the
    server). The CLI reaches it through a throttling forwarder (``rate`` bytes/s up, tests/throttle.py; 0: none),
    so that a checkpoint's upload lasts long enough for a kill to land mid-transfer, as on a slow link."""

    def __init__(self, rate: float = S3_RATE) -> None:
        import os
        import socket
        import subprocess
        import sys
        import uuid

        from tests.harness import free_port

        binary = Path(sys.executable).with_name("moto_server")
        port = free_port()
        self.proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.1)
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        }
        os.environ.update(self.env)
        self.bucket = f"torture-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=self.bucket)
        self.proxy = None
        self.cli_env = dict(self.env)  # the launches' environment: through the forwarder
        if rate:
            from tests.throttle import ThrottledProxy

            self.proxy = ThrottledProxy(self.env["AWS_ENDPOINT_URL"], rate)
            self.cli_env["AWS_ENDPOINT_URL"] = self.proxy.url

    def client(self) -> Any:
        import boto3

        return boto3.client("s3")

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:  # noqa: BLE001
            self.proc.kill()

    def objects(self, prefix: str) -> dict[int, dict[str, tuple[int, float]]]:
        """step -> {file: (size, last-modified Unix time)} under ``prefix/checkpoints/``."""
        out: dict[int, dict[str, tuple[int, float]]] = {}
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{prefix}/checkpoints/")
        )
        for page in pages:
            for o in page.get("Contents", []):
                head, _, name = o["Key"][len(prefix) + len("/checkpoints/") :].partition("/")
                if head.startswith("step-") and head[5:].isdigit() and name:
                    out.setdefault(int(head[5:]), {})[name] = (o["Size"], o["LastModified"].timestamp())
        return out

    def newest_whole(self, prefix: str) -> int:
        """Newest step whose manifest is there with every file it names at its size (0: none)."""
        import json

        objs = self.objects(prefix)
        for step in sorted((s for s, f in objs.items() if "manifest.json" in f), reverse=True):
            key = f"{prefix}/checkpoints/step-{step:08d}/manifest.json"
            try:
                man = json.loads(self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())
            except Exception:  # noqa: BLE001 - retired between the listing and the read
                continue
            if all(objs[step].get(e["path"], (None,))[0] == e["size"] for e in man["files"]):
                return step
        return 0


def _object_set(objs: dict[int, dict[str, tuple[int, float]]]) -> set[tuple[int, str, int, float]]:
    return {(step, name, size, t) for step, files in objs.items() for name, (size, t) in files.items()}


def _uploading(objs: dict[int, dict[str, tuple[int, float]]], before: set[tuple[int, str, int, float]]) -> set[int]:
    """Steps without a manifest with an object that was not there at the launch (a half upload of this launch;
    one that a kill before it left is not)."""
    return {
        step
        for step, files in objs.items()
        if "manifest.json" not in files
        and any((step, name, size, t) not in before for name, (size, t) in files.items())
    }


def _upload_probe(store: S3Store, prefix: str, before: set[tuple[int, str, int, float]], nth: int = 1) -> Any:
    """The "upload" window: the ``nth`` step directory of this launch seen without its manifest yet (a second
    one: the first upload of the launch may complete, so the store's resume point moves on). Through the
    forwarder an upload lasts seconds: the kill then comes at a random point of the next half of a checkpoint's
    transfer time (``spread_s``), and not at a local commit (``throttled``: the upload is what is waited for)."""
    last = [0.0]
    steps: set[int] = set()

    def seen() -> bool:
        now = time.monotonic()
        if now - last[0] < 0.02:
            return False
        last[0] = now
        steps.update(_uploading(store.objects(prefix), before))
        return len(steps) >= nth

    if store.proxy is not None:
        seen.throttled = True  # type: ignore[attr-defined]
        seen.spread_s = 0.5 * CKPT_BYTES / store.proxy.rate  # type: ignore[attr-defined]
    return seen


def s3_chain(h: Torture, store: S3Store, index: int, n_kills: int, deadline: float) -> dict:
    """A run directory on s3:// (the ranks write its local cache; the CLI's uploader pushes each checkpoint,
    manifest last, through a link of ``S3_RATE``; a checkpoint every 10 steps, so the uploads keep up with the
    commits: every 2 steps, each ~2 s upload would be overtaken by the local retention of its checkpoint).
    Each launch starts with the cache's checkpoints removed, so it resumes from the store (as on another machine); the
    CLI (or its whole group) is SIGKILLed while a checkpoint is half uploaded. The store must never list a step without
    its manifest, and the next segment must resume from the newest whole checkpoint there; the chain ends with an
    uninterrupted segment compared bitwise."""
    cfg = CONFIGS["fsdp2-s3"]
    prefix = f"s3-chain-{index}"
    cache = h.work / f"s3-cache-{index}"
    run_dir = cache / "s3" / store.bucket / prefix
    env = {**store.cli_env, "SHARDKEEPER_CACHE": str(cache), "SHARDKEEPER_UPLOAD_POLL_S": "0.05"}
    at_launch: dict[str, set] = {"objects": set()}  # the store's objects before the next launch
    h.remotes[run_dir] = (
        f"s3://{store.bucket}/{prefix}",
        env,
        lambda: _upload_probe(store, prefix, at_launch["objects"], h.rng.randint(1, 2)),
    )
    chain: dict[str, Any] = {"name": f"s3-{index}", "config": cfg.name, "kills": 0, "launches": 0, "remote": True}
    h.reference(cfg, wait=False)
    expected = 0
    for _ in range(n_kills):
        if time.monotonic() > deadline or expected >= h.final - 4:
            break
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # resume from the store, not the cache
        expected = store.newest_whole(prefix)
        at_launch["objects"] = _object_set(store.objects(prefix))
        h.one_kill(run_dir, cfg, expected, chain, h.rng.choice(("cli", "group")), "upload")
        rec = h.stats.kills[-1]
        chain["launches"] += 1
        chain["kills"] += int(rec["killed"])
        _remote_checks(rec, store, prefix, f"s3://{store.bucket}/{prefix}", chain, at_launch["objects"])
        expected = store.newest_whole(prefix)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    h.finish_chain(run_dir, cfg, store.newest_whole(prefix), chain)
    return chain


def _remote_checks(
    rec: dict, store: S3Store, prefix: str, url: str, chain: dict, before: set[tuple[int, str, int, float]]
) -> None:
    """The store after a launch. The resume point of an s3:// run is the store (each launch starts from an empty
    cache): "no valid checkpoint left" is judged there -- none whole after one was -- not in the cache, where a
    launch killed before its first local commit leaves nothing while the store still holds the resume point."""
    from ckpt.store.objstore import RemoteRun

    objs = store.objects(prefix)
    with_manifest = {s for s, f in objs.items() if "manifest.json" in f}
    remote = RemoteRun(url)
    listed = remote.committed_steps()
    rec["remote_listed_without_manifest"] = sorted(set(listed) - with_manifest)
    rec["remote_half_uploaded"] = sorted(_uploading(objs, before))  # this launch's (an earlier kill's stay too)
    newest = store.newest_whole(prefix)
    found = remote.latest_committed()
    rec["remote_newest_whole"] = newest
    chain["store_ever_whole"] = chain.get("store_ever_whole", False) or newest > 0
    rec["cache_no_valid_left"] = rec.get("no_valid_left", False)
    rec["no_valid_left"] = chain["store_ever_whole"] and newest == 0
    if store.proxy is not None:
        rec["upload_rate"] = store.proxy.rate
    if (found[0] if found else 0) != newest:
        rec["remote_listed_without_manifest"].append(f"newest {found[0] if found else 0} != whole {newest}")
        rec["remote_mismatch"] = _mismatch(remote, newest, objs)
    if rec.get("killed"):
        rec["moment"] = "upload:mid" if rec["remote_half_uploaded"] else "upload:none-in-flight"


def _mismatch(remote: Any, step: int, objs: dict) -> dict:
    """Why the shardkeeper reader did not take the store's newest whole checkpoint (for the record)."""
    out: dict[str, Any] = {
        "listed": remote.committed_steps(),
        "boto3_files": {n: v[0] for n, v in objs.get(step, {}).items()},
    }
    try:
        man = remote.manifest(step)
        out["reader_files"] = remote.checkpoint_objects().get(step)
        out["check_sizes"] = remote.check_sizes(step, man, out["reader_files"] or {})
    except Exception as e:  # noqa: BLE001
        out["manifest_error"] = f"{type(e).__name__}: {e}"
    return out


# --------------------------------------------------------------------------- Slurm
# not tests/test_slurm.py's: a test session beside the torture keeps its own cluster
SLURM_PORT = int(__import__("os").environ.get("SHARDKEEPER_TORTURE_SLURM_PORT", "26817"))


class SlurmCluster:
    """Real slurmctld + 2 slurmd (infra.slurm_local, as tests/test_slurm.py starts them) on loopback."""

    def __init__(self, work: Path) -> None:
        import os

        from infra import slurm_local

        why = slurm_local.available()
        if why:
            raise RuntimeError(f"real Slurm daemons: {why}")
        self.dir = work / "slurm-cluster"
        self.conf = slurm_local.start(self.dir, nodes=2, cpus=2, port=SLURM_PORT)
        pid_file = self.dir / "slurmctld.pid"
        pid = int(pid_file.read_text().strip() or 0) if pid_file.exists() else 0
        if not pid or not Path(f"/proc/{pid}").exists():  # another cluster answered on the port; ours died
            raise RuntimeError(
                f"slurmctld of {self.dir} is not running (port {SLURM_PORT} taken?); see {self.dir}/log/slurmctld.log"
            )
        self.env = {"SLURM_CONF": str(self.conf), "SHARDKEEPER_SLURM_UNPLACEABLE_S": "3"}
        self.proc_env = {**os.environ, **self.env}

    def run(self, *argv: str) -> str:
        import subprocess

        return subprocess.run(list(argv), env=self.proc_env, capture_output=True, text=True, timeout=60).stdout

    def job_of(self, ln: Any) -> str | None:
        import re

        m = re.search(r"submitted Slurm job (\d+)", ln.log_path.read_text(errors="replace"))
        return m.group(1) if m else None

    def scancel_kill(self, ln: Any) -> bool:
        """``scancel -s KILL``: SIGKILL to every step of the job (torchrun and the ranks under srun)."""
        job = self.job_of(ln)
        if job is None:
            return False
        self.run("scancel", "-s", "KILL", job)
        return True

    def node_down(self, ln: Any) -> bool:
        """Node n2 drained and taken down mid-run (a node lost): Slurm kills the job's processes on it."""
        if self.job_of(ln) is None:
            return False
        self.run("scontrol", "update", "nodename=n2", "state=drain", "reason=torture")
        self.run("scontrol", "update", "nodename=n2", "state=down", "reason=torture")
        return True

    def nodes_back(self) -> None:
        from infra import slurm_local

        slurm_local.resume_all_nodes(self.conf)

    def no_jobs_left(self) -> list[str]:
        return (
            self.run("squeue", "-h", "-o", "%i %T").split("\n") if self.run("squeue", "-h", "-o", "%i").strip() else []
        )

    def close(self) -> None:
        from infra import slurm_local

        for job in self.run("squeue", "-h", "-o", "%i").split():
            self.run("scancel", job)
        slurm_local.stop(self.dir)


def slurm_chain(h: Torture, cluster: SlurmCluster, index: int, n_kills: int, deadline: float) -> dict:
    """A run on 2 Slurm nodes x 1 rank (the 2-rank reference's world size and bits): the job SIGKILLed by
    ``scancel -s KILL`` or its second node taken down (drained, then down) at a random moment; the node
    comes back before the next launch. Ends with an uninterrupted segment compared bitwise."""
    cfg = CONFIGS["fsdp2-slurm"]
    folder = h.work / "slurm-runs"
    folder.mkdir(exist_ok=True)
    h.dir_env[folder] = cluster.env
    h.kill_hooks.update({"scancel": cluster.scancel_kill, "node-down": cluster.node_down})
    run_dir = folder / f"slurm-{index}"
    chain: dict[str, Any] = {"name": run_dir.name, "config": cfg.name, "kills": 0, "launches": 0}
    h.reference(CONFIGS["fsdp2-async"], wait=False)
    expected = 0
    from tests.reliability.torture_lib import WINDOWS, _weighted

    for i in range(n_kills):
        if time.monotonic() > deadline or expected >= h.final - 4:
            break
        window = _weighted(h.rng, {k: v for k, v in WINDOWS.items() if k != "startup"})
        expected = h.one_kill(run_dir, cfg, expected, chain, ("scancel", "node-down")[i % 2], window)
        rec = h.stats.kills[-1]
        cluster.nodes_back()
        rec["jobs_left"] = [j for j in cluster.no_jobs_left() if j.strip()]
        chain["launches"] += 1
        chain["kills"] += int(rec["killed"])
    h.finish_chain(run_dir, cfg, expected, chain)
    return chain
