"""A rank SIGKILLed during start-up: seconds from the kill until `shardkeeper train` exits, through the real CLI.

    python bench/startup_kill_bench.py                            # this checkout, 5 repetitions
    python bench/startup_kill_bench.py --baseline /path/to/other/checkout --reps 3   # and another checkout, alternated

Each repetition starts ``python -m shardkeeper train --config configs/tiny.yaml --nproc 2`` on a fresh run
directory, SIGSTOPs one rank as soon as both exist (it is importing torch), waits until the other has connected
to the rendezvous store (a TCP connection), SIGKILLs the stopped one and times the CLI until it exits: its peer
is left alone in rendezvous, the case where it waited for torchrun's 30 s teardown. A checkout given with
``--baseline`` runs the same scenario, alternated with this one, so both see the same machine load. The table
gives the median (min–max) seconds, the exit codes and whether the one error line named the killed rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import fmt, md_table, publish  # noqa: E402 - bench/ is on the path when run as a script


def ranks_of(run: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(run) in cmd and "trainer.segment" in cmd and "torch.distributed.run" not in cmd:
            found.append(p)
    return found


def connected(p: psutil.Process) -> bool:
    try:
        return any(c.status == psutil.CONN_ESTABLISHED for c in p.net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def once(root: Path, work: Path) -> tuple[float, int, bool]:
    """(seconds from the kill to the CLI's exit, its exit code, whether its error line named the killed rank)."""
    run = work / f"run-{time.monotonic_ns()}"
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "COLUMNS": "400", "PYTHONPATH": str(root)}
    # a death ends its segment here (checkpoint.restarts=0, where the checkout has it): what is timed is that end
    schema = root / "schemas" / "run.py"
    off = ["--set", "checkpoint.restarts=0"] if schema.is_file() and "restarts: int" in schema.read_text() else []
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardkeeper",
            "train",
            "--config",
            str(root / "configs" / "tiny.yaml"),
            "--run-dir",
            str(run),
            "--nproc",
            "2",
            "--until-step",
            "100000",
            *off,
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(ranks := ranks_of(run)) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the ranks of {run} did not start")
            time.sleep(0.02)
        victim, waiting = max(ranks, key=lambda p: p.pid), min(ranks, key=lambda p: p.pid)
        os.kill(victim.pid, signal.SIGSTOP)  # held before rendezvous until its peer waits there
        while not connected(waiting):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rank pid {waiting.pid} of {run} did not reach rendezvous")
            time.sleep(0.02)
        named = f"(pid {victim.pid})"
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(run, ignore_errors=True)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    return took, proc.returncode, len(lines) == 1 and named in lines[0] and "SIG" in lines[0]


def commit_of(root: Path) -> str:
    try:
        return (
            "commit "
            + subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return "no git commit"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to measure alternately (e.g. main)")
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    sides = [(f"this checkout ({commit_of(ROOT)})", ROOT)]
    if args.baseline:
        sides.append((f"baseline ({commit_of(args.baseline.resolve())})", args.baseline.resolve()))
    got: dict[str, list[tuple[float, int, bool]]] = {name: [] for name, _ in sides}
    with tempfile.TemporaryDirectory(prefix="startup-kill-") as tmp:
        for rep in range(args.reps):
            order = sides if rep % 2 == 0 else list(reversed(sides))
            for name, root in order:
                got[name].append(once(root, Path(tmp)))
                print(f"rep {rep + 1} {name}: {got[name][-1][0]:.1f} s, exit {got[name][-1][1]}", flush=True)
    rows = [
        [
            name,
            fmt([s for s, _, _ in got[name]], 1),
            ", ".join(str(c) for c in sorted({c for _, c, _ in got[name]})),
            f"{sum(ok for _, _, ok in got[name])}/{len(got[name])}",
        ]
        for name, _ in sides
    ]
    body = md_table(
        ["side", "kill → CLI exit, s: median (min–max)", "exit codes", "one error line naming the rank and its signal"],
        rows,
        "lrll",
    )
    if args.no_publish:
        print(body)
    else:
        publish("startup_kill", body)


if __name__ == "__main__":
    main()
