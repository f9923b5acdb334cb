"""The uploader of an s3:// run on a link slower than the commits: it pushes the newest checkpoint the store lacks
(skipping the ones committed meanwhile), and the one it pushes is pinned in the cache, so the ranks' retention
keeps it until it is up; a pin of a dead process protects nothing.

No launch of its own: checkpoints are copies of the session's ``tiny_run`` checkpoint committed into the cache
(``.partial`` then rename), each followed by what rank 0 does after a commit (the re-read that records it verified,
then retention); ``Mirror`` uploads them to the real moto_server through the throttling forwarder (tests/throttle.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.commit.layout import RunDir
from ckpt.guards.pin import Pin, pinned_steps
from ckpt.validate.checks import reread_and_record, validate
from ckpt.validate.retention import apply_retention
from tests.harness import tiny_spec
from tests.reliability.corrupt import edit_manifest
from tests.s3_server import _new_bucket

pytest_plugins = ["tests.s3_server"]

RATE = 1_600_000  # bytes/s: a tiny checkpoint (1.6 MB) takes ~1 s to go up; two commits take far less


def _commit(rd: RunDir, src: Path, step: int, keep_last: int) -> None:
    """A commit as the ranks make it, then rank 0's bookkeeping: re-read (recorded verified), then retention."""
    partial = rd.partial(step)
    shutil.copytree(src, partial)
    edit_manifest(partial, lambda raw: raw.update(step=step))
    os.rename(partial, rd.checkpoint(step))
    assert reread_and_record(rd, rd.checkpoint(step)) is None
    apply_retention(rd, keep_last=keep_last, keep_every=None)


def _next_upload(mirror: object, seen: list[int]) -> int:
    """The step the uploader starts pushing after those in ``seen``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        step = mirror.in_flight  # type: ignore[attr-defined]
        if step is not None and step not in seen:
            seen.append(step)
            return step
        time.sleep(0.005)
    pytest.fail(f"no upload began after {seen} within 30 s")


def test_a_slow_link_uploads_the_newest_and_retention_keeps_the_one_in_flight(
    s3_endpoint: str, tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt.store.objstore import RemoteRun
    from shardkeeper.remote import Mirror
    from tests.throttle import ThrottledProxy

    monkeypatch.setenv("SHARDKEEPER_CACHE", str(tmp_path / "cache"))
    src = tiny_run / "checkpoints" / "step-00000005"
    url = f"s3://{_new_bucket()}/slow"
    proxy = ThrottledProxy(os.environ["AWS_ENDPOINT_URL"], rate=RATE)
    remote = RemoteRun(url, storage_options={"endpoint_url": proxy.url})
    rd = remote.local
    keep_last = 2
    _commit(rd, src, 1, keep_last)
    mirror = Mirror(
        remote, tiny_spec(**{"checkpoint.keep_last": keep_last}), is_valid=lambda p: validate(p).valid, poll_s=0.02
    )
    mirror.start()
    seen: list[int] = []
    try:
        # two commits (and retention after each) while each upload is in flight: faster than the link
        assert _next_upload(mirror, seen) == 1
        assert pinned_steps(rd.root) == {1}
        _commit(rd, src, 2, keep_last)
        _commit(rd, src, 3, keep_last)
        assert rd.checkpoint(1).is_dir()  # pinned: retention keeps it while it goes up
        assert _next_upload(mirror, seen) == 3  # the newest; step 2 is skipped
        assert RemoteRun(url).committed_steps() == [1]  # the one in flight when 2 and 3 committed went up whole
        _commit(rd, src, 4, keep_last)
        _commit(rd, src, 5, keep_last)
        assert [p.name for p in rd.committed()] == ["step-00000003", "step-00000004", "step-00000005"]
        assert _next_upload(mirror, seen) == 5
        assert RemoteRun(url).committed_steps() == [1, 3]
    finally:
        mirror.finish()
        proxy.close()
    assert mirror.uploaded == [1, 3, 5] and RemoteRun(url).committed_steps() == [3, 5]  # the store's keep_last 2
    assert pinned_steps(rd.root) == set() and not (rd.root / ".pins" / "upload.json").exists()
    apply_retention(rd, keep_last=keep_last, keep_every=None)  # unpinned: the policy alone decides again
    assert [p.name for p in rd.committed()] == ["step-00000004", "step-00000005"]


def test_a_pin_counts_only_while_its_process_lives(tiny_run: Path, tmp_path: Path) -> None:
    rd = RunDir.at(tmp_path / "run")
    for step in (1, 2, 3):
        _commit(rd, tiny_run / "checkpoints" / "step-00000005", step, keep_last=3)
    held = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from ckpt.guards.pin import Pin; "
            "Pin(sys.argv[1]).acquire().set(1); print('pinned', flush=True); time.sleep(60)",
            str(rd.root),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "pinned"
        assert pinned_steps(rd.root) == {1}
        assert apply_retention(rd, keep_last=1, keep_every=None) == [rd.checkpoint(2)]  # step 1: pinned
        with pytest.raises(Exception, match="held by another live process"):
            Pin(rd.root, wait_s=0.2).acquire()
    finally:
        held.kill()
        held.wait()
    # the holder died with its pin on disk: the pin protects nothing, and the next holder replaces it
    assert (rd.root / ".pins" / "upload.json").exists() and pinned_steps(rd.root) == set()
    assert apply_retention(rd, keep_last=1, keep_every=None) == [rd.checkpoint(1)]
    pin = Pin(rd.root).acquire()
    assert not (rd.root / ".pins" / "upload.json").exists()
    pin.set(3)
    assert pinned_steps(rd.root) == {3}
    pin.release()
    assert pinned_steps(rd.root) == set()


def test_a_crafted_pin_is_ignored_and_never_hangs_retention(tiny_run: Path, tmp_path: Path) -> None:
    """What a pin file or its lock may be instead (a FIFO, a symlink to /dev/zero, a huge or deeply nested file)
    protects nothing, and retention neither hangs on it nor fails with a traceback."""
    cases = {
        "fifo": "os.mkfifo(p / 'upload.json')",
        "fifo-lock": "(p / 'upload.json').write_text('{\"step\": 1}'); os.mkfifo(p / 'upload.lock')",
        "zero": "(p / 'upload.json').symlink_to('/dev/zero')",
        "huge": "open(p / 'upload.json', 'wb').truncate(1 << 31)",
        "nested": "(p / 'upload.json').write_text('[' * 200000)",
    }
    for name, plant in cases.items():
        rd = RunDir.at(tmp_path / name)
        for step in (1, 2):
            _commit(rd, tiny_run / "checkpoints" / "step-00000005", step, keep_last=2)
        code = (
            "import os, sys; from pathlib import Path; from ckpt.commit.layout import RunDir; "
            "from ckpt.guards.pin import pinned_steps; from ckpt.validate.retention import apply_retention; "
            f"p = Path(sys.argv[1]) / '.pins'; p.mkdir(); {plant}; "
            "print(sorted(pinned_steps(sys.argv[1])), len(apply_retention(RunDir.at(sys.argv[1]), keep_last=1, "
            "keep_every=None)))"
        )
        try:
            out = subprocess.run(
                [sys.executable, "-c", code, str(rd.root)],
                capture_output=True,
                text=True,
                timeout=20,
                cwd=Path(__file__).parent.parent,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: retention hung on the planted pin")
        assert (out.returncode, out.stdout.strip()) == (0, "[] 1"), (name, out.stderr[-500:])
