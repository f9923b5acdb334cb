"""Typed errors. Each message is one line that names the file or field and says the fix."""

from __future__ import annotations


class ShardkeeperError(Exception):
    """A user-facing failure: the CLI prints ``str(err)`` on one line and exits with ``exit_code``."""

    exit_code = 2

    def __str__(self) -> str:  # never let a multi-line message reach the terminal
        return " ".join(super().__str__().split())


class ConfigError(ShardkeeperError):
    """A config file or --set override is wrong."""


class RunDirError(ShardkeeperError):
    """The run directory cannot be used as asked (other model, locked, ...)."""


class RunLockedError(RunDirError):
    exit_code = 3


class CheckpointError(ShardkeeperError):
    """A checkpoint is missing, partial, corrupted or does not fit the model."""

    exit_code = 4


class FingerprintMismatch(CheckpointError):
    """State after load differs from what was saved: training on it would spike."""

    exit_code = 5


class ExportError(ShardkeeperError):
    """Export cannot proceed as asked."""


class PublishError(ShardkeeperError):
    """Publishing cannot proceed as asked."""
