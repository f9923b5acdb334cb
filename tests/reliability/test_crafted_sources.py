"""Checkpoints of other tools, crafted: every extent is proven before it is used, every count is bounded by the
files present, every file is a regular file, and every refusal is one line naming the file and the field; nothing
is written when refused. The untouched sources still import, holding exactly the values they stored.

Sources are made without a launch: the session's 2-rank FSDP2 checkpoint (``tiny_run``) as a plain ``dcp.save``
folder of another tool (its ``.metadata`` keys renamed, ``corrupt.plain_dcp_source``), and the session's DeepSpeed
ZeRO-2 checkpoint (``ds_run``) as ``engine.save_checkpoint`` lays it out (``corrupt.deepspeed_source``). The
tiling proof itself is checked against a brute-force count of every element on random small layouts.
"""

from __future__ import annotations

import ast
import io
import itertools
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ckpt.formats.dcp.reader import DCPTensorReader
from ckpt.validate.checks import validate
from shardkeeper.cli import main
from tests.conftest import TINY_CONFIG, TINY_RUN_STEPS, tree_state
from tests.reliability import corrupt as c

TINY = str(TINY_CONFIG)
EMBED = "model.model.embed_tokens.weight"  # [256, 64]: chunks [128, 64] at rows 0 and 128 (2 ranks)
MODEL_STATES = "mp_rank_00_model_states.pt"
Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk: (offsets, sizes)


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_run: Path) -> Path:
    return tiny_run / "checkpoints" / f"step-{TINY_RUN_STEPS:08d}"


def error_line(capsys: pytest.CaptureFixture, argv: list[str], code: int) -> str:
    """``main(argv)`` exits ``code`` printing exactly one line, an ``error:`` line; returned."""
    capsys.readouterr()
    assert main(argv) == code, argv
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def refused_import(capsys: pytest.CaptureFixture, src: Path, tmp_path: Path, *needles: str) -> str:
    """``import`` of ``src`` is refused (exit 4) in one line holding every needle; no run directory is left and
    the source is untouched."""
    before, run = tree_state(src), tmp_path / "run"
    line = error_line(capsys, ["import", str(src), "--config", TINY, "--run-dir", str(run)], 4)
    for needle in needles:
        assert needle in line, (needle, line)
    assert not run.exists() and tree_state(src) == before
    return line


@contextmanager
def unblocked_after(fifo: Path, seconds: float = 20.0) -> Iterator[None]:
    """A reader that opens ``fifo`` blocks until a writer comes: one comes after ``seconds`` (and leaves at once),
    so a regression fails the test instead of hanging the suite. The body must end well before."""
    done = threading.Event()

    def writer() -> None:
        if done.wait(seconds):
            return
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO when nobody waits on it
        except OSError:
            pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        yield
    finally:
        done.set()
        thread.join()
    assert time.monotonic() - t0 < seconds, f"{fifo} was waited on"


# ------------------------------------------------------------------------------------------ the tiling proof
def _covers(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    count: dict[tuple[int, ...], int] = {}
    for offsets, sizes in boxes:
        for point in itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes))):
            count[point] = count.get(point, 0) + 1
    return all(count.get(p) == 1 for p in itertools.product(*(range(d) for d in shape))) and all(
        v == 1 for v in count.values()
    )


def _grid(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """A random exact tiling: each dimension cut at random points (a DTensor-like grid)."""
    cuts = [sorted({0, d, *rng.sample(range(1, d), min(d - 1, rng.randint(0, 2)))}) for d in shape]
    spans = [list(itertools.pairwise(cut)) for cut in cuts]
    return [(tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*spans)]


def _box(text: str) -> Box:
    """ "at [0, 64] of [128, 64]" -> ((0, 64), (128, 64))"""
    offsets, sizes = text.removeprefix("at ").split(" of ")
    return tuple(ast.literal_eval(offsets)), tuple(ast.literal_eval(sizes))


def _shared(a: Box, b: Box) -> bool:
    return all(max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]))


def test_tiling_proof_agrees_with_counting_every_element() -> None:
    """On 4,000 random layouts of 0-3 dimensions (exact grids, grids with one chunk moved, shrunk, dropped or
    doubled, free boxes, empty chunks): the proof accepts exactly the layouts where every element is in exactly
    one chunk, and what it names is true (the two chunks overlap; the element it names is in no chunk)."""
    from ckpt.formats.dcp._metadata import tiling_problem

    rng = random.Random(38)
    accepted = refused = 0
    for _ in range(4000):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3)))
        boxes = (
            _grid(rng, shape)
            if rng.random() < 0.6
            else [
                (o, tuple(rng.randint(1, d - a) for a, d in zip(o, shape)))
                for o in (tuple(rng.randrange(d) for d in shape) for _ in range(rng.randint(0, 5)))
            ]
        )
        if boxes and rng.random() < 0.5:
            i, kind = rng.randrange(len(boxes)), rng.choice(("move", "shrink", "drop", "double"))
            o, n = boxes[i]
            if kind == "drop":
                boxes.pop(i)
            elif kind == "double":
                boxes.append(boxes[i])
            elif shape:
                k = rng.randrange(len(shape))
                if kind == "move" and o[k] > 0:
                    boxes[i] = (o[:k] + (o[k] - 1,) + o[k + 1 :], n)
                elif kind == "shrink" and n[k] > 1:
                    boxes[i] = (o, n[:k] + (n[k] - 1,) + n[k + 1 :])
        if shape and rng.random() < 0.2:  # an empty shard: covers nothing, may share offsets with anything
            boxes.append((tuple(rng.randint(0, d) for d in shape), (0,) * len(shape)))
        problem = tiling_problem(shape, boxes)
        assert (problem is None) == _covers(shape, [b for b in boxes if all(b[1])]), (shape, boxes, problem)
        if problem is None:
            accepted += 1
            continue
        refused += 1
        if "overlap" in problem:
            a, b = (_box(x) for x in problem.split("the chunks ")[1].split(" overlap")[0].split(" and "))
            assert a in boxes and b in boxes and _shared(a, b), (shape, boxes, problem)
        else:
            point = tuple(ast.literal_eval(problem.split("element ")[1].split(" (")[0]))
            assert not any(all(o <= x < o + n for x, o, n in zip(point, *box)) for box in boxes), (shape, boxes)
    assert accepted > 1000 and refused > 1000


def test_tiling_proof_is_bounded_on_a_crafted_staircase() -> None:
    """Chunks that overlap along one dimension but not the next (not a grid) cannot make the proof quadratic:
    10,000 of them are refused in about a second, by their element count."""
    from ckpt.formats.dcp._metadata import tiling_problem

    n = 10_000
    boxes = [((i, i), (n, 1)) for i in range(n)]
    t0 = time.perf_counter()
    problem = tiling_problem((2 * n, n), boxes)
    assert problem is not None and time.perf_counter() - t0 < 10
    assert tiling_problem((4096 * 64, 64), [((r * 64, 0), (64, 64)) for r in range(4096)]) is None


# ------------------------------------------------------------------------------------------ DCP sources
def _both(change: Callable[[object, str], None]) -> Callable[[object], None]:
    """The same edit to the embedding and to its first moment (as the crafted file of the report had it)."""
    return lambda md: [change(md, key) for key in (EMBED, "optimizer.state.model.embed_tokens.weight.exp_avg")]


def _past_end(md: object, key: str) -> None:
    c.record_of(md, key, 1).length += 1 << 40  # a terabyte: refused before anything is allocated


CRAFTED_DCP = {
    # two chunks both claiming rows 0-127, sizes adding up to the tensor: rows 128-255 would never be read
    "overlap": (
        _both(lambda md, key: c.move_chunk(md, key, 1, offsets=(0, 0))),
        "the chunks at [0, 0] of [128, 64] and at [0, 0] of [128, 64] overlap",
    ),
    "gap": (_both(lambda md, key: c.move_chunk(md, key, 0, sizes=(127, 64))), "no chunk holds element [127, 0]"),
    "out-of-bounds": (
        _both(lambda md, key: c.move_chunk(md, key, 1, offsets=(129, 0))),
        "at [129, 0] of [128, 64], which reaches past the tensor",
    ),
    "record-past-file": (_both(_past_end), "of __"),
    # found by the fuzzer (tests/reliability/test_fuzz.py): a file name that is no string was sorted with the others
    "file-name-none": (
        _both(lambda md, key: setattr(c.record_of(md, key, 1), "relative_path", None)),
        "names data file None, not a plain file name",
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED_DCP))
def test_crafted_dcp_extents_are_refused_in_one_line(
    case: str, tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    change, needle = CRAFTED_DCP[case]
    src = c.plain_dcp_source(tiny_ckpt, tmp_path / "src")
    c.edit_metadata(src, change)
    refused_import(capsys, src, tmp_path, str(src / ".metadata"), "embed_tokens.weight", needle)


def test_plain_dcp_source_imports_exactly_what_it_stored(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The untouched source (the crafted cases' starting point): imported, valid deep, every weight and moment
    bit for bit the source's."""
    src = c.plain_dcp_source(tiny_ckpt, tmp_path / "src")
    run = tmp_path / "run"
    assert main(["import", str(src), "--config", TINY, "--run-dir", str(run)]) == 0
    out = run / "checkpoints" / f"step-{TINY_RUN_STEPS:08d}"
    assert validate(out, deep=True).valid
    with DCPTensorReader(tiny_ckpt) as before, DCPTensorReader(out) as after:
        keys = [k for k in before.tensor_keys() if k.startswith("model.") or k.endswith(("exp_avg", "exp_avg_sq"))]
        assert len(keys) > 60 and set(keys) <= set(after.tensor_keys())
        for key in keys:
            assert torch.equal(before.read(key), after.read(key)), key


@pytest.mark.parametrize("name", [".metadata", "__1_0.distcp"])
def test_fifo_in_a_dcp_source_is_refused_not_waited_on(
    name: str, tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = c.plain_dcp_source(tiny_ckpt, tmp_path / "src")
    fifo = c.make_fifo(src / name)
    with unblocked_after(fifo):
        refused_import(capsys, src, tmp_path, f"{fifo}: a fifo, not a regular file")


def test_empty_records_read_back_empty() -> None:
    """A record of no elements (the empty shard of a 1-element bias at 2 ranks) reads as an empty tensor from
    bytes and from a file: no write into read-only memory."""
    from ckpt.formats.pickle import safe_pickle
    from ckpt.formats.pickle.torchzip import TorchZip, load_bytes

    buf = io.BytesIO()
    torch.save({"bias": torch.empty(0), "rows": torch.empty(0, 64)}, buf)
    got = load_bytes(buf.getvalue(), safe_pickle.TENSOR_RECORD, "record")
    assert got["bias"].shape == (0,) and got["rows"].shape == (0, 64)
    with TorchZip.from_bytes(buf.getvalue(), "record") as zf:
        zf.read_into(0, 0, torch.empty(0))


# ------------------------------------------------------------------------------------------ DeepSpeed sources
@pytest.fixture
def ds_src(ds_run: Path, tmp_path: Path) -> Path:
    return c.deepspeed_source(ds_run / "checkpoints" / "step-00000002", tmp_path / "src", 2)


@pytest.mark.parametrize("value", [10**11, -3, 0, [2], "two", True], ids=repr)
def test_crafted_world_size_is_refused_without_allocating_by_it(
    value: object, ds_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``dp_world_size`` of 10**11 in a 434 KB file built a list of 10**11 ranks (7.7 GB, then MemoryError);
    a value that is no count at all said "internal error". Now: one line naming the file and the field, or the
    expected and found file counts, at once."""
    path = ds_src / "global_step2" / MODEL_STATES
    c.edit_torch_save(path, lambda sd: sd.__setitem__("dp_world_size", value))
    peak, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    if value == 10**11:
        refused_import(capsys, ds_src, tmp_path, "expected 100000000000 ZeRO optimizer files, found 2")
    else:
        refused_import(
            capsys, ds_src, tmp_path, f"{path}: dp_world_size is {value!r}, not a whole number of at least 1"
        )
    assert time.monotonic() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 500 * 1024  # KiB: no list of the size


@pytest.mark.parametrize("kind", ["model-states-fifo", "latest-fifo", "latest-sparse-6GB", "latest-dangling"])
def test_deepspeed_source_files_are_regular_and_latest_is_read_with_a_cap(
    kind: str, ds_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    latest = ds_src / "latest"
    if kind == "model-states-fifo":
        fifo = c.make_fifo(ds_src / "global_step2" / MODEL_STATES)
        with unblocked_after(fifo):
            refused_import(capsys, ds_src, tmp_path, f"{fifo}: a fifo, not a regular file")
    elif kind == "latest-fifo":
        with unblocked_after(c.make_fifo(latest)):
            refused_import(capsys, ds_src, tmp_path, f"{latest}: a fifo, not a regular file")
    elif kind == "latest-sparse-6GB":
        big = tmp_path / "sparse"
        with open(big, "wb") as f:
            f.truncate(6 << 30)  # no block allocated: reading it whole would take 6 GB of memory
        latest.unlink()
        latest.symlink_to(big)
        t0 = time.monotonic()
        refused_import(capsys, ds_src, tmp_path, f"{latest}: 6442450944 bytes, more than DeepSpeed's latest")
        assert time.monotonic() - t0 < 30
    else:
        latest.unlink()
        latest.symlink_to(tmp_path / "nothing")
        refused_import(capsys, ds_src, tmp_path, f"{latest}: a link to a missing file; pass --step N (present: 2)")


def test_ranks_declaring_another_zero_stage_are_refused(
    ds_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Rank 1's file declaring ZeRO stage 0 beside rank 0's 2 (found by the fuzzer: only rank 0's was read, and
    validate --deep said valid): one line naming that file and the field."""
    path = ds_src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    c.edit_torch_save(path, lambda sd: sd["optimizer_state_dict"].__setitem__("zero_stage", 0))
    refused_import(capsys, ds_src, tmp_path, f"{path}: zero_stage is 0, not 1, 2 or 3")
    c.edit_torch_save(path, lambda sd: sd["optimizer_state_dict"].__setitem__("zero_stage", 1))
    refused_import(
        capsys, ds_src, tmp_path, f"{path}: zero_stage is 1, zero_pp_rank_0_mp_rank_00_optim_states.pt says 2"
    )


def _slices_overlap(sd: dict) -> None:
    first, second = list(sd["optimizer_state_dict"]["param_slice_mappings"][0].values())[:2]
    second.start = first.start


def _slice_past_partition(sd: dict) -> None:
    last = list(sd["optimizer_state_dict"]["param_slice_mappings"][0].values())[-1]
    last.start += 1 << 40  # elements: a terabyte past the partition


@pytest.mark.parametrize(
    "change, needle",
    [(_slices_overlap, "both claim elements"), (_slice_past_partition, "its parameters need")],
    ids=["overlap", "past"],
)
def test_deepspeed_parameter_slices_lie_inside_their_partition_once(
    change: Callable[[dict], None], needle: str, ds_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two parameters claiming the same elements of a rank's flat partition (one value read into two places), or
    a slice past the partition (an allocation by a crafted count), are refused naming the file."""
    path = ds_src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    c.edit_torch_save(path, change)
    refused_import(capsys, ds_src, tmp_path, str(path), needle)
