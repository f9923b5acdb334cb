"""Peers: shardkeeper's memory tier against DLRover's Flash Checkpoint and torch DCP's async_save, on one model.

    python bench/peers_memtier.py       # 4 rounds of the 3 systems; publishes bench/results/peers-memtier.md (+ .png)
    python bench/peers_memtier.py --rounds 1 --vocab 8000 --hidden 128 --intermediate 256 --layers 1 --heads 4 \\
        --kv-heads 2 --no-publish       # smoke run, a 2.2M-parameter model (~3-5 min on 2 cores)
    python bench/peers_memtier.py --plot-only   # redraw bench/results/peers-memtier.png from the published table

One training loop (bench/peers_memtier_loop.py: a 37.9M-parameter Llama, fp32, FSDP2 on 2 gloo CPU ranks, AdamW,
the same batches) runs under each system in turn, launched as each is meant to be: ``shardkeeper train --script`` with
``checkpoint.memory_interval``; ``dlrover-run`` with DLRover's FSDP Flash Checkpoint engine; ``torchrun
--max-restarts`` with ``dcp.async_save``. Every run saves on the same schedule (a snapshot every
``--memory-interval`` steps, a storage save every ``--interval``; the first ``--interval`` steps are warm-up), then
rank 1 is SIGKILLed right after a snapshot and the run goes on to its end as its system recovers. The systems run
one after another, in an order rotated round by round (A B C, B C A, C A B, ...), ``--rounds`` times; the table
gives each figure's median and [min–max] over the rounds (within a run, the median of its saves).

DLRover is installed by the bench into a virtualenv of its own (bench/out/peers/dlrover-venv: ``dlrover[k8s]==0.6.1``
and protobuf, resolved against constraints.txt), which reuses the project's torch and transformers through a .pth
naming this interpreter's site-packages: the same torch files run under all three, and the project's environment
is not changed (dlrover's own requirements pull python-dateutil 4, which the project's prefect refuses).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import site
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

OUT = ROOT / "bench" / "out" / "peers"
LOOP = ROOT / "bench" / "peers_memtier_loop.py"
SYSTEMS = ("shardkeeper", "dlrover", "torch")
LABELS = {"shardkeeper": "shardkeeper", "dlrover": "DLRover Flash Checkpoint", "torch": "torch async_save"}
DLROVER_VERSION = "0.6.1"
# dlrover-run's agent imports grpc and its master kubernetes and tornado (the 'k8s' extra declares them); the
# master's generated protobuf code needs protobuf, which no extra declares.
DLROVER_REQUIREMENTS = (f"dlrover[k8s]=={DLROVER_VERSION}", "protobuf>=4.25.3")
NAME = "peers-memtier"
FIRST_COLUMN = "figure (median [min–max] over rounds)"
ROWS = (  # (key of a run's figures, row label, unit, digits)
    ("stall_ratio", "snapshot stall / one host copy of the state", "×", 2),
    ("storage_stall_s", "storage-save stall", " s", 3),
    ("durable_s", "durable on disk after the call", " s", 2),
    ("recovery_s", "SIGKILL of one rank → first step done again", " s", 1),
    ("kill_to_ranks_s", "of which: kill → new ranks started", " s", 2),
    ("ranks_to_loaded_s", "of which: new ranks started → state loaded", " s", 1),
    ("shm_peak_gb", "/dev/shm peak", " GB", 2),
)


# --------------------------------------------------------------------------------------------- DLRover's virtualenv
def dlrover_python(venv: Path) -> Path:
    """The Python of a virtualenv holding DLRover (made on first use): it sees this interpreter's site-packages
    after its own (a .pth file), so torch and transformers are the project's; pip resolves against constraints.txt,
    so a package both need keeps the project's version. Raises SystemExit (one line) when it cannot be made."""
    py = venv / "bin" / "python"
    marker = venv / ".installed"
    want = " ".join(DLROVER_REQUIREMENTS)
    if marker.is_file() and marker.read_text() == want and py.is_file():
        return py
    shutil.rmtree(venv, ignore_errors=True)
    print(f"installing {want} into {venv.relative_to(ROOT)} (reusing this environment's torch)", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        purelib = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(purelib, "project-site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "-c",
                str(ROOT / "constraints.txt"),
                *DLROVER_REQUIREMENTS,
            ],
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(
            f"error: could not install {want} into {venv}: {e}; run the other two with --systems shardkeeper,torch"
        ) from e
    theirs = subprocess.run(
        [str(py), "-c", "import importlib.util; print(importlib.util.find_spec('torch').origin)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    ours = importlib.util.find_spec("torch").origin  # type: ignore[union-attr]
    if theirs != ours:
        raise SystemExit(f"error: the DLRover virtualenv imports torch from {theirs}, not the project's {ours}")
    marker.write_text(want)
    return py


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (a launcher may start its ranks in sessions of their own)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------- one run
class ShmSampler(threading.Thread):
    """Every ``every_s``: the bytes the run's own files hold in /dev/shm (``owned()``: the pages allocated to the
    files under those paths) and the tmpfs's used bytes (statvfs: every process's files, and segments unlinked but
    still mapped); each peak is reported above its level before the run."""

    def __init__(self, owned: list[str], path: str = "/dev/shm", every_s: float = 0.02):
        super().__init__(daemon=True)
        self.owned_globs, self.path, self.every_s = owned, path, every_s
        self.base, self.base_owned = self.used(), self.owned()
        self.peak, self.peak_owned = self.base, self.base_owned
        self.halt = threading.Event()

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def owned(self) -> int:
        total = 0
        for pattern in self.owned_globs:
            for top in Path("/").glob(pattern.lstrip("/")):
                for root, _dirs, files in os.walk(top) if top.is_dir() else [(str(top.parent), [], [top.name])]:
                    for name in files:
                        try:
                            total += os.lstat(os.path.join(root, name)).st_blocks * 512
                        except FileNotFoundError:  # retired or renamed meanwhile
                            pass
        return total

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak, self.peak_owned = max(self.peak, self.used()), max(self.peak_owned, self.owned())
            time.sleep(self.every_s)

    def stop(self) -> tuple[float, float]:
        """(own files' peak, the tmpfs's peak), GB above their levels before the run."""
        self.halt.set()
        self.join()
        return (self.peak_owned - self.base_owned) / 1e9, (self.peak - self.base) / 1e9


class Tail:
    """The complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rest = path, 0, b""

    def new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        return [json.loads(x) for x in lines if x.strip()]


def schedule(args: argparse.Namespace) -> dict[str, int]:
    """The steps every run follows: saves up to ``interval`` are warm-up, those up to ``measure_to`` counted, rank 1
    killed after the snapshot of ``kill_at``, the run's end at ``until``."""
    k, m = args.memory_interval, args.interval
    measure_to = m * (args.cycles + 1)
    return {
        "memory_interval": k,
        "interval": m,
        "measure_from": m,
        "measure_to": measure_to,
        "kill_at": measure_to + k,
        "until": measure_to + k + 2,
    }


def loop_args(args: argparse.Namespace, system: str, events: Path, store: Path) -> list[str]:
    sch = schedule(args)
    return [
        "--system",
        system,
        "--events",
        str(events),
        "--storage",
        str(store),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--memory-interval",
        str(sch["memory_interval"]),
        "--interval",
        str(sch["interval"]),
        "--kill-at",
        str(sch["kill_at"]),
        "--until",
        str(sch["until"]),
    ]


def shardkeeper_restarts() -> bool:
    """Whether this shardkeeper restarts dead ranks in place (``checkpoint.restarts``); then the bench sets it."""
    from schemas.run import CheckpointPolicy

    return "restarts" in CheckpointPolicy.model_fields


def command(
    system: str, args: argparse.Namespace, events: Path, store: Path, mem: Path, dl_py: Path | None, first: bool = True
) -> list[str]:
    sch, restarts = schedule(args), str(args.max_restarts)
    if system == "shardkeeper":
        base = [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--run-dir",
            str(store),
            "--until-step",
            str(sch["until"]),
            "--nproc",
            str(args.nproc),
        ]
        if not first:  # the next segment: the run remembers its script, its arguments and its policy
            return base
        sets = [
            f"checkpoint.memory_interval={sch['memory_interval']}",
            f"checkpoint.interval={sch['interval']}",
            f"checkpoint.memory_dir={mem}",
        ]
        if shardkeeper_restarts():
            sets.append(f"checkpoint.restarts={restarts}")
        return [
            *base,
            "--script",
            str(LOOP),
            *[x for s in sets for x in ("--set", s)],
            "--",
            *loop_args(args, system, events, store),
        ]
    if system == "torch":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            f"--max-restarts={restarts}",
            str(LOOP),
            *loop_args(args, system, events, store),
        ]
    assert dl_py is not None
    return [
        str(dl_py.parent / "dlrover-run"),
        "--nnodes=1",
        f"--nproc-per-node={args.nproc}",
        f"--max-restarts={restarts}",
        str(LOOP),
        *loop_args(args, system, events, store),
    ]


def run_system(system: str, rnd: int, args: argparse.Namespace, dl_py: Path | None) -> dict[str, Any]:
    """One run of ``system``: launch, SIGKILL rank 1 at the loop's kill point, let the system recover (for
    shardkeeper without in-place restarts: start the next segment as soon as the launcher exits), to the end."""
    name = f"{system}-r{rnd}"
    store, mem = Path(args.storage_dir) / name, Path(args.memory_dir) / name
    events, log_path = OUT / f"{name}.events.jsonl", OUT / f"{name}.log"
    for p in (store, mem):
        shutil.rmtree(p, ignore_errors=True)
    events.unlink(missing_ok=True)
    store.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONUNBUFFERED": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    }
    job = f"peers{os.getpid()}{name.replace('-', '')}"
    master = None
    log = log_path.open("w")
    if system == "torch":
        # torchrun's restarted workers would find the previous attempt's gloo addresses in the rendezvous store they
        # share with the agent, and wait on them forever (pytorch/pytorch#135712): give them a store of their own
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if system == "dlrover":  # dlrover-run's standalone mode cannot start its master on torch >= 2.9: start it here
        assert dl_py is not None
        port = free_port()
        env.update(
            {
                "DLROVER_MASTER_ADDR": f"127.0.0.1:{port}",
                "ELASTIC_JOB_NAME": job,
                "DLROVER_EVENT_FILE_DIR": str(OUT / f"{name}.dlrover-events"),
            }
        )
        master = subprocess.Popen(
            [
                str(dl_py),
                "-u",
                "-m",
                "dlrover.python.master.main",
                "--port",
                str(port),
                "--node_num",
                "1",
                "--job_name",
                job,
                "--platform",
                "local",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    shm = ShmSampler({"shardkeeper": [str(mem)], "dlrover": [f"/dev/shm/{job}_*"], "torch": []}[system])
    shm.start()
    tail, seen = Tail(events), []
    starts: dict[int, int] = {}
    kill_t, victim, launches = None, None, []
    deadline = time.monotonic() + args.run_timeout
    proc = subprocess.Popen(
        command(system, args, events, store, mem, dl_py),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    launches.append(time.time())
    try:
        while True:
            for e in tail.new():
                seen.append(e)
                if e["ev"] == "start":
                    starts[e["rank"]] = e["pid"]
                if e["ev"] == "kill_point" and kill_t is None:
                    victim = starts[1]
                    kill_t = time.time()
                    os.kill(victim, signal.SIGKILL)
            rc = proc.poll()
            if rc is not None:
                if system == "shardkeeper" and rc != 0 and kill_t is not None and len(launches) < 3:
                    # the segment ended with its rank: start the next one at once, as an operator's loop would
                    proc = subprocess.Popen(
                        command(system, args, events, store, mem, dl_py, first=False),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                    launches.append(time.time())
                    continue
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: not done after {args.run_timeout:.0f} s; see {log_path}")
            time.sleep(0.01)
        seen += tail.new()
        if rc != 0 or kill_t is None:
            reached = "reached" if kill_t else "never reached"
            raise RuntimeError(f"{name}: exit {rc}, kill point {reached}; see {log_path}")
    finally:
        shm_gb, tmpfs_gb = shm.stop()
        if proc.poll() is None:
            kill_tree(proc)
        if master is not None:
            master.terminate()
            try:
                master.wait(timeout=20)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
            for f in Path("/dev/shm").glob(f"{job}_*"):  # the agent leaves its shared memory behind
                f.unlink(missing_ok=True)
            shutil.rmtree(Path("/tmp/ckpt_sock") / job, ignore_errors=True)
        log.close()
    tier = None
    if system == "shardkeeper":
        lineage = store / "lineage.jsonl"
        lines = lineage.read_text().splitlines() if lineage.is_file() else []
        resumes = [json.loads(x) for x in lines if '"resume"' in x]
        tier = resumes[-1]["data"].get("tier") if resumes else None
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(mem, ignore_errors=True)
    return {
        "system": system,
        "round": rnd,
        "events": seen,
        "kill_t": kill_t,
        "victim": victim,
        "launches": launches,
        "shm_gb": shm_gb,
        "tmpfs_gb": tmpfs_gb,
        "tier": tier,
    }


# --------------------------------------------------------------------------------------------- figures
def figures(run: dict[str, Any], sch: dict[str, int]) -> dict[str, Any]:
    """One run's figures from its events: the medians of its counted saves, its recovery, its /dev/shm peak."""
    evs, kill_t = run["events"], run["kill_t"]
    counted = lambda s: sch["measure_from"] < s <= sch["measure_to"]  # noqa: E731

    def slowest(kind: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for e in evs:
            if e["ev"] == kind and e["t"] < kill_t:
                out[e["s"]] = max(out.get(e["s"], 0.0), e["dt"])
        return out

    bounds, copies, durable = slowest("boundary"), slowest("copy"), slowest("durable")
    kinds = {e["s"]: e["kind"] for e in evs if e["ev"] == "boundary" and e["t"] < kill_t}
    plain = statistics.median([dt for s, dt in bounds.items() if kinds[s] is None and counted(s)])
    snaps = [bounds[s] - plain for s in bounds if kinds[s] == "memory" and counted(s)]
    stores = [bounds[s] - plain for s in bounds if kinds[s] == "storage" and counted(s)]
    # the ranks that ran before the kill: by when they said they started (a process's creation time is read from
    # /proc against a boot time of whole seconds, and a rank forked at the kill can seem to predate it)
    old = {e["pid"] for e in evs if e["ev"] == "start" and e["t"] < kill_t}
    new_starts = [e for e in evs if e["ev"] == "start" and e["pid"] not in old]
    loaded = [e for e in evs if e["ev"] == "loaded" and e["pid"] not in old and e["rank"] == 0]
    first = min(e["t"] for e in evs if e["ev"] == "step" and e["pid"] not in old)
    done_before = max(e["s"] for e in evs if e["ev"] == "step" and e["pid"] in old)
    ranks_at = max(kill_t, min(e["created"] for e in new_starts))
    built = [e for e in evs if e["ev"] == "built"]
    phase = lambda ev: min(e["t"] for e in evs if e["ev"] == ev and e["pid"] not in old)  # noqa: E731
    return {
        "stall_ratio": statistics.median(snaps) / statistics.median([copies[s] for s in copies if counted(s)]),
        "copy_s": statistics.median([copies[s] for s in copies if counted(s)]),
        "snapshot_stall_s": statistics.median(snaps),
        "storage_stall_s": statistics.median(stores),
        "durable_s": statistics.median([durable[s] for s in durable if counted(s)]),
        "recovery_s": first - kill_t,
        "kill_to_ranks_s": ranks_at - kill_t,
        "ranks_to_loaded_s": loaded[0]["t"] - ranks_at,
        # where the restarted ranks' time goes until the load: start-up and imports, process group, model build
        "restart_phases_s": {"joined": phase("joined") - ranks_at, "built": phase("built") - ranks_at},
        "shm_peak_gb": run["shm_gb"],
        "tmpfs_peak_gb": run["tmpfs_gb"],
        "restored_step": loaded[0]["step"],
        "redone": done_before - loaded[0]["step"],
        "source": run.get("tier") or loaded[0]["source"],
        "launches": len(run["launches"]),
        # a segment that ended with its rank: when its launcher exited (the bench starts the next one at once)
        "relaunch_s": run["launches"][1] - kill_t if len(run["launches"]) > 1 else None,
        "snapshots": len(snaps),
        "storage_saves": len(stores),
        "skipped": max((e.get("skipped", 0) for e in evs if e["ev"] == "boundary"), default=0),
        "params": built[0]["params"] if built else 0,
        "losses": {str(e["s"]): e["loss"] for e in evs if e["ev"] == "step"},
    }


def cell(values: list[float], unit: str, digits: int, best: bool) -> str:
    med = statistics.median(values)
    text = f"{med:.{digits}f}{unit}"
    text = f"**{text}**" if best else text
    if len(values) > 1:
        text += f" [{min(values):.{digits}f}–{max(values):.{digits}f}]"
    return text


def table(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The published table: one column per system, one row per figure (the lowest median in bold), and notes."""
    from benchlib import md_table

    systems = [s for s in SYSTEMS if any(r["system"] == s for r in runs)]
    figs = {s: [r["figures"] for r in runs if r["system"] == s] for s in systems}
    rows = []
    for key, label, unit, digits in ROWS:
        meds = {s: round(statistics.median([f[key] for f in figs[s]]), digits) for s in systems}
        low = min(meds.values())
        rows.append(
            [
                label,
                *[cell([f[key] for f in figs[s]], unit, digits, meds[s] == low and len(systems) > 1) for s in systems],
            ]
        )
    body = md_table([FIRST_COLUMN, *[LABELS[s] for s in systems]], rows, "l" + "r" * len(systems))
    return body + "\n\n" + "\n".join(f"- {n}" for n in notes(runs, figs, meta))


def notes(runs: list[dict[str, Any]], figs: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> list[str]:
    sch, a = meta["schedule"], meta["args"]
    params = max(f["params"] for fs in figs.values() for f in fs)
    losses = [r["figures"]["losses"] for r in runs]
    same = all(x == losses[0] for x in losses)
    order = " ".join("".join("ABC"[SYSTEMS.index(s)] for s in o) for o in meta["orders"])
    first = lambda key, s: figs[s][0][key] if s in figs else None  # noqa: E731
    out = [
        f"Model: a {params / 1e6:.1f}M-parameter Llama (hidden {a['hidden']}, {a['layers']} layers, vocabulary "
        f"{a['vocab']}), fp32, FSDP2 on {a['nproc']} gloo CPU ranks, AdamW: {params * 12 / 1e9:.2f} GB of state "
        f"(weights and both moments) per snapshot; global batch {a['batch']} × {a['seq']} tokens, the same batches "
        f"in every run; OMP_NUM_THREADS={a['threads']} for every process. {len(meta['orders'])} rounds, the "
        f"systems run one after another in an order rotated round by round ({order}; A = shardkeeper, B = DLRover, "
        "C = torch); within a run, the median of its counted saves.",
        f"Schedule, the same in every run: a snapshot every {sch['memory_interval']} steps and a storage save every "
        f"{sch['interval']} (torch: an `async_save` to disk at each, its only kind); the saves of the first "
        f"{sch['interval']} steps are warm-up, then {figs[next(iter(figs))][0]['snapshots']} snapshots and "
        f"{figs[next(iter(figs))][0]['storage_saves']} storage saves are counted per run. Before every save and "
        "every timed copy the previous save is waited for, so each starts with nothing in flight. Stall: the "
        "boundary between two steps with the save (after a barrier; the slower rank) minus one without; one host "
        "copy: `get_state_dict` and a copy of every tensor into preallocated buffers, the same in every run.",
        "Durable on disk: from the call until the checkpoint is committed on disk in its own terms: shardkeeper, the "
        "step's manifest.json renamed into place (persisted from its snapshot in the background); DLRover, its "
        "agent's commit (every shard's done file, then the tracker names the step); torch, `async_save`'s future done "
        "(every file fsynced, .metadata written). Checkpoints of all three on the same disk (bench/out/peers), "
        "nothing evicted from the page cache.",
        f"Kill: rank 1 SIGKILLed right after the snapshot of step {sch['kill_at']} is complete (shardkeeper: committed "
        "in /dev/shm; DLRover: in its shared memory; torch: on disk), while step "
        f"{sch['kill_at'] + 1} computes. First step done again: the restarted rank 0's first optimizer step; new "
        "ranks started: the restarted rank processes' start. Restored from: "
        + ", ".join(
            f"{LABELS[s]} {first('source', s)} (step {first('restored_step', s)}, "
            f"{first('redone', s)} step(s) trained again)"
            for s in figs
        )
        + ".",
        f"On the kill: DLRover's agent (`dlrover-run --max-restarts {a['max_restarts']}`) restarts the worker group "
        "in place and the new ranks load from the shared memory it holds; torch's `async_save` has no restart of "
        f"its own: `torchrun --max-restarts {a['max_restarts']}` restarts the worker group in place and the new "
        "ranks `dcp.load` the newest complete checkpoint; shardkeeper "
        + (
            f"restarts the ranks in place (`checkpoint.restarts: {a['max_restarts']}`), which resume from the "
            "newest snapshot."
            if meta["sk_restarts"]
            else "ends the segment (torchrun exits, the launcher persists the newest snapshot to storage and exits) "
            "and "
            "the bench starts the next segment (`shardkeeper train`) at once, which resumes from the snapshot in "
            "/dev/shm: kill → new ranks started includes all of that."
        ),
        "/dev/shm peak: the pages of the run's own files there (shardkeeper's memory dir, DLRover's shared memory "
        "segments; torch keeps nothing there), sampled every 20 ms. The tmpfs's used bytes above their level before "
        "the run (every process's files, and segments unlinked but still mapped), median per system: "
        + ", ".join(f"{LABELS[s]} {statistics.median(f['tmpfs_peak_gb'] for f in figs[s]):.2f} GB" for s in figs)
        + ".",
        f"DLRover {DLROVER_VERSION} in a virtualenv of the bench's own that runs the project's torch (the same files); "
        "its FSDP checkpointer class wraps FSDP1's state-dict API, so the FSDP2 model goes through its FSDP engine "
        "(`FsdpCheckpointEngine`) with `get_state_dict`'s state dict. Three things in 0.6.1 are worked around "
        "(bench/peers_memtier_loop.py says how): its standalone mode cannot start its local master on this torch "
        "(torch's `SubprocessHandler` takes one more argument), so the bench starts the master as `dlrover-run` would "
        "(`python -m dlrover.python.master.main --platform local`) and points `dlrover-run` at it; its FSDP engine "
        "leaves the rank out of the config each snapshot hands the agent (every shard's done file is named 0, so the "
        "commit waits out its 600 s timeout and holds back the next storage save), which the loop sets as DLRover's "
        "other engines do; and it restores the values no rank shards (AdamW's step counters) from rank 0's part "
        "only, as DCP once saved them all from rank 0, so its snapshots are planned that way "
        "(`dedup_save_to_lowest_rank`).",
        "torch: `dcp.async_save` with its defaults (a background thread, a fresh staging copy at each call: "
        "torchtitan's 'async' mode) on a gloo process group of its own; torchrun with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which its restarted workers wait forever on the previous "
        "attempt's gloo addresses.",
        f"The loss of every step, before the kill and after the restore, is identical in all {len(runs)} runs: "
        f"{'yes' if same else 'NO'}.",
    ]
    return out


# --------------------------------------------------------------------------------------------- plot
def plot(results: Path | None = None) -> Path:
    """bench/results/peers-memtier.png: one panel per figure of the published table, a bar per system."""
    from benchlib import hbars, plot_from_table, table_rows

    rows = table_rows(NAME, results=results)
    systems = [k for k in rows[0] if k != FIRST_COLUMN]
    units = {label: unit.strip() for _, label, unit, _ in ROWS}
    shown = [r for r in rows if not r[FIRST_COLUMN].startswith("of which: new ranks")]

    def draw(fig) -> None:
        for i, row in enumerate(shown):
            ax = fig.add_subplot(2, 3, i + 1)
            label = row[FIRST_COLUMN]
            hbars(
                ax,
                systems,
                [row[s] for s in systems],
                units.get(label, ""),
                grey={j for j, s in enumerate(systems) if s != LABELS["shardkeeper"]},
            )
            ax.set_title(label, fontsize=8)

    return plot_from_table(NAME, draw, size=(11.0, 5.0), results=results)


# --------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="runs of each system, in an order rotated per round")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (2 -> 37.9M parameters at the defaults)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--memory-interval", type=int, default=2, help="steps between snapshots")
    ap.add_argument("--interval", type=int, default=8, help="steps between storage saves")
    ap.add_argument("--cycles", type=int, default=2, help="counted storage intervals per run (after one of warm-up)")
    ap.add_argument("--max-restarts", type=int, default=3, help="in-place restarts each launcher may make")
    ap.add_argument("--storage-dir", default=str(OUT / "ckpt"), help="where every system's checkpoints go")
    ap.add_argument(
        "--memory-dir",
        default=f"/dev/shm/shardkeeper-peers-{os.getpid()}",
        help="shardkeeper's checkpoint.memory_dir (one per run below it)",
    )
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--no-publish", action="store_true")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from the published table")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        ap.error(f"--systems {args.systems!r}: use a comma-separated subset of {', '.join(SYSTEMS)}")
    if not 2 <= args.memory_interval < args.interval:
        ap.error(f"--memory-interval {args.memory_interval}: must be at least 2 and below --interval {args.interval}")
    if args.rounds < 1 or args.cycles < 1 or args.batch % args.nproc:
        ap.error("--rounds and --cycles must be at least 1, and --batch a multiple of --nproc")
    args.systems = [s for s in SYSTEMS if s in systems]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.plot_only:
        plot()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    dl_py = dlrover_python(OUT / "dlrover-venv") if "dlrover" in args.systems else None
    sch = schedule(args)
    runs, orders = [], []
    try:
        for rnd in range(args.rounds):
            order = args.systems[rnd % len(args.systems) :] + args.systems[: rnd % len(args.systems)]
            orders.append(order)
            for system in order:
                t0 = time.monotonic()
                run = run_system(system, rnd, args, dl_py)
                run["figures"] = figures(run, sch)
                runs.append(run)
                f = run["figures"]
                print(
                    f"round {rnd + 1} {system}: stall {f['stall_ratio']:.2f}x copy, storage stall "
                    f"{f['storage_stall_s']:.3f} s, durable {f['durable_s']:.2f} s, kill -> step "
                    f"{f['recovery_s']:.1f} s (ranks {f['kill_to_ranks_s']:.2f} s), /dev/shm "
                    f"{f['shm_peak_gb']:.2f} GB [{time.monotonic() - t0:.0f} s]",
                    flush=True,
                )
                (OUT / "raw.json").write_text(
                    json.dumps({"runs": [{k: v for k, v in r.items() if k != "events"} for r in runs]}, indent=1)
                )
    finally:
        shutil.rmtree(args.memory_dir, ignore_errors=True)
    meta = {
        "schedule": sch,
        "args": vars(args),
        "orders": orders,
        "sk_restarts": "shardkeeper" in args.systems and shardkeeper_restarts(),
    }
    body = table(runs, meta)
    if args.no_publish:
        print("\n" + body)
        return
    from benchlib import publish

    publish(NAME, body)
    plot()


if __name__ == "__main__":
    main()
