"""The run's plan on disk: ``RUN_DIR/plan.json`` (schemas.plan.RunPlan) and the plan lock ``RUN_DIR/.lock.plan``.

The plan file is rewritten whole, atomically (temporary file, fsync, rename, fsync of the folder), so a reader
beside its writer sees the old plan or the new one, never a mix. Only the holder of the plan lock writes it.

The plan lock is an exclusive flock held by the process that drives the plan -- the train-and-export flow run,
or the resume flow run that took it over -- from before it reads the plan until it finishes or hands the plan
over, across segments (the run lock, ``.lock``, is held for one segment only). A second resumer finds it held
and leaves the run alone ("already running"); the kernel drops it when its holder dies, so a driver that was
killed leaves the plan to the next resumer.

For a run directory on an object store the plan lives in the run's local cache (the machine that drives it).
Stdlib and pydantic only.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path

from pydantic import ValidationError

from ckpt.commit.fsutil import atomic_write_text
from ckpt.guards.flock import LOCK_SH, NotALockFile, is_held, release_recorded, take_recorded
from schemas.errors import RunDirError, RunLockedError
from schemas.plan import PLAN_NAME, RunPlan

PLAN_LOCK_NAME = ".lock.plan"
MAX_PLAN_BYTES = 1 << 20  # a plan is a few KB; anything larger was not written by shardkeeper


class PlanError(RunDirError):
    """``plan.json`` cannot be read: not a file shardkeeper wrote, or damaged."""


def plan_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / PLAN_NAME


def read_plan(run_dir: str | Path) -> RunPlan | None:
    """The run's plan, or None when it has none. Raises PlanError (one line naming the file and the fix) when
    ``plan.json`` is not a regular file, too large, or not a valid plan. Safe beside the writer (see above)."""
    path = plan_path(run_dir)
    try:  # never follows a link, never blocks on a FIFO planted there
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PlanError(f"{path}: cannot be read ({e.strerror}); remove it to drop the plan") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PlanError(f"{path}: not a regular file; remove it to drop the plan")
        if st.st_size > MAX_PLAN_BYTES:
            raise PlanError(f"{path}: {st.st_size} bytes, larger than any plan ({MAX_PLAN_BYTES}); remove it")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return RunPlan.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise PlanError(
            f"{path}: not a valid plan ({where}: {err['msg']}); remove it to drop the plan, or start "
            "the run's train-and-export flow again"
        ) from None


def write_plan(run_dir: str | Path, plan: RunPlan) -> None:
    """Replace the run's plan atomically (call it while holding the PlanLock)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan_path(run_dir), plan.model_dump_json(indent=2) + "\n")


class PlanLock:
    """The exclusive flock on ``RUN_DIR/.lock.plan`` of the process that drives the run's plan.

    ``acquire`` never waits for a holder: a second driver gets RunLockedError naming the holder at once."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / PLAN_LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Does this object hold the lock now?"""
        return self._fd is not None

    def acquire(self, who: str = "") -> PlanLock:
        """Take the lock; ``who`` (a line saying which flow run) is recorded for the next one who finds it held.
        Raises RunLockedError (exit code 3) when another process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "who": who,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        try:
            fd, holder = take_recorded(self.path, json.dumps(info), nofollow=True)
        except NotALockFile as e:
            raise RunDirError(str(e)) from None
        if fd is None:
            raise RunLockedError(
                f"{self.path.parent}: its plan is being driven by {describe(holder)}; it goes on "
                "to the plan's end without another resumer"
            )
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            release_recorded(self._fd)
            self._fd = None

    def is_locked(self) -> bool:
        """Does another process (or another PlanLock of this one) hold it now? A momentary probe."""
        return self._fd is None and is_held(self.path, LOCK_SH)

    def holder(self) -> str:
        """Who holds it, as its holder recorded (empty when nobody does)."""
        try:
            return describe(self.path.read_text(encoding="utf-8", errors="replace")) if self.is_locked() else ""
        except OSError:
            return ""

    def __enter__(self) -> PlanLock:
        return self if self.held else self.acquire()  # ``with PlanLock(d).acquire(who):`` holds it once

    def __exit__(self, *exc: object) -> None:
        self.release()


def describe(record: str) -> str:
    """A lock file's record as words: ``automation ... (flow run ...) (pid 12 on host since 2026-...)``."""
    try:
        who = json.loads(record)
        where = f"pid {who.get('pid')} on {who.get('host')} since {who.get('since')}"
        return f"{who['who']} ({where})" if who.get("who") else where
    except (json.JSONDecodeError, TypeError, AttributeError):
        return "another process"
