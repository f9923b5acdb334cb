"""Reliability torture: SIGKILL and SIGTERM real 2-rank segments (FSDP2 async/sync, DeepSpeed ZeRO-2)
through the real CLI at random moments weighted toward save, commit and retention, and count what must
never happen. Prints a markdown table and writes bench/out/torture.json (+ torture-events.jsonl).

    python bench/torture.py --kills 200            # the full torture (~1 h on 2 cores)
    python bench/torture.py --quick                # 8 kills, 5 preemptions, secrets (~8 min)
    python bench/torture.py --quick --corpora      # + the tests/reliability hostile/bad-input suites
    python bench/torture.py --kills 40 --max-minutes 20 --work /tmp/torture --keep
    python bench/torture.py --only s3 --kills 24 --per-chain 12 --no-preempt --no-secrets --out /tmp/t-s3
                                                   # one chain kind (here: uploads through a 800 KB/s link)

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

from tests.reliability.torture_lib import (
    CONFIGS,
    PREEMPT_CASES,
    TARGETS,
    Torture,
    completed_in_last_steps,  # noqa: E402
    run_corpora,
)
from tests.reliability.torture_targets import (
    S3_RATE,
    S3Store,
    SlurmCluster,
    convert_chain,
    s3_chain,  # noqa: E402
    slurm_chain,
)

QUICK_PLAN = {  # (target, window) per kill: every target once per backend, the windows that matter most
    "fsdp2-async": [("rank", "train"), ("cli", "save"), ("group", "commit"), ("torchrun", "retention")],
    "deepspeed": [("rank", "save"), ("torchrun", "commit"), ("cli", "train"), ("group", "retention")],
}
# "convert": a 2-rank DeepSpeed checkpoint resumed on 1 rank, killed while rank 0 converts it to universal/;
# "s3": a run directory on the S3-protocol server, killed while a checkpoint is half uploaded.
# "slurm": 2 Slurm nodes x 1 rank, the job SIGKILLed (scancel -s KILL) or a node taken down.
CHAIN_ORDER = ("fsdp2-async", "fsdp2-sync", "deepspeed", "convert", "s3", "slurm")
ALL_TARGETS = (*TARGETS, "scancel", "node-down")
CONVERT_KILLS = 3  # per conversion chain: once the conversion committed, there is nothing left to convert


def machine() -> dict:
    import psutil

    def ver(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "disk_free_gib": round(shutil.disk_usage(ROOT).free / 2**30, 1),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "deepspeed": ver("deepspeed"),
        "argv": list(sys.argv),
    }


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
        order = [c for c in CHAIN_ORDER if c not in args.skip and (not args.only or c in args.only)]
        store = S3Store(rate=args.s3_kbps * 1000) if "s3" in order else None
        cluster = SlurmCluster(work) if "slurm" in order else None
        while left > 0 and time.monotonic() < deadline:
            kind = order[i % len(order)]
            before = len([k for k in h.stats.kills if k["killed"]])
            try:
                if kind == "convert":
                    chains.append(convert_chain(h, i, min(CONVERT_KILLS, left), deadline))
                elif kind == "s3":
                    chains.append(s3_chain(h, store, i, min(args.per_chain, left), deadline))
                elif kind == "slurm":
                    chains.append(slurm_chain(h, cluster, i, min(args.per_chain, left), deadline))
                else:
                    chains.append(h.kill_chain(CONFIGS[kind], i, min(args.per_chain, left), deadline, None))
            except Exception as e:  # a fault of the harness itself (not a verdict): noted, the next chain goes on
                h.stats.notes.append(f"chain {kind}-{i}: the harness failed: {type(e).__name__}: {e}")
                log(f"chain {kind}-{i}: harness error {type(e).__name__}: {e}")
            left -= len([k for k in h.stats.kills if k["killed"]]) - before
            i += 1
            _dump(out_dir, h, machine_info, time.monotonic() - kill_t0, partial=True)
        if store is not None:
            store.close()
        if cluster is not None:
            cluster.close()
    kill_seconds = time.monotonic() - kill_t0
    if not args.no_preempt:
        h.preempt_chain(CONFIGS["fsdp2-async"], PREEMPT_CASES)
        if not args.quick and time.monotonic() < deadline:
            h.preempt_chain(CONFIGS["deepspeed"], tuple(c for c in PREEMPT_CASES if c != "async-save"))
    if args.quick or not args.only or "fsdp2-sync" in args.only:  # (a reference run of its own)
        h.check_async_sync_same()
    secrets = None if args.no_secrets else h.secrets(CONFIGS["fsdp2-async"])
    corpora = run_corpora(out_dir / "reliability-junit.xml") if args.corpora else None
    events.close()
    result = _dump(out_dir, h, machine_info, kill_seconds, secrets=secrets, corpora=corpora)
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _dump(
    out_dir: Path,
    h: Torture,
    info: dict,
    kill_seconds: float,
    *,
    partial: bool = False,
    secrets: dict | None = None,
    corpora: dict | None = None,
) -> dict:
    st = h.stats
    result = {
        "machine": info,
        "partial": partial,
        "kills_asked": _asked[0] if _asked else None,
        "final_step": h.final,
        "kill_phase_seconds": round(kill_seconds, 1),
        "violations": st.violations(),
        "kills": st.kills,
        "segments": st.segments,
        "chains": st.chains,
        "preemptions": st.preemptions,
        "secrets": secrets,
        "corpora": corpora,
        "notes": st.notes,
    }
    (out_dir / "torture.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def run_command(m: dict) -> str:
    """The command of the run the figures come from, as published: ``python bench/torture.py ...`` relative to the
    checkout, whatever interpreter ran it and without the machine's paths (records before ``argv`` kept a string
    starting with the interpreter's path)."""
    from bench.benchlib import command_line

    argv = m.get("argv") or m.get("command", "?").split()[1:]
    return command_line(argv)


def table(r: dict) -> str:
    kills = [k for k in r["kills"] if k["killed"]]
    m = r["machine"]
    lines = [
        f"Reliability torture, {m['date']}: {m['cpus']} cores, {m['memory_gib']} GiB RAM, "
        f"{m['disk_free_gib']} GiB disk free; Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}",
        f"`{run_command(m)}`",
        "",
    ]
    lines += _kill_grid(kills) + ["", "| figure | value |", "|---|---|"]
    v = r["violations"]
    segs = [s for s in r["segments"] if s["loaded"] and s["kind"] != "finish" and s["expected_resume"] > 0]
    exact = [s for s in segs if not s["resume_problem"] and not s["inexact_steps"]]
    chains = r["chains"]
    secs = [k["seconds"] for k in kills]
    pre = [p for p in r["preemptions"] if p["signalled"]]
    survived = [k for k in kills if k["target"] in ("torchrun", "rank") and k.get("launcher_exit_s") is not None]
    exits, bounds = [k["launcher_exit_s"] for k in survived], [k["teardown_bound_s"] for k in survived]
    conv = [k for k in kills if k["chain"].startswith("convert-")]
    up = [k for k in kills if k["chain"].startswith("s3-")]
    sl = [k for k in kills if k["chain"].startswith("slurm-")]
    rows = [
        (
            "kills (all targets)",
            f"{len(kills)} over {len(chains)} run dirs "
            f"(+{len(r['kills']) - len(kills)} segments that ended before their moment)",
        ),
        (
            "torn checkpoint accepted (latest committed fails validate --deep, or resumed from .partial / wrong step)",
            v.get("torn_latest_checkpoint", 0) + v.get("partial_or_wrong_resume", 0),
        ),
        ("no valid checkpoint left after one was committed", v.get("no_valid_checkpoint_left", 0)),
        (
            "segments with processes alive 5 s after the lock holder (the CLI) was gone",
            f"{v.get('orphans_after_5s', 0)} ({sum(k.get('orphans', 0) for k in r['kills'])} processes)",
        ),
        (
            "CLI that survived the kill (torchrun or a rank killed) and exited past 4x its start-up in the same launch",
            f"{sum(1 for k in survived if k.get('launcher_past_bound'))} of {len(survived)}; "
            "exit after the kill median "
            f"{_median(exits):.1f} s, max {max(exits, default=0):.1f} s (bound median {_median(bounds):.1f} s)",
        ),
        (
            "SIGKILLs after which a checkpoint not yet decided at the kill was committed "
            "(ranks outlived their launcher)",
            v.get("committed_after_kill", 0),
        ),
        (
            "second writer started while they lived",
            f"{v.get('second_writer_started', 0)} "
            f"(probed {sum(1 for k in r['kills'] if k.get('second_writer'))}, refused "
            f"{sum(1 for k in r['kills'] if k.get('second_writer') == 'refused')})",
        ),
        (
            "exact resumes (segment resumed at the newest valid step, every step bitwise = reference)",
            f"{len(exact)}/{len(segs)} ({100 * len(exact) / max(1, len(segs)):.0f} %); "
            f"{v.get('inexact_steps', 0)} inexact steps",
        ),
        (
            "conversion kills: mid-conversion (universal.partial left, never loaded) / after its commit",
            f"{sum(1 for k in conv if k['moment'] == 'convert:mid')} / "
            f"{sum(1 for k in conv if k['moment'] != 'convert:mid')}; "
            f"torn universal/ accepted {v.get('torn_universal', 0)}; resumes that did not convert again "
            f"{v.get('not_reconverted', 0)}",
        ),
        (
            "S3 upload kills: half-uploaded step left on the store / none in flight at the kill",
            f"{sum(1 for k in up if k['moment'] == 'upload:mid')} / "
            f"{sum(1 for k in up if k['moment'] != 'upload:mid')}; "
            f"steps listed without their manifest (or newest listed != newest whole) "
            f"{v.get('remote_listed_without_manifest', 0)}",
        ),
        (
            "Slurm kills (scancel -s KILL / node taken down) after which a job of the run was still queued or running",
            f"{sum(1 for k in sl if k.get('jobs_left'))} of {len(sl)}",
        ),
        (
            "Slurm kills: CLI exit after the kill (it returns once Slurm has killed every rank; bound: 4x start-up + "
            "slurmd's KillWait)",
            "; ".join(
                f"{t} median {_median(x):.1f} s ({min(x):.1f}-{max(x):.1f})"
                for t in ("scancel", "node-down")
                if (
                    x := [k["launcher_exit_s"] for k in sl if k["target"] == t and k.get("launcher_exit_s") is not None]
                )
            )
            + f"; past the bound {sum(1 for k in sl if k.get('killed') and k.get('launcher_past_bound'))}",
        ),
        (
            "run dirs whose final checkpoint = reference bitwise",
            f"{sum(1 for c in chains if not c['final_diffs'])}/{len(chains)}",
        ),
        (
            "preemption cases (SIGTERM): exit 75 (or exit 0: signalled within its last 2 steps, it completed and "
            "committed its until-step)",
            "not run"
            if not pre
            else f"{sum(1 for p in pre if p['exit_code'] == 75)}/{len(pre)}, "
            f"completed {sum(1 for p in pre if completed_in_last_steps(p))}, "
            f"wrong {v.get('preempt_wrong_exit', 0)} "
            "(" + ", ".join(f"{p['case']}={p['exit_code']}" for p in pre) + ")",
        ),
        ("completed steps lost on preemption", v.get("preempt_steps_lost", 0)),
        ("segments whose CLI printed its own traceback", v.get("cli_traceback", 0)),
        (
            "secret (HF_TOKEN) leaks",
            "n/a"
            if not r["secrets"]
            else f"{len(r['secrets']['hits'])} files of {r['secrets']['files_scanned']} scanned",
        ),
        (
            "time per kill (launch to checks done)",
            f"median {_median(secs):.1f} s, max {max(secs, default=0):.1f} s; "
            f"{3600 * len(kills) / max(1.0, sum(k['seconds'] for k in r['kills'])):.0f} kills/hour "
            f"(references and finishing segments excluded)",
        ),
    ]
    if r["corpora"]:
        c = r["corpora"]
        rows.append(
            (
                "hostile/corruption/bad-input corpus (pytest tests/reliability)",
                f"{c['passed']} passed, {c['failed'] + c['errors']} failed, {c['skipped']} skipped"
                + (f" ({c['note']})" if c.get("note") else ""),
            )
        )
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "violations: " + (json.dumps(v) if v else "none")] + [f"note: {n}" for n in r["notes"]]
    if r.get("partial"):
        lines.append(
            f"note: stopped before its end (--kills {r.get('kills_asked', '?')} asked): the figures of the "
            "run dirs finished by then; no preemption, secrets or corpus phase"
        )
    return "\n".join(lines)


def _merge(runs: list[dict]) -> dict:
    """Several runs' records as one: the first run's machine line, every run's command."""
    r = runs[0]
    for other in runs[1:]:
        for key in ("kills", "segments", "chains", "preemptions", "notes"):
            r[key] = [*r[key], *other[key]]
        r["partial"] = r["partial"] or other["partial"]
        r["kill_phase_seconds"] = r["kill_phase_seconds"] + other["kill_phase_seconds"]
        r["notes"].append(f"also counted: the run `{other['machine']['command']}` of {other['machine']['date']}")
    return r


def _recount(r: dict, drop: list[list[str]] = ()) -> dict:
    """An earlier run's records counted again with this harness's rules. A harness before this one could miss
    the exit of a CLI killed with its group (a zombie it had not reaped yet): such a kill has no exit time but
    an all-gone time, which is then its exit time (noted in the table)."""
    from tests.reliability.torture_lib import Stats

    for name, why in drop:
        n = sum(1 for k in r["kills"] if k["chain"] == name)
        r["kills"] = [k for k in r["kills"] if k["chain"] != name]
        r["segments"] = [x for x in r["segments"] if x.get("chain") != name]
        r["chains"] = [c for c in r["chains"] if c["name"] != name]
        r["notes"] = [*r["notes"], f"run dir {name} left out ({n} launches): {why}"]
    from tests.reliability.torture_lib import PREEMPT_SPAN, slurm_kill_wait

    for p in r["preemptions"]:  # a run before preemption records kept their until-step: the harness's rule
        if p.get("signalled") and "until" not in p:
            seg = next(
                (s for s in r["segments"] if s.get("chain") == p["chain"] and s.get("kind") == f"preempt-{p['case']}"),
                None,
            )
            if seg is not None and r.get("final_step"):
                p["until"] = min(r["final_step"], seg["expected_resume"] + PREEMPT_SPAN)

    fixed = 0
    for k in r["kills"]:
        if k.get("killed") and "slurm_kill_wait_s" not in k and slurm_kill_wait(k.get("target")):
            # a run before Slurm kills had their own bound held them to the local one
            k["teardown_bound_s"] = round(k["teardown_bound_s"] + slurm_kill_wait(k["target"]), 2)
            k["slurm_kill_wait_s"] = slurm_kill_wait(k["target"])
            k["launcher_past_bound"] = k.get("launcher_exit_s") is None or k["launcher_exit_s"] > k["teardown_bound_s"]
        if k.get("killed") and k.get("launcher_exit_s") is None and k.get("gone_after_s") is not None:
            k["launcher_exit_s"] = k["gone_after_s"]
            k["launcher_past_bound"] = k["gone_after_s"] > k["teardown_bound_s"]
            fixed += 1
    st = Stats(kills=r["kills"], segments=r["segments"], chains=r["chains"], preemptions=r["preemptions"])
    r["violations"] = st.violations()
    if fixed:
        r["notes"] = [*r["notes"], f"{fixed} kills whose CLI exit the run's harness missed: exit time = all-gone time"]
    return r


def kill_kind(k: dict) -> str:
    """Which chain a kill belongs to: the backend and save mode, or the conversion / S3 upload chains."""
    if k["chain"].startswith("convert-"):
        return "DeepSpeed 2->1 rank (universal conversion)"
    if k["chain"].startswith("s3-"):
        return "FSDP2 async on s3:// (upload)"
    if k["chain"].startswith("slurm-"):
        return "FSDP2 async on Slurm (2 nodes x 1 rank)"
    return {"fsdp2": "FSDP2 async" if k.get("async") else "FSDP2 sync", "deepspeed": "DeepSpeed ZeRO-2"}[k["backend"]]


def _kill_grid(kills: list[dict]) -> list[str]:
    """SIGKILLs per chain kind (rows) and target (columns), each cell split by the window it landed in."""
    kinds = sorted({kill_kind(k) for k in kills})
    targets = [t for t in ALL_TARGETS if any(k["target"] == t for k in kills)]
    out = [
        "| SIGKILLs by chain and target (windows) | " + " | ".join(targets) + " | all |",
        "|---|" + "---|" * (len(targets) + 1),
    ]
    for kind in kinds:
        cells = []
        for t in targets:
            n = [k for k in kills if kill_kind(k) == kind and k["target"] == t]
            by: dict[str, int] = {}
            for k in n:
                w = (k["moment"] or "").split(":")[0]
                by[w] = by.get(w, 0) + 1
            cells.append(f"{len(n)} ({', '.join(f'{w} {c}' for w, c in sorted(by.items()))})" if n else "0")
        total = sum(1 for k in kills if kill_kind(k) == kind)
        out.append(f"| {kind} | " + " | ".join(cells) + f" | {total} |")
    out.append(
        "| all | " + " | ".join(str(sum(1 for k in kills if k["target"] == t)) for t in targets) + f" | {len(kills)} |"
    )
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


machine_info: dict = {}
_asked: list[int] = []


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
    ap.add_argument("--skip", nargs="*", default=[], choices=CHAIN_ORDER, help="chain kinds to leave out")
    ap.add_argument("--only", nargs="*", default=[], choices=CHAIN_ORDER, help="run only these chain kinds")
    ap.add_argument(
        "--s3-kbps",
        type=float,
        default=S3_RATE / 1000,
        help="the s3 chain's upload bandwidth to the store, "
        "KB/s (a throttling forwarder on loopback; 0: unthrottled, uploads then take milliseconds)",
    )
    ap.add_argument("--no-preempt", action="store_true")
    ap.add_argument("--no-secrets", action="store_true")
    ap.add_argument(
        "--corpora", action="store_true", help="also run tests/reliability -k 'hostile or corruption or bad_input'"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument(
        "--drop-chain",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "WHY"),
        help="with --table-from: leave a run dir's records out (a harness fault, e.g. a daemon that never "
        "started), saying why in the table",
    )
    ap.add_argument("--publish", action="store_true", help="keep the table as bench/results/torture.md")
    ap.add_argument(
        "--table-from",
        nargs="+",
        default=None,
        help="print (and --publish) the table of earlier "
        "torture.json files (one run's partial figures, or runs of different chain kinds, counted together) "
        "instead of running",
    )
    args = ap.parse_args(argv)
    if args.publish and args.only and not args.table_from:
        ap.error(
            "--publish with --only: a run of some chain kinds would replace the published table of all of them; "
            "publish it with the others through --table-from"
        )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine_info.update(machine())
    _asked.append(args.kills)
    if args.table_from:
        result = _recount(_merge([json.loads(Path(f).read_text()) for f in args.table_from]), args.drop_chain)
    else:
        result = run(args, out_dir)
    text = table(result)
    (out_dir / "torture.md").write_text(text + "\n")
    print(text)
    if args.publish:  # bench/results/torture.md: README's headline block and docs/benchmarks/torture.md
        from bench.benchlib import publish

        publish("torture", text)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
