"""The memory tier's preflight (unit level, no launch): a memory dir that cannot hold two snapshots of every
rank, or that is read-only, missing or a file, is refused in one line naming the key and the fix, and nothing
is written. The rank-side behaviour (snapshots, crash, resume from memory, tampered snapshot) is exercised by
tests/test_resume.py::test_memory_tier_rank_crash_resumes_from_memory_exactly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from schemas.errors import ConfigError
from shardkeeper.preflight import check_memory_tier, preflight
from shardkeeper.stages.train import plan_topology
from tests.harness import tiny_spec


def _spec(mem: Path, **more: object):
    return tiny_spec(**{"checkpoint.memory_interval": 5, "checkpoint.memory_dir": str(mem), **more})


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_memory_tier_that_does_not_fit_is_refused_with_how_to_size_it(tmp_path: Path) -> None:
    mem = tmp_path / "shm" / "run"
    spec = _spec(mem)
    topo = plan_topology(spec, 2)
    preflight(spec, topo, tmp_path / "run")  # the tiny model's two snapshots fit: accepted, nothing written
    assert not mem.exists() and not (tmp_path / "shm").exists()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    params = int(free / 12)  # two snapshots of 12 B/param over 2 ranks x 2 ranks on the node = 2x the free space
    with pytest.raises(ConfigError) as e:
        check_memory_tier(spec, topo, tmp_path / "run", params)
    msg = _one_line(e)
    assert msg.startswith("checkpoint.memory_dir: two memory snapshots of 2 rank(s) need")
    assert "--shm-size=" in msg and "memory_interval" in msg and str(tmp_path) in msg
    assert not mem.exists() and not (tmp_path / "shm").exists()
    check_memory_tier(spec, topo, tmp_path / "run", params // 4)  # half the free space: fits


def test_read_only_missing_or_file_memory_dir_is_refused_and_nothing_written(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount is what refuses it
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                 capture_output=True).returncode == 0
        if not mounted:
            pytest.skip("running as root without the right to mount a read-only tmpfs")
    else:
        ro.chmod(0o555)
    try:
        spec = _spec(ro / "snapshots")
        with pytest.raises(ConfigError) as e:
            preflight(spec, plan_topology(spec, 2), tmp_path / "run")
        msg = _one_line(e)
        assert msg.startswith(f"checkpoint.memory_dir: {ro} is missing or read-only") and "--shm-size" in msg
        assert not (ro / "snapshots").exists() and not (tmp_path / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        ro.chmod(0o755)
    (tmp_path / "file").write_text("x")
    spec = _spec(tmp_path / "file" / "snapshots")
    with pytest.raises(ConfigError) as e:
        preflight(spec, plan_topology(spec, 2), tmp_path / "run")
    assert "is not a directory" in _one_line(e)
    spec = _spec(tmp_path / "m", backend="deepspeed")
    with pytest.raises(ConfigError) as e:
        check_memory_tier(spec, plan_topology(spec, 2), tmp_path / "run", 10)
    assert "fsdp2 backend only" in _one_line(e)
