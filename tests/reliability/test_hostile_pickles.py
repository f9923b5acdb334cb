"""Hostile pickles planted into real checkpoints (manifest sizes and xxh3 checksums made to match) are
refused, in one line naming the file, by ``validate --deep``, ``export``, ``convert`` and the readers a
resume uses; and none of their payloads runs (each would create a sentinel file).

Corpus: tests/reliability/hostile.py (hand-written opcodes, protocols 0-5). Each entry is planted as a
DCP ``.metadata``, as the data.pkl of a DCP tensor record (a chunk of the embedding) and as a DeepSpeed
optimizer-state ``.pt``; a subset also as a DCP byte value, a DeepSpeed model-states file and an rng file.
One tiny FSDP2 run (the session's ``tiny_run``) and one DeepSpeed run (module fixture) are the victims.
"""

from __future__ import annotations

import pickle
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckpt.formats.pickle import safe_pickle
from schemas.errors import CheckpointError
from shardkeeper.cli import main
from tests.reliability.hostile import (
    CORPUS,
    LIVE,
    Hostile,
    plant_dcp_record,
    plant_metadata,
    plant_pt,
    register_extensions,
    torch_record,
)

EMBED = "model.model.embed_tokens.weight"
VALUE = "optim.param_groups.0.lr"
SUBSET = [
    "dotted-dcp-filesystem-os.system",
    "global-os.system-proto2",
    "builtins.getattr+__import__",
    "copyreg._reconstructor",
    "rebuild-tensor-foreign-hook",
    "rebuild-tensor-admitted-hook",
    "binpersid-path-key",
    "ext2",
    "deep-tuple1-chain",
    "truncated-empty",
]
BY_NAME = {h.name: h for h in CORPUS}
IDS = [h.name for h in CORPUS]


@pytest.fixture(scope="module", autouse=True)
def _extensions() -> Iterator[None]:
    """copyreg's extension registry holds os.system & co., as an attacker using EXT opcodes would hope."""
    undo = register_extensions()
    yield
    undo()


@pytest.fixture(scope="module")
def dcp_ckpt(tiny_run: Path) -> Path:
    return sorted((tiny_run / "checkpoints").glob("step-*"))[-1]


@pytest.fixture(scope="module")
def ds_ckpt(ds_run: Path) -> Path:
    """The session's DeepSpeed ZeRO-2 checkpoint at step 2 (read-only: tests plant into copies)."""
    return ds_run / "checkpoints" / "step-00000002"


def victim(src: Path, tmp_path: Path) -> Path:
    """A private copy of a committed checkpoint inside its own run directory."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(src.parent.parent / "run.yaml", run / "run.yaml")
    shutil.copytree(src, run / "checkpoints" / src.name)
    return run / "checkpoints" / src.name


def refused(capsys: pytest.CaptureFixture, argv: list[str], planted: Path) -> str:
    """The CLI exits non-zero with exactly one ``error:`` line that names the planted file."""
    capsys.readouterr()
    assert main(argv) != 0, argv
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    assert planted.name in lines[0], (argv, lines[0])
    return lines[0]


def reader_refuses(fn: Callable[[], object], planted: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and planted.name in message, message


def no_sentinel(sentinel: Path) -> None:
    assert not sentinel.exists(), f"the payload ran: {sentinel} exists"


# ----------------------------------------------------------------------------------------- the corpus
def test_corpus_is_large_and_live(tmp_path: Path, dcp_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus is what a refusal test needs: many entries, and the live ones DO run their payload under
    the standard unpickler (so a missing sentinel below means a refusal, not a dud)."""
    assert len(CORPUS) >= 40 and len(set(IDS)) == len(IDS)
    real = (dcp_ckpt / ".metadata").read_bytes()
    monkeypatch.chdir(tmp_path)
    for name in sorted(LIVE):
        sentinel = tmp_path / f"live-{name}"
        pickle.loads(BY_NAME[name].build(sentinel, real))  # noqa: S301 - proving the payload is real
        assert sentinel.exists(), name


@pytest.mark.parametrize("hostile", CORPUS, ids=IDS)
def test_hostile_metadata_is_refused(
    hostile: Hostile, dcp_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from ckpt.formats.dcp.reader import SafeFileSystemReader, read_metadata

    ckpt = victim(dcp_ckpt, tmp_path)
    sentinel = tmp_path / "SENTINEL"
    planted = plant_metadata(ckpt, hostile.build(sentinel, (dcp_ckpt / ".metadata").read_bytes()))
    # The quick check reads .metadata too (the manifest's file list must equal the files it references).
    refused(capsys, ["validate", str(ckpt)], planted)
    refused(capsys, ["validate", "--deep", str(ckpt)], planted)
    refused(capsys, ["export", str(ckpt), str(tmp_path / "out")], planted)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "converted"), "--to", "deepspeed"], planted)
    reader_refuses(lambda: read_metadata(ckpt), planted)
    reader_refuses(lambda: SafeFileSystemReader(ckpt).read_metadata(), planted)
    assert not (tmp_path / "out").exists()
    no_sentinel(sentinel)


def _dcp_load(ckpt: Path) -> None:
    """What a resume does, in one process: dcp.load through the safe reader and planner."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckpt.formats.dcp.reader import load_state, read_metadata

    md = read_metadata(ckpt)
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
        for k, v in md.state_dict_metadata.items()
    }
    load_state(sd, ckpt, no_dist=True)


@pytest.mark.parametrize("hostile", CORPUS, ids=IDS)
def test_hostile_dcp_tensor_record_is_refused(
    hostile: Hostile, dcp_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = victim(dcp_ckpt, tmp_path)
    sentinel = tmp_path / "SENTINEL"
    record = torch_record(hostile.build(sentinel, (dcp_ckpt / ".metadata").read_bytes()))
    planted = plant_dcp_record(ckpt, EMBED, record)
    refused(capsys, ["validate", "--deep", str(ckpt)], planted)
    refused(capsys, ["export", str(ckpt), str(tmp_path / "out")], planted)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "converted"), "--to", "deepspeed"], planted)
    reader_refuses(lambda: _dcp_load(ckpt), planted)
    no_sentinel(sentinel)


@pytest.mark.parametrize("name", SUBSET)
def test_hostile_dcp_byte_value_is_refused(
    name: str, dcp_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A non-tensor value (an optimizer hyperparameter) that DCP would torch.load at resume."""
    ckpt = victim(dcp_ckpt, tmp_path)
    sentinel = tmp_path / "SENTINEL"
    planted = plant_dcp_record(ckpt, VALUE, torch_record(BY_NAME[name].build(sentinel, b"\x80\x04N.")))
    refused(capsys, ["validate", "--deep", str(ckpt)], planted)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "converted"), "--to", "deepspeed"], planted)
    reader_refuses(lambda: _dcp_load(ckpt), planted)
    no_sentinel(sentinel)


def _engine_load(path: Path) -> object:
    """What DeepSpeed's engine calls for every .pt file of a same-world-size resume."""
    from trainer.deepspeed._staging import capturing_engine

    return capturing_engine().load(str(path), map_location="cpu")


@pytest.mark.parametrize("hostile", CORPUS, ids=IDS)
def test_hostile_deepspeed_optimizer_file_is_refused(
    hostile: Hostile, ds_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from ckpt.formats.pickle.torchzip import check_file

    ckpt = victim(ds_ckpt, tmp_path)
    sentinel = tmp_path / "SENTINEL"
    planted = plant_pt(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", hostile.build(sentinel, b"\x80\x04N."))
    refused(capsys, ["validate", "--deep", str(ckpt)], planted)
    refused(capsys, ["export", str(ckpt), str(tmp_path / "out")], planted)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "converted"), "--to", "dcp"], planted)
    reader_refuses(lambda: _engine_load(planted), planted)
    reader_refuses(lambda: check_file(planted), planted)  # the pre-parse before DeepSpeed's universal loader
    no_sentinel(sentinel)


@pytest.mark.parametrize("name", SUBSET)
@pytest.mark.parametrize("victim_file", ["mp_rank_00_model_states.pt", "rng_rank_00000.pt"])
def test_hostile_deepspeed_model_and_rng_files_are_refused(
    name: str, victim_file: str, ds_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from ckpt.formats.deepspeed.zero import read_rng

    ckpt = victim(ds_ckpt, tmp_path)
    sentinel = tmp_path / "SENTINEL"
    planted = plant_pt(ckpt / victim_file, BY_NAME[name].build(sentinel, b"\x80\x04N."))
    refused(capsys, ["validate", "--deep", str(ckpt)], planted)
    refused(capsys, ["convert", str(ckpt), str(tmp_path / "converted"), "--to", "dcp"], planted)
    if victim_file.startswith("rng"):
        reader_refuses(lambda: read_rng(planted), planted)  # export reads no rng state
    else:
        refused(capsys, ["export", str(ckpt), str(tmp_path / "out")], planted)
        reader_refuses(lambda: _engine_load(planted), planted)
    no_sentinel(sentinel)


@pytest.mark.parametrize("hostile", CORPUS, ids=IDS)
def test_hostile_pickle_is_refused_by_every_profile(hostile: Hostile, tmp_path: Path) -> None:
    """The unpickler itself, under each allow-list, with copyreg's extension registry and cache filled."""
    from torch.distributed.checkpoint.metadata import Metadata

    sentinel = tmp_path / "SENTINEL"
    data = hostile.build(sentinel, pickle.dumps(Metadata(state_dict_metadata={}), protocol=4))
    for profile in safe_pickle.PROFILES:
        with pytest.raises(CheckpointError, match="^where: refused to unpickle"):
            safe_pickle.load(
                data,
                profile,
                where="where",
                storage=lambda st, key, numel: safe_pickle.StorageRef(key, st.dtype, numel),
            )
    no_sentinel(sentinel)


def test_engine_checks_every_opcode() -> None:
    """The engine is the pure-Python unpickler with its opcodes overridden, not the C one (see safe_pickle's
    docstring: a subclass of the C unpickler cannot bound memo indices, refuse EXT through copyreg's cache or
    BUILD on a process-wide object)."""
    assert issubclass(safe_pickle.SafeUnpickler, pickle._Unpickler)  # type: ignore[attr-defined]
    assert not issubclass(safe_pickle.SafeUnpickler, pickle.Unpickler)
    d = safe_pickle.SafeUnpickler.dispatch
    for op in (pickle.LONG_BINPUT, pickle.PUT, pickle.BUILD, pickle.REDUCE, pickle.NEWOBJ, pickle.EXT2):
        assert d[op[0]] is not pickle._Unpickler.dispatch[op[0]], op  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------- limits
def test_oversized_pickle_is_refused_before_parsing(dcp_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt.formats.dcp.reader import read_metadata

    monkeypatch.setattr(safe_pickle, "MAX_PICKLE_BYTES", 1024)
    # refused by its size before it is even read (ckpt.commit.fsutil.read_regular)
    with pytest.raises(CheckpointError, match=r"\.metadata: \d+ bytes, more than a DCP \.metadata can be \(1024 bytes"):
        read_metadata(dcp_ckpt)
    with pytest.raises(CheckpointError, match=r"refused to unpickle \(\d+ bytes of pickle, more than 1024\)"):
        read_metadata(dcp_ckpt, (dcp_ckpt / ".metadata").read_bytes())  # and by the unpickler, given the bytes


def test_allow_list_is_exact_pairs() -> None:
    """No prefix, no dotted name: the union of the profiles is a fixed set of (module, name) pairs."""
    assert all("." not in name for _, name in safe_pickle.ALLOWED)
    forbidden = {("builtins", n) for n in ("eval", "exec", "getattr", "__import__", "bytes", "bytearray", "apply")}
    forbidden |= {
        ("copyreg", "_reconstructor"),
        ("torch._utils", "_rebuild_parameter"),
        ("functools", "partial"),
        ("torch", "load"),
        ("os", "system"),
    }
    assert not forbidden & safe_pickle.ALLOWED


# ----------------------------------------------------------------------------------------- genuine files
def test_genuine_checkpoints_still_read(dcp_ckpt: Path, ds_ckpt: Path, tmp_path: Path) -> None:
    """The same readers load real files: dcp.load restores every tensor bit for bit, the DeepSpeed engine
    loader returns what torch.load returns (DeepSpeed's own value classes included)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ckpt.formats.dcp.reader import DCPTensorReader, load_state, read_metadata

    md = read_metadata(dcp_ckpt)
    sd = {
        k: torch.full(tuple(v.size), 7, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
        for k, v in md.state_dict_metadata.items()
    }
    load_state(sd, dcp_ckpt, no_dist=True)
    with DCPTensorReader(dcp_ckpt) as reader:
        for key in reader.tensor_keys():
            assert torch.equal(sd[key], reader.read(key)), key
        assert sd[VALUE] == reader.read_bytes_value(VALUE) and isinstance(sd[VALUE], float)
    # validate --deep records lineage in the run directory: on private copies, not the shared runs
    assert main(["validate", "--deep", str(victim(dcp_ckpt, tmp_path / "dcp"))]) == 0
    for f in sorted(ds_ckpt.glob("*.pt")):
        ours, theirs = _engine_load(f), torch.load(f, weights_only=False)  # noqa: S614 - our own fresh run
        _same(ours, theirs, f.name)
    assert main(["validate", "--deep", str(victim(ds_ckpt, tmp_path / "ds"))]) == 0


def test_the_quick_check_reads_the_same_layout_without_torch(dcp_ckpt: Path, ds_ckpt: Path) -> None:
    """``status`` and a quick ``validate`` read .metadata into stand-ins of DCP's classes (DCP_LAYOUT): the files,
    offsets, shapes and dtypes they see are those of DCP's own classes, and the process never imports torch."""
    import subprocess
    import sys

    from ckpt.formats.dcp._metadata import read_layout
    from ckpt.formats.dcp.reader import read_metadata

    real, stand_in = read_metadata(dcp_ckpt), read_layout(dcp_ckpt)

    def storage(md: object) -> list:
        return sorted(
            (i.fqn, None if i.offset is None else tuple(i.offset), s.relative_path, s.offset, s.length)
            for i, s in md.storage_data.items()
        )  # type: ignore[attr-defined]

    def tensors(md: object) -> dict:
        return {
            k: (
                type(v).__name__,
                tuple(getattr(v, "size", ())),
                str(getattr(getattr(v, "properties", None), "dtype", None)),
            )
            for k, v in md.state_dict_metadata.items()
        }  # type: ignore[attr-defined]

    assert storage(stand_in) == storage(real) and len(storage(real)) > 10
    assert tensors(stand_in) == tensors(real) and "torch.float32" in str(tensors(real))
    probe = (
        "import sys\nfrom shardkeeper.cli import main\n"
        f"codes = [main(['status', {str(dcp_ckpt.parent.parent)!r}]), main(['validate', {str(dcp_ckpt)!r}]), "
        f"main(['validate', {str(ds_ckpt)!r}])]\n"
        "print(codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip().splitlines()[-1] == "[0, 0, 0] []", out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.parametrize(
    "genuine,crafted",
    [(b"torch.strided", b"torch.strixed"), (b"\x8c\x03fqn", b"\x8c\x03fqm"), (b"relative_path", b"relative_pith")],
    ids=["unknown-layout", "index-without-fqn", "storage-without-path"],
)
def test_the_quick_check_refuses_what_a_load_would(
    genuine: bytes, crafted: bytes, dcp_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A .metadata DCP's own classes cannot use (an unknown layout name, a chunk index without its tensor name, a
    storage record without its file) is refused by the stand-ins of the quick check too, in one line."""
    ckpt = victim(dcp_ckpt, tmp_path)
    real = (dcp_ckpt / ".metadata").read_bytes()
    assert genuine in real
    planted = plant_metadata(ckpt, real.replace(genuine, crafted))
    refused(capsys, ["validate", str(ckpt)], planted)
    if genuine != b"relative_path":  # DCP's reader takes a record without its file; the load then fails
        from ckpt.formats.dcp.reader import read_metadata

        reader_refuses(lambda: read_metadata(ckpt), planted)
    # the stand-ins know the layouts torch knows (torch.serialization._get_layout's table)
    assert safe_pickle.LAYOUT_NAMES == {str(v) for v in vars(torch).values() if isinstance(v, torch.layout)}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_genuine_containers_load_as_pickle_loads_them(protocol: int) -> None:
    """Sets, frozensets, OrderedDicts (a state_dict's ``_metadata``), tuple keys and values as torch.save writes
    them, at every protocol it uses: the checks on keys and BUILD change nothing of a genuine pickle."""
    sd: OrderedDict = OrderedDict([("w", 1.5), ("b", 2)])
    sd._metadata = OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    value = {"k": [1, frozenset({3, "x"})], "s": {1, 2}, (1, 2): ((0, 0), (4, 4)), 3: sd, "t": [(0.9, 0.95)]}
    data = pickle.dumps(value, protocol=protocol)
    got = safe_pickle.load(data, safe_pickle.DEEPSPEED_RECORDS, where="w")
    assert got == pickle.loads(data) == value  # noqa: S301 - our own pickle
    assert got[3]._metadata == sd._metadata  # type: ignore[attr-defined]


def _same(a: object, b: object, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.stride() == b.stride(), where  # type: ignore[union-attr]
    elif isinstance(a, dict):
        assert list(a) == list(b), where  # type: ignore[arg-type]
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")  # type: ignore[index]
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where  # type: ignore[arg-type]
        for i, (x, y) in enumerate(zip(a, b)):  # type: ignore[call-overload]
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.mark.parametrize("craft", ["huge-tensor", "record-past-end"])
def test_crafted_sizes_never_allocate(
    craft: str, dcp_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A .metadata that declares a terabyte tensor, or a record extent past the end of its file, is refused
    before anything of that size is allocated (denial of service by memory, not code execution)."""
    import dataclasses

    from ckpt.formats.dcp.reader import DCPTensorReader, read_metadata

    ckpt = victim(dcp_ckpt, tmp_path)
    md = read_metadata(ckpt)
    if craft == "huge-tensor":
        meta = md.state_dict_metadata[EMBED]
        meta.size = torch.Size([1 << 40, *meta.size[1:]])
    else:
        index = next(i for i in md.storage_data if i.fqn == EMBED)
        md.storage_data[index] = dataclasses.replace(md.storage_data[index], length=1 << 40)
    planted = plant_metadata(ckpt, pickle.dumps(md, protocol=2))
    with pytest.raises(CheckpointError) as info:
        DCPTensorReader(ckpt).read(EMBED)
    assert "\n" not in str(info.value) and "pick another step" in str(info.value)
    for argv in (["validate", "--deep", str(ckpt)], ["export", str(ckpt), str(tmp_path / "out")]):
        capsys.readouterr()
        assert main(argv) != 0, argv
        lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
    assert planted.exists() and not (tmp_path / "out").exists()


def _zip_differential(path: Path, payload: bytes) -> None:
    """Rewrite a torch.save file so that Python's zipfile still finds the genuine data.pkl while torch.load
    (miniz) reads ``payload``: the genuine entry is renamed 'PREFIX/data.pkl<NUL>x' (zipfile cuts names at a
    NUL and the later duplicate wins), the payload is stored first under the exact name."""
    import io
    import zipfile

    src = zipfile.ZipFile(path)
    names = src.namelist()
    pkl = next(n for n in names if n.endswith("/data.pkl"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        out.writestr(pkl, payload)
        for n in names:
            out.writestr(n + "_x" if n == pkl else n, src.read(n))
    raw = buf.getvalue().replace((pkl + "_x").encode(), (pkl + "\0x").encode())
    path.write_bytes(raw)


def test_zip_parser_differential_is_refused(tmp_path: Path) -> None:
    """A file that our reader and torch.load would read differently (the genuine pickle for us, a payload for
    DeepSpeed's unrestricted torch.load) is refused by the one reader, so the pre-parse cannot be fooled."""
    from ckpt.formats.pickle.torchzip import check_file

    sentinel = tmp_path / "SENTINEL"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"step": torch.ones(2)}}, path)
    check_file(path)  # the genuine file passes
    payload = pickle.dumps(_Touch(str(sentinel)), protocol=2)  # harmless, but shows which pickle a reader ran
    _zip_differential(path, payload)
    torch.load(path, weights_only=False)  # noqa: S614 - proves the differential is live: torch.load runs the payload
    assert sentinel.exists()
    sentinel.unlink()
    with pytest.raises(CheckpointError) as info:
        check_file(path)
    assert "NUL" in str(info.value) and path.name in str(info.value) and "\n" not in str(info.value)
    assert not sentinel.exists()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path(self.path),))
