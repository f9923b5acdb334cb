"""Reliability torture: kill and preempt real multi-rank segments through the real CLI, and count
what must never happen (torn checkpoints accepted, orphaned processes, a second writer, an
inexact resume, completed steps lost, a leaked secret).

Used by ``bench/torture.py`` (the full torture and its figures) and by
``tests/reliability/test_kill_torture.py`` (a CI-sized subset). No test imports another test module:
everything shared lives here.

Each segment is ``python -m shardkeeper train ... --nproc 2`` started in its own session (as a job
scheduler starts a job), so the harness can kill the CLI, its process group, torchrun (the CLI's
child running ``torch.distributed.run``) or one rank (a grandchild running ``trainer.segment``).
Kill moments are chosen by polling the checkpoint directory: a fresh ``step-*.partial`` (save), a
manifest inside it or a new committed step (commit), a ``.deleting`` directory or the commit that
retention follows (retention), the first metrics line (training) or the ranks' start-up.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
TARGETS = ("cli", "group", "torchrun", "rank")
WINDOWS = {"startup": 0.15, "train": 0.25, "save": 0.25, "commit": 0.2, "retention": 0.15}
ORPHAN_DEADLINE_S = 5.0  # after the lock holder (the CLI) is gone, nothing of its segment may run longer
# A CLI that survived a kill of its torchrun or a rank reads their last output, validates and records the
# segment, then exits: within TEARDOWN_FACTOR times its own start-up in the same launch (import, config,
# preflight: the same kind of work, slowed alike by a loaded machine), and never less than ORPHAN_DEADLINE_S.
TEARDOWN_FACTOR = 4.0
LAUNCHER_CAP_S = 120.0  # a CLI still running this long after the kill is past any bound: stop waiting
EXIT_LOCKED = 3
from schemas.seam import EXIT_PREEMPTED

PREEMPT_CASES = ("train", "async-save", "commit", "startup", "repeat-term")


@dataclass(frozen=True)
class Cfg:
    """One chain configuration: backend and save mode (checkpoint every 2 steps, keep 2)."""

    name: str
    backend: str
    async_save: bool
    interval: int = 2
    keep_last: int = 2
    nproc: int = 2
    nodes: int = 1
    launcher: str = "local"

    def sets(self) -> list[str]:
        # restarts=0: a killed rank ends its segment, whose end and resume the torture judges (the restart in
        # place of a killed rank: tests/reliability/test_failure_attribution.py)
        s = [
            f"checkpoint.interval={self.interval}",
            f"checkpoint.keep_last={self.keep_last}",
            f"checkpoint.async_save={'true' if self.async_save else 'false'}",
            "checkpoint.restarts=0",
        ]
        if self.backend == "deepspeed":  # as tests/test_deepspeed.py runs it: ZeRO-2 on CPU
            s += ["backend=deepspeed", "deepspeed.zero_stage=2"]
        return s


CONFIGS = {
    "fsdp2-async": Cfg("fsdp2-async", "fsdp2", True),
    "fsdp2-sync": Cfg("fsdp2-sync", "fsdp2", False),
    "deepspeed": Cfg("deepspeed", "deepspeed", False),
    # a 2-rank DeepSpeed checkpoint resumed on 1 rank: rank 0 converts it to the universal layout first
    "deepspeed-ws1": Cfg("deepspeed-ws1", "deepspeed", False, nproc=1),
    # 2 Slurm nodes x 1 rank: the same world size (and the same bits) as 2 local ranks
    "fsdp2-slurm": Cfg("fsdp2-slurm", "fsdp2", True, nproc=1, nodes=2, launcher="slurm"),
    # a run directory on s3:// through a slow link (torture_targets.s3_chain): a checkpoint every 10 steps
    "fsdp2-s3": Cfg("fsdp2-s3", "fsdp2", True, interval=10),
}


def child_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    # where tests/test_deepspeed.py keeps DeepSpeed's compiled op: another folder would compile it again (~2 min)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# --------------------------------------------------------------------------- processes
@dataclass
class Proc:
    pid: int
    ctime: float
    role: str  # cli | torchrun | rank | other


def _role(p: psutil.Process, cli_pid: int) -> str:
    if p.pid == cli_pid:
        return "cli"
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "other"
    return "torchrun" if "torch.distributed.run" in cmd else "rank" if "trainer.segment" in cmd else "other"


def alive(pr: Proc) -> bool:
    try:
        p = psutil.Process(pr.pid)
        return p.create_time() == pr.ctime and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def referencing(run_dir: Path) -> list[Proc]:
    """Live processes (not this one) whose command line names the run directory or a path under it."""
    root = str(run_dir)
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        args = p.info["cmdline"] or []
        if any(a == root or a.startswith(root + "/") or a.endswith("=" + root) for a in args):
            out.append(Proc(p.pid, p.info["create_time"], "ref"))
    return out


class Launch:
    """One ``shardkeeper train`` segment in its own session, with every descendant it ever had."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Cfg,
        until: int,
        log_path: Path,
        extra_env: dict[str, str] | None = None,
        run_arg: str | None = None,
    ):
        """``run_dir``: the run directory on this machine (for s3://, ``run_arg``, the local cache the ranks write)."""
        self.run_dir, self.cfg, self.until, self.log_path = run_dir, cfg, until, log_path
        self.offsets = {n: _size(run_dir / n) for n in ("metrics.jsonl", "lineage.jsonl", "segments.jsonl")}
        self.at_launch = ckpt_scan(run_dir)
        self.convert_leftovers = set((run_dir / "checkpoints").glob("step-*/universal.partial-*"))
        cmd = [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--config",
            str(TINY),
            "--run-dir",
            run_arg or str(run_dir),
            "--nproc",
            str(cfg.nproc),
            "--until-step",
            str(until),
        ]
        if cfg.launcher != "local":
            cmd += ["--launcher", cfg.launcher, "--nodes", str(cfg.nodes)]
        for s in cfg.sets():
            cmd += ["--set", s]
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**child_env(), **(extra_env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.t0 = time.monotonic()
        self.procs: dict[int, Proc] = {}
        self.upload_seen: Callable[[], bool] | None = None  # the "upload" window's probe of the object store
        self.startup_s: float | None = (
            None  # spawn -> its torchrun seen running: the CLI's start-up on this machine now
        )
        self.refresh()

    def refresh(self) -> None:
        try:
            root = psutil.Process(self.popen.pid)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in found:
            try:
                if p.pid not in self.procs or self.procs[p.pid].role == "other":
                    self.procs[p.pid] = Proc(p.pid, p.create_time(), _role(p, self.popen.pid))
                    if self.startup_s is None and self.procs[p.pid].role == "torchrun":
                        self.startup_s = time.monotonic() - self.t0
            except psutil.NoSuchProcess:
                pass

    def live(self, role: str) -> list[Proc]:
        return [p for p in self.procs.values() if p.role == role and alive(p)]

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.refresh()

    def close(self) -> None:
        self.log.close()

    def new_lines(self, name: str) -> list[dict]:
        path = self.run_dir / name
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.offsets[name])
            raw = f.read().decode("utf-8", "replace")
        out = []
        for line in raw.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by SIGKILL mid-append
        return out

    def segment_index(self) -> int | None:
        starts = [r for r in self.new_lines("segments.jsonl") if r.get("event") == "start"]
        return starts[0]["segment"] if starts else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _descends(pid: int, root: int) -> bool:
    try:
        return any(q.pid == root for q in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def kill_all(procs: list[Proc], timeout: float = 30.0) -> list[Proc]:
    """SIGKILL every process still alive; return those that did not go within ``timeout``."""
    for p in procs:
        if alive(p):
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in procs):
        time.sleep(0.05)
    return [p for p in procs if alive(p)]


# --------------------------------------------------------------------------- checkpoint directory
@dataclass(frozen=True)
class Scan:
    partials: frozenset[tuple[str, int]]  # (name, inode): a re-created .partial is a new one
    partial_manifests: frozenset[tuple[str, int]]
    committed: frozenset[str]
    deleting: int


def ckpt_scan(run_dir: Path) -> Scan:
    parts, mans, done, deleting = set(), set(), set(), 0
    try:
        entries = list(os.scandir(run_dir / "checkpoints"))
    except FileNotFoundError:
        entries = []
    for e in entries:
        try:
            if e.name.endswith(".partial"):
                key = (e.name, e.inode())
                parts.add(key)
                if os.path.exists(os.path.join(e.path, "manifest.json")):
                    mans.add(key)
            elif e.name.endswith(".deleting"):
                deleting += 1
            elif (
                e.name.startswith("step-")
                and "." not in e.name
                and os.path.exists(os.path.join(e.path, "manifest.json"))
            ):
                done.add(e.name)
        except FileNotFoundError:
            pass
    return Scan(frozenset(parts), frozenset(mans), frozenset(done), deleting)


def wait_moment(ln: Launch, window: str, rng: random.Random, target: str, limit_s: float = 150.0) -> str | None:
    """Block until the chosen moment of the segment; the label of what was seen, or None if it ended first."""
    nth = rng.randint(1, 2)
    seen: set = set()
    fire_at: float | None = None
    label = window
    last_refresh = 0.0
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if ln.exited():
            return None
        now = time.monotonic()
        if now - last_refresh > 0.15:
            ln.refresh()
            last_refresh = now
        if fire_at is not None:
            if now >= fire_at:
                return label
        elif window == "startup":
            need = {"cli": "cli", "group": "cli", "torchrun": "torchrun", "rank": "rank"}[target]
            if ln.live(need):
                fire_at = now + rng.uniform(0.0, 2.5)
        elif window == "convert":  # rank 0 writing a fresh <step>/universal.partial-* (not one a kill left)
            if set((ln.run_dir / "checkpoints").glob("step-*/universal.partial-*")) - ln.convert_leftovers:
                fire_at = now
        elif window == "upload" and ln.upload_seen is not None:  # an upload in flight, no manifest yet
            if ln.upload_seen():  # (a throttled upload lasts seconds: a random point of it)
                fire_at = now + rng.uniform(0.0, getattr(ln.upload_seen, "spread_s", 0.0))
            elif not getattr(ln.upload_seen, "throttled", False) and _window_hit(
                ln, ckpt_scan(ln.run_dir), "commit", seen
            ):  # its push starts within the poll
                fire_at = now + rng.uniform(0.0, 0.3)
        elif window == "train":
            if _size(ln.run_dir / "metrics.jsonl") > ln.offsets["metrics.jsonl"]:
                fire_at = now + rng.uniform(0.0, 0.6)
        else:
            hit = _window_hit(ln, ckpt_scan(ln.run_dir), window, seen)
            if hit and len(seen) >= nth:
                label = hit
                fire_at = now + (rng.uniform(0.0, 0.05) if window == "save" else 0.0)
        time.sleep(0.002)
    return None


def _window_hit(ln: Launch, sc: Scan, window: str, seen: set) -> str | None:
    base = ln.at_launch
    fresh_parts = sc.partials - base.partials
    new_commits = sc.committed - base.committed
    if window == "save":
        new = {k for k in fresh_parts if k not in sc.partial_manifests} - seen
        seen |= new
        return "save" if new else None
    if window == "commit":
        new = (sc.partial_manifests - base.partial_manifests - seen) | ({("c", n) for n in new_commits} - seen)
        seen |= new
        return ("commit:manifest" if any(k[0] != "c" for k in new) else "commit:renamed") if new else None
    if sc.deleting:  # retention
        seen.add(("d", len(seen)))
        return "retention:deleting"
    new = {("c", n) for n in new_commits} - seen
    seen |= new
    return "retention:after-commit" if new and len(sc.committed) > ln.cfg.keep_last else None


@dataclass
class DirCheck:
    committed: list[int]
    valid: list[int]
    invalid: dict[int, str]
    partials: list[str]

    @property
    def expected_resume(self) -> int:
        return max(self.valid) if self.valid else 0

    @property
    def torn_latest(self) -> bool:
        return bool(self.committed) and max(self.committed) in self.invalid


def check_dir(run_dir: Path) -> DirCheck:
    """Deep-validate every committed checkpoint (in-process, as ``shardkeeper validate --deep``)."""
    from ckpt.commit.layout import RunDir, parse_step
    from ckpt.validate.checks import validate

    rd = RunDir.at(run_dir)
    committed, valid, invalid = [], [], {}
    for path in rd.committed():
        step = parse_step(path.name) or 0
        committed.append(step)
        try:
            rep = validate(path, deep=True)
            ok, why = rep.valid, (rep.errors[0] if rep.errors else "")
        except Exception as e:  # a crash of the validator on a torn file is itself a finding
            ok, why = False, f"validate raised {type(e).__name__}: {e}"
        if ok:
            valid.append(step)
        else:
            invalid[step] = why
    return DirCheck(committed, valid, invalid, [p.name for p in rd.partials()])


# --------------------------------------------------------------------------- reference and comparison
def read_metrics(run_dir: Path) -> dict[int, tuple[float, float]]:
    out = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[r["step"]] = (r["loss"], r["grad_norm"])
    return out


def compare_final(a: Path, b: Path) -> list[str]:
    """Differences between two checkpoints' stored state: every DCP tensor bitwise, or the DeepSpeed
    manifest fingerprint exactly (per-tensor float64 norms of weights and both AdamW moments)."""
    import torch

    from ckpt.commit.manifest import read_manifest

    ma, mb = read_manifest(a), read_manifest(b)
    if ma.format != mb.format or ma.step != mb.step:
        return [f"format/step {ma.format}/{ma.step} vs {mb.format}/{mb.step}"]
    if ma.format == "deepspeed":
        fa, fb = ma.fingerprint.model_dump(), mb.fingerprint.model_dump()
        return [f"fingerprint {k} differs" for k in ("model", "optim", "optim_step") if fa[k] != fb[k]]
    from ckpt.formats.dcp.reader import DCPTensorReader

    diffs = []
    with DCPTensorReader(a) as ra, DCPTensorReader(b) as rb:
        ka, kb = set(ra.tensor_keys()), set(rb.tensor_keys())
        if ka != kb:
            diffs.append(f"tensor keys differ: {sorted(ka ^ kb)[:3]}")
        for k in sorted(ka & kb):
            x, y = ra.read(k), rb.read(k)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                diffs.append(f"{k} differs")
    return diffs


# --------------------------------------------------------------------------- records
SLURM_TARGETS = ("scancel", "node-down")
PREEMPT_SPAN = 10  # a preemption case's segment trains at most this many steps past its resume point


def slurm_kill_wait(target: str | None) -> float:
    """What a Slurm kill adds to the CLI's teardown bound: the CLI returns only once no rank of the job runs, and
    slurmd kills a cancelled job's steps up to KillWait after it ended in Slurm's books (the local cluster's
    setting); a local kill adds nothing."""
    from infra.slurm_local import KILL_WAIT_S

    return float(KILL_WAIT_S) if target in SLURM_TARGETS else 0.0


def completed_in_last_steps(p: dict) -> bool:
    """A SIGTERM that reached a segment in its last steps: the ranks agree on a stop one step after it arrives,
    so a segment signalled within two steps of its end completes its until-step, commits it and exits 0 -- the
    right end (nothing left to preempt, no step lost), not a wrong exit code."""
    done, after, until = p.get("completed_at_signal"), p.get("committed_after"), p.get("until")
    return (
        p.get("exit_code") == 0
        and not p.get("steps_lost")
        and None not in (done, after, until)
        and after == until
        and after - done <= 2
    )


@dataclass
class Stats:
    kills: list[dict] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)  # every launch's resume check
    chains: list[dict] = field(default_factory=list)
    preemptions: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def violations(self) -> dict[str, int]:
        v = {
            "orphans_after_5s": sum(1 for k in self.kills + self.preemptions if k.get("orphans")),
            "launcher_past_bound": sum(1 for k in self.kills if k.get("killed") and k.get("launcher_past_bound")),
            "second_writer_started": sum(1 for k in self.kills if k.get("second_writer") == "started"),
            "second_writer_not_refused": sum(1 for k in self.kills if k.get("second_writer") == "timeout"),
            "committed_after_kill": sum(1 for k in self.kills if k.get("killed") and k.get("committed_after_kill")),
            "torn_latest_checkpoint": sum(1 for k in self.kills + self.preemptions if k.get("torn_latest")),
            "no_valid_checkpoint_left": sum(1 for k in self.kills + self.preemptions if k.get("no_valid_left")),
            "partial_or_wrong_resume": sum(1 for s in self.segments if s.get("resume_problem")),
            "inexact_steps": sum(len(s.get("inexact_steps", [])) for s in self.segments),
            "cli_traceback": sum(1 for s in self.segments if s.get("cli_traceback")),
            "chains_not_bitwise": sum(1 for c in self.chains if c.get("final_diffs")),
            "preempt_wrong_exit": sum(
                1
                for p in self.preemptions
                if p["signalled"] and p.get("exit_code") != EXIT_PREEMPTED and not completed_in_last_steps(p)
            ),
            "preempt_steps_lost": sum(p.get("steps_lost", 0) for p in self.preemptions),
            "torn_universal": sum(1 for k in self.kills if k.get("torn_universal")),
            "not_reconverted": sum(1 for r in self.kills + self.chains if r.get("reconverted") is False),
            "remote_listed_without_manifest": sum(1 for k in self.kills if k.get("remote_listed_without_manifest")),
        }
        return {k: n for k, n in v.items() if n}


class _Probe:
    """A second ``train`` on a run dir whose previous segment has processes alive."""

    def __init__(self, h: Torture, ln: Launch):
        self.p = h.launch(ln.run_dir, ln.cfg, ln.until, "second-writer")
        self.end = time.monotonic() + 60
        self.result: str | None = None

    def poll(self, old_alive: bool) -> None:
        if self.result is not None:
            return
        code = self.p.popen.poll()
        if code is not None:
            self.result = "refused" if code == EXIT_LOCKED else f"exit {code}"
            return
        self.p.refresh()
        if self.p.live("torchrun") or self.p.live("rank"):
            self.result = "started" if old_alive else "after-gone"
        elif not old_alive:
            # The old processes are all gone before the probe was refused or started: starting now is
            # legitimate, so there is nothing left to see (it is stopped, not left to start its ranks).
            self.result = "after-gone"
        elif time.monotonic() > self.end:
            self.result = "timeout"

    def finish(self) -> str:
        self.p.refresh()
        kill_all([*self.p.procs.values(), *referencing(self.p.run_dir)])
        self.p.wait(10)
        self.p.close()
        return self.result or "timeout"


class Torture:
    """The harness: references, kill chains, preemption cases, secrets. ``log`` gets progress lines."""

    def __init__(self, work: Path, *, final: int, seed: int = 0, log: Callable[[str], None] = print):
        self.work = work
        self.work.mkdir(parents=True, exist_ok=True)
        self.final = final
        self.rng = random.Random(seed)
        self.log = log
        self.stats = Stats()
        self.refs: dict[str, Path] = {}
        self.ref_metrics: dict[str, dict[int, tuple[float, float]]] = {}
        self._n = 0
        self.startups: list[float] = []
        self._pending: dict[str, tuple[Launch, float]] = {}
        # local cache of an s3:// run -> (its URL, the launch environment, a factory of the upload-window probe)
        self.remotes: dict[Path, tuple[str, dict[str, str], Callable[[], Callable[[], bool]]]] = {}
        self.dir_env: dict[Path, dict[str, str]] = {}  # folder -> environment of the launches of run dirs in it
        self.kill_hooks: dict[str, Callable[[Launch], bool]] = {}  # other targets (a Slurm job, a node)

    def _logfile(self, tag: str) -> Path:
        self._n += 1
        d = self.work / "logs"
        d.mkdir(exist_ok=True)
        return d / f"{self._n:04d}-{tag}.log"

    def launch(self, run_dir: Path, cfg: Cfg, until: int, tag: str, env: dict[str, str] | None = None) -> Launch:
        if run_dir in self.remotes:  # the local cache of an s3:// run: launched on its URL, with its probe
            url, remote_env, probe = self.remotes[run_dir]
            ln = Launch(run_dir, cfg, until, self._logfile(tag), {**remote_env, **(env or {})}, run_arg=url)
            ln.upload_seen = probe()
            return ln
        return Launch(run_dir, cfg, until, self._logfile(tag), {**self.dir_env.get(run_dir.parent, {}), **(env or {})})

    def teardown_bound(self, ln: Launch) -> float:
        """How long a CLI that survived a kill may take to exit: TEARDOWN_FACTOR x its start-up in this launch
        (or the median start-up so far, when the kill came before its torchrun was seen)."""
        if ln.startup_s is not None:
            self.startups.append(ln.startup_s)
        ref = ln.startup_s if ln.startup_s is not None else (_median(self.startups) if self.startups else 10.0)
        return max(ORPHAN_DEADLINE_S, TEARDOWN_FACTOR * ref)

    def ref_key(self, cfg: Cfg) -> str:
        world = cfg.nproc * cfg.nodes
        return cfg.backend if world == 2 else f"{cfg.backend}-ws{world}"

    # ------------------------------------------------------------- reference
    def reference(self, cfg: Cfg, *, key: str | None = None, wait: bool = True) -> Path | None:
        """An uninterrupted run to ``final`` (one per backend: the save mode does not change the math).
        ``wait=False`` starts it and returns None: it runs beside the chain's first launch (whose checks
        need it only once that launch is over), which saves a launch's start-up."""
        key = key or self.ref_key(cfg)
        if key in self.refs:
            return self.refs[key]
        if key not in self._pending:
            self._pending[key] = (
                self.launch(self.work / f"ref-{key}", cfg, self.final, f"ref-{key}"),
                time.monotonic(),
            )
        if not wait:
            return None
        ln, t0 = self._pending.pop(key)
        run = ln.run_dir
        code = ln.wait(900)
        ln.close()
        if code != 0:
            raise RuntimeError(f"reference run {run} exited {code}; see {ln.log_path}")
        self.log(f"reference {key} ({cfg.name}) to step {self.final}: {time.monotonic() - t0:.1f} s")
        self.refs[key] = run
        self.ref_metrics[key] = read_metrics(run)
        return run

    def check_async_sync_same(self) -> bool:
        """Verify once that async and sync saves give the same run (one FSDP2 reference serves both)."""
        a = self.reference(CONFIGS["fsdp2-async"])
        s = self.reference(CONFIGS["fsdp2-sync"], key="fsdp2-sync")
        diffs = compare_final(_ckpt(a, self.final), _ckpt(s, self.final))
        same = not diffs and read_metrics(a) == read_metrics(s)
        self.stats.notes.append(
            f"async vs sync FSDP2 reference runs bitwise equal: {same}" + (f" ({diffs[:2]})" if diffs else "")
        )
        return same

    # ------------------------------------------------------------- per-launch resume check
    def check_resume(self, ln: Launch, expected: int, context: dict) -> dict:
        """Did this launch resume from the newest valid committed step (never a .partial, never 0 when a
        valid checkpoint existed), and did every step it trained match the reference bitwise?"""
        seg = ln.segment_index()
        rec: dict[str, Any] = {
            "chain": context.get("chain"),
            "segment": seg,
            "expected_resume": expected,
            "kind": context.get("kind"),
            "log": ln.log_path.name,
        }
        resumes = [e for e in ln.new_lines("lineage.jsonl") if e.get("kind") == "resume"]
        text = ln.log_path.read_text(errors="replace")
        rec["resumed_from_partial"] = ".partial" in "".join(
            line for line in text.splitlines() if "resumed from" in line
        )
        # The CLI must report a failed segment in one line, never with its own traceback.
        rec["cli_traceback"] = "Traceback" in text and 'shardkeeper/cli.py", line' in text
        mets = [m for m in ln.new_lines("metrics.jsonl") if seg is not None and m.get("segment") == seg]
        problems = []
        if resumes:
            rec["resumed_step"] = resumes[0].get("step")
            if resumes[0].get("step") != expected:
                problems.append(f"resumed at step {resumes[0].get('step')}, newest valid committed step is {expected}")
        elif mets and expected > 0:
            problems.append(f"trained without a resume event although step {expected} was committed")
        if mets:
            rec["first_step"] = mets[0]["step"]
            if mets[0]["step"] != expected + 1:
                problems.append(f"metrics start at step {mets[0]['step']}, expected {expected + 1}")
        if rec["resumed_from_partial"]:
            problems.append("resumed from a .partial directory")
        self.reference(ln.cfg)  # (started beside the chain's first launch: finished by now, or waited for)
        ref = self.ref_metrics[self.ref_key(ln.cfg)]
        rec["steps"] = len(mets)
        rec["inexact_steps"] = [m["step"] for m in mets if ref.get(m["step"]) != (m["loss"], m["grad_norm"])]
        rec["resume_problem"] = "; ".join(problems) or None
        rec["loaded"] = bool(resumes or mets)
        self.stats.segments.append(rec)
        return rec

    # ------------------------------------------------------------- after a kill or a preemption
    def settle(self, ln: Launch, rec: dict, probe: bool) -> None:
        """Count what outlives the lock holder. The launching CLI holds the run lock and waits (by pid) for its
        torchrun and every rank before it exits, so a process of the segment is an orphan when it still runs
        ``ORPHAN_DEADLINE_S`` after the CLI is gone (killed, or exited). A CLI that survived the kill must
        itself exit within ``teardown_bound``: a multiple of what this machine takes now to start the same
        CLI (measured in the same launch), not a fixed number of seconds a loaded machine cannot keep.
        If anything still lives 0.5 s after the kill, a second ``train`` is started on the run dir at once:
        it must be refused (exit 3) while they live (the old CLI alone, past its lock, no longer counts)."""
        t0 = time.monotonic()
        at_kill = ckpt_scan(ln.run_dir)
        second: _Probe | None = None
        left: list[Proc] = []
        orphans_counted = False
        kill_wait = slurm_kill_wait(rec.get("target"))
        bound = self.teardown_bound(ln) + kill_wait
        rec["teardown_bound_s"] = round(bound, 2)
        if kill_wait:
            rec["slurm_kill_wait_s"] = kill_wait
        lock_gone_at: float | None = None
        while True:
            if second is not None:
                second.p.refresh()  # its processes name the same run dir: they are not the old segment's
            mine = set(second.p.procs) if second is not None else set()
            left = [p for p in ln.procs.values() if alive(p)] + [
                p
                for p in referencing(ln.run_dir)
                if p.pid not in ln.procs
                and p.pid not in mine
                and not (second is not None and _descends(p.pid, second.p.popen.pid))
            ]
            elapsed = time.monotonic() - t0
            # after ``left``: a CLI not alive there (a zombie, or already reaped) is gone, whatever poll says yet
            gone = ln.popen.poll() is not None or not any(p.role == "cli" for p in left)
            if gone and lock_gone_at is None:
                lock_gone_at = elapsed
                rec["launcher_exit_s"] = round(elapsed, 2)
                at_kill = ckpt_scan(ln.run_dir) if elapsed > 0.5 else at_kill  # a CLI that lived on supervised
            if not left and "gone_after_s" not in rec:
                rec["gone_after_s"] = round(elapsed, 2)
            if probe and second is None and left and elapsed >= 0.5:
                second = _Probe(self, ln)
            if second is not None:
                # The old CLI gives up the run lock only once its ranks are gone, after its last record; it may take
                # a moment more to exit (interpreter teardown). A second writer can then take the lock: legitimate,
                # so the old segment counts as alive while anything but that CLI is (a second writer while the CLI
                # still held the lock is impossible: the lock refuses it).
                second.poll(any(p.role != "cli" for p in left))
            give_up = lock_gone_at is None and elapsed >= max(bound, LAUNCHER_CAP_S)
            if not orphans_counted and (
                not left or give_up or (lock_gone_at is not None and elapsed >= lock_gone_at + ORPHAN_DEADLINE_S)
            ):
                orphans_counted = True
                rec["orphans"] = len(left)
                if left:
                    rec["orphan_roles"] = sorted(p.role for p in left)
            if orphans_counted and (second is None or second.result is not None or elapsed > 90):
                break
            time.sleep(0.05)
        rec["launcher_past_bound"] = lock_gone_at is None or lock_gone_at > bound
        if second is not None:
            rec["second_writer"] = second.finish()
        stuck = kill_all([*left, *referencing(ln.run_dir)])  # (the probe is gone by now)
        if stuck:
            rec["unkillable"] = len(stuck)
        # Anything committed after the CLI was gone (killed, or exited later: until then it supervised its
        # ranks, and Slurm's own termination lets them commit) that was not already decided (manifest
        # written) then, was written by processes that outlived their launcher.
        late = sorted(
            ckpt_scan(ln.run_dir).committed
            - at_kill.committed
            - {n.removesuffix(".partial") for n, _ in at_kill.partial_manifests}
        )
        rec["committed_after_kill"] = late
        ln.wait(30)
        ln.close()

    def after_checks(self, run_dir: Path, rec: dict, chain: dict) -> int:
        dc = check_dir(run_dir)
        chain["ever_committed"] = chain.get("ever_committed", False) or bool(dc.committed) or bool(dc.invalid)
        rec["committed"] = dc.committed
        rec["valid"] = dc.valid
        rec["torn_latest"] = dc.torn_latest
        if dc.invalid:
            rec["invalid"] = {str(k): v for k, v in dc.invalid.items()}
        rec["no_valid_left"] = chain["ever_committed"] and not dc.valid
        return dc.expected_resume

    # ------------------------------------------------------------- one kill
    def one_kill(
        self, run_dir: Path, cfg: Cfg, expected: int, chain: dict, target: str, window: str, until: int | None = None
    ) -> int:
        # Segments long enough (20-40 steps, seconds) that ranks outliving their launcher are seen;
        # the kill comes early (first or second window), so each launch advances the run a few steps.
        until = until or min(self.final, expected + self.rng.randint(20, 40))
        t0 = time.monotonic()
        ln = self.launch(run_dir, cfg, until, f"{chain['name']}-{target}-{window}")
        moment = wait_moment(ln, window, self.rng, target)
        rec: dict[str, Any] = {
            "chain": chain["name"],
            "backend": cfg.backend,
            "async": cfg.async_save,
            "target": target,
            "window": window,
            "moment": moment,
            "until": until,
        }
        if moment is None:
            rec["killed"] = False
            rec["exit_code"] = ln.wait(300)
            self.settle(ln, rec, probe=False)
        else:
            rec["killed"] = self._kill(ln, target, rec)
            rec["at_s"] = round(time.monotonic() - ln.t0, 2)
            rec["trained_before_kill"] = bool(ln.new_lines("metrics.jsonl"))
            self.settle(ln, rec, probe=True)
        self.check_resume(ln, expected, {"chain": chain["name"], "kind": "kill"})
        new_expected = self.after_checks(run_dir, rec, chain)
        rec["seconds"] = round(time.monotonic() - t0, 2)
        self.stats.kills.append(rec)
        self.log(
            f"  {chain['name']} {target:8s} {str(moment):24s} orphans={rec['orphans']} "
            f"cli-exit={rec.get('launcher_exit_s')}s (bound {rec['teardown_bound_s']}s) "
            f"2nd={rec.get('second_writer', '-')} valid={rec['valid']} {rec['seconds']:.1f}s"
        )
        return new_expected

    def _kill(self, ln: Launch, target: str, rec: dict) -> bool:
        ln.refresh()
        rec["procs_before"] = sorted(p.role for p in ln.procs.values() if alive(p))
        if target in self.kill_hooks:
            return self.kill_hooks[target](ln)
        try:
            if target == "cli":
                os.kill(ln.popen.pid, signal.SIGKILL)
            elif target == "group":
                os.killpg(ln.popen.pid, signal.SIGKILL)
            else:
                victims = ln.live(target)
                if not victims:
                    return False
                os.kill(self.rng.choice(victims).pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    # ------------------------------------------------------------- chains
    def finish_chain(self, run_dir: Path, cfg: Cfg, expected: int, chain: dict, end: int | None = None) -> None:
        """Run uninterrupted to the end (``end``, default ``final``) and compare with the reference bitwise."""
        end = end or self.final
        ln = self.launch(run_dir, cfg, end, f"{chain['name']}-finish")
        code = ln.wait(900)
        rec: dict[str, Any] = {}
        self.settle(ln, rec, probe=False)
        self.check_resume(ln, expected, {"chain": chain["name"], "kind": "finish"})
        chain["finish_exit"] = code
        final = _ckpt(run_dir, end)
        ref = _ckpt(self.reference(cfg), end)
        if code != 0 or not final.is_dir():
            chain["final_diffs"] = [f"finishing segment exited {code}; {final.name} missing: {not final.is_dir()}"]
        else:
            chain["final_diffs"] = compare_final(final, ref)
        self.stats.chains.append(chain)
        self.log(
            f"chain {chain['name']}: {chain['kills']} kills, "
            f"final bitwise equal to reference: {not chain['final_diffs']}"
        )

    def kill_chain(
        self,
        cfg: Cfg,
        index: int,
        n_kills: int,
        deadline: float,
        plan: list[tuple[str, str]] | None = None,
        preempt: tuple[str, ...] = (),
        prefix: str = "chain",
    ) -> dict:
        """Up to ``n_kills`` killed launches on one run dir (random or ``plan``ned target and window),
        then the ``preempt`` cases, then an uninterrupted finish compared bitwise with the reference."""
        run_dir = self.work / f"{prefix}-{cfg.name}-{index}"
        chain: dict[str, Any] = {"name": run_dir.name, "config": cfg.name, "kills": 0, "launches": 0}
        self.reference(cfg, wait=False)
        expected = 0
        for i in range(n_kills):
            if time.monotonic() > deadline or expected >= self.final - 4:
                break
            target, window = plan[i] if plan else (self.rng.choice(TARGETS), _weighted(self.rng, WINDOWS))
            expected = self.one_kill(run_dir, cfg, expected, chain, target, window)
            chain["launches"] += 1
            chain["kills"] += int(self.stats.kills[-1]["killed"])
        for case in preempt:
            expected = self.preempt(run_dir, cfg, case, expected, chain)
            chain["launches"] += 1
        self.finish_chain(run_dir, cfg, expected, chain)
        return chain

    # ------------------------------------------------------------- preemption
    def preempt(self, run_dir: Path, cfg: Cfg, case: str, expected: int, chain: dict, grace_s: float = 45.0) -> int:
        """SIGTERM to the CLI at the case's moment; expect exit 75, a committed checkpoint, no step lost."""
        until = min(self.final, expected + PREEMPT_SPAN)
        ln = self.launch(run_dir, cfg, until, f"{chain['name']}-preempt-{case}")
        window = {
            "train": "train",
            "async-save": "save",
            "commit": "commit",
            "startup": "startup",
            "repeat-term": "train",
        }[case]
        moment = wait_moment(ln, window, self.rng, "rank" if case == "startup" else "cli")
        rec: dict[str, Any] = {
            "chain": chain["name"],
            "backend": cfg.backend,
            "async": cfg.async_save,
            "case": case,
            "moment": moment,
            "until": until,
        }
        if moment is not None:
            done = [m["step"] for m in ln.new_lines("metrics.jsonl")]
            rec["completed_at_signal"] = max(done) if done else expected
            os.kill(ln.popen.pid, signal.SIGTERM)
            if case == "repeat-term":
                for _ in range(2):
                    time.sleep(0.3)
                    os.kill(ln.popen.pid, signal.SIGTERM)
        code = ln.wait(grace_s)
        if code is None:  # past the grace period: what a scheduler does next
            rec["killed_after_grace"] = True
            ln.refresh()
            kill_all(list(ln.procs.values()))
            code = ln.wait(10)
        rec["exit_code"] = code
        rec["signalled"] = moment is not None  # False: the segment ended before the moment; not a case
        self.settle(ln, rec, probe=False)
        self.check_resume(ln, expected, {"chain": chain["name"], "kind": f"preempt-{case}"})
        new_expected = self.after_checks(run_dir, rec, chain)
        if moment is not None:
            rec["committed_after"] = new_expected
            rec["steps_lost"] = max(0, rec["completed_at_signal"] - new_expected)
        self.stats.preemptions.append(rec)
        self.log(
            f"  preempt {case:12s} {str(moment):24s} exit={code} completed={rec.get('completed_at_signal')} "
            f"committed={new_expected} lost={rec.get('steps_lost')}"
        )
        return new_expected

    def preempt_chain(self, cfg: Cfg, cases: tuple[str, ...] = PREEMPT_CASES, index: int = 0) -> dict:
        return self.kill_chain(cfg, index, 0, 0.0, preempt=cases, prefix="preempt")

    # ------------------------------------------------------------- secrets
    def secrets(self, cfg: Cfg) -> dict:
        """HF_TOKEN planted in train + export + publish (file://): every byte written must be free of it."""
        token = "hf_" + "".join(
            self.rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(34)
        )
        env = {"HF_TOKEN": token, "HUGGING_FACE_HUB_TOKEN": token}
        base = self.work / "secrets"
        run, exp, pub, logs = base / "run", base / "export", base / "published", base / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        ln = self.launch(run, cfg, 4, "secrets-train", env)
        codes = {"train": ln.wait(600)}
        ln.close()
        ck = _ckpt(run, 4)
        py = [sys.executable, "-m", "shardkeeper"]
        for name, cmd in (
            ("export", [*py, "export", str(ck), str(exp)]),
            ("publish", [*py, "publish", str(exp), "--target", pub.as_uri()]),
            ("lineage", [*py, "lineage", str(run), "--json"]),
            ("validate", [*py, "validate", str(ck), "--deep", "--json"]),
        ):
            with open(logs / f"{name}.out", "wb") as out, open(logs / f"{name}.err", "wb") as err:
                codes[name] = subprocess.run(
                    cmd, cwd=REPO, env={**child_env(), **env}, stdout=out, stderr=err, timeout=600
                ).returncode
        (logs / "train.log").write_bytes(ln.log_path.read_bytes())
        hits, scanned = [], 0
        for root in (run, exp, pub, logs):
            for path in root.rglob("*") if root.exists() else []:
                if path.is_file():
                    scanned += 1
                    if token.encode() in path.read_bytes():
                        hits.append(str(path))
        rec = {"exit_codes": codes, "files_scanned": scanned, "hits": hits}
        self.log(f"secrets: exit codes {codes}, {scanned} files scanned, {len(hits)} with the token")
        return rec


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _weighted(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


# --------------------------------------------------------------------------- corpora (pytest suites)
def run_corpora(junit: Path, timeout_s: float = 1800) -> dict:
    """Run the hostile-file / corruption / bad-input suites of tests/reliability and count the cases."""
    import xml.etree.ElementTree as ET

    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/reliability",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "hostile or corruption or bad_input",
        f"--junitxml={junit}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    counts = {"exit_code": proc.returncode, "passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failed_ids": []}
    if not junit.exists():
        counts["note"] = "no junit report (suites not present?)"
        return counts
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {c.tag for c in case}
        cid = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in kinds:
            counts["failed"] += 1
            counts["failed_ids"].append(cid)
        elif "error" in kinds:
            counts["errors"] += 1
            counts["failed_ids"].append(cid)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    if proc.returncode == 5:
        counts["note"] = "no tests collected (suites not present yet)"
    return counts
