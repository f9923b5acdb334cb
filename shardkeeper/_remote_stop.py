"""The upload after a stop (shardkeeper.remote.Mirror): its budget, and the uploads a stop gave up on. Stdlib only:
the CLI asks ``abandoned_uploads`` on its way out."""

from __future__ import annotations

import os

from schemas.errors import ConfigError

STOP_UPLOAD_ENV = "SHARDKEEPER_STOP_UPLOAD_S"  # the stop's upload budget; default: the launcher's stop grace
_abandoned: list[str] = []  # uploads left running when their segment's finish gave up on them (see abandoned_uploads)


class UploadAbandoned(Exception):
    """The stop's upload was given up (a second stop signal, or past its grace): nothing more is committed."""


def abandoned_uploads() -> list[str]:
    """The checkpoints whose upload a stopped segment gave up while its requests were still in flight: a process
    that exits now must exit at once (``os._exit``) rather than wait for them (they never get a manifest)."""
    return list(_abandoned)


def _stop_budget() -> float | None:
    """``SHARDKEEPER_STOP_UPLOAD_S`` in seconds (None: unset); one line when it is not a number >= 0."""
    raw = os.environ.get(STOP_UPLOAD_ENV)
    try:
        value = float(raw) if raw else None
    except ValueError:
        value = -1.0
    if value is not None and not value >= 0:  # (nan too)
        raise ConfigError(
            f"{STOP_UPLOAD_ENV}={raw!r}: not a number of seconds (>= 0); set the upload budget after "
            "a stop in seconds, e.g. 60, or unset it for the launcher's stop grace"
        )
    return value


__all__ = ["STOP_UPLOAD_ENV", "UploadAbandoned", "abandoned_uploads"]
