"""Fast unit tests: data order, retention policy, fingerprints, config loading, layering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt.commit import fingerprint as fp
from ckpt.validate.retention import plan_retention
from schemas.errors import ConfigError
from shardkeeper.config import load_run_spec
from trainer.builtin.data import GlobalOrderLoader, synthetic_corpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_sample_order_does_not_depend_on_world_size(world: int) -> None:
    tokens = synthetic_corpus(7, 5000, 100)
    loader = GlobalOrderLoader(tokens, seq_len=16, seed=7, global_batch=12)
    ref = GlobalOrderLoader(tokens, seq_len=16, seed=7, global_batch=12)
    for step in (0, 1, 25, 26, 400):  # 400 crosses several epochs
        whole = ref.samples(step, 0, 12)
        parts = [torch.cat([x for x, _ in loader.rank_batches(step, r, world, None)]) for r in range(world)]
        assert torch.equal(torch.cat(parts), whole[:, :-1])


def test_epochs_are_permutations_and_differ() -> None:
    tokens = np.arange(16 * 10 + 1)
    loader = GlobalOrderLoader(tokens, seq_len=16, seed=3, global_batch=5)
    e0 = [loader._window(g) for g in range(10)]
    e1 = [loader._window(g) for g in range(10, 20)]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1


def test_retention_keeps_last_k_milestones_and_newest_valid() -> None:
    steps = [5, 10, 15, 20, 25, 30]
    assert plan_retention(steps, set(steps), keep_last=2, keep_every=None) == {5, 10, 15, 20}
    assert plan_retention(steps, set(steps), keep_last=2, keep_every=10) == {5, 15}
    # the newest is invalid: the newest *valid* one (25) is kept, the invalid newer one is left for inspection
    assert plan_retention(steps, set(steps) - {30}, keep_last=1, keep_every=None) == {5, 10, 15, 20}
    with pytest.raises(ValueError):
        plan_retention(steps, set(steps), keep_last=0, keep_every=None)


def test_memory_retention_keeps_the_newest_k_and_deletes_through_a_deleting_name(tmp_path: Path) -> None:
    """ckpt.memtier.tier.retain: the newest ``keep`` snapshots stay (0: none); older snapshots and leftovers go by
    way of a ``.deleting`` name (one already so named is removed where it is); the stage dir stays; a snapshot
    whose ``.deleting`` name is taken stays as it was, retried later, as storage retention would refuse it."""
    from ckpt.commit.layout import RunDir
    from ckpt.memtier.tier import retain
    from ckpt.validate.retention import remove_checkpoint_dir

    mem = RunDir(tmp_path / "mem")
    for step in (2, 4, 6, 8):
        (mem.checkpoint(step)).mkdir(parents=True)
        (mem.checkpoint(step) / "manifest.json").write_text("{}")
    for name in ("step-00000001.partial", "step-00000003.deleting", "step-00000005.recycle-next", "step-00000009.x"):
        (mem.checkpoints / name).mkdir()
    blocked = mem.checkpoints / "step-00000002.deleting"  # a half-deleted copy of step 2 still being removed
    (blocked / "held").mkdir(parents=True)
    gone = retain(mem, keep=2)
    assert [p.name for p in gone[:2]] == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in gone[2:]) == [
        "step-00000001.partial",
        "step-00000002.deleting",
        "step-00000003.deleting",
    ]
    left = sorted(p.name for p in mem.checkpoints.iterdir())
    # step 2 could not take its .deleting name while the old one was there: it stays whole, retried next time
    assert left == ["step-00000002", "step-00000005.recycle-next", "step-00000006", "step-00000008", "step-00000009.x"]
    assert [p.name for p in retain(mem, keep=2)] == ["step-00000002"] and not mem.checkpoint(2).exists()
    assert [p.name for p in retain(mem, keep=0)] == ["step-00000006", "step-00000008"] and mem.committed() == []
    with pytest.raises(ValueError):
        retain(mem, keep=-1)
    with pytest.raises(OSError):
        remove_checkpoint_dir(mem.checkpoint(6))  # gone: nothing to rename


def test_fingerprint_compare_exact_and_tolerant() -> None:
    a = fp.make_fingerprint({"w": 4.0}, {"w.exp_avg": 1.0}, 3)
    b = fp.make_fingerprint({"w": 4.0 * (1 + 1e-12)}, {"w.exp_avg": 1.0}, 3)
    assert fp.compare(a, a, exact=True) == []
    assert fp.compare(a, b, exact=False) == [] and fp.compare(a, b, exact=True)
    c = fp.make_fingerprint({"w": 4.0}, {"w.exp_avg": 0.0}, 3)  # optimizer state lost
    assert "w.exp_avg" in fp.compare(a, c, exact=False)[0]
    d = fp.make_fingerprint({"w": 4.0}, {"w.exp_avg": 1.0}, 1)
    assert "step" in fp.compare(a, d, exact=False)[0]


def test_sum_squares_of_shards_equals_whole() -> None:
    t = torch.randn(10, 3)
    whole = fp.sum_squares([("t", t)])["t"]
    parts = fp.sum_squares([("a", t[:4]), ("b", t[4:])])
    assert abs(parts["a"] + parts["b"] - whole) <= 1e-12 * whole


def test_config_overrides_and_errors(tmp_path: Path) -> None:
    spec = load_run_spec(ROOT / "configs" / "tiny.yaml", ["optim.lr=1e-3", "checkpoint.async_save=true"])
    assert spec.optim.lr == 1e-3 and spec.checkpoint.async_save
    for bad, expect in [
        (["global_batch_size=0"], "global_batch_size"),
        (["data.source=tokens"], "data.path is required"),
        (["nonsense"], "expected key.path=value"),
        (["model.config=3"], "model.config"),
    ]:
        with pytest.raises(ConfigError, match=expect) as err:
            load_run_spec(ROOT / "configs" / "tiny.yaml", bad)
        assert "\n" not in str(err.value)


def test_tiny_config_divides_over_1_to_4_ranks() -> None:
    spec = load_run_spec(ROOT / "configs" / "tiny.yaml")
    assert [spec.per_rank_batch(w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]


def test_the_world_size_rule_is_the_run_descriptions_and_a_script_run_has_none() -> None:
    """One home for the batch rule: a built-in run refuses a world size its global batch does not split over (the
    line names the field and the choices); a script run splits its own batches, so none is refused there -- not
    even by the default global_batch_size 8 it carries unused."""
    from schemas import RunSpec, ScriptSpec

    built_in = load_run_spec(ROOT / "configs" / "tiny.yaml")
    assert [w for w in range(1, 13) if built_in.world_size_refusal(w) is None] == [1, 2, 3, 4, 6, 12]
    line = built_in.world_size_refusal(5, choose="--world-size")
    assert line == (
        "global_batch_size 12 is not divisible by 5 ranks; choose --world-size among [1, 2, 3, 4, 6, 12] "
        "or change global_batch_size"
    )
    script = RunSpec(script=ScriptSpec(path="/x/train.py"))
    assert script.global_batch_size == 8 and all(script.world_size_refusal(w) is None for w in (1, 3, 5, 7))
    assert script.world_size_refusal(0) is not None
    with pytest.raises(ValueError, match="splits its own batches"):
        script.per_rank_batch(3)


def test_a_set_a_script_run_never_reads_is_refused_in_one_line(tmp_path: Path) -> None:
    """--set global_batch_size (and the other keys of SCRIPT_UNUSED) would be written to run.yaml and change
    nothing for a script run: refused, naming the key; a key the script run reads is taken."""
    from shardkeeper.config import train_spec

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for key in ("global_batch_size=12", "schedule.total_steps=50", "data.seq_len=16"):
        with pytest.raises(ConfigError, match=f"--set {key.split('=')[0]}: a script run") as err:
            train_spec(None, [key], tmp_path / "run", script=str(script))
        assert "\n" not in str(err.value)
    spec = train_spec(None, ["checkpoint.interval=3", "seed=7"], tmp_path / "run", script=str(script))
    assert spec.checkpoint.interval == 3 and spec.seed == 7
    assert train_spec(ROOT / "configs" / "tiny.yaml", ["global_batch_size=6"], tmp_path / "run").global_batch_size == 6


def test_status_skips_segments_the_ranks_refused() -> None:
    """A segment refused before its first step trained nothing: the run stands where the last segment that ran
    left it (its status and until_step), for status and the resume flow alike."""
    from schemas.requests import last_segment

    ran = [{"event": "start", "segment": 0, "until_step": 10}, {"event": "end", "segment": 0, "status": "preempted"}]
    refused = [{"event": "start", "segment": 1, "until_step": 40}, {"event": "end", "segment": 1, "status": "refused"}]
    assert last_segment(ran + refused, locked=False) == ("preempted", 10)
    assert last_segment(refused, locked=False) == (None, None)
    assert last_segment([*ran, *refused, {"event": "start", "segment": 2, "until_step": 20}], locked=True) == (
        "running",
        20,
    )


def test_layers_schemas_import_no_torch_and_rank_side_no_prefect() -> None:
    code = (
        "import sys, schemas, shardkeeper.config; assert 'torch' not in sys.modules and 'prefect' not in sys.modules;"
        "import trainer.segment, ckpt.validate.checks, ckpt.formats.dcp.reader; assert 'prefect' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_manifest_hf_model_record_is_optional_and_described() -> None:
    from schemas import CheckpointManifest, HFModelRecord

    for cls in (CheckpointManifest, HFModelRecord):
        assert all(f.description for f in cls.model_fields.values()), cls
    assert CheckpointManifest.model_fields["hf_model"].default is None  # manifests written before it still load
    rec = HFModelRecord(
        config={"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
        generation_config={"bos_token_id": 1},
        tied={"lm_head.weight": "model.embed_tokens.weight"},
        transformers_version="5.0.0",
    )
    back = HFModelRecord.model_validate_json(rec.model_dump_json())
    assert back == rec and isinstance(back.config["rope_theta"], float)
    with pytest.raises(ValueError, match="extra"):
        HFModelRecord(config={}, transformers_version="5", unknown=1)


def test_token_file_source(tmp_path: Path) -> None:
    from schemas import DataSpec
    from schemas.errors import ConfigError
    from trainer.builtin.data import open_tokens

    arr = (np.arange(5000) % 251).astype(np.uint16)
    arr.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", arr.astype(np.int32))
    a = open_tokens(DataSpec(source="tokens", path=str(tmp_path / "t.bin")), 0, 256)
    b = open_tokens(DataSpec(source="tokens", path=str(tmp_path / "t.npy")), 0, 256)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ConfigError, match="data.path .*none.bin: no such token file"):
        open_tokens(DataSpec(source="tokens", path=str(tmp_path / "none.bin")), 0, 256)


def test_yaml_exponent_floats_stay_floats(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("rms_norm_eps: 1.0e-5", "rms_norm_eps: 1e-5"))
    spec = load_run_spec(cfg, ["optim.lr=3e-4"])
    assert spec.model.config["rms_norm_eps"] == 1e-5 and isinstance(spec.model.config["rms_norm_eps"], float)
    assert spec.optim.lr == 3e-4


def test_seam_round_trip_and_bad_files(tmp_path: Path) -> None:
    """What a launcher hands the ranks and what rank 0 reports back go through one schema each way; a stale
    report (another segment) or a damaged one is not taken for this segment's, a damaged launch is one line."""
    from schemas import ClusterTopology
    from schemas.errors import RunDirError
    from schemas.seam import EXIT_CANCELLED, EXIT_PREEMPTED, LAUNCH_FILE, SegmentLaunch, SegmentReport, exit_code_of

    topo = ClusterTopology(nodes=1, procs_per_node=2)
    launch = SegmentLaunch(run_dir=str(tmp_path), until_step=7, segment=3, topology=topo, restart=True, launcher_pid=42)
    assert SegmentLaunch.read(launch.write(tmp_path)) == launch
    report = SegmentReport(segment=3, status="preempted", start_step=5, end_step=6, world_size=2, topology=topo)
    report.write(tmp_path)
    assert SegmentReport.read(tmp_path, 3) == report
    assert SegmentReport.read(tmp_path, 4) is None  # a report of another segment is never this one's
    SegmentReport.clear(tmp_path)
    assert SegmentReport.read(tmp_path, 3) is None
    (tmp_path / ".segment-status.json").write_text('{"segment": 3, "status": "done"}')
    assert SegmentReport.read(tmp_path, 3) is None
    (tmp_path / LAUNCH_FILE).write_text("{not json")
    with pytest.raises(RunDirError) as err:
        SegmentLaunch.read(tmp_path / LAUNCH_FILE)
    assert str(err.value).startswith(str(tmp_path / LAUNCH_FILE)) and "\n" not in str(err.value)
    assert (exit_code_of("completed", 1), exit_code_of("preempted", 1), exit_code_of("cancelled", 1)) == (
        0,
        EXIT_PREEMPTED,
        EXIT_CANCELLED,
    )
    assert exit_code_of("failed", 0) == 1 and exit_code_of("failed", 3) == 3
    # a signal-killed torchrun (-9), or any code outside the documented set, is EXIT_FAILED (never 247)
    assert [exit_code_of("failed", c) for c in (-9, -15, 137, 247, 99)] == [1] * 5
    assert exit_code_of("failed", 65) == 65 and exit_code_of("failed", 4) == 4


def test_live_tail_reads_whole_new_lines_and_survives_a_restart(tmp_path: Path) -> None:
    """The live-progress watcher reads only complete new lines, and starts over when the file is replaced."""
    from tasks.live import Tail

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n')
    tail = Tail(f)  # what was there before the segment is not news
    f.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert tail.read() == [{"step": 2}]
    with f.open("a") as out:
        out.write('ep": 3}\n')
    assert tail.read() == [{"step": 3}]
    f.write_text('{"step": 1}\n')  # set aside and started again
    assert tail.read() == [{"step": 1}] and tail.read() == []


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_state_for_a_load_matches_what_torch_would_create(amsgrad: bool) -> None:
    """trainer.optim.init_state stands in for get_state_dict's dummy optimizer step (_init_optim_state): the same
    state entries, shapes, dtypes and step type, so DCP loads into exactly what it loaded into before."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from trainer.optim import init_state

    def make() -> torch.optim.AdamW:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        return torch.optim.AdamW(
            [
                {"params": [model[0].weight], "weight_decay": 0.1},
                {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0},
            ],
            lr=1e-3,
            foreach=True,
            amsgrad=amsgrad,
        )

    ours, theirs = make(), make()
    before = [p.detach().clone() for g in ours.param_groups for p in g["params"]]
    init_state(ours)
    _init_optim_state(theirs)
    a, b = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert sorted(a) == sorted(b)
    for k in a:
        assert sorted(a[k]) == sorted(b[k])
        for name, v in a[k].items():
            assert v.dtype == b[k][name].dtype and v.shape == b[k][name].shape and v.device == b[k][name].device, name
    assert all(torch.equal(x, p) for x, p in zip(before, (p for g in ours.param_groups for p in g["params"])))
    assert all(p.grad is None for g in ours.param_groups for p in g["params"])


def test_stopped_early_note_says_loaded_only_when_the_checkpoint_was_loaded() -> None:
    """A SIGTERM during start-up stops the ranks before they build the model: the segment report must not claim
    the checkpoint was loaded (its phase times have loaded_s None)."""
    from trainer.api.segment import stopped_early_note

    assert "(loaded)" in stopped_early_note(15)
    before = stopped_early_note(15, loaded=False)
    assert "(loaded)" not in before and "not loaded" in before and "step-00000015" in before
    assert "starts clean" in stopped_early_note(0, loaded=False)


def test_blocked_fingerprint_is_thread_independent_and_agrees_with_the_legacy_method() -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    named = [
        ("big", torch.randn(300_001, generator=g) * 3),
        ("view", torch.randn(64, 100, generator=g)[:, 7:60]),
        ("empty", torch.zeros(0)),
    ]
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            runs.append(fp.local_sum_squares(named)[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, runs[0]) for r in runs)  # bitwise, whatever the thread count
    legacy = fp.local_sum_squares(named, fp.LEGACY_METHOD)[1]
    assert torch.allclose(runs[0], legacy, rtol=1e-12, atol=0)
    exact = torch.tensor([float((t.double() ** 2).sum()) for _, t in named], dtype=torch.float64)
    assert torch.allclose(runs[0], exact, rtol=1e-12, atol=0)
    assert fp.make_fingerprint({}, {}, 0).method == fp.METHOD == "l2-per-tensor-f64-blocked"
    with pytest.raises(ValueError):
        fp.local_sum_squares(named, "l2-something-else")


def test_blocked_fingerprint_gives_the_bits_of_its_one_block_at_a_time_definition() -> None:
    """The method ``l2-per-tensor-f64-blocked`` as written into manifests before its sums were batched: each block
    of 32,768 elements converted to float64, squared, summed by itself, the block sums added in order. Checkpoints
    saved with that code must compare bit for bit with the batched sums, at any thread count and size (one block,
    a block and one element, many blocks and a tail, more than one batch of blocks)."""
    import torch

    def definition(t: torch.Tensor) -> float:
        acc = torch.zeros((), dtype=torch.float64)
        for part in t.reshape(-1).split(fp._BLOCK):
            acc += part.to(torch.float64).square_().sum()
        return float(acc)

    g = torch.Generator().manual_seed(7)
    sizes = [
        1,
        100,
        fp._BLOCK,
        fp._BLOCK + 1,
        2 * fp._BLOCK,
        5 * fp._BLOCK + 7,
        fp._BLOCK * fp._CHUNK_BLOCKS,
        fp._BLOCK * fp._CHUNK_BLOCKS * 2 + 12_345,
        1_441_792,
    ]
    named = [(f"t{n}", torch.randn(n, generator=g) * (10.0 ** (n % 7 - 3))) for n in sizes]
    want = [definition(t) for _, t in named]
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 8):
            torch.set_num_threads(n)
            got = fp.local_sum_squares(named)[1].tolist()
            assert got == want, f"{n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_background_checkpoint_threads_run_nicer_than_training() -> None:
    import threading

    from trainer.checkpointer.core import background_pool

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def nice_of_a_thread_it_starts() -> int:  # DCP's writer threads are started by the commit thread
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(nice()))
        t.start()
        t.join()
        return out[0]

    base = nice()
    lowered, plain = background_pool("t-nice", 10), background_pool("t-plain", 0)
    try:
        assert lowered.submit(nice).result() == min(19, base + 10)
        assert lowered.submit(nice_of_a_thread_it_starts).result() == min(19, base + 10)
        assert plain.submit(nice).result() == base
    finally:
        lowered.shutdown()
        plain.shutdown()
    assert nice() == base  # the training thread keeps its priority


def test_fingerprint_equal_within_tolerance_but_not_bitwise_warns_and_loads(caplog: pytest.LogCaptureFixture) -> None:
    """Other arithmetic recomputing the norms (another torch release, an edited fingerprint.method) leaves them
    equal within 1e-9 but not bit for bit: a warning naming the method, not a refusal; beyond 1e-9 it refuses."""
    from schemas.errors import FingerprintMismatch

    saved = fp.make_fingerprint({"w": 3.2082914900000001}, {"w.exp_avg": 1.0}, 3)
    close = fp.make_fingerprint({"w": 3.2082914900000001 * (1 + 3e-15)}, {"w.exp_avg": 1.0}, 3)
    with caplog.at_level("WARNING", logger="shardkeeper.checkpoint"):
        fp.require_match("ckpt", saved, close, exact=True)
    assert "not bit for bit" in caplog.text and "fingerprint.method" in caplog.text
    import re

    shown = re.search(r"norm (\S+) != saved (\S+) ", caplog.text)
    assert shown and shown.group(1) != shown.group(2)  # printed with the digits that show the difference
    far = fp.make_fingerprint({"w": 3.2082914900000001 * (1 + 1e-6)}, {"w.exp_avg": 1.0}, 3)
    with pytest.raises(FingerprintMismatch, match="state after load differs"):
        fp.require_match("ckpt", saved, far, exact=True)


def test_atomic_write_on_a_full_disk_names_the_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from ckpt.commit import fsutil

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsutil.os, "fsync", full)
    with pytest.raises(OSError) as e:
        fsutil.atomic_write_text(tmp_path / "verified.json", "{}")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "verified.json")
    assert list(tmp_path.iterdir()) == []


def test_cli_says_a_full_disk_is_a_full_disk(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import errno

    import shardkeeper.cli as cli

    def app(**_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/verified/step-00000020.json")

    monkeypatch.setattr(cli, "app", app)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr()
    line = (err.out + err.err).strip()
    assert line.count("\n") == 0 and "/runs/x/verified/step-00000020.json" in line and "disk is full" in line
    assert "permissions" not in line


def test_a_rank_error_line_run_into_another_ranks_is_cut_at_the_second() -> None:
    from launch.base import failing_rank_lines
    from schemas.seam import RANK_ERROR_PREFIX

    tail = [
        "[rank0]: noise",
        f"{RANK_ERROR_PREFIX} rank 0: run/x: first cause; fix it{RANK_ERROR_PREFIX} rank 1: run/x: second cause",
        "torchrun summary",
    ]
    assert failing_rank_lines(tail) == "rank 0: run/x: first cause; fix it; rank 1 then failed: run/x: second cause"


def test_a_failed_load_is_blamed_on_the_checkpoint_only_for_what_its_bytes_say() -> None:
    """Quarantine is for checkpoints whose bytes are bad (our readers' CheckpointError, also inside DCP's
    CheckpointException); a missing key, a shape mismatch or a failed collective is the live run's."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from schemas.errors import CheckpointError, FingerprintMismatch
    from trainer.checkpointer.core import _load_problem, checkpoint_at_fault

    tb = traceback.extract_stack()
    bad_record = CheckpointException("load", {1: (CheckpointError("x.distcp: CRC-32 mismatch"), tb)})
    missing_key = CheckpointException("load", {0: (RuntimeError("Missing key in checkpoint state_dict: lm_head"), tb)})
    assert checkpoint_at_fault(FingerprintMismatch("norms differ")) and checkpoint_at_fault(bad_record)
    assert not checkpoint_at_fault(missing_key)
    assert not checkpoint_at_fault(RuntimeError("size mismatch for model.embed_tokens.weight"))
    assert not checkpoint_at_fault(RuntimeError("[../gloo/transport] Connection closed by peer"))
    assert _load_problem(missing_key) == "RuntimeError: Missing key in checkpoint state_dict: lm_head"


def test_preflight_keeps_a_checked_model_and_never_a_refused_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shardkeeper._model_facts: the second launch of the same model section reads its numbers back (equal to the
    full check's); another config or seq_len is another key; a refusal is not kept; a malformed entry is ignored."""
    from schemas import ClusterTopology
    from shardkeeper import _model_facts as model_facts
    from shardkeeper.config import check_model_config
    from shardkeeper.preflight import meta_model, preflight

    monkeypatch.setenv("SHARDKEEPER_CACHE", str(tmp_path / "cache"))
    spec = load_run_spec(Path("configs/tiny.yaml"))
    topo = ClusterTopology(nodes=1, procs_per_node=2, device_type="cpu", backend="gloo", launcher="local")
    preflight(spec, topo, tmp_path / "run")
    k = model_facts.key(spec)
    facts = model_facts.load(k)
    cfg = check_model_config(spec)
    assert facts is not None and facts.params == sum(p.numel() for p in meta_model(spec, cfg).parameters())
    assert (facts.vocab_size, facts.hidden_size, facts.num_hidden_layers) == (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_hidden_layers,
    )
    assert model_facts.key(load_run_spec(Path("configs/tiny.yaml"), ["model.config.num_hidden_layers=3"])) != k
    assert model_facts.key(load_run_spec(Path("configs/tiny.yaml"), ["data.seq_len=16"])) != k
    bad = load_run_spec(Path("configs/tiny.yaml"), ["model.config.hidden_sise=8"])
    for _ in range(2):  # refused both times, with its line, and nothing kept for it
        with pytest.raises(ConfigError, match="hidden_sise"):
            preflight(bad, topo, tmp_path / "run2")
    assert model_facts.load(model_facts.key(bad)) is None
    (tmp_path / "cache" / "preflight" / f"{k}.json").write_text('{"params": "1e9"}')
    assert model_facts.load(k) is None
    # Crafted entries are never taken for the check's: out of bounds, or at odds with what model.config states
    entry = tmp_path / "cache" / "preflight" / f"{k}.json"
    real = {f: getattr(facts, f) for f in model_facts.FIELDS}
    for crafted in (
        {"params": 10**400},
        {"params": 10**13 + 1},
        {"hidden_size": 2**31 + 1},
        {"vocab_size": 0},
        {"vocab_size": 1000},
        {"hidden_size": 8, "params": 1000},
        {"num_hidden_layers": 1},
        {"max_position_embeddings": 4096},
        {"params": 10},
    ):
        entry.write_text(json.dumps({**real, **crafted}))
        assert model_facts.load(k, spec) is None, crafted
    entry.write_text(json.dumps({**real, "params": 10**400}))
    preflight(spec, topo, tmp_path / "run")  # the full check again (no OverflowError), and the entry rewritten
    assert model_facts.load(k, spec) == facts
    long = load_run_spec(Path("configs/tiny.yaml"), ["data.seq_len=200"])  # longer than max_position_embeddings
    (tmp_path / "cache" / "preflight" / f"{model_facts.key(long)}.json").write_text(json.dumps(real))
    assert model_facts.load(model_facts.key(long), long) is None
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        preflight(long, topo, tmp_path / "run3")
    monkeypatch.setenv("SHARDKEEPER_PREFLIGHT_CACHE", "0")
    assert model_facts.key(spec) is None


def test_launcher_waits_by_pid_for_what_its_agent_left_running() -> None:
    """A grandchild orphaned by its parent's SIGKILL (as a rank whose torchrun was killed) is recorded while
    the parent lives, then SIGKILLed and waited for by pid: gone when reap_orphans returns."""
    import signal
    import time

    from launch.procs import Descendants, reap_orphans

    agent = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    tree = Descendants(agent.pid)
    end = time.monotonic() + 10
    while len(tree.seen) < 2 and time.monotonic() < end:
        tree.scan()
        time.sleep(0.01)
    assert len(tree.seen) == 2 and len(tree.live()) == 2
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert len(tree.live()) == 2  # orphans, still running: no parent-death signal here
    t0 = time.monotonic()
    assert reap_orphans(tree) == []
    assert time.monotonic() - t0 < 5
    assert not any(_is_running(pid) for pid in tree.seen)  # gone, or a zombie waiting for its new parent


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] not in "ZX"


def test_slurm_launcher_sees_ranks_that_outlive_their_job(tmp_path: Path) -> None:
    """launch.slurm.ranks_alive: a process holding RUN_DIR/.lock.ranks shared (as a rank slurmd has not killed
    yet) is seen; once it is gone, nothing is; a run dir without the file has no ranks."""
    from ckpt.guards.lock import RANKS_LOCK_NAME
    from launch.slurm import RANKS_LOCK, ranks_alive

    assert RANKS_LOCK == RANKS_LOCK_NAME
    assert not ranks_alive(tmp_path)
    code = (
        f"import sys, time; sys.path.insert(0, {str(Path.cwd())!r}); from ckpt.guards.lock import hold_ranks_lock; "
        f"hold_ranks_lock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "held"
        assert ranks_alive(tmp_path)
        import fcntl

        fd = os.open(tmp_path / RANKS_LOCK, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe left the lock as it found it: a rank can join
        os.close(fd)
    finally:
        rank.kill()
        rank.wait()
    assert not ranks_alive(tmp_path)


def test_checksum_mismatch_says_its_phrase_once_after_crossing_ranks() -> None:
    """DCP pickles a rank's exception to the coordinator: the line must come back as it was written."""
    import pickle

    from ckpt.commit.hashing import ChecksumMismatch
    from trainer.checkpointer.core import _load_problem

    err = pickle.loads(pickle.dumps(ChecksumMismatch("/run/step_4/__1_1.distcp")))
    assert isinstance(err, ChecksumMismatch) and err.path == "/run/step_4/__1_1.distcp"
    assert _load_problem(err) == "/run/step_4/__1_1.distcp: checksum mismatch; the file is corrupted"


def test_lease_document_types_checked() -> None:
    """A lease object of JSON but of other types is garbage (an unknown writer, the local expiry), never a crash."""
    import math
    import socket

    from ckpt.guards.lease import LeaseView, parse_doc

    good = {"owner": {"host": "h", "pid": 7, "id": "u"}, "acquired": "t", "renewed": "t", "expiry_s": 20}
    assert parse_doc(json.dumps(good).encode(), 60.0) == (good, 20.0)
    for bad in (
        '{"owner": "x"}',
        '{"owner": {"host": 1, "pid": 7, "id": "u"}}',
        '{"owner": {"host": "h", "pid": "7", "id": "u"}}',
        '{"owner": {"host": "h", "pid": true, "id": "u"}}',
        "[]",
        '"s"',
        "nope",
        '{"owner": {"host": "h", "pid": 7, "id": "u"}, "renewed": 5}',
    ):
        doc, expiry = parse_doc(bad.encode(), 60.0)
        assert doc == {"owner": {"host": "an unknown writer", "pid": "?"}} and expiry == 60.0, bad
    for expiry in ("Infinity", "NaN", "-1", "0", "86401", '"10"', "true"):
        raw = json.dumps({k: v for k, v in good.items() if k != "expiry_s"})[:-1] + f', "expiry_s": {expiry}}}'
        doc, got = parse_doc(raw.encode(), 60.0)
        assert doc["owner"] == good["owner"] and got == 60.0 and math.isfinite(got), expiry
    here = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    view = lambda host, pid: LeaseView({"owner": {"host": host, "pid": pid, "id": "u"}}, "e", 10.0)  # noqa: E731
    assert view(here, gone.pid).holder_dead()
    assert not view(here, os.getpid()).holder_dead() and not view(here, 1).holder_dead()
    assert not view(here + "-other", gone.pid).holder_dead() and not view(here, "?").holder_dead()


def test_the_first_rank_failure_line_outlives_the_output_window() -> None:
    """A rank's one-line failure stays in what the launcher reads however many lines follow it (a script's atexit
    handlers printing a summary): the segment is reported failed with that line, not completed."""
    from launch.base import OutputSplitter, failing_rank_lines
    from schemas.seam import RANK_ERROR_PREFIX

    out = OutputSplitter(lambda line: None, keep=5)
    out.feed("2026-01-01 00:00:00,000 [rank0] shardkeeper.trainer: step 4/4")
    out.feed(f"{RANK_ERROR_PREFIX} rank 1: ValueError: boom after the loop\n")
    out.feed(f"{RANK_ERROR_PREFIX} rank 0: a later consequence")
    for i in range(20):
        out.feed(f"tracker: summary line {i}")
    lines = out.lines()
    assert len(lines) == 6 and lines[1:] == [f"tracker: summary line {i}" for i in range(15, 20)]
    assert failing_rank_lines(lines) == "rank 1: ValueError: boom after the loop"
    # every rank's line is kept with its arrival time, whatever the window: the launcher's account has both
    assert [t for _, t in out.rank_errors] == ["rank 1: ValueError: boom after the loop", "rank 0: a later consequence"]
    quiet = OutputSplitter(lambda line: None, keep=5)
    quiet.feed(f"{RANK_ERROR_PREFIX} rank 0: failed")
    assert quiet.lines() == [f"{RANK_ERROR_PREFIX} rank 0: failed"]


def test_a_failed_group_restarts_in_place_for_a_death_or_a_lost_peer_never_for_an_error_of_its_own() -> None:
    from launch.attribution import WorkerEnd, parse_restart_line, restart_line, restart_verdict

    killed, lost = WorkerEnd(1, -9, 41), WorkerEnd(0, 1, 40, consequence="connection reset by peer")
    assert restart_verdict([killed, lost]) == (killed, None)  # SIGKILL (from outside, the OOM killer)
    assert restart_verdict([lost, WorkerEnd(1, -11)])[0].exitcode == -11  # a segfault, seen after its peer's error
    timed_out = WorkerEnd(0, 1, consequence="timed out waiting in a collective")
    assert restart_verdict([timed_out, WorkerEnd(1, -15)]) == (timed_out, None)  # a hang: no rank failed on its own
    for own in (WorkerEnd(1, 1), WorkerEnd(1, 65), WorkerEnd(1, 2), WorkerEnd(1, 3), WorkerEnd(1, 0)):
        first, why = restart_verdict([killed, lost, own])  # an error of a rank's own vetoes whatever else happened
        assert first is None and "rank 1 " in why and "a restart would fail the same way" in why, (own, why)
    assert restart_verdict([WorkerEnd(0, 75), WorkerEnd(1, -15)]) == (None, "the ranks were stopped, not killed")
    record = parse_restart_line("noise " + restart_line(2, 3, killed, "run-7"))
    assert record == {
        "restart": 2,
        "of": 3,
        "rank": 1,
        "pid": 41,
        "cause": "SIGKILL",
        "exitcode": -9,
        "line": "rank 1 (pid 41) died of SIGKILL",
        "run_id": "run-7",
    }
    assert parse_restart_line("shardkeeper-restart: {not json") is None


def test_a_rank_forked_by_the_fork_server_starts_as_a_fresh_process_and_ends_as_its_client(tmp_path: Path) -> None:
    """trainer.forkserver: the same descriptors, signal dispositions, mask, threads, session, argv, working directory
    and environment as the same command started fresh (the RNG reseeded per fork); its exit code or signal comes back
    as the client's own, torchrun's SIGTERM reaches it, and it dies with its client."""
    import signal as sig
    import time

    scripts = ROOT / "tests" / "scripts"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PROBE_VAR": "x",
        "SHARDKEEPER_FORK_PRELOAD": "json",
        "SHARDKEEPER_FORK_SERVER": str(tmp_path / "fork.sock"),
    }
    server = subprocess.Popen(
        [sys.executable, "-u", "-m", "trainer.forkserver", "serve", env["SHARDKEEPER_FORK_SERVER"], str(tmp_path)],
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    log = open(tmp_path / "stdout.txt", "w")  # noqa: SIM115 - both ranks' stdout

    def start(name: str, mode: str, forked: bool = True) -> subprocess.Popen:
        head = ["-u", "-m", "trainer.forkserver", "rank"] if forked else []
        return subprocess.Popen(
            [sys.executable, *head, "-u", "-m", "fork_probe", str(tmp_path / name), mode],
            env=env,
            cwd=scripts,
            stdout=log,
            start_new_session=True,
        )

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, path
            time.sleep(0.02)

    try:
        wait_for(tmp_path / "fork.sock")
        assert start("fresh", "exit7", forked=False).wait(30) == 7
        assert start("a", "exit7").wait(30) == 7
        assert start("b", "segv").wait(30) == -sig.SIGSEGV
        fresh, a, b = (json.loads((tmp_path / n).read_text()) for n in ("fresh", "a", "b"))
        for key in ("signals", "blocked", "threads", "fds", "cwd", "path0", "probe_var", "stdout", "pdeathsig", "name"):
            assert a[key] == fresh[key] == b[key], (key, a[key], fresh[key])
        assert a["argv"][0] == fresh["argv"][0] and a["argv"][0].endswith("fork_probe.py")
        assert a["argv"][1:] == [str(tmp_path / "a"), "exit7"]
        assert a["sid"] == a["pid"] and fresh["sid"] == fresh["pid"]  # a session of its own, as torchrun starts ranks
        assert a["forked_by"] == b["forked_by"] == str(server.pid) and fresh["forked_by"] is None
        assert a["random"] != b["random"]
        term = start("t", "term")
        wait_for(tmp_path / "t.ready")
        term.send_signal(sig.SIGTERM)  # torchrun's stop, passed on
        assert term.wait(30) == 5 and (tmp_path / "t.term").exists()
        sleeper = start("s", "sleep")
        wait_for(tmp_path / "s.ready")
        pid = json.loads((tmp_path / "s").read_text())["pid"]
        sleeper.kill()  # torchrun's SIGKILL of the client: the rank goes with it
        sleeper.wait(30)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] not in "ZX":
            assert time.monotonic() < deadline, "the forked rank outlived its client"
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait(30)
        log.close()
