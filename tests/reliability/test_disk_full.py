"""A save that hits a full disk fails on every rank with one line naming the path, commits nothing, leaves
the previous checkpoint valid, and the run resumes from it once space is back.

The run directory lives on a small tmpfs (``mount -t tmpfs -o size=…``, root only: skipped otherwise);
three real torchrun launches (2 CPU ranks): a checkpoint at step 2, a segment whose step-4 save does not
fit, and the resume after the ballast is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt.validate.checks import validate
from shardkeeper.config import load_run_spec
from shardkeeper.stages import plan_topology, train_segment

ROOT = Path(__file__).resolve().parents[2]
SIZE_MB = 8


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: cannot make a small file system for the disk-full test")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}M", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"mount -t tmpfs is not permitted here ({done.stderr.strip() or done.returncode}); "
            "the disk-full test needs root or CAP_SYS_ADMIN"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_disk_full_save_commits_nothing_and_the_run_resumes(small_disk: Path) -> None:
    spec = load_run_spec(ROOT / "configs" / "tiny.yaml", ["checkpoint.interval=2", "checkpoint.keep_last=100"])
    topo = plan_topology(spec, 2, device="cpu")
    run = small_disk / "run"
    assert train_segment(spec, run, topo, 2).status == "completed"
    ck = run / "checkpoints"
    size = sum(f["size"] for f in json.loads((ck / "step-00000002" / "manifest.json").read_text())["files"])
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * max(0, _free(small_disk) - size // 2))  # half a checkpoint of room left
    metrics_rows = len((run / "metrics.jsonl").read_text().splitlines())

    res = train_segment(spec, run, topo, 4)
    assert res.status == "failed" and res.exit_code != 0
    line = next(ln for ln in (res.failure or "").splitlines() if "disk full at" in ln)
    assert str(ck / "step-00000004.partial") in line and "the run resumes from step 2" in line, line
    assert "Traceback" not in (res.failure or "")
    assert not (ck / "step-00000004").exists() and not (ck / "step-00000004.partial").exists()
    assert validate(ck / "step-00000002", deep=True).valid

    ballast.unlink()
    res = train_segment(spec, run, topo, 4)
    assert res.status == "completed", res.failure
    assert validate(ck / "step-00000004", deep=True).valid
    resumes = [json.loads(x) for x in (run / "lineage.jsonl").read_text().splitlines()]
    assert [e for e in resumes if e["kind"] == "resume"][-1]["parent"] == "checkpoint:step-00000002"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == metrics_rows + 4  # 3, 4 twice


@pytest.mark.parametrize("case", ["import", "convert-to-deepspeed", "convert-to-dcp"])
def test_import_and_convert_on_a_full_disk_are_one_line_and_leave_nothing(
    case: str, small_disk: Path, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture
) -> None:
    """Import (a plain DCP folder into a new fsdp2 run) and convert (either way) with less room left than they
    write: exit 1, one line naming the file and the full disk (DCP's CheckpointException derives from
    BaseException: it no longer escapes as a 77-line traceback), and nothing left on the disk (no run directory,
    no empty output folder, no .partial)."""
    from shardkeeper.cli import main
    from tests.reliability.corrupt import plain_dcp_source

    out = str(small_disk / "out")
    if case == "convert-to-dcp":
        argv = ["convert", str(request.getfixturevalue("ds_run") / "checkpoints" / "step-00000002"), out, "--to", "dcp"]
    else:
        tiny = request.getfixturevalue("tiny_run") / "checkpoints" / "step-00000005"
        argv = ["convert", str(tiny), out, "--to", "deepspeed"]
        if case == "import":
            src = plain_dcp_source(tiny, tmp_path / "src")
            argv = ["import", str(src), "--config", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", out]
    (small_disk / "ballast").write_bytes(b"\0" * max(0, _free(small_disk) - (256 << 10)))  # 256 KB left
    capsys.readouterr()
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {small_disk / 'out'}/"), lines
    assert "No space left on device: the disk is full; free space and rerun the same command" in lines[0]
    assert sorted(os.listdir(small_disk)) == ["ballast"]
