"""Typed errors. Each message is one line that names the file or field and says the fix."""

from __future__ import annotations


class ShardkeeperError(Exception):
    """A user-facing failure: the CLI prints ``str(err)`` on one line and exits with ``exit_code``."""

    exit_code = 2

    def __str__(self) -> str:  # never let a multi-line message reach the terminal
        return " ".join(super().__str__().split())


class ConfigError(ShardkeeperError):
    """A config file or --set override is wrong."""


class UsageError(ShardkeeperError):
    """The public training API (shardkeeper.Segment) was used in a way that cannot work; the message names the
    call and the fix."""


class RunDirError(ShardkeeperError):
    """The run directory cannot be used as asked (other model, locked, ...)."""


class RunLockedError(RunDirError):
    exit_code = 3


class CheckpointError(ShardkeeperError):
    """A checkpoint is missing, partial, corrupted or does not fit the model."""

    exit_code = 4


class ModelMismatch(CheckpointError):
    """A checkpoint holds another model than the live run's (a tensor's name, shape, dtype or tie differs): bad
    input, refused before anything is loaded, with the exit code of bad input (the segment ends 'refused')."""

    exit_code = 2


class CheckpointRetired(CheckpointError):
    """The checkpoint was retired (retention) or quarantined by a writer while it was being read: not a fault of
    the checkpoint or of the path; a newer one is there to use."""


class FingerprintMismatch(CheckpointError):
    """State after load differs from what was saved: training on it would spike."""

    exit_code = 5


class ExportError(ShardkeeperError):
    """Export cannot proceed as asked."""


class PublishError(ShardkeeperError):
    """Publishing cannot proceed as asked."""


class ServerError(RuntimeError):
    """The local Prefect server could not be started or reached; the message says why and what to do."""


# Flow outcomes: a stage ended in a way the flow cannot continue from. Not ShardkeeperErrors: their
# message may span lines (a failing rank's last lines) and they are shown in the Prefect UI, not a terminal.
class PipelineError(RuntimeError):
    """A stage ended in a way the flow cannot continue from; the message says what and where."""


class SegmentFailed(PipelineError):
    """The ranks failed: the message carries the failing rank's last lines."""


class SegmentCancelled(PipelineError):
    """The flow run was cancelled while a segment trained: its ranks committed a checkpoint and
    stopped; no further segment starts (the flow ends Cancelled)."""


class SegmentPreempted(PipelineError):
    """Preempted more often than the request allows; the run can be resumed later (resume flow)."""
