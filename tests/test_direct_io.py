"""The O_DIRECT hashing stream every checkpoint file goes through (DCP shards via HashingDirectWriter,
DeepSpeed files via write_hashed): the bytes on disk are exactly what was written, the digest is the
digest of the file, and a refused O_DIRECT write or a failing writer never yields a digest."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import torch

import ckpt.formats.dcp.direct_io as dio
from ckpt.commit.hashing import hash_file
from ckpt.formats.deepspeed.zero import save_torch, write_hashed


def _payload() -> dict:
    g = torch.Generator().manual_seed(0)
    # 40 MB: crosses the 16 MiB staging buffer twice and ends on a tail that is not a whole block
    return {"w": torch.randn(10_000_003, generator=g), "view": torch.arange(100)[3:71], "n": 7}


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_save_torch_writes_torch_save_bytes_and_their_digest(tmp_path: Path) -> None:
    obj = _payload()
    size, digest = save_torch(tmp_path / "x.pt", obj)
    data = (tmp_path / "x.pt").read_bytes()
    assert data == _torch_bytes(obj) and size == len(data) and size % 4096 != 0
    assert hash_file(tmp_path / "x.pt") == (size, digest)
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["w"], obj["w"])


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "straight_to_tmpfs"])
def test_a_file_already_there_is_overwritten_to_exactly_the_new_bytes_and_a_symlink_is_refused(
    tmp_path: Path, direct: bool
) -> None:
    """A longer file at the path ends with exactly the new bytes; a symlink at the path is refused and its target
    untouched.
    ``direct=False`` (the memory tier's tmpfs) writes straight from the caller's bytes, no staging buffers."""
    obj = _payload()
    path = tmp_path / "x.pt"
    path.write_bytes(os.urandom(len(_torch_bytes(obj)) + 5 * (1 << 20)))  # longer, random
    ino = path.stat().st_ino
    size, digest = dio.write_direct(path, lambda f: torch.save(obj, f), direct)
    assert path.read_bytes() == _torch_bytes(obj) and hash_file(path) == (size, digest)
    assert path.stat().st_ino == ino  # the same file (its pages), not a new one
    target = tmp_path / "elsewhere"
    target.write_bytes(b"precious")
    path.unlink()
    path.symlink_to(target)
    with pytest.raises(OSError) as e:
        dio.write_direct(path, lambda f: torch.save(obj, f), direct)
    assert e.value.errno == errno.ELOOP and target.read_bytes() == b"precious"


def test_a_refused_direct_write_falls_back_to_buffered_with_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd: int, data: object, at: int) -> int:  # the staged buffers are written positionally
        if fcntl_direct(fd) and not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, at)

    def fcntl_direct(fd: int) -> bool:
        import fcntl

        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))

    monkeypatch.setattr(dio.os, "pwrite", pwrite)
    obj = _payload()
    size, digest = save_torch(tmp_path / "x.pt", obj)
    assert refused, "the stream never wrote with O_DIRECT"
    assert (tmp_path / "x.pt").read_bytes() == _torch_bytes(obj)
    assert hash_file(tmp_path / "x.pt") == (size, digest)


def test_a_failing_writer_yields_no_digest_and_leaks_no_descriptor(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))

    def fill(f: io.RawIOBase) -> None:
        f.write(b"x" * 5000)
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        write_hashed(tmp_path / "x.bin", fill)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_short_file_is_truncated_to_its_real_length(tmp_path: Path) -> None:
    size, digest = write_hashed(tmp_path / "s.json", lambda f: f.write(b'{"step": 3}'))
    assert (tmp_path / "s.json").read_bytes() == b'{"step": 3}' and size == 11
    assert hash_file(tmp_path / "s.json") == (size, digest)


def test_a_write_failing_in_the_background_fails_the_file_and_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full buffer is written by a pool thread while the next ones fill: its ENOSPC still fails the file."""
    real_pwrite, calls = os.pwrite, []

    def pwrite(fd: int, data: object, at: int) -> int:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(dio.os, "pwrite", pwrite)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as e:
        save_torch(tmp_path / "x.pt", _payload())
    assert e.value.errno == errno.ENOSPC and len(calls) >= 2
    assert len(os.listdir("/proc/self/fd")) == before


def test_dcp_saves_record_no_torch_crc32_and_alias_padded_shards(tmp_path: Path) -> None:
    """torch's CRC-32 is off in the writer threads of a HashingDirectWriter save (the manifest's xxh3 covers every
    byte), still on in the caller after it; a tensor viewing a larger storage is written as its own bytes (an
    alias, not its whole storage), and everything loads back equal."""
    import zipfile

    import torch.distributed.checkpoint as dcp

    from ckpt.formats.dcp.reader import SafeFileSystemReader, SafeLoadPlanner, read_metadata

    padded = torch.arange(1000, dtype=torch.float32)
    sd = {"view": padded[8:408].view(20, 20), "b": torch.randn(300), "n": 7}
    writer = dio.HashingDirectWriter(tmp_path, thread_count=2)
    dcp.save(sd, storage_writer=writer, planner=dio.ExactStoragePlanner(), no_dist=True)
    assert torch.serialization.get_crc32_options()
    md = read_metadata(tmp_path)
    for index, info in md.storage_data.items():
        with open(tmp_path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            record = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        assert not any(i.CRC for i in record.infolist()), index.fqn
        if index.fqn == "view":
            assert [i.file_size for i in record.infolist() if "/data/" in i.filename] == [400 * 4]
    data_files = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(data_files) == 2 and all(writer.digests[n] == hash_file(tmp_path / n) for n in data_files)
    out = {"view": torch.zeros(20, 20), "b": torch.zeros(300), "n": 0}
    dcp.load(out, storage_reader=SafeFileSystemReader(tmp_path), planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(out["view"], sd["view"]) and torch.equal(out["b"], sd["b"]) and out["n"] == 7


def _dcp_bytes(obj: object) -> bytes:
    """torch.save's bytes as a DCP stream writes them: torch's CRC-32 off (the manifest's xxh3 covers them)."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        return _torch_bytes(obj)
    finally:
        torch.serialization.set_crc32_options(crc)


def _take_over_write(partial: Path, reuse: Path, name: str, obj: object) -> tuple[int, str]:
    fs = dio.HashingDirectFileSystem(direct=False, reuse=reuse)
    with fs.create_stream(partial / name, "wb") as f:
        torch.save(obj, f)
    return fs.digests[name]


def test_a_retired_snapshots_file_is_taken_over_in_place_and_ends_with_exactly_the_new_bytes(tmp_path: Path) -> None:
    """The memory tier's page reuse: a longer file of the same name in the recycle dir is moved into the new
    snapshot and overwritten (same inode: its tmpfs pages), cut to the new length; its digest is the file's."""
    obj = _payload()
    reuse, partial = tmp_path / "step-00000002.recycle", tmp_path / "step-00000006.partial"
    reuse.mkdir()
    partial.mkdir()
    old = reuse / "__1_0.distcp"
    old.write_bytes(os.urandom(len(_torch_bytes(obj)) + 3 * (1 << 20) + 17))
    ino = old.stat().st_ino
    size, digest = _take_over_write(partial, reuse, "__1_0.distcp", obj)
    new = partial / "__1_0.distcp"
    assert new.stat().st_ino == ino and not old.exists()
    assert new.read_bytes() == _dcp_bytes(obj) and hash_file(new) == (size, digest)
    # A shorter file grows to the new length, bytes exact.
    (reuse / "__1_1.distcp").write_bytes(b"x" * 100)
    size, digest = _take_over_write(partial, reuse, "__1_1.distcp", obj)
    assert (partial / "__1_1.distcp").read_bytes() == _dcp_bytes(obj) and hash_file(partial / "__1_1.distcp") == (
        size,
        digest,
    )


def test_a_recycle_dir_never_gets_a_write_through_a_symlink_a_hard_link_or_into_a_non_data_file(tmp_path: Path) -> None:
    """Someone who read the take-over code plants, in the recycle dir: a symlink to a precious file, a hard link to
    one, a directory, and a '.metadata.tmp'. None is written through or taken: the precious bytes stay, and each
    new file is a fresh regular file with exactly the new bytes."""
    obj = _payload()
    reuse, partial = tmp_path / "step-00000002.recycle", tmp_path / "step-00000006.partial"
    reuse.mkdir()
    partial.mkdir()
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious" * 1000)
    linked = tmp_path / "linked"
    linked.write_bytes(b"linked" * 1000)
    (reuse / "__0_0.distcp").symlink_to(precious)
    os.link(linked, reuse / "__0_1.distcp")
    (reuse / "__0_2.distcp").mkdir()
    (reuse / ".metadata.tmp").write_bytes(b"m" * 5000)
    meta_ino = (reuse / ".metadata.tmp").stat().st_ino
    for name in ("__0_0.distcp", "__0_1.distcp", "__0_2.distcp", ".metadata.tmp"):
        size, digest = _take_over_write(partial, reuse, name, obj)
        out = partial / name
        assert not out.is_symlink() and out.is_file() and out.stat().st_nlink == 1
        assert out.read_bytes() == _dcp_bytes(obj) and hash_file(out) == (size, digest)
    assert precious.read_bytes() == b"precious" * 1000 and linked.read_bytes() == b"linked" * 1000
    assert (partial / ".metadata.tmp").stat().st_ino != meta_ino  # never taken over: not a data file


def test_a_fifo_swapped_into_the_recycle_dir_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Racing as the same user, a FIFO replaces the retired file between its check and the move: the take-over does
    not block in open() (the save and training would wait for good); the file is created fresh instead."""
    import threading

    reuse, partial = tmp_path / "step-00000002.recycle-00000006", tmp_path / "step-00000006.partial"
    reuse.mkdir()
    partial.mkdir()
    (reuse / "__0_0.distcp").write_bytes(b"old pages" * 100)
    real_rename = os.rename

    def racing_rename(src, dst, *a, **k):  # noqa: ANN001, ANN002, ANN003
        fd = k.get("src_dir_fd")
        os.unlink(src, dir_fd=fd)
        os.mkfifo(src, dir_fd=fd)
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(dio.os, "rename", racing_rename)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(dio.take_over(reuse, partial / "__0_0.distcp")), daemon=True)
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:  # let it go: a reader on the FIFO
        fd = os.open(partial / "__0_0.distcp", os.O_RDONLY | os.O_NONBLOCK)
        t.join(5)
        os.close(fd)
    assert not hung and out == [None] and not (partial / "__0_0.distcp").exists()


def test_einval_on_two_o_direct_writes_in_flight_falls_back_once_with_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both buffers' writes in flight are refused (EINVAL) under O_DIRECT; the first switches the file to buffered,
    the second, refused as a direct write too, retries buffered instead of failing the file."""
    import fcntl
    import threading
    import time

    real_pwrite = os.pwrite
    both = threading.Barrier(2, timeout=10)
    refused: list[int] = []

    def pwrite(fd: int, data: object, at: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(at)
            try:
                both.wait()  # both writes are in flight with O_DIRECT
            except threading.BrokenBarrierError:
                pass
            if at:
                time.sleep(0.3)  # handled after the first one switched the file
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(dio.os, "pwrite", pwrite)
    data = os.urandom(40 << 20)
    size, digest = dio.write_direct(tmp_path / "x.bin", lambda f: f.write(data), True)
    assert len(refused) >= 2
    assert (tmp_path / "x.bin").read_bytes() == data and hash_file(tmp_path / "x.bin") == (size, digest)
