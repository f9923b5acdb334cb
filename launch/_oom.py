"""Was a rank that died of SIGKILL killed by the kernel's OOM killer? Only the kernel can say, and only where this
process may read what it says:

- the kernel log (``/dev/kmsg``: root or CAP_SYSLOG, or ``kernel.dmesg_restrict=0``): the OOM killer logs
  "Out of memory: Killed process PID (comm)" ("Memory cgroup out of memory: ..." inside a limited cgroup) for
  every process it kills. A record naming the rank's pid is proof. (In a container, the log's pids are the
  host's: a record at the moment the rank died, for a process of the same name, is named as likely.)
- the memory cgroup the rank ran in: its ``oom_kill`` counter (cgroup v2 ``memory.events``, hierarchical; v1
  ``memory.oom_control``, that cgroup only), read when the launcher first saw the rank and again after it died.
  An increase says the OOM killer acted there during the segment: likely, not proof (another process of the
  cgroup may have been its victim).

Neither readable: the line says that it cannot tell. Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

KMSG = "/dev/kmsg"
MAX_KMSG_RECORDS = 200_000  # the ring buffer holds far fewer; a bound on a device that never ends
_KILLED_RE = re.compile(r"(?:Out of memory|Memory cgroup out of memory)[^:]*: Killed process (\d+) \(([^)]*)\)")
_WINDOW_S = 2.0  # a log record this close to the rank's death, for a process of its name, is likely it


@dataclass(frozen=True)
class MemoryCounter:
    """The ``oom_kill`` counter of a process's memory cgroup, as read when the launcher first saw the process."""

    path: str  # the file holding it
    before: int


@dataclass(frozen=True)
class OomKill:
    at: float  # seconds since boot (the kernel's clock: CLOCK_MONOTONIC here)
    pid: int
    comm: str
    text: str


def _mounts() -> tuple[str | None, str | None]:
    """Where the cgroup v2 hierarchy and the v1 memory hierarchy are mounted (None: not mounted)."""
    v2 = v1 = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "/sys/fs/cgroup", "/sys/fs/cgroup/memory"
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or not kind:
            continue
        if kind[0] == "cgroup2" and v2 is None:
            v2 = fields[4]
        elif kind[0] == "cgroup" and len(kind) >= 3 and "memory" in kind[2].split(",") and v1 is None:
            v1 = fields[4]
    return v2, v1


def _read_counter(path: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def memory_counter(pid: int) -> MemoryCounter | None:
    """The ``oom_kill`` counter of ``pid``'s memory cgroup now (None: no readable memory cgroup)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v2, v1 = _mounts()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and v2:
            file = os.path.join(v2, path.lstrip("/"), "memory.events")
        elif "memory" in controllers.split(",") and v1:
            file = os.path.join(v1, path.lstrip("/"), "memory.oom_control")
        else:
            continue
        count = _read_counter(file)
        if count is not None:
            return MemoryCounter(file, count)
    return None


def kernel_oom_kills(since: float) -> list[OomKill] | None:
    """The OOM killer's kills the kernel log records from ``since`` (seconds since boot) on; None when the kernel
    log cannot be read here."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    found: list[OomKill] = []
    try:
        for _ in range(MAX_KMSG_RECORDS):
            try:
                record = os.read(fd, 8192).decode("utf-8", "replace")
            except BlockingIOError:
                break
            except OSError as e:  # EPIPE: the ring buffer overwrote the record being read; go on with the next
                if e.errno == 32:
                    continue
                return None if not found else found
            if not record:
                break
            head, _, text = record.partition(";")
            m = _KILLED_RE.search(text)
            if not m:
                continue
            try:
                at = int(head.split(",")[2]) / 1e6
            except (IndexError, ValueError):
                continue
            if at >= since:
                found.append(OomKill(at, int(m.group(1)), m.group(2), text.strip().split(" total-vm")[0]))
    finally:
        os.close(fd)
    return found


def sigkill_cause(
    pid: int, comm: str | None, ended_at: float | None, counter: MemoryCounter | None, since: float
) -> tuple[str, str | None]:
    """What the kernel says about ``pid``'s SIGKILL: ("yes" | "likely" | "", the evidence in a few words, or None
    when nothing could be read). ``ended_at`` and ``since`` on the monotonic clock (the kernel log's)."""
    kills = kernel_oom_kills(since - 5.0)
    if kills:
        exact = [k for k in kills if k.pid == pid]
        if exact:
            return "yes", f"kernel log: {exact[-1].text}"
        near = [
            k for k in kills if ended_at is not None and abs(k.at - ended_at) <= _WINDOW_S and comm and k.comm == comm
        ]
        if near:
            return "likely", (
                f"most likely by the kernel's OOM killer: at that moment the kernel log says "
                f'"{near[-1].text}" (another pid namespace\'s numbering)'
            )
    after = _read_counter(counter.path) if counter is not None else None
    if counter is not None and after is not None and after > counter.before:
        return "likely", (
            f"most likely by the kernel's OOM killer: its memory cgroup counted {after - counter.before} "
            f"OOM kill(s) during the segment ({counter.path})"
        )
    if kills is not None:
        return "", "not by the OOM killer: the kernel log names no OOM kill of it; a kill from outside"
    if after is not None:
        return "", (
            f"its memory cgroup counted no OOM kill ({counter.path}); the kernel log is not readable here to tell more"
        )
    return "", None
