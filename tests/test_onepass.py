"""Verified DCP loads (ckpt.formats.dcp.onepass): every file is hashed as it comes off the disk, and nothing of a
checkpoint whose bytes do not match its manifest reaches the live state; resume then falls back to the older one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import spawn


def _save(tmp: Path) -> tuple[Path, dict[str, tuple[int, str]], dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt.commit.hashing import hash_file

    g = torch.Generator().manual_seed(0)
    sd = {
        "a": torch.randn(256, 64, generator=g),
        "b": torch.randn(1000, generator=g),
        "n": torch.tensor(7),
        "c": torch.arange(300, dtype=torch.int32),
    }
    ckpt = tmp / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(ckpt, thread_count=2), no_dist=True)
    expected = {p.name: hash_file(p) for p in ckpt.iterdir()}
    return ckpt, expected, sd


def _zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _offset_in(ckpt: Path, key: str, where: str) -> tuple[Path, int]:
    from ckpt.formats.dcp.reader import read_metadata

    info = next(s for i, s in read_metadata(ckpt).storage_data.items() if i.fqn == key)
    return ckpt / info.relative_path, info.offset + (info.length // 2 if where == "middle" else 2)


def test_one_pass_load_verifies_every_file_and_applies_nothing_on_a_mismatch(tmp_path: Path) -> None:
    from ckpt.commit.hashing import ChecksumMismatch
    from ckpt.formats.dcp.onepass import load_verified

    ckpt, expected, sd = _save(tmp_path)
    out = _zeros(sd)
    reader = load_verified(out, ckpt, expected, no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert reader.digests == expected  # every file of the manifest hashed, .metadata included
    assert reader.extra_bytes < sum(s for s, _ in expected.values()) // 4  # little is read only to be hashed

    # a loaded tensor's storage byte, a record's zip header byte, a byte of a tensor not asked for: each refused,
    # the destination tensors untouched
    for key, where, asked in (
        ("a", "middle", ("a", "b", "n", "c")),
        ("b", "header", ("a", "b", "n", "c")),
        ("c", "middle", ("a",)),
    ):
        bad = tmp_path / f"bad-{key}"
        import shutil

        shutil.copytree(ckpt, bad)
        path, off = _offset_in(bad, key, where)
        data = bytearray(path.read_bytes())
        data[off] ^= 0x01
        path.write_bytes(bytes(data))
        dest = {k: torch.full_like(sd[k], 3) for k in asked}
        with pytest.raises(ChecksumMismatch, match=f"{path.name}: checksum mismatch; the file is corrupted"):
            load_verified(dest, bad, expected, no_dist=True)
        assert all(torch.equal(dest[k], torch.full_like(sd[k], 3)) for k in asked), (key, where)


def _live(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = [local(p) for p in model.parameters()]
    for st in opt.state.values():
        out += [local(v) for _, v in sorted(st.items())]
    return out


def _refused_then_fallback(run_dir: str) -> list[object]:
    import torch.distributed as dist

    from ckpt.commit.hashing import ChecksumMismatch
    from ckpt.commit.layout import RunDir
    from ckpt.formats.dcp import reader
    from tests.harness import tiny_spec
    from tests.reliability.corrupt import flip_byte, model_item_offset
    from trainer.checkpointer import dcp_backend
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    eager: list[bool] = []  # how each load wrote the live state
    shared: list[bool] = []  # whether each load was given the .metadata another rank parsed
    parses = [0]  # .metadata parses under DCP's profile on this rank
    real, real_parse = dcp_backend.load_verified, reader.read_metadata_as

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        eager.append(kwargs["eager"])
        shared.append(kwargs["shared"] is not None)
        return real(*args, **kwargs)

    def parse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        parses[0] += 1
        return real_parse(*args, **kwargs)

    dcp_backend.load_verified = recorded
    reader.read_metadata_as = parse
    env = init_distributed()
    spec = tiny_spec()
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)

    def step() -> None:
        model(input_ids=torch.randint(0, 256, (2, 16))).logits.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = [Path(run_dir) / "a", Path(run_dir) / "b"]
    ck, ck_b = (DCPCheckpointer(RunDir.at(str(r)), spec, model, opt, env, segment=0) for r in runs)
    step()
    ck.save(TrainState(step=2), reason="interval", blocking=True)
    at2 = _live(model, opt)
    step()
    ck.save(TrainState(step=4), reason="interval", blocking=True)
    ck_b.save(TrainState(step=4), reason="interval", blocking=True)
    ck._wait_reread()
    ck_b._wait_reread()
    if env.is_rank0:  # a model tensor's byte in rank 1's file: rank 1 owns it, rank 0 must not apply its own share
        for run in runs:
            flip_byte(*model_item_offset(run / "checkpoints" / "step-00000004", rank=1, longer_than=4096), mask=0x01)
    dist.barrier()
    step()  # the live state now differs from both checkpoints
    before = _live(model, opt)
    seen: list[object] = []
    try:
        ck.load(runs[0] / "checkpoints" / "step-00000004")
        seen.append("loaded")
    except ChecksumMismatch as e:
        seen.append("__1_" in str(e) and str(e).endswith("checksum mismatch; the file is corrupted"))
    seen.append(all(torch.equal(a, b) for a, b in zip(before, _live(model, opt))))
    # only the corrupted checkpoint, restart allowed: nothing to resume, the state untouched (a fresh start is valid)
    seen.append(ck_b.load_latest(restart=True))
    seen.append(all(torch.equal(a, b) for a, b in zip(before, _live(model, opt))))
    # the fallback takes step 2, bitwise, and sets step 4 aside
    parses[0] = 0
    ts = ck.load_latest(restart=False)
    seen += [
        ts.step if ts else None,
        all(torch.equal(a, b) for a, b in zip(at2, _live(model, opt))),
        len(list((runs[0] / "checkpoints").glob("step-00000004.invalid-*"))),
        # a direct load and a resume that may start over wait for every file; a resume that falls back copies eagerly
        eager,
        ck.eager_load,
        # a resume's loads take the .metadata rank 1 parsed during rank 0's quick check (a direct load parses its
        # own); rank 1 parsed each of the two once, rank 0 none
        shared,
        parses[0],
        ck.shared_metadata,
    ]
    ck.close()
    ck_b.close()
    dist.destroy_process_group()
    return seen


def test_checksum_mismatch_found_while_loading_is_refused_untouched_and_resume_falls_back(tmp_path: Path) -> None:
    eager = [False, False, True, True]  # ck.load, ck_b's resume with restart, ck's refused step 4, then step 2
    shared = [False, True, True, True]
    got = spawn(_refused_then_fallback, 2, str(tmp_path))
    assert got == [[True, True, None, True, 2, True, 1, eager, False, shared, n, None] for n in (0, 2)]


def test_a_shared_metadata_is_taken_only_for_the_same_bytes_and_its_extents_are_checked_again(tmp_path: Path) -> None:
    from ckpt.formats.dcp.reader import SharedMetadata, read_metadata, share_metadata, shared_from
    from schemas.errors import CheckpointError

    ckpt, _, _ = _save(tmp_path)
    made = share_metadata(ckpt)
    assert made is not None
    shared = shared_from(made[1])  # as another rank receives it
    assert shared is not None and shared.metadata == read_metadata(ckpt) == made[0].metadata
    assert read_metadata(ckpt, shared=shared) is shared.metadata  # the same bytes: not parsed again
    other = SharedMetadata(bytes(32), shared.metadata)  # said to be of other bytes: this rank parses its own
    assert read_metadata(ckpt, shared=other) is not shared.metadata
    # the same .metadata, but a data file cut short since it was parsed: refused here all the same
    data = max(ckpt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_metadata(ckpt, shared=shared)
    (ckpt / ".metadata").unlink()
    assert share_metadata(ckpt) is None  # nothing to share: each rank's own read says what is missing
    assert shared_from(None) is None and shared_from(b"not a pickle") is None
    with pytest.raises(CheckpointError, match="missing"):
        read_metadata(ckpt, shared=shared)


@pytest.mark.parametrize("eager", [False, True])
def test_eager_load_copies_each_chunk_behind_the_hash_and_still_refuses_a_mismatch(tmp_path: Path, eager: bool) -> None:
    """Eager or not, the same bytes reach the live tensors (a contiguous chunk read straight in, a transposed view
    decoded and copied), and a changed byte is refused with the same error; only eager writes before the verdict."""
    import shutil

    from ckpt.commit.hashing import ChecksumMismatch
    from ckpt.formats.dcp.onepass import load_verified

    ckpt, expected, sd = _save(tmp_path)
    out = _zeros(sd)
    out["a"] = torch.zeros(64, 256).t()  # another layout: the slow path
    reader = load_verified(out, ckpt, expected, no_dist=True, eager=eager)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert reader.written is eager and not reader.pending

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    path, off = _offset_in(bad, "b", "middle")
    data = bytearray(path.read_bytes())
    data[off] ^= 0x01
    path.write_bytes(bytes(data))
    dest = {k: torch.full_like(v, 3) for k, v in sd.items()}
    with pytest.raises(ChecksumMismatch, match=f"{path.name}: checksum mismatch; the file is corrupted"):
        load_verified(dest, bad, expected, no_dist=True, eager=eager)
    untouched = all(torch.equal(dest[k], torch.full_like(sd[k], 3)) for k in sd)
    assert untouched is not eager  # eager: the chunks were copied before the file's digest was known


def test_a_file_changed_after_it_was_hashed_is_refused_before_its_bytes_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from ckpt.formats.dcp import onepass as dcp_onepass
    from schemas.errors import CheckpointError

    ckpt, expected, sd = _save(tmp_path)
    first = sorted(n for n in expected if n.endswith(".distcp"))[0]
    verify = dcp_onepass.OnePassReader.read_data

    def then_rewritten(self, plan, planner):  # noqa: ANN001, ANN202
        done = verify(self, plan, planner)
        st = (ckpt / first).stat()
        os.utime(ckpt / first, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        return done

    monkeypatch.setattr(dcp_onepass.OnePassReader, "read_data", then_rewritten)
    dest = _zeros(sd)
    with pytest.raises(CheckpointError, match=f"{first}: changed after it was verified"):
        dcp_onepass.load_verified(dest, ckpt, expected, no_dist=True)
    assert not any(dest[k].any() for k in sd)


def test_files_verified_on_the_way_in_are_not_hashed_again_unless_they_changed(tmp_path: Path, monkeypatch) -> None:
    """A node copy's files hashed whole during the restore's transfer (ckpt.memtier.replicate.Verified) are read without
    a second hash while each is the same file; one written since (even with its mtime set back), one whose recorded
    digest is not the manifest's, and one replaced by another inode are hashed again, and a changed byte is
    refused."""
    import os
    import shutil

    from ckpt.commit.fsutil import file_identity as identity
    from ckpt.commit.hashing import ChecksumMismatch
    from ckpt.formats.dcp import onepass as dcp_onepass
    from ckpt.formats.dcp.onepass import load_verified

    ckpt, expected, sd = _save(tmp_path)
    hashed: list[int] = []
    real = dcp_onepass.OnePassReader._hash_whole
    monkeypatch.setattr(
        dcp_onepass.OnePassReader,
        "_hash_whole",
        lambda self, fd, size, progress: hashed.append(size) or real(self, fd, size, progress),
    )

    def known(root: Path) -> dict:
        return {n: (*expected[n], identity(os.stat(root / n))) for n in expected}

    out = _zeros(sd)
    reader = load_verified(out, ckpt, expected, no_dist=True, verified=known(ckpt))
    assert all(torch.equal(out[k], sd[k]) for k in sd) and reader.digests == expected
    assert hashed == []  # nothing hashed twice

    data = max((p for p in ckpt.iterdir() if p.name != ".metadata"), key=lambda p: p.stat().st_size)
    for how in ("rewritten", "wrong-digest", "replaced"):
        bad = tmp_path / f"bad-{how}"
        shutil.copytree(ckpt, bad)
        told = known(bad)
        path, off = _offset_in(bad, "a", "middle")
        assert path.name == data.name
        raw = bytearray(path.read_bytes())
        raw[off] ^= 0xFF
        if how == "rewritten":  # same inode, new bytes, its mtime then set back as it was (its ctime moved)
            before = os.stat(path)
            path.write_bytes(bytes(raw))
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert identity(os.stat(path))[:4] == told[path.name][2][:4]
        elif how == "wrong-digest":  # its identity as recorded, but the digest recorded for it is not the manifest's
            path.write_bytes(bytes(raw))
            told[path.name] = (told[path.name][0], "0" * 32, identity(os.stat(path)))
        else:  # another file renamed into its place
            (bad / "x").write_bytes(bytes(raw))
            os.replace(bad / "x", path)
        hashed.clear()
        out = _zeros(sd)
        with pytest.raises(ChecksumMismatch):
            load_verified(out, bad, expected, no_dist=True, verified=told)
        assert hashed == [path.stat().st_size], how  # that one file hashed, the others taken as verified
        assert all(torch.equal(out[k], torch.zeros_like(sd[k])) for k in sd), how  # nothing applied


def test_a_sent_file_is_verified_only_if_it_matched_and_did_not_change_while_read(tmp_path: Path, monkeypatch) -> None:
    """The sender of a restore's transfer hashes each file as it reads its chunks: a file that matched its entry
    and kept its identity is verified (with that identity); one touched between chunks, or with other bytes, is not."""
    import os

    from ckpt.commit.fsutil import file_identity as identity
    from ckpt.commit.hashing import hash_file
    from ckpt.memtier import replicate
    from schemas import FileEntry

    monkeypatch.setattr(replicate, "CHUNK", 1000)
    files = []
    for name in ("good", "touched", "other"):
        (tmp_path / name).write_bytes(os.urandom(2500))
        size, digest = hash_file(tmp_path / name)
        files.append(FileEntry(path=name, size=size, xxh3_128=digest if name != "other" else "1" * 32, rank=0))
    out = replicate._Out(tmp_path, files, verify=True)
    for i, (k, _, _) in enumerate(out.parts):
        out.chunk(i)
        if files[k].path == "touched" and i == 3:  # between its first and second chunk
            os.utime(tmp_path / "touched", ns=(5, 5))
    assert out.problem is None
    assert out.verified() == {"good": (2500, files[0].xxh3_128, identity(os.stat(tmp_path / "good")))}


def test_a_received_file_is_written_whole_through_short_writes_and_a_full_memory_dir_is_one_line(
    tmp_path: Path, monkeypatch
) -> None:
    """The receiver of a transfer continues a short write (a nearly full tmpfs) until the chunk is on disk: bytes
    equal, verified; a write that writes nothing is "disk full", and nothing is verified."""
    import os

    import xxhash

    from ckpt.memtier import replicate
    from schemas import FileEntry

    monkeypatch.setattr(replicate, "CHUNK", 1000)
    data = os.urandom(2500)
    entry = FileEntry(path="f", size=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest(), rank=0)
    real = os.pwrite
    for mode in ("short", "nothing"):
        root = tmp_path / mode
        root.mkdir()
        calls: list[int] = []

        def pwrite(fd: int, buf, off: int, mode: str = mode) -> int:
            calls.append(len(buf))  # noqa: B023
            if len(calls) == 2:  # the second write: half of it, or nothing  # noqa: B023
                return 0 if mode == "nothing" else real(fd, bytes(buf)[: len(buf) // 2], off)
            return real(fd, buf, off)

        monkeypatch.setattr(replicate.os, "pwrite", pwrite)
        inc = replicate._In(root, [entry])
        inc.open_all()
        for k, (_, off, n) in enumerate(inc.parts):
            inc.take(k, torch.frombuffer(bytearray(data[off : off + n]), dtype=torch.uint8))
        problem = inc.close()
        monkeypatch.setattr(replicate.os, "pwrite", real)
        if mode == "short":
            assert problem is None and (root / "f").read_bytes() == data
            assert list(inc.verified()) == ["f"]
        else:
            assert problem is not None and problem.startswith(f"disk full at {root / 'f'}"), problem


def test_the_sums_a_load_computes_as_it_reads_are_the_fingerprint_bits_of_what_it_wrote(tmp_path: Path) -> None:
    """``sum_method``: the reader sums each chunk it copies whole into a tensor, from the bytes it copies (tensors
    longer than one torch call's part, two dtypes): bit for bit the blocked fingerprint of the loaded tensors, and
    ``local_sum_squares`` takes them (a planted sum shows it is used, not recomputed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt.commit import fingerprint as fp
    from ckpt.commit.hashing import hash_file
    from ckpt.formats.dcp.onepass import load_verified

    g = torch.Generator().manual_seed(1)
    sd = {
        "big": torch.randn(fp.STREAM * 2 + 12345, generator=g),
        "half": torch.randn(fp.STREAM + 7, generator=g).to(torch.bfloat16),
        "small": torch.randn(33, 5, generator=g),
    }
    ckpt = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(ckpt, thread_count=2), no_dist=True)
    expected = {p.name: hash_file(p) for p in ckpt.iterdir()}
    out = _zeros(sd)
    reader = load_verified(out, ckpt, expected, no_dist=True, sum_method=fp.METHOD)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    named = sorted(out.items())
    names, plain = fp.local_sum_squares(named)
    assert set(reader.sums) == {fp.memory_key(t) for _, t in named}
    for name, t in named:
        assert torch.equal(reader.sums[fp.memory_key(t)], fp.local_sum_squares([(name, t)])[1][0]), name  # type: ignore[index]
    assert torch.equal(fp.local_sum_squares(named, fp.METHOD, reader.sums)[1], plain)
    planted = {**reader.sums, fp.memory_key(out["small"]): torch.tensor(-1.0, dtype=torch.float64)}
    assert fp.local_sum_squares(named, fp.METHOD, planted)[1][names.index("small")] == -1.0  # type: ignore[index]
    assert torch.equal(
        fp.local_sum_squares(named, fp.LEGACY_METHOD, planted)[1], fp.local_sum_squares(named, fp.LEGACY_METHOD)[1]
    )
    # without a method nothing is summed
    assert load_verified(_zeros(sd), ckpt, expected, no_dist=True).sums == {}


def _save_sharded(ckpt: str) -> None:
    """A 2-rank DCP save of one row-sharded DTensor (each rank's chunk is half the rows)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    full = torch.randn(300, 77, generator=torch.Generator().manual_seed(3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=ckpt)
    dist.destroy_process_group()


def test_at_another_world_size_the_sums_of_the_chunks_that_fill_a_tensor_are_added(tmp_path: Path) -> None:
    """A tensor filled by several chunks (a 2-rank save loaded by one process) gets the sum of its parts' sums with
    ``sum_parts`` (within the fingerprint's cross-world tolerance of one pass over it), none without; memory
    ``sum_keys`` does not name is never summed."""
    from ckpt.commit import fingerprint as fp
    from ckpt.commit.hashing import hash_file
    from ckpt.formats.dcp.onepass import load_verified

    ckpt = tmp_path / "ckpt"
    spawn(_save_sharded, 2, str(ckpt))
    expected = {p.name: hash_file(p) for p in ckpt.iterdir()}
    out = {"w": torch.zeros(300, 77)}
    key = fp.memory_key(out["w"])
    assert key is not None
    one_pass = fp.local_sum_squares([("w", out["w"])])[1][0]
    reader = load_verified(out, ckpt, expected, no_dist=True, sum_method=fp.METHOD, sum_keys={key}, sum_parts=True)
    whole = fp.local_sum_squares([("w", out["w"])])[1][0]
    assert float(whole) > 0 and float(one_pass) == 0.0
    assert set(reader.sums) == {key}
    assert abs(float(reader.sums[key]) - float(whole)) <= fp.CROSS_WORLD_RTOL * float(whole)
    out2 = {"w": torch.zeros(300, 77)}
    key2 = fp.memory_key(out2["w"])
    assert load_verified(out2, ckpt, expected, no_dist=True, sum_method=fp.METHOD, sum_keys={key2}).sums == {}
    out3 = {"w": torch.zeros(300, 77)}
    assert (
        load_verified(out3, ckpt, expected, no_dist=True, sum_method=fp.METHOD, sum_keys=set(), sum_parts=True).sums
        == {}
    )


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_no_sum_is_kept_for_memory_that_another_write_of_the_load_also_fills(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    """Two names of one tensor (tied weights), saved as different values: one chunk copied whole, the other a
    record decoded in apply (non-contiguous). The load's last write decides what the tensor holds, so no sum of
    either chunk may stand for it: the fingerprint reads the tensor."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt.commit import fingerprint as fp
    from ckpt.commit.hashing import hash_file
    from ckpt.formats.dcp.onepass import load_verified

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g) * 3
    ckpt = tmp_path / "ckpt"
    dcp.save({order[0]: x, order[1]: y.t()}, storage_writer=FileSystemWriter(ckpt), no_dist=True)
    expected = {p.name: hash_file(p) for p in ckpt.iterdir()}
    tied = torch.zeros(64, 64)
    key = fp.memory_key(tied)
    reader = load_verified(
        {"a": tied, "b": tied},
        ckpt,
        expected,
        no_dist=True,
        sum_method=fp.METHOD,
        sum_keys={key},  # type: ignore[arg-type]
    )
    assert key not in reader.sums
    # the same tensor under one name, copied whole: summed
    one = torch.zeros(64, 64)
    reader = load_verified(
        {order[0]: one},
        ckpt,
        expected,
        no_dist=True,
        sum_method=fp.METHOD,
        sum_keys={fp.memory_key(one)},  # type: ignore[arg-type]
    )
    assert torch.equal(reader.sums[fp.memory_key(one)], fp.local_sum_squares([("x", one)])[1][0])  # type: ignore[index]


def test_sums_skip_empty_tensors_of_any_dtype(tmp_path: Path) -> None:
    """Empty tensors (all at address 0) of several dtypes beside a summed one: no key, no crash, at another
    world size too (``sum_parts``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckpt.commit import fingerprint as fp
    from ckpt.commit.hashing import hash_file
    from ckpt.formats.dcp.onepass import load_verified

    sd = {
        "w": torch.randn(40, 3),
        "e32": torch.zeros(0),
        "e64": torch.zeros(0, dtype=torch.int64),
        "ebf": torch.zeros(0, dtype=torch.bfloat16),
    }
    ckpt = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(ckpt), no_dist=True)
    expected = {p.name: hash_file(p) for p in ckpt.iterdir()}
    out = _zeros(sd)
    keys = {k for k in map(fp.memory_key, out.values()) if k is not None}
    assert keys == {fp.memory_key(out["w"])}
    reader = load_verified(out, ckpt, expected, no_dist=True, sum_method=fp.METHOD, sum_keys=keys, sum_parts=True)
    assert set(reader.sums) == keys


def _crafted_metadata_value(run_dir: str) -> list[object]:
    import pathlib
    import pickle

    import torch.distributed as dist

    from ckpt.commit.layout import RunDir
    from ckpt.formats.dcp.reader import share_metadata
    from tests.harness import tiny_spec
    from trainer.checkpointer.core import TrainState
    from trainer.checkpointer.dcp_backend import DCPCheckpointer
    from trainer.dist import init_distributed
    from trainer.model import build_model, shard_model
    from trainer.optim import build_optimizer

    env = init_distributed(timeout_s=60)
    spec = tiny_spec()
    model = build_model(spec)
    shard_model(model, env.mesh, spec)
    opt = build_optimizer(model, spec)
    ck = DCPCheckpointer(RunDir.at(run_dir), spec, model, opt, env, segment=0)
    ck.save(TrainState(step=2), reason="interval", blocking=True)
    ck.save(TrainState(step=4), reason="interval", blocking=True)
    ck._wait_reread()
    step4 = Path(run_dir) / "checkpoints" / "step-00000004"
    if env.is_rank0:  # an admitted callable as a plain value, same size: the quick check and the parse take it
        md = pickle.loads((step4 / ".metadata").read_bytes())  # noqa: S301 - our own file, written just above
        md.planner_data = pathlib.PosixPath
        old = (step4 / ".metadata").stat().st_size
        new = pickle.dumps(md)
        (step4 / ".metadata").write_bytes(new + b"\0" * (old - len(new)))
    dist.barrier()
    shared = share_metadata(step4)  # what it parsed cannot be sent: nothing is shared, nothing raised
    ts = ck.load_latest(restart=False)
    out = [shared, ts.step if ts else None, len(list((Path(run_dir) / "checkpoints").glob("step-00000004.invalid-*")))]
    ck.close()
    dist.destroy_process_group()
    return out


def test_a_metadata_rank_1_parses_but_cannot_send_is_parsed_by_each_rank_and_refused_by_its_checksum(
    tmp_path: Path,
) -> None:
    # the tampered .metadata fails its checksum in the load; the resume falls back to step 2 on every rank
    assert spawn(_crafted_metadata_value, 2, str(tmp_path)) == [[None, 2, 1]] * 2
