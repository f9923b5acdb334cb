"""The fuzzer's short run: Hypothesis mutations of the committed seed corpus (``tests/reliability/fuzz_seed/``) --
DCP ``.metadata``, ``manifest.json``, DeepSpeed model/optim state files, ``latest``, an HF Trainer/DeepSpeed
``checkpoint-N/`` layout and a memory snapshot -- each through ``shardkeeper import``, ``validate --deep``, a resume
into the live model and the memory tier's persist (``tests.reliability.fuzz_lib`` says which target goes through
which, and what each outcome must be). Only "correct state" or "one-line refusal, nothing committed" may come out;
every input runs in its own process under a deadline and a memory bound.

Derandomized and bounded (``EXAMPLES`` inputs per target, ~60 s on 2 cores with the worker's start); the inputs
that found a bug are replayed first (``REGRESSIONS``). The long run with random seeds is ``bench/fuzz.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.reliability.fuzz_lib import RSS_BOUND, TARGETS, Fuzzer

DEADLINE_S = 60.0  # per input and entry point: ~1 s on a loaded 2-core machine, a hang is killed here
EXAMPLES = {"metadata": 4, "manifest": 4, "deepspeed": 4, "latest": 4, "layout": 5, "memory": 3}
# inputs that found a bug (each fixed in the reader where it lived); the picks resolve in the committed seeds
REGRESSIONS: dict[str, list[dict]] = {
    # a storage record whose file name is None: import sorted the names first (an internal error)
    "metadata": [{"ops": [["record_path", 0, 10]], "forged": True}],
    # manifest.json bytes that are not UTF-8: validate's "check the arguments", a resume's UnicodeDecodeError
    "manifest": [
        {"ops": [["raw_insert", 205, 255]]},
        # source_world_size recorded on a checkpoint that is no conversion: validate --deep said valid
        {"ops": [["set", 7883, ["int", 2]], ["file_dup", 71]]},
    ],
    # rank 1's file declaring ZeRO stage 0 beside rank 0's 2: validate --deep said valid
    "deepspeed": [{"ops": [["stage", 1, ["int", 0]]], "forged": True}],
    # a sparse GiB as `latest`: import must read a bounded prefix (the fuzzer's own edit once read it whole)
    "latest": [{"ops": [["kind", "sparse"], ["raw_trunc", 39]]}],
    # a fifo inside the tag the mutation copies as a decoy (the fuzzer's own copy once failed on it)
    "layout": [{"ops": [["special", 40784, "fifo"], ["tag", "decoy", 0], ["tag", "decoy", 0]]}],
    # a fifo in a snapshot (the persist waited on it), tier.json a fifo (resume and persist waited) or a JSON
    # list, .run-id not UTF-8 (resume and persist crashed), manifest.json a symlink to a copy outside the snapshot
    # (validate said valid, the persist committed the bytes it found there)
    "memory": [
        {"ops": [["file", 1, "fifo", 0]]},
        {"ops": [["tier", "fifo"]]},
        {"ops": [["tier", "list"]]},
        {"ops": [["run_id", "garbage"]]},
        {"ops": [["manifest", [["file_dup", 106]]], ["file", 1091, "link_outside", 5061]]},
        {"ops": [["tier", "dir"], ["tier", "fifo"], ["tier", "other_id"]]},  # the fuzzer's own edit once hung here
    ],
}


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[Fuzzer]:
    with Fuzzer(deadline_s=DEADLINE_S) as f:
        yield f


def _failures(results: list[dict]) -> str:
    return "\n".join(
        f"{r['target']}/{r['entry']}: {r['why']} (input {json.dumps(r['program'])})"
        for r in results
        if r["outcome"] == "other"
    )


def test_the_seeds_go_through_every_entry_point_whole(fuzzer: Fuzzer) -> None:
    """The unmutated seed of every target is imported, valid, loaded and persisted with exactly its state: the
    mutated runs below measure the mutations, not a harness that refuses everything."""
    results = [r for name in sorted(TARGETS) for r in fuzzer.run(name, {"ops": [], "forged": False})]
    assert {r["outcome"] for r in results} == {"correct"}, [(r["target"], r["entry"], r["why"]) for r in results]
    assert len(results) == sum(len(t.entries) for t in TARGETS.values()) == 12


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_mutated_inputs_are_read_exactly_or_refused_in_one_line(target: str, fuzzer: Fuzzer) -> None:
    seen: list[dict] = []

    def check(program: dict) -> None:
        results = fuzzer.run(target, program)
        seen.extend(results)
        bad = _failures(results)
        assert not bad, bad

    for program in REGRESSIONS[target]:
        check = example(program=program)(check)
    profile = settings(
        max_examples=EXAMPLES[target],
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    profile(given(program=TARGETS[target].strategy)(check))()
    assert len(seen) >= EXAMPLES[target] * len(TARGETS[target].entries)
    assert all(r["rss_mib"] > 0 and r["seconds"] < DEADLINE_S for r in seen)
    assert max(r["rss_mib"] for r in seen) < fuzzer.worker_rss_mib + RSS_BOUND / 2**20
