"""ckpt.guards.flock, the flock primitives every lock of a run directory is built on, against a real second process
holding the lock; and the probe's refusal of what is not a lock file (a FIFO, a symlink)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.guards import flock
from ckpt.guards.flock import LOCK_EX, LOCK_SH, FileLock, FlockRefused, is_held, open_lock

ROOT = Path(__file__).resolve().parents[1]

# A holder in another process: takes the lock, says so, lets go when told (a line on stdin), says so, and stays
# alive until killed (so a lock found free was released, not dropped by the kernel at the holder's death).
HOLDER = """
import sys
from ckpt.guards.flock import FileLock, LOCK_EX, LOCK_SH
lock = FileLock(sys.argv[1], directory=sys.argv[3] == "dir")
assert lock.acquire(LOCK_EX if sys.argv[2] == "ex" else LOCK_SH, 0.0)
print("held", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
sys.stdin.readline()
"""


class Holder:
    def __init__(self, path: Path, mode: str, kind: str = "file") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), mode, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"

    def release_in(self, seconds: float) -> threading.Thread:
        t = threading.Thread(target=lambda: (time.sleep(seconds), self.release()))
        t.start()
        return t


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.proc.kill()
        h.proc.wait()


def test_acquire_fails_at_once_polls_a_bounded_time_then_succeeds_after_the_holder_releases(
    tmp_path: Path, holders: list[Holder]
) -> None:
    """Another process holds the lock exclusively: one try fails at once, a bounded wait fails after about its
    bound, the probe sees it held; a wait that spans the holder's release succeeds (the holder still alive), and
    the file stays a lock file for the next one."""
    path = tmp_path / "x.lock"
    holders.append(h := Holder(path, "ex"))
    lock = FileLock(path)
    t0 = time.monotonic()
    assert not lock.acquire(LOCK_EX, 0.0) and not lock.held
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert not lock.acquire(LOCK_SH, 0.3) and lock.fd is None
    assert 0.3 <= time.monotonic() - t0 < 3.0
    assert is_held(path, LOCK_SH) and is_held(path, LOCK_EX)
    t0 = time.monotonic()  # before the release is timed: the release comes 0.3 s after this, never sooner
    releaser = h.release_in(0.3)
    assert lock.acquire(LOCK_EX, 20.0) and lock.held
    releaser.join()
    assert 0.3 <= time.monotonic() - t0 < 20.0 and h.proc.poll() is None
    assert lock.acquire(LOCK_EX, 0.0)  # held by this object already: nothing more taken
    # held by this process: a probe of another open file conflicts with it too
    assert is_held(path, LOCK_SH)
    lock.release()
    assert not is_held(path, LOCK_EX) and not lock.held
    lock.release()  # not held: nothing


def test_shared_holders_coexist_and_exclude_an_exclusive_one(tmp_path: Path, holders: list[Holder]) -> None:
    path = tmp_path / "x.lock"
    holders.append(h := Holder(path, "sh"))
    lock = FileLock(path)
    assert not is_held(path, LOCK_SH) and is_held(path, LOCK_EX)
    assert lock.acquire(LOCK_SH, 0.0)
    lock.release()
    assert not lock.acquire(LOCK_EX, 0.0)
    fd = open_lock(path)
    try:
        releaser = h.release_in(0.2)
        assert flock.flock_within(fd, LOCK_EX, 20.0)
        releaser.join()
    finally:
        os.close(fd)


def test_blocking_context_manager_waits_for_a_directory_lock(tmp_path: Path, holders: list[Holder]) -> None:
    """``with FileLock(dir, directory=True)`` (the export folder's commit lock) blocks until the other process
    lets go, then holds it until the block ends."""
    folder = tmp_path / "exports"
    folder.mkdir()
    holders.append(h := Holder(folder, "ex", "dir"))
    t0 = time.monotonic()  # before the release is timed (see above)
    releaser = h.release_in(0.3)
    with FileLock(folder, directory=True) as lock:
        assert lock.held and time.monotonic() - t0 >= 0.3
        assert not FileLock(folder, directory=True).acquire(LOCK_EX, 0.0)
    releaser.join()
    assert not lock.held and FileLock(folder, directory=True).acquire(LOCK_EX, 0.0)
    assert [p.name for p in tmp_path.iterdir()] == ["exports"]  # a directory lock creates no file


def test_a_dead_holder_leaves_no_lock(tmp_path: Path, holders: list[Holder]) -> None:
    path = tmp_path / "x.lock"
    holders.append(h := Holder(path, "ex"))
    assert is_held(path, LOCK_SH)
    h.proc.kill()
    h.proc.wait()
    assert not is_held(path, LOCK_SH) and FileLock(path).acquire(LOCK_EX, 0.0)


def _returns_within(seconds: float, fn: object) -> list[object]:
    """Run ``fn`` in a thread; the list holds its result once it returned (empty: it is still blocked)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    t.join(seconds)
    return out


def test_probe_refuses_a_fifo_and_a_symlink_without_blocking(tmp_path: Path, holders: list[Holder]) -> None:
    """A FIFO at the lock path is never opened for waiting (no writer ever comes) and holds no lock; a symlink is
    never followed, even to a lock file another process holds; ``open_lock(nofollow=True)`` refuses it."""
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    assert _returns_within(5.0, lambda: is_held(fifo, LOCK_SH)) == [False]
    assert _returns_within(5.0, lambda: flock.open_regular(fifo)) == [None]
    target = tmp_path / "real.lock"
    holders.append(Holder(target, "ex"))
    link = tmp_path / "link.lock"
    link.symlink_to(target)
    assert is_held(target, LOCK_SH)
    assert _returns_within(5.0, lambda: is_held(link, LOCK_SH)) == [False]
    assert not is_held(tmp_path / "missing.lock", LOCK_EX) and not (tmp_path / "missing.lock").exists()
    (tmp_path / "dir.lock").mkdir()
    assert not is_held(tmp_path / "dir.lock", LOCK_EX)
    with pytest.raises(OSError) as e:
        open_lock(link, nofollow=True)
    assert e.value.errno == errno.ELOOP


def test_a_refused_flock_is_no_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file system refusing flock (ENOLCK) is FlockRefused, not contention: a FileLock closes its file and
    raises; the memory tier's lock reports the dir in use (nothing claimed); a pin's lock then pins nothing."""
    from ckpt.commit.layout import RunDir
    from ckpt.guards.pin import _lock_held
    from ckpt.memtier.tier import TierLock

    def refuse(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(flock.fcntl, "flock", refuse)
    path = tmp_path / "x.lock"
    lock = FileLock(path)
    with pytest.raises(FlockRefused) as e:
        lock.acquire(LOCK_EX, 1.0)
    assert e.value.errno == errno.ENOLCK and not lock.held
    tier = TierLock(RunDir(tmp_path))
    assert tier.acquire() is False and tier.fd is None
    assert _lock_held(path) is False
    with pytest.raises(FlockRefused):
        is_held(path, LOCK_SH)


def test_run_and_plan_locks_refuse_a_fifo_in_one_line_and_leak_no_descriptor(tmp_path: Path) -> None:
    """A FIFO planted where ``.lock`` / ``.lock.plan`` belong is refused as a RunDirError naming it and the fix, and
    the descriptor opened on it is closed (a leaked one would hold its flock for the life of a long-lived worker)."""
    from ckpt.guards.lock import RunLock
    from ckpt.plan import PlanLock
    from schemas.errors import RunDirError

    for make, name in ((lambda d: RunLock(d), ".lock"), (lambda d: PlanLock(d), ".lock.plan")):
        run = tmp_path / name.strip(".")
        run.mkdir()
        os.mkfifo(run / name)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(RunDirError, match=r"a FIFO where a lock file belongs; remove it"):
            make(run).acquire()
        assert len(os.listdir("/proc/self/fd")) == before


def test_a_pin_acquired_twice_keeps_its_pinned_step(tmp_path: Path) -> None:
    """Acquiring a held pin again is refused; it never removes the holder's own live pin."""
    from ckpt.guards.pin import Pin
    from schemas.errors import RunLockedError

    pin = Pin(tmp_path)
    pin.acquire()
    try:
        pin.set(7)
        with pytest.raises(RunLockedError, match="already held by this pin"):
            pin.acquire()
        assert pin.path.is_file() and "7" in pin.path.read_text()
    finally:
        pin.release()
