"""One writer per run directory, for as long as any process of its segment lives.

Two flock files (the kernel releases a flock when its last holder dies, so a crash never leaves a
stale lock):

- ``RUN_DIR/.lock``: held exclusively by the launching process (``shardkeeper train``, a Prefect
  task) for the whole segment. It records the holder's pid, host and start time.
- ``RUN_DIR/.lock.ranks``: every rank holds a *shared* flock on it for its whole life and appends its
  pid (``hold_ranks_lock``). ``RunLock.acquire()`` takes ``.lock`` and then waits (bounded) for an
  exclusive flock on ``.lock.ranks``: ranks of an earlier segment that are still alive (their
  launcher was SIGKILLed before they could be stopped) make it fail with a one-line
  ``RunLockedError`` that names their pids, so a second writer never starts beside them.

Stdlib only: the ranks take their lock before torch is imported. The flock primitives are ``ckpt.guards.flock``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ckpt.commit.fsutil import pid_alive
from ckpt.guards.flock import (
    LOCK_EX,
    LOCK_SH,
    NotALockFile,
    flock_within,
    is_held,
    open_lock,
    release_recorded,
    take_recorded,
    unlock,
)
from schemas.errors import RunDirError, RunLockedError

LOCK_NAME = ".lock"
RANKS_LOCK_NAME = ".lock.ranks"
# How long acquire() waits for the ranks of a previous segment to go (they die within ~1 s of their
# launcher: PR_SET_PDEATHSIG plus a watchdog); SHARDKEEPER_RANKS_WAIT_S overrides it.
DEFAULT_RANKS_WAIT_S = 10.0


def _ranks_wait_default() -> float:
    try:
        return float(os.environ.get("SHARDKEEPER_RANKS_WAIT_S", DEFAULT_RANKS_WAIT_S))
    except ValueError:
        return DEFAULT_RANKS_WAIT_S


def live_rank_pids(run_dir: str | Path) -> list[int]:
    """Pids recorded in ``.lock.ranks`` whose process is still alive (best effort: pids can be reused)."""
    try:
        text = (Path(run_dir) / RANKS_LOCK_NAME).read_text()
    except OSError:
        return []
    pids = sorted({int(x) for x in text.split() if x.isdigit()})
    return [p for p in pids if pid_alive(p)]


def lock_holders(path: Path, limit: int = 1_000_000) -> list[tuple[int, str]]:
    """The processes with ``path`` open (pid, command line), found through /proc as ``fuser`` does: a leftover of a
    segment that holds its ``.lock.ranks``. Only the processes this user may inspect are seen; at most ``limit``
    descriptors are looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    found: list[tuple[int, str]] = []
    looked = 0
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in sorted(pids):
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            looked += 1
            if looked > limit:
                return found
            try:
                other = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                try:
                    cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0"))
                except OSError:
                    cmd = "?"
                found.append((pid, cmd.strip()[:80]))
                break
    return found


class RunLock:
    def __init__(self, run_dir: str | Path, *, ranks_wait_s: float | None = None):
        self.path = Path(run_dir) / LOCK_NAME
        self.ranks_path = Path(run_dir) / RANKS_LOCK_NAME
        self.ranks_wait_s = _ranks_wait_default() if ranks_wait_s is None else ranks_wait_s
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Who holds it, written at once: a lock held with an empty file is a reader's probe (``is_locked``),
        # which the next acquire waits out instead of failing.
        info = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
        try:
            fd, holder = take_recorded(self.path, info)
        except NotALockFile as e:
            raise RunDirError(str(e)) from None
        if fd is None:
            try:
                who = json.loads(holder)
                desc = f"pid {who.get('pid')} on {who.get('host')} since {who.get('since')}"
            except json.JSONDecodeError:
                desc = "another process"
            raise RunLockedError(
                f"{self.path.parent}: run directory is locked by {desc}; "
                "wait for that segment to end or use another --run-dir"
            )
        try:
            self._wait_for_ranks_gone()
        except BaseException:
            release_recorded(fd)
            raise
        self._fd = fd
        return self

    def _wait_for_ranks_gone(self) -> None:
        """Exclusive flock on ``.lock.ranks`` (no rank of any segment alive), then clear its stale pids."""
        fd = open_lock(self.ranks_path)
        try:
            if not flock_within(fd, LOCK_EX, self.ranks_wait_s):
                raise self._ranks_alive_error()
            os.ftruncate(fd, 0)
            unlock(fd)
        finally:
            os.close(fd)

    def _ranks_alive_error(self) -> RunLockedError:
        holders = lock_holders(self.ranks_path)
        ranks = set(live_rank_pids(self.path.parent))
        if holders:
            which = "; ".join(
                f"pid {pid}: {'a rank' if pid in ranks else 'started by a rank'} ({cmd})" for pid, cmd in holders[:4]
            ) + (f"; {len(holders) - 4} more" if len(holders) > 4 else "")
            pids = " ".join(str(pid) for pid, _ in holders)
            fix = f"stop them (kill {pids}; kill -9 {pids} if they ignore SIGTERM)"
        elif ranks:
            pids = " ".join(map(str, sorted(ranks)))
            which, fix = f"pids {', '.join(map(str, sorted(ranks)))}", f"stop them (kill {pids})"
        else:  # on another node (shared storage), or another user's: invisible from here
            which = "not visible from this host: on another node, or another user's"
            fix = f"find and stop them (fuser -v {self.ranks_path} on each node)"
        return RunLockedError(
            f"{self.path.parent}: processes of an earlier segment still hold {RANKS_LOCK_NAME} ({which}) "
            f"{self.ranks_wait_s:g} s after their launcher went; {fix} and retry"
        )

    def release(self) -> None:
        if self._fd is not None:
            release_recorded(self._fd)
            self._fd = None

    def is_locked(self) -> bool:
        """True if some other process holds the lock now, or ranks of a segment are still alive.

        A probe never makes a writer fail: flock has no test, so the probe takes a shared flock for a moment;
        ``acquire`` finds it held with an empty lock file (a holder writes who it is at once) and waits it out,
        and the ranks poll for theirs."""
        return is_held(self.path, LOCK_SH) or is_held(self.ranks_path, LOCK_EX)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_ranks_lock(run_dir: str | Path, wait_s: float = 30.0) -> int | None:
    """Rank side: a shared flock on ``RUN_DIR/.lock.ranks`` for the life of this process, and this pid
    appended to it. Returns the fd (never closed: the kernel drops the lock when the process dies), or
    None when the run directory does not exist (the segment reports that error itself).

    The rank opens the file itself (close-on-exec, not inherited from torchrun), so only processes of
    the segment hold it. Raises RunLockedError if it is held exclusively for longer than ``wait_s``
    (a launcher checking for ranks holds it for a moment only)."""
    root = Path(run_dir)
    if not root.is_dir():
        return None
    fd = open_lock(root / RANKS_LOCK_NAME, append=True)
    try:
        if not flock_within(fd, LOCK_SH, wait_s):
            raise RunLockedError(
                f"{root / RANKS_LOCK_NAME}: held exclusively for {wait_s:g} s; "
                "another launcher is checking this run directory, retry"
            )
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd
