"""The typer app of the ``shardkeeper`` CLI and its consoles, shared by the modules that register commands on it
(``shardkeeper.cli``: the stages; ``shardkeeper._cli_runs``: lineage, status, Kubernetes manifests)."""

from __future__ import annotations

import re

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Resumable, verified, elastic sharded checkpoints for PyTorch LM training.",
)
console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


_STATE = {"verbose": False}
# A line the ranks log through trainer.segment's logging format ("<time> [rankN] name: message").
# The ranks' log lines, and the launcher's own ("shardkeeper: submitted Slurm job 12 ...", job state changes).
_RANK_LOG = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \[rank\d+\] |shardkeeper: )")
