"""Process primitives every launcher and every rank share (stdlib only): the kernel's parent-death
signal and child subreaper, /proc parent/start-time lookups, a launcher's wait (by pid) for what its torchrun
started, and its watch over the ranks (``RankWatch``: when each ended, and how).
A launcher ties torchrun to itself with ``pdeathsig_preexec``; a rank ties itself to torchrun with
``set_pdeathsig`` (trainer.lifetime)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
EXIT_ORPHANED = 1


def _prctl():  # noqa: ANN202 - a ctypes function or None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def set_child_subreaper() -> bool:
    """Make this process a child subreaper (Linux): its orphaned descendants are re-parented to it instead of to
    init. False where the platform has no prctl."""
    prctl = _prctl()
    return bool(prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits. False where the
    platform has no prctl (macOS, Windows): the watchdog is then the only guard."""
    prctl = _prctl()
    return bool(prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def pdeathsig_preexec(parent_pid: int):  # noqa: ANN201 - a preexec_fn for subprocess.Popen
    """A ``preexec_fn`` that ties the child to ``parent_pid`` (the launcher): PDEATHSIG=SIGKILL, then
    exit at once if the parent already died between fork and prctl. The prctl function is looked up
    here, before the fork, so the child only makes the one foreign call."""
    prctl = _prctl()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(EXIT_ORPHANED)

    return preexec


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid`` from /proc, or None (gone, or no /proc)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # after "pid (comm)": state ppid ... starttime is field 22
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), from /proc; [] when gone or without /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


class Descendants:
    """Every process started under one root (torchrun), by (pid, start time): recorded while the root lives, so
    that after it is gone the launcher can wait for each of them by pid, not by sleeping a fixed time."""

    def __init__(self, root: int):
        self.root = root
        self.seen: dict[int, int] = {}  # pid -> start time in clock ticks

    def scan(self) -> None:
        todo = children(self.root)
        while todo:
            pid = todo.pop()
            stat = proc_stat(pid)
            if stat is None or pid in self.seen:
                continue
            self.seen[pid] = stat[1]
            todo += children(pid)

    def live(self) -> list[int]:
        """Recorded processes still running (same pid and start time, not a zombie)."""
        return [pid for pid, start in self.seen.items() if running(pid, start)]


def _state(pid: int) -> bytes | None:
    """The one-letter state of ``pid`` from /proc (b"R", b"S", b"Z", ...), or None when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :][:1]


def why_silent(pid: int, looks: int = 3, apart_s: float = 0.05) -> str | None:
    """Why a live process asked for its stacks may not have answered, from its state in /proc, the same at ``looks``
    looks ``apart_s`` apart (a rank only passing through a slow fsync is not named): stopped, or in uninterruptible
    sleep; None otherwise (running or sleeping as usual, gone, unreadable, or changing)."""
    states = set()
    for k in range(looks):
        if k:
            time.sleep(apart_s)
        states.add(_state(pid))
    if len(states) != 1:
        return None
    return {
        b"T": "it was stopped (SIGSTOP, or a debugger attached)",
        b"t": "it was stopped (SIGSTOP, or a debugger attached)",
        b"D": "it stayed in uninterruptible sleep in the kernel (waiting on I/O or a kernel lock)",
    }.get(states.pop() or b"")


def is_zombie(pid: int) -> bool:
    """Exited, not reaped yet by its parent: gone, though kill(pid, 0) still finds it."""
    return _state(pid) in (b"Z", b"X")


def running(pid: int, start: int) -> bool:
    """``pid`` still runs as the process that started at ``start`` (clock ticks): not gone, not a zombie, not reused."""
    stat = proc_stat(pid)
    if stat is None or stat[1] != start:
        return False
    state = _state(pid)
    return state is not None and state not in (b"Z", b"X")


def reap_orphans(procs: Descendants, timeout_s: float = 60.0) -> list[int]:
    """After the root is gone: SIGKILL what it left (the kernel's PDEATHSIG has normally done so already) and
    block on each process's pidfd until it has exited. Returns the pids still running after ``timeout_s``
    (a process stuck in the kernel); [] in every ordinary case, however loaded the machine."""
    import select

    left = procs.live()
    fds: list[int] = []
    for pid in left:
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # gone already, or no pidfd (old kernel / not Linux): polled below
            fd = -1
        if fd >= 0 and not running(pid, procs.seen[pid]):  # the pid was reused between the check and the open
            os.close(fd)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if fd >= 0:
            fds.append(fd)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        pending = set(fds)
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(1, int(1000 * (deadline - time.monotonic())))):
                poller.unregister(fd)
                pending.discard(fd)
        while time.monotonic() < deadline and procs.live():  # without pidfds
            time.sleep(0.05)
    finally:
        for fd in fds:
            os.close(fd)
    return procs.live()


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode("utf-8", "replace").split("\0") if "=" in kv)


def _session(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        return int(raw[raw.rfind(b")") + 2 :].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def exit_status(pid: int, start: int) -> int | None:
    """The exit status of ``pid`` (started at ``start``) while it is a zombie, as waitpid would decode it (>= 0 an
    exit code, < 0 the signal), read from /proc (field 52 of stat); None once its parent has reaped it."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        if int(fields[19]) != start or fields[0] not in (b"Z", b"X"):
            return None
        status = int(fields[49])
    except (IndexError, ValueError):
        return None
    return status >> 8 if status & 0x7F == 0 else -(status & 0x7F)


@dataclass
class WatchedRank:
    """One rank process as the launcher saw it (``RankWatch``)."""

    pid: int
    start: int
    rank: int
    local_rank: int | None
    comm: str | None
    memory: object | None  # launch._oom.MemoryCounter read when first seen
    ended_at: float | None = None  # time.monotonic() when its pidfd turned readable
    status: int | None = None  # exit status read from the zombie (None: reaped before it could be read)
    generation: int = 0  # how often the agent had restarted the segment's ranks in place when it started this one
    notes: str | None = None  # its agent's notes folder (SHARDKEEPER_RANK_NOTES): where a forked rank's pid is told
    forked_pid: int | None = (
        None  # the rank's own process when this one is the fork server's client (trainer.forkserver)
    )

    @property
    def rank_pid(self) -> int:
        """The pid of the process that ran the rank's code (the kernel log names it)."""
        return self.forked_pid or self.pid


def _forked_pid(w: WatchedRank) -> int | None:
    """The rank's own pid when ``w`` is a fork server's client (it leaves it in its agent's notes folder)."""
    if not w.notes:
        return None
    try:
        raw = Path(w.notes, f"forked-{w.pid}").read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


class RankWatch:
    """The ranks of a segment as the launcher watches them: every rank process an agent (torchrun) started is
    found among its children (a process with torchrun's RANK in its environment that leads its own session, as
    torchrun starts them; what a rank forks later inherits RANK but not the session, or comes after its rank),
    and a thread waits on their pidfds: the moment each rank ends is known to the millisecond, and its exit
    status is read from the zombie before torchrun's next poll reaps it. Ranks an agent restarted in place are a
    new generation (torchrun's TORCHELASTIC_RESTART_COUNT in their environment). Linux only; elsewhere it sees
    nothing and the failure line comes from torchrun's output alone."""

    def __init__(self) -> None:
        self.ranks: dict[int, WatchedRank] = {}  # pid -> rank
        self._ranks_seen: set[tuple[int, int]] = set()  # (generation, rank)
        self._new: list[tuple[int, WatchedRank]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()

    def consider(self, agent: int) -> None:
        """Look for new ranks among the children of ``agent``."""
        from launch._oom import memory_counter

        for pid in children(agent):
            if pid in self.ranks:
                continue
            env = _environ(pid)
            rank = env.get("RANK", "")
            restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            generation = int(restarts) if restarts.isdigit() else 0
            if not rank.isdigit() or (generation, int(rank)) in self._ranks_seen or _session(pid) != pid:
                continue  # not a rank yet (between fork and exec), or something a rank left behind
            stat = proc_stat(pid)
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                continue
            if stat is None or not running(pid, stat[1]):
                os.close(fd)
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = None
            local = env.get("LOCAL_RANK", "")
            watched = WatchedRank(
                pid,
                stat[1],
                int(rank),
                int(local) if local.isdigit() else None,
                comm,
                memory_counter(pid),
                generation=generation,
                notes=env.get("SHARDKEEPER_RANK_NOTES"),
            )
            with self._lock:
                self._ranks_seen.add((generation, int(rank)))
                self.ranks[pid] = watched
                self._new.append((fd, watched))
            os.write(self._wake_w, b"+")

    def watched(self, generation: int | None = None) -> list[WatchedRank]:
        """The ranks seen so far (a copy: the scan adds to them from another thread); of one generation (None: the
        newest seen)."""
        with self._lock:
            ranks = list(self.ranks.values())
        if generation is None:
            generation = max((w.generation for w in ranks), default=0)
        return [w for w in ranks if w.generation == generation]

    def _run(self) -> None:
        import select

        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds: dict[int, WatchedRank] = {}
        try:
            while True:
                events = poller.poll()
                now = time.monotonic()
                closing = False
                for fd, _ in events:
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                        with self._lock:
                            for new_fd, watched in self._new:
                                fds[new_fd] = watched
                                poller.register(new_fd, select.POLLIN)
                            self._new.clear()
                            closing = self._closed
                        continue
                    watched = fds.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    watched.ended_at = now
                    watched.status = exit_status(watched.pid, watched.start)
                    watched.forked_pid = _forked_pid(watched)
                if closing:
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Stop watching (the segment's processes are gone); the ranks' records stay."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with self._lock:
            for fd, _ in self._new:
                os.close(fd)
            self._new.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
