"""CI-sized kill torture: four SIGKILLs of a real 2-rank FSDP2 segment with async saves (the CLI in the
save window, its process group in the commit, torchrun in retention, one rank while training) and one
SIGTERM while an async save is in flight, all on one run directory, then an uninterrupted finish.

Asserts zero violations: nothing of a killed segment alive 5 s later, no checkpoint committed by
processes that outlived their launcher, no second writer while they live, the newest committed
checkpoint always passes validate --deep, every resume at the newest valid step with every step
bitwise equal to an uninterrupted reference run, and the preempted segment exits 75 with no completed
step lost. About 2 minutes on 2 idle cores (7 torchrun launches). The full torture: bench/torture.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.reliability.torture_lib import CONFIGS, Torture

pytestmark = pytest.mark.slow

PLAN = [("cli", "save"), ("group", "commit"), ("torchrun", "retention"), ("rank", "train")]


def test_kill_torture_ci(tmp_path: Path) -> None:
    lines: list[str] = []
    h = Torture(tmp_path, final=40, seed=7, log=lines.append)
    chain = h.kill_chain(CONFIGS["fsdp2-async"], 0, len(PLAN), time.monotonic() + 600, PLAN, preempt=("async-save",))
    st = h.stats
    report = (f"violations {st.violations()}\n" + "\n".join(lines) + "\n"
              + json.dumps({"kills": st.kills, "preemptions": st.preemptions, "segments": st.segments, "chain": chain},
                           default=str))
    assert st.violations() == {}, report
    assert chain["final_diffs"] == [], report
    # Every planned moment was reached (a segment that ended before its moment tests nothing).
    assert [k["killed"] for k in st.kills] == [True] * len(PLAN), report
    assert [p["signalled"] for p in st.preemptions] == [True], report
