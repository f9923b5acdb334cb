"""CI-sized kill torture: three SIGKILLs of a real 2-rank FSDP2 segment with async saves (the CLI in the
commit, torchrun in retention, one rank while an async save is in flight) and one SIGTERM while an async
save is in flight, all on one run directory, then an uninterrupted finish. The reference run starts
beside the first killed launch.

Asserts zero violations: nothing of a segment alive 5 s after the process that holds the run lock (the
launching CLI, which waits by pid for its torchrun and every rank) is gone; a CLI that survived the kill
of its torchrun or a rank exits within 4x its own start-up in the same launch (a bound relative to what
this machine does now, not a fixed number of seconds); no checkpoint committed by processes that
outlived their launcher, no second writer while they live, the newest committed checkpoint always
passes validate --deep, every resume at the newest valid step with every step bitwise equal to an
uninterrupted reference run, and the preempted segment exits 75 with no completed step lost. About
2 minutes on 2 cores (6 torchrun launches, two of them side by side). The full torture: bench/torture.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.reliability.torture_lib import CONFIGS, Torture

pytestmark = pytest.mark.slow

# The CLI killed mid-commit (torchrun and the ranks must follow it: parent-death signals), torchrun killed
# while retention deletes (the CLI survives and must wait for the ranks), one rank killed while an async
# save is in flight (torchrun's teardown of the other rank, under the CLI that survives).
PLAN = [("cli", "commit"), ("torchrun", "retention"), ("rank", "save")]


def test_kill_torture_ci(tmp_path: Path) -> None:
    lines: list[str] = []
    h = Torture(tmp_path, final=24, seed=7, log=lines.append)
    chain = h.kill_chain(CONFIGS["fsdp2-async"], 0, len(PLAN), time.monotonic() + 600, PLAN, preempt=("async-save",))
    st = h.stats
    report = (
        f"violations {st.violations()}\n"
        + "\n".join(lines)
        + "\n"
        + json.dumps(
            {"kills": st.kills, "preemptions": st.preemptions, "segments": st.segments, "chain": chain}, default=str
        )
    )
    assert st.violations() == {}, report
    assert chain["final_diffs"] == [], report
    # Every planned moment was reached (a segment that ended before its moment tests nothing).
    assert [k["killed"] for k in st.kills] == [True] * len(PLAN), report
    assert [p["signalled"] for p in st.preemptions] == [True], report
    # The CLI killed: its torchrun and ranks are gone with it. Torchrun or a rank killed: the CLI outlives
    # them (it holds the lock) and exits only once nothing of its segment runs (waited for by pid), so the
    # last of them is seen gone with the CLI (within the harness's polling, 50 ms per round when idle).
    cli_kill, *survived = st.kills
    assert cli_kill["launcher_exit_s"] < 1 and cli_kill["gone_after_s"] <= 5, report
    for k in survived:
        assert k["launcher_exit_s"] <= k["teardown_bound_s"], report
        assert k["gone_after_s"] <= k["launcher_exit_s"] + 1.0, report


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_detectors_see_torn_checkpoints_and_bad_resumes(tiny_run: Path, tmp_path: Path) -> None:
    """The torture's verdicts can fail: a corrupted committed checkpoint, a resume from a .partial or at
    the wrong step, and a step that differs from the reference are each counted (no launch needed)."""
    import shutil

    from tests.reliability.torture_lib import Launch, check_dir, compare_final

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    step5 = run / "checkpoints" / "step-00000005"
    good = check_dir(run)
    assert (good.valid, good.torn_latest, good.expected_resume) == ([5], False, 5)
    assert compare_final(step5, tiny_run / "checkpoints" / "step-00000005") == []
    _flip_byte(next(step5.glob("*.distcp")))
    h = Torture(tmp_path / "work", final=5)
    rec: dict = {}
    assert h.after_checks(run, rec, {"ever_committed": True}) == 0
    assert rec["torn_latest"] and rec["no_valid_left"] and "checksum" in rec["invalid"]["5"]
    assert "torn_latest_checkpoint" in _violations_of(h, kills=[{**rec, "killed": True}])

    # A launch that resumed from a .partial at step 3 although step 5 was the newest valid one, and whose
    # step 4 loss differs from the reference.
    ln = Launch.__new__(Launch)
    ln.run_dir, ln.cfg, ln.log_path = run, CONFIGS["fsdp2-async"], tmp_path / "seg.log"
    ln.offsets = {
        n: (run / n).stat().st_size if (run / n).exists() else 0
        for n in ("metrics.jsonl", "lineage.jsonl", "segments.jsonl")
    }
    with open(run / "segments.jsonl", "a") as f:
        f.write(json.dumps({"event": "start", "segment": 9}) + "\n")
    with open(run / "lineage.jsonl", "a") as f:
        f.write(json.dumps({"kind": "resume", "id": "resume:segment-9", "step": 3}) + "\n")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "loss": 1.0, "grad_norm": 1.0, "segment": 9}) + "\n")
    ln.log_path.write_text("resumed from step-00000005.partial at step 3\n")
    h.refs["fsdp2"], h.ref_metrics["fsdp2"] = tiny_run, {4: (2.0, 1.0)}
    seg = h.check_resume(ln, 5, {"kind": "kill"})
    assert seg["resumed_from_partial"] and "resumed at step 3" in seg["resume_problem"]
    assert "metrics start at step 4, expected 6" in seg["resume_problem"] and seg["inexact_steps"] == [4]
    assert {"partial_or_wrong_resume", "inexact_steps"} <= set(h.stats.violations())
    # A CLI past its teardown bound, a segment process left 5 s after it, a torn universal/ conversion, a
    # resume after a killed conversion that did not convert again, a remote step listed without its manifest.
    bad = {
        "killed": True,
        "launcher_past_bound": True,
        "orphans": 1,
        "torn_universal": "checksum",
        "reconverted": False,
        "remote_listed_without_manifest": [8],
    }
    assert {
        "launcher_past_bound",
        "orphans_after_5s",
        "torn_universal",
        "not_reconverted",
        "remote_listed_without_manifest",
    } <= set(_violations_of(h, kills=[bad]))


def test_verdicts_on_slurm_exits_and_late_stop_signals() -> None:
    """A Slurm kill's CLI waits for slurmd to kill the job's steps (up to KillWait): held to 4x start-up + KillWait;
    a SIGTERM within the last two steps may complete the segment (exit 0, until-step committed); any other
    exit of a signalled segment is still a violation."""
    from tests.reliability.torture_lib import Stats, completed_in_last_steps, slurm_kill_wait

    assert slurm_kill_wait("node-down") == slurm_kill_wait("scancel") > 0 == slurm_kill_wait("rank")
    late = {
        "signalled": True,
        "exit_code": 0,
        "completed_at_signal": 8,
        "committed_after": 10,
        "until": 10,
        "steps_lost": 0,
    }
    early = {**late, "completed_at_signal": 2}
    short = {**late, "committed_after": 9}  # exit 0 before its until-step: never right
    unknown = {k: v for k, v in late.items() if k != "until"}  # no until-step recorded: nothing to excuse it with
    assert completed_in_last_steps(late) and not completed_in_last_steps(early) and not completed_in_last_steps(short)
    assert not completed_in_last_steps(unknown)
    assert Stats(preemptions=[late]).violations() == {}
    assert Stats(preemptions=[late, early, short, unknown]).violations() == {"preempt_wrong_exit": 3}


def _violations_of(h: Torture, kills: list[dict]) -> dict[str, int]:
    h.stats.kills.extend(kills)
    return h.stats.violations()
