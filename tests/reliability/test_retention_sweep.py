"""Retention never prunes the newest verified checkpoint; the segment-start sweep removes leftovers only.

Built from copies of the session's real ``tiny_run`` checkpoint (no launch of its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ckpt.commit.layout import RunDir
from ckpt.validate.checks import is_verified, reread_and_record, validate
from ckpt.validate.retention import apply_retention, sweep_leftovers
from tests.reliability import corrupt as c


def _run_with_steps(tiny_run: Path, root: Path, steps: list[int]) -> RunDir:
    rd = RunDir.at(root)
    for s in steps:
        d = rd.checkpoint(s)
        shutil.copytree(tiny_run / "checkpoints" / "step-00000005", d)
        c.edit_manifest(d, lambda raw, s=s: raw.update(step=s))
    return rd


def test_retention_keeps_the_newest_verified_checkpoint(tiny_run: Path, tmp_path: Path) -> None:
    rd = _run_with_steps(tiny_run, tmp_path / "run", [1, 2, 3])
    assert reread_and_record(rd, rd.checkpoint(1)) is None and is_verified(rd, rd.checkpoint(1))
    # step 3: bytes corrupted at the right size, so the size checks retention runs cannot tell
    c.flip_byte(rd.checkpoint(3) / "__1_0.distcp")
    assert validate(rd.checkpoint(3)).valid and not validate(rd.checkpoint(3), deep=True).valid
    assert reread_and_record(rd, rd.checkpoint(3)) is not None and not is_verified(rd, rd.checkpoint(3))
    removed = apply_retention(rd, keep_last=1, keep_every=None)
    assert [p.name for p in removed] == ["step-00000002"]
    assert rd.checkpoint(1).is_dir() and rd.checkpoint(3).is_dir()
    # a re-commit at a verified step (another manifest) is not verified by the old record
    c.edit_manifest(rd.checkpoint(1), lambda raw: raw.update(created_at="2000-01-01T00:00:00Z"))
    assert not is_verified(rd, rd.checkpoint(1))


def test_nothing_verified_prunes_nothing_valid(tiny_run: Path, tmp_path: Path) -> None:
    rd = _run_with_steps(tiny_run, tmp_path / "run", [1, 2, 3])
    assert apply_retention(rd, keep_last=1, keep_every=None) == []


def test_sweep_removes_leftovers_and_keeps_what_matters(tiny_run: Path, tmp_path: Path) -> None:
    rd = _run_with_steps(tiny_run, tmp_path / "run", [3])
    ck = rd.checkpoints
    (ck / "step-00000002.deleting").mkdir()
    (ck / "step-00000002.partial").mkdir()  # older than the newest valid: abandoned
    (ck / "step-00000009.partial").mkdir()  # newer: could be a save in flight, kept
    invalid = [ck / f"step-00000004.invalid-{t}" for t in (100, 200, 300)]
    for d in invalid:
        d.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    exports = rd.exports
    (exports / f".step-00000003.export-{int(dead.stdout)}").mkdir(parents=True)
    (exports / f".step-00000003.export-{os.getpid()}").mkdir()  # alive: an export running now
    (exports / "step-00000003").mkdir()
    rd.verified.mkdir()
    (rd.verified / "step-00000007.json").write_text("{}")  # its checkpoint is gone
    swept = {p.name for p in sweep_leftovers(rd)}
    assert swept == {
        "step-00000002.deleting",
        "step-00000002.partial",
        invalid[0].name,
        f".step-00000003.export-{int(dead.stdout)}",
        "step-00000007.json",
    }
    assert invalid[1].is_dir() and invalid[2].is_dir() and (ck / "step-00000009.partial").is_dir()
    assert (exports / f".step-00000003.export-{os.getpid()}").is_dir() and rd.checkpoint(3).is_dir()
