"""The ``shardkeeper`` command's entry point: for ``train``, a stop signal is remembered from the first moment
(before typer, pydantic and the CLI are imported, ~1 s), so a preemption that comes that early still ends the
segment 'preempted' (exit 75, nothing started) rather than killing the process with 143."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        from launch.early import install_early_stop_handlers

        install_early_stop_handlers()
    from shardkeeper.cli import run

    run()
