"""Run state: the newest valid checkpoint and how the last segment ended, for one run or every run under
a folder (status, the resume scan)."""

from __future__ import annotations

from pathlib import Path

from ckpt.commit.fsutil import read_jsonl
from ckpt.commit.layout import RunDir
from ckpt.guards.lock import RunLock
from ckpt.memtier.tier import newest_valid_snapshot
from ckpt.validate.checks import latest_valid
from schemas.errors import ShardkeeperError
from schemas.requests import RunState, last_placement, last_segment
from shardkeeper.stages._where import is_remote


def run_state(run_dir: str | Path) -> RunState:
    """Newest valid checkpoint and how the last segment ended (plain function: the resume scan uses it)."""
    if is_remote(run_dir):
        from shardkeeper.remote import run_state_remote

        return run_state_remote(str(run_dir), is_locked=lambda root: RunLock(root).is_locked())
    rd = RunDir.at(run_dir)
    exists = rd.spec_path.exists() or bool(rd.committed())
    if not exists:
        return RunState(run_dir=str(rd.root), exists=False)
    found, tier = latest_valid(rd), "storage"
    snap = newest_valid_snapshot(rd)
    if snap is not None and (found is None or snap[1].step > found[1].step):
        found, tier = snap, "memory"
    locked = RunLock(rd.root).is_locked()
    records = read_jsonl(rd.segments)
    last_status, last_until_step = last_segment(records, locked=locked)
    return RunState(
        run_dir=str(rd.root),
        exists=True,
        checkpoint=str(found[0]) if found else None,
        step=found[1].step if found else 0,
        world_size=found[1].topology.world_size if found else None,
        tier=tier if found else None,
        last_status=last_status,
        last_until_step=last_until_step,
        locked=locked,
        **last_placement(records),
    )


def run_dirs_under(root: Path) -> list[Path]:
    """The run directories (a run.yaml or a checkpoints/ folder) directly under ``root``."""
    if not root.is_dir():
        raise ShardkeeperError(f"resume root {root}: no such folder; pass the folder that holds the run directories")
    return sorted(
        p for p in root.iterdir() if p.is_dir() and (RunDir(p).spec_path.exists() or RunDir(p).checkpoints.is_dir())
    )


def scan_runs(roots: str | list[str] | None, run_dirs: list[str]) -> list[RunState]:
    """The state of every run directory under ``roots`` (one folder or several) and in ``run_dirs`` (each once)."""
    roots = [roots] if isinstance(roots, str) else list(roots or [])
    found: list[str | Path] = []
    for root in roots:
        if is_remote(root):  # s3://bucket/prefix: the runs on the store (manifest-committed checkpoints only)
            from shardkeeper.remote import remote_run_urls

            found += remote_run_urls(root)
        else:
            found += run_dirs_under(Path(root))
    seen: dict[str | Path, None] = {}
    for p in [*found, *run_dirs]:
        seen.setdefault(str(p).rstrip("/") if is_remote(p) else Path(p).resolve(), None)
    return [run_state(p) for p in seen]
