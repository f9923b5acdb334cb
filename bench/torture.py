"""Reliability torture: SIGKILL and SIGTERM real 2-rank segments (FSDP2 async/sync, DeepSpeed ZeRO-2)
through the real CLI at random moments weighted toward save, commit and retention, and count what must
never happen. Prints a markdown table and writes bench/out/torture.json (+ torture-events.jsonl).

    python bench/torture.py --kills 200            # the full torture (~1 h on 2 cores)
    python bench/torture.py --quick                # 8 kills, 5 preemptions, secrets (~8 min)
    python bench/torture.py --quick --corpora      # + the tests/reliability hostile/bad-input suites
    python bench/torture.py --kills 40 --max-minutes 20 --work /tmp/torture --keep

Every chain of kills lives in its own run directory and ends with an uninterrupted segment whose
final checkpoint is compared bitwise with a reference run; --max-minutes stops starting kills (the
chains in progress are still finished and compared). Events are appended to torture-events.jsonl as
they happen, so an interrupted torture still leaves its figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.reliability.torture_lib import CONFIGS, PREEMPT_CASES, TARGETS, Torture, run_corpora  # noqa: E402

QUICK_PLAN = {  # (target, window) per kill: every target once per backend, the windows that matter most
    "fsdp2-async": [("rank", "train"), ("cli", "save"), ("group", "commit"), ("torchrun", "retention")],
    "deepspeed": [("rank", "save"), ("torchrun", "commit"), ("cli", "train"), ("group", "retention")],
}
CHAIN_ORDER = ("fsdp2-async", "fsdp2-sync", "deepspeed")


def machine() -> dict:
    import psutil

    def ver(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "disk_free_gib": round(shutil.disk_usage(ROOT).free / 2**30, 1), "python": platform.python_version(),
            "torch": ver("torch"), "deepspeed": ver("deepspeed"), "command": " ".join([sys.executable, *sys.argv])}


def run(args: argparse.Namespace, out_dir: Path) -> dict:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="torture-"))
    events = (out_dir / "torture-events.jsonl").open("w")

    def log(line: str) -> None:
        print(line, flush=True)
        events.write(json.dumps({"t": round(time.monotonic() - t0, 1), "line": line}) + "\n")
        events.flush()

    t0 = time.monotonic()
    deadline = t0 + args.max_minutes * 60
    h = Torture(work, final=args.final or (150 if args.quick else 200), seed=args.seed, log=log)
    log(f"work dir {work}; final step {h.final}")
    chains: list[dict] = []
    kill_t0 = time.monotonic()
    if args.quick:
        for name, plan in QUICK_PLAN.items():
            chains.append(h.kill_chain(CONFIGS[name], 0, len(plan), deadline, plan))
    else:
        left, i = args.kills, 0
        while left > 0 and time.monotonic() < deadline:
            cfg = CONFIGS[CHAIN_ORDER[i % len(CHAIN_ORDER)]]
            before = len([k for k in h.stats.kills if k["killed"]])
            chains.append(h.kill_chain(cfg, i, min(args.per_chain, left), deadline, None))
            left -= len([k for k in h.stats.kills if k["killed"]]) - before
            i += 1
            _dump(out_dir, h, machine_info, time.monotonic() - kill_t0, partial=True)
    kill_seconds = time.monotonic() - kill_t0
    if not args.no_preempt:
        h.preempt_chain(CONFIGS["fsdp2-async"], PREEMPT_CASES)
        if not args.quick and time.monotonic() < deadline:
            h.preempt_chain(CONFIGS["deepspeed"], tuple(c for c in PREEMPT_CASES if c != "async-save"))
    h.check_async_sync_same()
    secrets = None if args.no_secrets else h.secrets(CONFIGS["fsdp2-async"])
    corpora = run_corpora(out_dir / "reliability-junit.xml") if args.corpora else None
    events.close()
    result = _dump(out_dir, h, machine_info, kill_seconds, secrets=secrets, corpora=corpora)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _dump(out_dir: Path, h: Torture, info: dict, kill_seconds: float, *, partial: bool = False,
          secrets: dict | None = None, corpora: dict | None = None) -> dict:
    st = h.stats
    result = {"machine": info, "partial": partial, "final_step": h.final, "kill_phase_seconds": round(kill_seconds, 1),
              "violations": st.violations(), "kills": st.kills, "segments": st.segments, "chains": st.chains,
              "preemptions": st.preemptions, "secrets": secrets, "corpora": corpora, "notes": st.notes}
    (out_dir / "torture.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def table(r: dict) -> str:
    kills = [k for k in r["kills"] if k["killed"]]
    m = r["machine"]
    lines = [f"Reliability torture, {m['date']} on {m['host']}: {m['cpus']} cores, {m['memory_gib']} GiB RAM, "
             f"{m['disk_free_gib']} GiB disk free; Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}",
             f"`{m['command']}`", "", "| figure | value |", "|---|---|"]
    for backend in ("fsdp2", "deepspeed"):
        for t in TARGETS:
            n = [k for k in kills if k["backend"] == backend and k["target"] == t]
            if n:
                by = {}
                for k in n:
                    w = (k["moment"] or "").split(":")[0]
                    by[w] = by.get(w, 0) + 1
                lines.append(f"| SIGKILL {t} ({backend}) | {len(n)} ({', '.join(f'{w} {c}' for w, c in sorted(by.items()))}) |")
    v = r["violations"]
    segs = [s for s in r["segments"] if s["loaded"] and s["kind"] != "finish" and s["expected_resume"] > 0]
    exact = [s for s in segs if not s["resume_problem"] and not s["inexact_steps"]]
    chains = r["chains"]
    secs = [k["seconds"] for k in kills]
    pre = [p for p in r["preemptions"] if p["signalled"]]
    rows = [
        ("kills (all targets)", f"{len(kills)} over {len(chains)} run dirs (+{len(r['kills']) - len(kills)} segments that ended before their moment)"),
        ("torn checkpoint accepted (latest committed fails validate --deep, or resumed from .partial / wrong step)",
         v.get("torn_latest_checkpoint", 0) + v.get("partial_or_wrong_resume", 0)),
        ("no valid checkpoint left after one was committed", v.get("no_valid_checkpoint_left", 0)),
        ("segments with processes alive 5 s after the kill", f"{v.get('orphans_after_5s', 0)} "
         f"({sum(k.get('orphans', 0) for k in r['kills'])} processes)"),
        ("SIGKILLs after which a checkpoint not yet decided at the kill was committed (ranks outlived their launcher)",
         v.get("committed_after_kill", 0)),
        ("second writer started while they lived", f"{v.get('second_writer_started', 0)} "
         f"(probed {sum(1 for k in r['kills'] if k.get('second_writer'))}, refused "
         f"{sum(1 for k in r['kills'] if k.get('second_writer') == 'refused')})"),
        ("exact resumes (segment resumed at the newest valid step, every step bitwise = reference)",
         f"{len(exact)}/{len(segs)} ({100 * len(exact) / max(1, len(segs)):.0f} %); "
         f"{v.get('inexact_steps', 0)} inexact steps"),
        ("run dirs whose final checkpoint = reference bitwise", f"{sum(1 for c in chains if not c['final_diffs'])}/{len(chains)}"),
        ("preemption cases (SIGTERM): exit 75", f"{sum(1 for p in pre if p['exit_code'] == 75)}/{len(pre)} "
         '(' + ', '.join(f"{p['case']}={p['exit_code']}" for p in pre) + ')'),
        ("completed steps lost on preemption", v.get("preempt_steps_lost", 0)),
        ("segments whose CLI printed its own traceback", v.get("cli_traceback", 0)),
        ("secret (HF_TOKEN) leaks", "n/a" if not r["secrets"] else
         f"{len(r['secrets']['hits'])} files of {r['secrets']['files_scanned']} scanned"),
        ("time per kill (launch to checks done)", f"median {_median(secs):.1f} s, max {max(secs, default=0):.1f} s; "
         f"{3600 * len(kills) / max(1.0, sum(k['seconds'] for k in r['kills'])):.0f} kills/hour "
         f"(references and finishing segments excluded)"),
    ]
    if r["corpora"]:
        c = r["corpora"]
        rows.append(("hostile/corruption/bad-input corpus (pytest tests/reliability)",
                     f"{c['passed']} passed, {c['failed'] + c['errors']} failed, {c['skipped']} skipped" + (f" ({c['note']})" if c.get("note") else "")))
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "violations: " + (json.dumps(v) if v else "none")] + [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


machine_info: dict = {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=200, help="SIGKILLs in all (spread over run dirs of --per-chain)")
    ap.add_argument("--per-chain", type=int, default=50, help="launches per run dir before it is finished and compared")
    ap.add_argument("--quick", action="store_true", help="the small subset: 8 kills, 5 preemptions, secrets")
    ap.add_argument("--max-minutes", type=float, default=120.0, help="start no new kill after this")
    ap.add_argument("--final", type=int, default=None, help="final step of every run (default 200; 150 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--no-preempt", action="store_true")
    ap.add_argument("--no-secrets", action="store_true")
    ap.add_argument("--corpora", action="store_true", help="also run tests/reliability -k 'hostile or corruption or bad_input'")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine_info.update(machine())
    result = run(args, out_dir)
    text = table(result)
    (out_dir / "torture.md").write_text(text + "\n")
    print(text)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
