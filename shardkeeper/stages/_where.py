"""Local path or object-store URL: the one test every stage makes first (ckpt.store.objstore, imported lazily so
that a local run never loads the object-store client)."""

from __future__ import annotations

from pathlib import Path


def is_remote(path: str | Path) -> bool:
    from ckpt.store.objstore import is_remote

    return is_remote(path)


def remote_run(run_dir: str | Path):
    """A RemoteRun for an object-store URL (``s3://bucket/prefix``), None for a local path."""
    from ckpt.store.objstore import RemoteRun, is_remote

    return RemoteRun(str(run_dir)) if is_remote(run_dir) else None
