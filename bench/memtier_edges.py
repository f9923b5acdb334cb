"""The memory tier's edges: a fault x a moment, through the real CLI; steps lost, wrong states, the lines printed.

    nice -n 5 python bench/memtier_edges.py              # ~40 CLI launches, ~10 min on 2 idle cores
    python bench/memtier_edges.py --only kill,tamper --no-publish

Every cell is a run of bench/memtier_edges_loop.py (a small FSDP2 MLP, 2 ranks, ``shardkeeper train --script``)
with a memory snapshot every K=2 steps (``checkpoint.memory_dir`` under /dev/shm) and a storage checkpoint every 6:
a first segment to step 12 with one fault, then a second segment to step 16 (with the memory tier off, or another
memory dir, for those rows). Faults: a rank SIGKILLed; a byte of a snapshot flipped; a snapshot deleted; the next
segment with the memory tier off; the next segment with another memory dir; another run's snapshot (same run name,
another learning rate) copied into the memory dir. Moments: right after the commit of a snapshot (step 4, or 6 where
a storage checkpoint is persisted from it); while the ranks copy the snapshot of step 6 to storage (mid-persist);
between segments (the launcher itself SIGKILLed with its ranks right after the snapshot of step 4 and the fault
applied before the next ``train``; for the rows about the next segment, after a segment that ended normally).

What is counted, against a reference run of the same script without a fault:
- steps lost: progress the memory tier (an intact committed snapshot) or the live ranks held when the fault struck
  that the next resume point does not include (0 required; steps trained after the newest snapshot when a rank died
  are retrained and shown apart: at most K);
- wrong state: steps whose logged loss differs (bitwise) from the reference's after the run reached step 16, plus a
  final checkpoint that fails deep validation (0 required);
- the lines printed: the launcher's own lines (``shardkeeper: ...``) and the ranks' warnings about the memory tier.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

LOOP = ROOT / "bench" / "memtier_edges_loop.py"
OUT = ROOT / "bench" / "out" / "memtier-edges"
K, EVERY, FIRST, SECOND = 2, 6, 12, 16
EVENTS = ("kill", "tamper", "vanish", "tier-off", "other-dir", "foreign")
MOMENTS = ("commit", "persist", "between")
TITLE = {
    "kill": "kill a rank",
    "tamper": "tamper a snapshot",
    "vanish": "snapshot vanished",
    "tier-off": "tier off next segment",
    "other-dir": "other memory_dir next segment",
    "foreign": "another run's snapshot",
}
MOMENT_TITLE = {"commit": "right after a snapshot commit", "persist": "mid-persist", "between": "between segments"}


def cli(
    run: Path,
    until: int,
    sets: list[str],
    env: dict[str, str] | None = None,
    script: bool = False,
    script_args: list[str] | None = None,
    mark: Path | None = None,
) -> tuple[int, str]:
    """One ``shardkeeper train`` of the loop; with ``mark``, SIGKILL the launcher once that file appears."""
    argv = [
        sys.executable,
        "-m",
        "shardkeeper",
        "train",
        "--run-dir",
        str(run),
        "--nproc",
        "2",
        "--until-step",
        str(until),
        "--device",
        "cpu",
        *[x for s in sets for x in ("--set", s)],
    ]
    if script:
        argv += ["--script", str(LOOP), "--", *(script_args or [])]
    full = {**os.environ, "COLUMNS": "400", **(env or {})}
    proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if mark is not None:
        deadline = time.monotonic() + 600
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()  # the launcher dies: torchrun and its ranks die with it (PDEATHSIG, the ranks' watchdog)
    out, _ = proc.communicate(timeout=900)
    if mark is not None:
        _ranks_gone(run)
    return proc.returncode, out


def _ranks_gone(run: Path) -> None:
    """Wait until no process of the killed segment holds the run's rank lock (the next train would wait too)."""
    import fcntl

    path = run / ".lock.ranks"
    deadline = time.monotonic() + 120
    while path.exists() and time.monotonic() < deadline:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            time.sleep(0.1)
        finally:
            os.close(fd)


def metrics(run: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def flip(snap: Path) -> None:
    shard = sorted(snap.glob("__1_*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def said(out: str, work: Path, mem_root: Path) -> list[str]:
    """The launcher's lines and the ranks' memory-tier warnings, paths shortened."""
    keep = []
    for line in out.splitlines():
        line = line.strip()
        body = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \[rank\d+\] [\w.]+: ", "", line)
        launcher = line.startswith("shardkeeper: ")
        rank = body != line and re.search(r"not persisted|not used|refused|memory tier lost", body)
        if launcher or rank:
            short = body.replace(str(mem_root), "MEM").replace(str(work / "run"), "RUN").replace(str(work), "WORK")
            keep.append(short)
    return keep


class Cell:
    """One fault at one moment: its run directory, memory dirs and what came of it."""

    def __init__(self, event: str, moment: str, base: Path, shm: Path) -> None:
        self.event, self.moment = event, moment
        self.work = base / f"{event}-{moment}"
        self.mem_root = shm / f"{event}-{moment}"
        self.mem, self.mem2 = self.mem_root / "a", self.mem_root / "b"
        for p in (self.work, self.mem_root):
            shutil.rmtree(p, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.run = self.work / "run"
        self.lines: list[str] = []
        self.rcs: list[int] = []
        self.held = -1  # the newest step the tier or the live ranks held intact when the fault struck
        self.trained = 0  # the newest step trained before the fault ended the segment
        self.stored: list[int] = []  # the storage checkpoints after the first segment (and its launcher's persist)
        self.struck: int | None = None  # the step of the snapshot the fault struck (None: the fault is not one)

    def sets(self, mem: Path | None) -> list[str]:
        # restarts=0: a killed rank ends its segment, as the edges judge it (a restart in place: recovery_bench --kill)
        base = ["name=edges", f"checkpoint.interval={EVERY}", "checkpoint.keep_last=100", "checkpoint.restarts=0"]
        return base + (
            [f"checkpoint.memory_interval={K}", f"checkpoint.memory_dir={mem}"]
            if mem is not None
            else ["checkpoint.memory_interval=null"]
        )

    def segment(
        self,
        until: int,
        mem: Path | None,
        env: dict[str, str] | None = None,
        first: bool = False,
        mark: Path | None = None,
    ) -> None:
        rc, out = cli(self.run, until, self.sets(mem), env, script=first, mark=mark)
        self.rcs.append(rc)
        self.lines += said(out, self.work, self.mem_root)
        (self.work / f"segment-{len(self.rcs)}.log").write_text(out)


def snapshot_steps(mem: Path) -> list[int]:
    ck = mem / "checkpoints"
    return (
        sorted(
            int(p.name[5:])
            for p in ck.glob("step-*")
            if re.fullmatch(r"step-\d{8}", p.name) and (p / "manifest.json").is_file()
        )
        if ck.is_dir()
        else []
    )


def storage_steps(run: Path) -> list[int]:
    return sorted(
        int(p.name[5:])
        for p in (run / "checkpoints").glob("step-*")
        if re.fullmatch(r"step-\d{8}", p.name) and (p / "manifest.json").is_file()
    )


def run_cell(event: str, moment: str, base: Path, shm: Path, foreign: dict[int, Path]) -> Cell:
    c = Cell(event, moment, base, shm)
    mark = c.work / "reached"
    fault = {"EDGE_MARK": str(mark)}
    # the snapshot struck: 4 (a memory-only step) for a kill; 6 (a storage step: its persist follows) for a change
    step = 6 if moment == "persist" or (moment == "commit" and event in ("tamper", "vanish")) else 4
    if event in ("tier-off", "other-dir"):  # the previous segment's end: killed with its launcher, or normal
        if moment == "between":
            c.segment(FIRST, c.mem, first=True)
        else:
            c.segment(
                FIRST,
                c.mem,
                {**fault, "EDGE_EVENT": "launcher", "EDGE_MOMENT": moment, "EDGE_STEP": str(step)},
                first=True,
                mark=mark,
            )
        if moment != "between":
            c.struck = int(Path(f"{mark}.step").read_text())
        c.held = max(snapshot_steps(c.mem) + storage_steps(c.run))
        c.trained = max(metrics(c.run))
        c.stored = storage_steps(c.run)
        c.segment(SECOND, None if event == "tier-off" else c.mem2)
        return c
    if (
        moment == "between"
    ):  # the launcher dies with its ranks after the snapshot of step 4; the fault before next train
        if event == "foreign":  # after a segment that ended normally
            c.segment(FIRST, c.mem, first=True)
            c.held = max(snapshot_steps(c.mem) + storage_steps(c.run))
            shutil.copytree(foreign[14], c.mem / "checkpoints" / foreign[14].name)
        else:
            c.segment(
                FIRST,
                c.mem,
                {**fault, "EDGE_EVENT": "launcher", "EDGE_MOMENT": "commit", "EDGE_STEP": "4"},
                first=True,
                mark=mark,
            )
            c.struck = struck = int(Path(f"{mark}.step").read_text())
            snap = c.mem / "checkpoints" / f"step-{struck:08d}"
            if event == "tamper":
                flip(snap)
            elif event == "vanish":
                shutil.rmtree(snap)
            intact = [s for s in snapshot_steps(c.mem) if event == "kill" or s != struck]  # what the fault left whole
            c.held = max(intact + storage_steps(c.run) + [0])
        c.trained = max(metrics(c.run))
        c.stored = storage_steps(c.run)
        c.segment(SECOND, c.mem)
        return c
    env = {**fault, "EDGE_EVENT": event, "EDGE_MOMENT": moment, "EDGE_STEP": str(step)}
    if event == "foreign":
        env["EDGE_FOREIGN"] = str(foreign[14 if moment == "commit" else step])
    c.segment(FIRST, c.mem, env, first=True)
    c.trained = max(metrics(c.run))
    c.stored = storage_steps(c.run)
    if not Path(f"{mark}.step").exists():
        raise RuntimeError(f"{c.work}: the fault never struck (no snapshot at or after step {step})")
    c.struck = int(Path(f"{mark}.step").read_text())
    c.held = c.struck if c.rcs[-1] != 0 else c.trained  # a rank died: the snapshot struck is the newest progress
    c.segment(SECOND, c.mem)
    return c


def outcome(c: Cell, reference: dict[int, dict]) -> dict:
    from ckpt.validate.checks import validate

    segs = [json.loads(x) for x in (c.run / "segments.jsonl").read_text().splitlines()]
    starts = [s for s in segs if s.get("event") == "start"]
    resumed = starts[-1]["start_step"]
    got = metrics(c.run)
    wrong = [s for s in range(1, SECOND + 1) if s not in got or got[s]["loss"] != reference[s]["loss"]]
    final = c.run / "checkpoints" / f"step-{SECOND:08d}"
    deep = validate(final, deep=True)
    went_on = c.rcs[0] == 0
    return {
        "event": c.event,
        "moment": c.moment,
        "struck": c.struck,
        "rcs": c.rcs,
        "went_on": went_on,
        "resumed_at": resumed,
        "held": c.held,
        "trained": c.trained,
        "lost": 0 if went_on else max(0, c.held - resumed),
        "retrained": 0 if went_on else max(0, c.trained - resumed),
        "stored": c.stored,
        "wrong": len(wrong) + (0 if deep.valid else 1),
        "wrong_steps": wrong[:5],
        "deep_valid": deep.valid,
        "lines": c.lines,
        "memory_dirs_left": sorted(p.name for p in c.mem_root.iterdir()) if c.mem_root.is_dir() else [],
    }


def foreign_snapshots(base: Path, shm: Path) -> dict[int, Path]:
    """Another run with this run's name (another learning rate): its snapshots of steps 6 and 14, kept aside."""
    c = Cell("other", "run", base, shm)
    keep = c.work / "kept"
    keep.mkdir()
    out = {}
    for until in (6, 14):
        rc, log = cli(c.run, until, c.sets(c.mem), script=until == 6, script_args=["--lr", "0.02"])
        assert rc == 0, log[-3000:]
        snap = c.mem / "checkpoints" / f"step-{until:08d}"
        out[until] = Path(shutil.copytree(snap, keep / snap.name))
    return out


def table(rows: list[dict]) -> str:
    from benchlib import md_table

    head = [
        "fault",
        "moment",
        "at snapshot",
        "first segment",
        "storage after it",
        "resumed at (held)",
        "steps lost",
        "retrained",
        "wrong state",
        "memory dirs left",
        "lines printed",
    ]
    body = []
    for r in rows:
        seg = ("went on (rc 0)" if r["went_on"] else f"ended rc {r['rcs'][0]}") + f"; next rc {r['rcs'][-1]}"
        lines = "<br>".join(ln.replace("|", "\\|") for ln in dict.fromkeys(r["lines"])) or "(none)"
        body.append(
            [
                TITLE[r["event"]],
                MOMENT_TITLE[r["moment"]],
                r["struck"] or "-",
                seg,
                ", ".join(map(str, r["stored"])) or "none",
                f"{r['resumed_at']} ({r['held'] if not r['went_on'] else '-'})",
                r["lost"],
                r["retrained"],
                r["wrong"],
                ", ".join(r["memory_dirs_left"]) or "none",
                lines,
            ]
        )
    lost, wrong = sum(r["lost"] for r in rows), sum(r["wrong"] for r in rows)
    whole = [r["retrained"] for r in rows if r["event"] not in ("tamper", "vanish") or r["went_on"]]
    broken = [r["retrained"] for r in rows if r["event"] in ("tamper", "vanish") and not r["went_on"]]
    return (
        md_table(head, body, "llrllrrrrll")
        + f"\n\n{len(rows)} cells: steps lost {lost} (0 required), wrong states {wrong} (0 required). Steps "
        f"retrained after a segment died: at most {max(whole, default=0)} when the newest snapshot survived "
        f"(those trained after it; memory_interval K = {K}, and a snapshot due while a save is in flight is "
        f"skipped), at most {max(broken, default=0)} when the fault destroyed it (the run resumes from the one "
        "before). 'held': the newest step an intact snapshot, storage or the live ranks held when the fault "
        "struck; 'at snapshot': the snapshot the fault struck (the first at or after step 4, or the one of step "
        "6 that storage is persisted from); 'memory dirs left': a = the first segment's memory dir, b = the "
        "second's. MEM = the cell's /dev/shm root, RUN = its run directory."
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(EVENTS), help="comma-separated faults: " + ", ".join(EVENTS))
    ap.add_argument("--moments", default=",".join(MOMENTS))
    ap.add_argument("--shm", default="/dev/shm/shardkeeper-edges", help="where the cells' memory dirs go (a tmpfs)")
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("SHARDKEEPER_DEVICE", "cpu")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    base, shm = OUT, Path(args.shm)
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    base.mkdir(parents=True)
    t0 = time.monotonic()
    ref = Cell("reference", "run", base, shm)
    rc, out = cli(ref.run, FIRST, ref.sets(ref.mem), script=True)
    assert rc == 0, out[-3000:]
    rc, out = cli(ref.run, SECOND, ref.sets(ref.mem))
    assert rc == 0, out[-3000:]
    reference = metrics(ref.run)
    events = args.only.split(",")
    foreign = foreign_snapshots(base, shm) if "foreign" in events else {}
    rows = []
    for event in events:
        for moment in args.moments.split(","):
            t = time.monotonic()
            row = outcome(run_cell(event, moment, base, shm, foreign), reference)
            row["seconds"] = round(time.monotonic() - t, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (base / "edges.json").write_text(json.dumps(rows, indent=1))
    body = table(rows)
    print(f"\n{body}\n({time.monotonic() - t0:.0f} s)")
    shutil.rmtree(shm, ignore_errors=True)
    if not args.no_publish:
        from benchlib import publish

        publish("memtier-edges", body)


if __name__ == "__main__":
    main()
