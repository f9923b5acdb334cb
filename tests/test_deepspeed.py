"""The DeepSpeed ZeRO backend on real gloo groups (CPU): exact and elastic resume, cross-backend
continuation, export, and one-line refusals of bad input.

Reference runs (2 ranks, steps 1..8, a checkpoint every 4) are shared by the module; resumed runs are
compared with them step by step. The first DeepSpeed launch on a machine JIT-compiles
deepspeed_shm_comm_op (~2 min) into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions): keep
that directory between CI runs and the whole module takes about 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from ckpt.commit.hashing import hash_file
from ckpt.commit.layout import RunDir
from ckpt.commit.manifest import read_manifest
from ckpt.validate.checks import validate
from schemas import RunSpec
from shardkeeper.cli import main
from shardkeeper.stages import convert_checkpoint, prepare_run_dir
from tests.harness import assert_bitwise, copy_run_until, max_rel, metrics, spawn, tiny_spec
from trainer.segment import run_segment

pytestmark = [
    pytest.mark.skipif(
        find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install -e '.[deepspeed]')"
    ),
    pytest.mark.slow,
]

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
END = 8
CUT = 4
TIMEOUT = 900  # the first launch may JIT-compile DeepSpeed's shm op


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_env():
    mp = pytest.MonkeyPatch()
    mp.setenv(
        "TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    )
    mp.setenv("DS_ACCELERATOR", "cpu")
    yield
    mp.undo()


def ds_spec(stage: int = 2, **overrides: object) -> RunSpec:
    return tiny_spec(**{"backend": "deepspeed", "deepspeed.zero_stage": stage, "checkpoint.interval": CUT, **overrides})


def train(run: Path, world: int, until: int, segment: int = 0, spec: RunSpec | None = None) -> None:
    if spec is not None:
        prepare_run_dir(RunDir.at(run), spec)
    assert spawn(run_segment, world, str(run), until, segment, timeout=TIMEOUT) == [0] * world


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]


def error_line(capsys: pytest.CaptureFixture, argv: list[str], code: int) -> str:
    assert main(argv) == code
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error: ")]
    assert len(err) == 1, err
    return err[0]


def rehash(ckpt_dir: Path) -> None:
    """Refresh sizes and checksums in the manifest after a test edited the files on purpose."""
    mpath = ckpt_dir / "manifest.json"
    raw = json.loads(mpath.read_text())
    for entry in raw["files"]:
        entry["size"], entry["xxh3_128"] = hash_file(ckpt_dir / entry["path"])
    mpath.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def z2_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("z2") / "run"
    train(run, 2, END, spec=ds_spec(2))
    return run


@pytest.fixture(scope="module")
def z3_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("z3") / "run"
    train(run, 2, END, spec=ds_spec(3))
    return run


@pytest.fixture(scope="module")
def fsdp_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("fsdp") / "run"
    train(run, 2, END, spec=tiny_spec(**{"checkpoint.interval": CUT}))
    return run


# ----------------------------------------------------------------------------------------- resume
def test_zero2_same_world_size_resume_is_bitwise(z2_ref: Path, tmp_path: Path) -> None:
    man = read_manifest(ckpt(z2_ref, CUT))
    assert (man.format, man.run_spec.deepspeed.zero_stage, man.topology.world_size) == ("deepspeed", 2, 2)
    assert {f.path for f in man.files} >= {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng_rank_00001.pt",
        "shardkeeper_state.json",
    }
    assert all(t.dtype == "float32" for t in man.tensors) and validate(ckpt(z2_ref, CUT), deep=True).valid
    assert not list((z2_ref / "checkpoints").glob("*.py"))  # no stray DeepSpeed scripts beside the checkpoints
    run = copy_run_until(z2_ref, tmp_path / "run", CUT)
    train(run, 2, END, 1)
    assert_bitwise(metrics(z2_ref), metrics(run), range(CUT + 1, END + 1))
    assert not (ckpt(run, CUT) / "universal").exists()  # same world size: loaded natively, nothing converted


def test_zero3_same_world_size_resume_is_bitwise(z3_ref: Path, tmp_path: Path) -> None:
    run = copy_run_until(z3_ref, tmp_path / "run", CUT)
    train(run, 2, END, 1)
    assert_bitwise(metrics(z3_ref), metrics(run), range(CUT + 1, END + 1))


def test_zero3_resume_at_three_ranks_within_1e6(z3_ref: Path, tmp_path: Path) -> None:
    run = copy_run_until(z3_ref, tmp_path / "run", CUT)
    train(run, 3, END, 1)
    rel = max_rel(metrics(z3_ref), metrics(run), range(CUT + 1, END + 1))
    assert rel <= 1e-6, f"ZeRO-3 2->3: max relative loss difference {rel:.3e}"
    # saved at 3 ranks, where ZeRO-3 pads partitions: the fingerprint covers the parameters, not the
    # padding (deep validation recomputes it from the files), and the checkpoint resumes at 2 ranks
    report = validate(ckpt(run, END), deep=True)
    assert report.valid, report.errors


# ----------------------------------------------------------------------------------------- async saves
def _same(a: object, b: object, where: str) -> None:
    """Loaded DeepSpeed states equal: every tensor bitwise (dtype, shape, values), every other value."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 - bitwise, NaN included
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        _same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_zero2_async_saves_equal_sync_saves(z2_ref: Path, tmp_path: Path) -> None:
    """checkpoint.async_save is honoured by the DeepSpeed backend: the interval save is written in the
    background, training is bitwise unchanged, and every file holds the same state as the sync save's."""
    from ckpt.formats.pickle.safe_pickle import DEEPSPEED_STATE
    from ckpt.formats.pickle.torchzip import load_file

    run = tmp_path / "run"
    train(run, 2, END, spec=ds_spec(2, **{"checkpoint.async_save": "true"}))
    assert_bitwise(metrics(z2_ref), metrics(run), range(1, END + 1))
    for step in (CUT, END):
        sync, done = read_manifest(ckpt(z2_ref, step)), read_manifest(ckpt(run, step))
        assert done.async_save == (step == CUT) and validate(ckpt(run, step), deep=True).valid
        assert [(f.path, f.size, f.xxh3_128) for f in done.files] == [(f.path, f.size, f.xxh3_128) for f in sync.files]
        for f in sync.files:
            if f.path.endswith(".pt"):
                _same(
                    load_file(ckpt(z2_ref, step) / f.path, DEEPSPEED_STATE),
                    load_file(ckpt(run, step) / f.path, DEEPSPEED_STATE),
                    f"step {step} {f.path}",
                )
    event = [e for e in events(run) if e["id"] == f"checkpoint:step-{CUT:08d}"][0]
    assert event["data"]["async_save"] is True


def _stalled_segment(run: str, until: int, segment: int, stall: int, marks: str) -> int:
    """A rank whose background write of step ``stall`` hangs after its first file (then it is killed)."""
    import threading
    import time

    import trainer.deepspeed.checkpointer as ds

    real = ds.save_torch

    def save_torch(path: object, obj: object) -> tuple[int, str]:
        out = real(path, obj)
        if Path(path).parent.name == f"step-{stall:08d}.partial" and threading.current_thread().name.startswith(
            "ckpt-commit"
        ):
            (Path(marks) / f"rank{os.environ['RANK']}").touch()
            time.sleep(600)
        return out

    ds.save_torch = save_torch
    return run_segment(run, until, segment)


def test_sigkill_during_an_async_write_commits_nothing_and_resume_is_bitwise(z2_ref: Path, tmp_path: Path) -> None:
    import queue
    import signal
    import time

    run, marks, stall = tmp_path / "run", tmp_path / "marks", 2 * CUT
    marks.mkdir()
    prepare_run_dir(RunDir.at(run), ds_spec(2, **{"checkpoint.async_save": "true"}))

    def kill_when_stalled(procs: list) -> None:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            trained = (
                max((json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()), default=0)
                if (run / "metrics.jsonl").exists()
                else 0
            )
            if len(list(marks.iterdir())) == 2 and trained > stall:  # both writes stuck, training went on
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                return
            time.sleep(0.05)
        raise AssertionError("the background writes never stalled")

    with pytest.raises(queue.Empty):  # killed ranks report nothing (both are dead when on_start returns)
        spawn(_stalled_segment, 2, str(run), stall + CUT, 0, stall, str(marks), timeout=2, on_start=kill_when_stalled)
    partial = run / "checkpoints" / f"step-{stall:08d}.partial"
    assert not ckpt(run, stall).exists() and partial.is_dir() and any(partial.iterdir())
    assert not (partial / "manifest.json").exists() and not validate(partial).valid
    assert validate(ckpt(run, CUT), deep=True).valid
    train(run, 2, END, 1)  # resumes from the async checkpoint at CUT
    assert [e for e in events(run) if e["kind"] == "resume"][-1]["parent"] == f"checkpoint:step-{CUT:08d}"
    assert_bitwise(metrics(z2_ref), metrics(run), range(CUT + 1, END + 1))
    assert validate(ckpt(run, END), deep=True).valid


def cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDKEEPER_DEVICE": "cpu", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "shardkeeper", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_cli_train_at_a_new_world_size_converts_once_and_resumes_within_1e6(z2_ref: Path, tmp_path: Path) -> None:
    run = copy_run_until(z2_ref, tmp_path / "run", CUT)  # the first segment: 2 ranks, steps 0 -> CUT
    copied = len([e for e in events(run) if e["kind"] == "reshard"])  # conversions other tests made of z2_ref
    base = [
        "train",
        "--config",
        TINY,
        "--run-dir",
        str(run),
        "--set",
        "backend=deepspeed",
        "--set",
        "checkpoint.keep_last=100",
        "--set",
        f"checkpoint.interval={CUT}",
    ]  # = ds_spec(2)
    second = cli(*base, "--nproc", "3", "--until-step", str(END))  # the trainer converts by itself
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[DeepSpeedDiagnostics] zero_stage=2 world_size=3" in second.stderr
    got = metrics(run)
    assert {got[s]["world_size"] for s in range(CUT + 1, END + 1)} == {3}
    rel = max_rel(metrics(z2_ref), got, range(CUT + 1, END + 1))
    assert rel <= 1e-6, f"ZeRO-2 2->3: max relative loss difference {rel:.3e}"
    universal = ckpt(run, CUT) / "universal"
    assert validate(universal, deep=True).valid and validate(ckpt(run, CUT), deep=True).valid
    record = read_manifest(ckpt(run, CUT)).hf_model  # carried into the universal manifest, recorded again at 3 ranks
    assert record is not None and read_manifest(universal).hf_model == record == read_manifest(ckpt(run, END)).hf_model
    assert validate(ckpt(run, END), deep=True).valid  # written at 3 ranks
    reshards = [e for e in events(run) if e["kind"] == "reshard"][copied:]
    assert len(reshards) == 1 and reshards[0]["data"]["method"] == "deepspeed-universal"
    resume = [e for e in events(run) if e["kind"] == "resume"][-1]
    assert (resume["data"]["from_world_size"], resume["data"]["to_world_size"]) == (2, 3)
    again = cli("reshard", str(ckpt(run, CUT)), "--world-size", "3")  # cached: no second conversion
    assert again.returncode == 0 and "deepspeed-universal" in again.stdout and str(universal) in again.stdout
    assert len([e for e in events(run) if e["kind"] == "reshard"]) == copied + 1


# ----------------------------------------------------------------------------------------- across backends
def test_backends_agree_on_uninterrupted_runs(z2_ref: Path, fsdp_ref: Path) -> None:
    rel = max_rel(metrics(fsdp_ref), metrics(z2_ref), range(1, END + 1))
    gn = max_rel(metrics(fsdp_ref), metrics(z2_ref), range(1, END + 1), key="grad_norm")
    print(
        f"\nDeepSpeed ZeRO-2 vs FSDP2, 2 ranks, steps 1-{END}: "
        f"max relative difference loss {rel:.2e}, grad norm {gn:.2e}"
    )
    assert rel <= 1e-6 and gn <= 1e-5


def test_deepspeed_checkpoint_continues_under_fsdp2(z2_ref: Path, fsdp_ref: Path, tmp_path: Path) -> None:
    run = tmp_path / "fsdp"
    done = convert_checkpoint(ckpt(z2_ref, CUT), "dcp", run)
    man = read_manifest(done)
    assert (man.format, man.reason, man.run_spec.backend, done) == ("dcp", "converted", "fsdp2", ckpt(run, CUT))
    assert man.hf_model is not None and man.hf_model == read_manifest(ckpt(z2_ref, CUT)).hf_model
    assert validate(done, deep=True).valid  # checksums and the fingerprint of the stored tensors
    train(run, 2, END, 0)
    got = metrics(run)
    rel_ds = max_rel(metrics(z2_ref), got, range(CUT + 1, END + 1))
    rel_fsdp = max_rel(metrics(fsdp_ref), got, range(CUT + 1, END + 1))
    print(f"\nZeRO-2 -> FSDP2 at step {CUT}: vs DeepSpeed run {rel_ds:.2e}, vs FSDP2 run {rel_fsdp:.2e}")
    assert rel_ds <= 1e-6 and rel_fsdp <= 1e-6
    assert any(e["kind"] == "reshard" and e["data"]["method"] == "convert-to-dcp" for e in events(z2_ref))


def test_conversion_to_dcp_streams_the_zero_state_bit_for_bit(z2_ref: Path, tmp_path: Path) -> None:
    """The streamed DeepSpeed -> DCP conversion (one parameter at a time, freed heap handed back) writes
    exactly the ZeRO state: the fp32 weights of DeepSpeed's own zero_to_fp32 and the AdamW moments of
    the ZeRO partitions (gathered here with torch.load, as DeepSpeed reads them), bit for bit; two
    conversions write byte-identical data files and the same .metadata but for DCP's per-save id; the
    fingerprint verifies. (The FSDP2 resume from it: test_deepspeed_checkpoint_continues_under_fsdp2.)"""
    import pickle

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ckpt.formats.dcp.reader import DCPTensorReader
    from ckpt.formats.deepspeed.convert import to_dcp

    src = ckpt(z2_ref, CUT)
    first, second = (to_dcp(src, tmp_path / n / src.name) for n in ("a", "b"))
    assert validate(first, deep=True).valid
    data = sorted(p.name for p in first.glob("*.distcp"))
    assert data and data == sorted(p.name for p in second.glob("*.distcp"))
    assert all((first / n).read_bytes() == (second / n).read_bytes() for n in data)
    metas = [pickle.loads((d / ".metadata").read_bytes()) for d in (first, second)]  # noqa: S301 - files made here
    assert [(m.state_dict_metadata, m.planner_data, m.storage_data) for m in metas[:1]] == [
        (m.state_dict_metadata, m.planner_data, m.storage_data) for m in metas[1:]
    ]

    expect = {
        f"model.{k}": v
        for k, v in get_fp32_state_dict_from_zero_checkpoint(str(z2_ref / "checkpoints"), tag=src.name).items()
    }
    pieces: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        osd = torch.load(src / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)  # noqa: S614
        osd = osd["optimizer_state_dict"]
        for group, maps in enumerate(osd["param_slice_mappings"]):
            state = osd["base_optimizer_state"]["state"][group]
            for name, frag in maps.items():
                for m in ("exp_avg", "exp_avg_sq"):
                    pieces.setdefault(f"optim.state.{name}.{m}", []).append(state[m].narrow(0, frag.start, frag.numel))
    with DCPTensorReader(first) as reader:
        for key, parts in pieces.items():
            expect[key] = torch.cat(parts).view(reader.meta(key).size)
        got = {k: reader.read(k) for k in expect}
    assert expect and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expect.items())


def test_fsdp2_checkpoint_continues_under_deepspeed_at_another_size(fsdp_ref: Path, tmp_path: Path) -> None:
    run = tmp_path / "ds"
    done = convert_checkpoint(ckpt(fsdp_ref, CUT), "deepspeed", run, zero_stage=2)
    man = read_manifest(done)
    assert (man.format, man.reason, man.run_spec.backend) == ("deepspeed", "converted", "deepspeed")
    assert validate(done / "universal", deep=True).valid
    record = read_manifest(ckpt(fsdp_ref, CUT)).hf_model
    assert record is not None and man.hf_model == record == read_manifest(done / "universal").hf_model
    train(run, 3, END, 0)
    rel = max_rel(metrics(fsdp_ref), metrics(run), range(CUT + 1, END + 1))
    assert rel <= 1e-6, f"FSDP2 -> ZeRO-2 at 3 ranks: {rel:.3e}"
    assert read_manifest(ckpt(run, END)).format == "deepspeed"
    assert read_manifest(ckpt(run, END)).hf_model == record  # the DeepSpeed backend records the same model


# ------------------------------------------------------------------------------------- tied embeddings
TIED = {"model.config.tie_word_embeddings": "true"}


@pytest.fixture(scope="module")
def tied_z2_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tied-z2") / "run"
    train(run, 2, END, spec=ds_spec(2, **TIED))
    return run


@pytest.fixture(scope="module")
def tied_fsdp_ref(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tied-fsdp") / "run"
    train(run, 2, END, spec=tiny_spec(**{"checkpoint.interval": CUT, **TIED}))
    return run


def _names(ckpt_dir: Path) -> tuple[list[str], list[str]]:
    man = read_manifest(ckpt_dir)
    return sorted(t.name for t in man.tensors), sorted(man.fingerprint.model)


def test_tied_zero2_checkpoint_continues_under_fsdp2(tied_z2_ref: Path, tied_fsdp_ref: Path, tmp_path: Path) -> None:
    """A tied model (lm_head.weight is model.embed_tokens.weight): DeepSpeed saves the pair once, FSDP2's state
    dict holds both names. The converted checkpoint holds exactly the names of FSDP2's own checkpoints, the tied
    name with the source's values, and the FSDP2 run continues the ZeRO-2 run's losses."""
    import torch

    from ckpt.formats.dcp.reader import DCPTensorReader

    assert _names(ckpt(tied_z2_ref, CUT))[0] != _names(ckpt(tied_fsdp_ref, CUT))[0]  # the layouts differ
    run = tmp_path / "fsdp"
    done = convert_checkpoint(ckpt(tied_z2_ref, CUT), "dcp", run)
    assert _names(done) == _names(ckpt(tied_fsdp_ref, CUT)) and validate(done, deep=True).valid
    with DCPTensorReader(done) as reader:
        assert torch.equal(reader.read("model.lm_head.weight"), reader.read("model.model.embed_tokens.weight"))
    assert read_manifest(done).source_world_size == 2
    train(run, 2, END, 0)
    got = metrics(run)
    for ref in (tied_z2_ref, tied_fsdp_ref):
        rel = max_rel(metrics(ref), got, range(CUT + 1, END + 1))
        assert rel <= 1e-6, f"tied ZeRO-2 -> FSDP2 vs {ref.parent.name}: {rel:.3e}"
    resume = [e for e in events(run) if e["kind"] == "resume"][-1]["data"]
    assert (resume["from_world_size"], resume["converted"]) == (2, True)  # not "saved at world size 1"
    assert validate(ckpt(run, END), deep=True).valid and _names(ckpt(run, END)) == _names(ckpt(tied_fsdp_ref, END))


def test_tied_fsdp2_checkpoint_continues_under_zero2(tied_z2_ref: Path, tied_fsdp_ref: Path, tmp_path: Path) -> None:
    run = tmp_path / "ds"
    done = convert_checkpoint(ckpt(tied_fsdp_ref, CUT), "deepspeed", run, zero_stage=2)
    assert _names(done) == _names(ckpt(tied_z2_ref, CUT)) and validate(done / "universal", deep=True).valid
    train(run, 2, END, 0)
    got = metrics(run)
    for ref in (tied_z2_ref, tied_fsdp_ref):
        rel = max_rel(metrics(ref), got, range(CUT + 1, END + 1))
        assert rel <= 1e-6, f"tied FSDP2 -> ZeRO-2 vs {ref.parent.name}: {rel:.3e}"
    assert validate(ckpt(run, END), deep=True).valid and _names(ckpt(run, END)) == _names(ckpt(tied_z2_ref, END))


def test_refused_conversion_into_a_new_run_dir_leaves_nothing(
    tied_fsdp_ref: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A tied copy the manifest does not declare tied (an edited record) is refused before anything is written,
    and the run directory the conversion would have made is not left behind (status would list it)."""
    run = tmp_path / "src"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tied_fsdp_ref / "run.yaml", run / "run.yaml")
    src = shutil.copytree(ckpt(tied_fsdp_ref, CUT), ckpt(run, CUT))
    raw = json.loads((src / "manifest.json").read_text())
    raw["hf_model"]["tied"] = {}
    (src / "manifest.json").write_text(json.dumps(raw))
    out = tmp_path / "new-run"
    line = error_line(capsys, ["convert", str(src), "--to", "deepspeed", str(out)], 4)
    assert "lm_head.weight has no optimizer state" in line
    assert not out.exists()


def _without_the_model_check(run: str, until: int) -> int:
    """run_segment on a rank that skips the model comparison before the load (as runs did before it existed)."""
    from trainer.checkpointer.resumer import Resumer

    Resumer.model_problem = lambda self, manifest: None  # type: ignore[method-assign]
    return run_segment(run, until, 0)


def test_a_checkpoint_the_live_run_cannot_load_is_not_quarantined(
    tied_z2_ref: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid checkpoint that does not fit the live run (here: FSDP2's model has a name the checkpoint lacks, as
    conversions wrote tied models before) fails the segment in one line and stays in place: it is not moved aside
    as if its bytes were bad, and the next segment finds it again. The model comparison refuses it before the
    load, naming the tensor; a load that fails anyway (the comparison skipped) leaves it in place too."""
    import ckpt.formats.deepspeed.convert as conv

    monkeypatch.setattr(conv, "tied_of", lambda manifest, names: {})  # the old conversion: embed_tokens only
    run = tmp_path / "fsdp"
    done = convert_checkpoint(ckpt(tied_z2_ref, CUT), "dcp", run)
    assert validate(done, deep=True).valid
    for target, args, says in (
        (
            run_segment,
            (str(run), END, 0),
            "lm_head.weight [256, 64] float32 is in this run's model but not in the checkpoint",
        ),
        (_without_the_model_check, (str(run), END), "does not load into this run"),
    ):
        with pytest.raises(RuntimeError) as err:
            spawn(target, 2, *args, timeout=TIMEOUT)
        lines = [ln for ln in str(err.value).splitlines() if ln.startswith("rank 0:")]
        assert len(lines) == 1 and says in lines[0] and "lm_head.weight" in lines[0], str(err.value)
        assert done.is_dir() and not list(done.parent.glob("*.invalid-*")) and validate(done).valid
        assert not [e for e in events(run) if e["kind"] == "validate" and e["data"].get("action") == "quarantined"]


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _export_and_compare(ref_run: Path, tmp_path: Path, **options: object) -> dict:
    """Export the reference run's last checkpoint through the export stage, in a run directory of its
    own; check it against zero_to_fp32 bit for bit (after the cast, when a dtype is given), that nothing
    but the output is left beside it, and that the export is recorded in the run's lineage."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from shardkeeper.stages import export_and_record

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ref_run / "run.yaml", run / "run.yaml")
    shutil.copytree(ckpt(ref_run, END), ckpt(run, END))
    out = run / "exports" / "final"
    res = export_and_record(ckpt(run, END), out, **options)
    assert res.checkpoint == str(ckpt(run, END)) and res.num_shards == len(list(out.glob("*.safetensors")))
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["final"]
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    ref = get_fp32_state_dict_from_zero_checkpoint(str(ref_run / "checkpoints"), tag=f"step-{END:08d}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(options.get("dtype")), torch.float32)
    assert sorted(got) == sorted(ref)
    assert all(got[k].dtype == dtype and torch.equal(got[k], ref[k].to(dtype)) for k in ref)
    assert [e["parent"] for e in events(run) if e["kind"] == "export"] == [f"checkpoint:step-{END:08d}"]
    return got


def test_export_stage_on_a_zero_checkpoint_matches_zero_to_fp32(z2_ref: Path, tmp_path: Path) -> None:
    """The export stage takes a deepspeed checkpoint like a DCP one, in one pass from the ZeRO files:
    same tensors as zero_to_fp32, bit for bit, no scratch left beside the output, the export recorded
    in the run's lineage, and the same bytes as the export of the checkpoint converted to DCP."""
    from ckpt.commit.manifest import write_manifest
    from ckpt.export import export_checkpoint as export_dcp
    from ckpt.formats.deepspeed.convert import to_dcp

    _export_and_compare(z2_ref, tmp_path)
    direct = tmp_path / "run" / "exports" / "final"
    files = {p.name: sha256_of(p) for p in direct.iterdir()}
    dcp = to_dcp(ckpt(z2_ref, END), tmp_path / "dcp" / f"step-{END:08d}", model_only=True)
    record = read_manifest(ckpt(z2_ref, END)).hf_model
    assert record is not None and read_manifest(dcp).hf_model == record  # the conversion carries the record
    assert export_dcp(dcp, tmp_path / "from-dcp").files == files
    # without the record (checkpoints written before it), transformers describes the model: same bytes
    old = shutil.copytree(ckpt(z2_ref, END), tmp_path / "old" / f"step-{END:08d}")
    write_manifest(old, read_manifest(old).model_copy(update={"hf_model": None}))
    assert export_dcp(old, tmp_path / "from-old").files == files


def test_export_stage_on_a_zero3_checkpoint_matches_zero_to_fp32(z3_ref: Path, tmp_path: Path) -> None:
    """ZeRO-3 partitions (each parameter split over the ranks, padded): bf16, several shards."""
    got = _export_and_compare(z3_ref, tmp_path, dtype="bfloat16", max_shard_size="20KB")
    assert len(list((tmp_path / "run" / "exports" / "final").glob("*.safetensors"))) > 1 and got


@pytest.mark.parametrize("where", ["middle", "last"])
def test_export_of_a_corrupted_zero_partition_is_refused(
    broken: Path, tmp_path: Path, where: str, capsys: pytest.CaptureFixture
) -> None:
    """A flipped bit in the fp32 master partition (same size: quick validation passes) is caught by the
    CRC-32 of its zip entry before anything is committed; one line names the file."""
    from ckpt.formats.deepspeed.zero import ZeroShards

    path = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with ZeroShards(broken) as shards:
        offset, length, crc = shards.files[1].storage_entry(shards.flat(1, 0, "fp32").key)
    assert crc, "torch.save recorded no CRC-32"
    raw = bytearray(path.read_bytes())
    raw[offset + (length // 2 if where == "middle" else length - 1)] ^= 0xFF
    path.write_bytes(raw)
    out = tmp_path / "exports" / "bad"
    line = error_line(capsys, ["export", str(broken), str(out)], 4)
    assert "CRC-32 mismatch" in line and path.name in line and "pick another step" in line
    assert not out.exists() and (not out.parent.exists() or not list(out.parent.iterdir()))  # no temporary left


# ----------------------------------------------------------------------------------------- bad input
@pytest.fixture
def broken(z2_ref: Path, tmp_path: Path) -> Path:
    """A private copy of the reference run's step-4 checkpoint, inside a run directory."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(z2_ref / "run.yaml", run / "run.yaml")
    shutil.copytree(ckpt(z2_ref, CUT), ckpt(run, CUT))
    return ckpt(run, CUT)


def _unchanged(ckpt_dir: Path, out: Path) -> None:
    assert not (ckpt_dir / "universal").exists() and not list(ckpt_dir.glob("universal.partial*"))
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.partial*"))


def test_missing_rank_file_is_refused(broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    line = error_line(capsys, ["reshard", str(broken), "--world-size", "3"], 4)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in line and "missing" in line
    out = tmp_path / "out" / f"step-{CUT:08d}"
    assert "zero_pp_rank_1" in error_line(capsys, ["convert", str(broken), "--to", "dcp", str(out)], 4)
    _unchanged(broken, out)


def test_mismatched_zero_stage_is_refused(broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mpath = broken / "manifest.json"
    raw = json.loads(mpath.read_text())
    raw["run_spec"]["deepspeed"]["zero_stage"] = 3
    mpath.write_text(json.dumps(raw))
    out = tmp_path / "out" / f"step-{CUT:08d}"
    line = error_line(capsys, ["convert", str(broken), "--to", "dcp", str(out)], 4)
    assert "ZeRO stage 2 state, the manifest says stage 3" in line
    _unchanged(broken, out)
    run = broken.parent.parent  # resuming the run under another stage is refused before anything runs
    line = error_line(
        capsys,
        [
            "train",
            "--config",
            TINY,
            "--run-dir",
            str(run),
            "--set",
            "backend=deepspeed",
            "--set",
            "deepspeed.zero_stage=3",
            "--set",
            "checkpoint.keep_last=100",
            "--set",
            f"checkpoint.interval={CUT}",
        ],
        2,
    )
    assert "different deepspeed" in line


def test_checkpoint_of_another_model_is_refused(broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "other"
    prepare_run_dir(RunDir.at(other), tiny_spec(**{"model.config.intermediate_size": 96}))
    line = error_line(capsys, ["convert", str(broken), "--to", "dcp", str(other)], 2)
    assert "holds another model" in line and not (other / "checkpoints").exists()
    # the rank side checks the architecture too (a run.yaml edited behind the CLI's back)
    run = broken.parent.parent
    (run / "run.yaml").write_text(
        json.dumps(ds_spec(2, **{"model.config.intermediate_size": 96}).model_dump(mode="json"))
    )
    with pytest.raises(
        RuntimeError,
        match=r"ModelMismatch: .*holds another model than this run's: model\.layers\.0\."
        r"mlp\.gate_proj\.weight is \[128, 64\] float32 in the checkpoint, \[96, 64\] float32 in ",
    ):
        spawn(run_segment, 2, str(run), END, 1, timeout=TIMEOUT)
    assert not (run / "metrics.jsonl").exists()


def test_unsupported_optimizer_state_is_refused(broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    for f in broken.glob("*_optim_states.pt"):
        sd = torch.load(f, weights_only=False)  # the test's own file, rewritten as SGD-with-momentum state
        for st in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            st["momentum_buffer"] = st.pop("exp_avg")
            del st["exp_avg_sq"]
        torch.save(sd, f)
    rehash(broken)
    out = tmp_path / "out" / f"step-{CUT:08d}"
    line = error_line(capsys, ["convert", str(broken), "--to", "dcp", str(out)], 4)
    assert "momentum_buffer" in line and "only AdamW" in line
    assert "only AdamW" in error_line(capsys, ["reshard", str(broken), "--world-size", "3"], 4)
    _unchanged(broken, out)


def test_conversion_with_a_wrong_fingerprint_writes_nothing(
    broken: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    mpath = broken / "manifest.json"
    raw = json.loads(mpath.read_text())
    key = sorted(raw["fingerprint"]["optim"])[0]
    raw["fingerprint"]["optim"][key] *= 1.001  # what a misplaced optimizer shard looks like
    mpath.write_text(json.dumps(raw))
    out = tmp_path / "out" / f"step-{CUT:08d}"
    line = error_line(capsys, ["convert", str(broken), "--to", "dcp", str(out)], 5)
    assert "differs from the saved fingerprint" in line and key in line
    assert "nothing was written" in error_line(capsys, ["reshard", str(broken), "--world-size", "3"], 5)
    _unchanged(broken, out)


# ------------------------------------------------------------------------------------------- flows
def test_flow_runs_a_deepspeed_run_at_two_sizes_and_exports(prefect_server: object, tmp_path: Path) -> None:
    """train-and-export with ``backend=deepspeed`` and no other change: 2 ranks, then 3 (the reshard
    stage converts once, cached and recorded), then the same export and publish as for FSDP2."""
    from flows.train_and_export import train_and_export
    from schemas.requests import SegmentPlan, TrainExportRequest

    run = tmp_path / "ds-flow"
    request = TrainExportRequest(
        config=TINY,
        overrides=["backend=deepspeed", "deepspeed.zero_stage=2", f"checkpoint.interval={CUT}"],
        run_dir=str(run),
        segments=[SegmentPlan(nproc=2, until_step=CUT), SegmentPlan(nproc=3, until_step=END)],
        export_dtype="float32",
        publish_target=(run / "published").as_uri(),
        backoff_s=0,
    )
    summary = train_and_export(**request.parameters())
    assert summary.status == "completed" and summary.final_step == END
    second = summary.segments[1]
    assert second.reshard is not None and second.reshard.method == "deepspeed-universal"
    assert read_manifest(ckpt(run, END)).format == "deepspeed"
    assert read_manifest(ckpt(run, END)).topology.world_size == 3
    assert (Path(summary.export.out_dir) / "model.safetensors").is_file()
    kinds = [e["kind"] for e in events(run)]
    assert {"reshard", "resume", "export", "publish"} <= set(kinds)


def test_universal_file_with_foreign_objects_is_never_handed_to_deepspeed(
    broken: Path, capsys: pytest.CaptureFixture
) -> None:
    """DeepSpeed unpickles universal files without restriction: a cached universal/ folder whose file
    holds anything but tensor records (checksums made to match) stops the segment before DeepSpeed reads it."""
    import fractions

    import torch

    assert main(["reshard", str(broken), "--world-size", "3"]) == 0
    universal = broken / "universal"
    victim = sorted((universal / "zero").rglob("exp_avg.pt"))[0]
    torch.save({"param": torch.zeros(1), "payload": fractions.Fraction(1, 3)}, victim)  # a global not allowed
    rehash(universal)
    run = broken.parent.parent
    with pytest.raises(RuntimeError, match="refused to unpickle.*fractions.Fraction"):
        spawn(run_segment, 3, str(run), END, 1, timeout=TIMEOUT)
