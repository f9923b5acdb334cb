"""Launchers: how the ranks of a segment are started (local torchrun today; Slurm and Kubernetes plug in
beside it) and the seam to them (``schemas.seam``). No torch, no prefect.

- ``launch.base``: LaunchRequest / LaunchOutcome / the Launcher interface, torchrun output handling.
- ``launch.local``: ranks on this machine through torchrun, supervised (signals, cancellation, timeout); several
  nodes on loopback (one torchrun agent each, c10d rendezvous) for multi-node segments without a cluster.
- ``launch.slurm``: a segment as a Slurm batch job (sbatch --requeue --signal), one torchrun agent per node.
- ``launch.procs``: parent-death signal and /proc helpers shared with the rank side; the launcher's watch over the
  ranks (when each ended, its exit status).
- ``launch.contain``: the wrapper torchrun runs in (a child subreaper): what the ranks leave behind ends with the
  segment.
- ``launch.attribution``: the failed segment's line (the first rank that failed, how, its last error line, what
  followed); ``launch._oom``: what the kernel says about a SIGKILL (the OOM killer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launch.base import Launcher

# Importing a submodule (launch.procs, on the rank side before anything else) runs this file: it stays
# stdlib-only, and the launchers are imported when asked for.
LAUNCHERS: dict[str, str] = {
    "local": "launch.local:LocalTorchrun",
    "slurm": "launch.slurm:SlurmLauncher",
    "kubernetes": "launch.kubernetes:KubernetesLauncher",
}


def get_launcher(name: str, **options: Any) -> Launcher:
    """The launcher ``name``, built with its own options (e.g. the Slurm partition)."""
    import importlib

    try:
        module, _, cls = LAUNCHERS[name].partition(":")
    except KeyError:
        raise ValueError(f"launcher {name!r} is not available here; choose one of {sorted(LAUNCHERS)}") from None
    return getattr(importlib.import_module(module), cls)(**options)


_FROM_BASE = (
    "LaunchOutcome",
    "LaunchRequest",
    "Launcher",
    "failing_rank_lines",
    "first_rank_exit_code",
    "rank_stopped_at_startup",
    "without_torchrun_closing",
)


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from launch import base

        return getattr(base, name)
    raise AttributeError(f"module 'launch' has no attribute {name!r}")


__all__ = [
    "LAUNCHERS",
    "LaunchOutcome",
    "LaunchRequest",
    "Launcher",
    "failing_rank_lines",
    "first_rank_exit_code",
    "get_launcher",
    "rank_stopped_at_startup",
    "without_torchrun_closing",
]
