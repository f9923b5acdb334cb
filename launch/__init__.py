"""Launchers: how the ranks of a segment are started (local torchrun today; Slurm and Kubernetes plug in
beside it) and the seam to them (``schemas.seam``). No torch, no prefect.

- ``launch.base``: LaunchRequest / LaunchOutcome / the Launcher interface, torchrun output handling.
- ``launch.local``: ranks on this machine through torchrun, supervised (signals, cancellation, timeout).
- ``launch.procs``: parent-death signal and /proc helpers shared with the rank side.
"""
from __future__ import annotations

from collections.abc import Callable

from launch.base import Launcher, LaunchOutcome, LaunchRequest, failing_rank_lines, without_torchrun_closing
from launch.local import LocalTorchrun

LAUNCHERS: dict[str, Callable[[], Launcher]] = {"local": LocalTorchrun}


def get_launcher(name: str) -> Launcher:
    try:
        return LAUNCHERS[name]()
    except KeyError:
        raise ValueError(f"launcher {name!r} is not available here; choose one of {sorted(LAUNCHERS)}") from None


__all__ = ["LAUNCHERS", "LaunchOutcome", "LaunchRequest", "Launcher", "failing_rank_lines", "get_launcher",
           "without_torchrun_closing"]
