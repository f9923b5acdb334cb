"""Durable file-system steps of the commit protocol: fsync files and directories, atomic writes."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from schemas.errors import CheckpointError

log = logging.getLogger(__name__)

INVALID_MARK = ".invalid-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_durable(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents), fsyncing each parent whose entry it created, so the directory
    survives a crash as soon as this returns."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)
    return path


def quarantine(path: str | os.PathLike[str], why: str = "") -> Path:
    """Move an invalid checkpoint directory aside to ``NAME.invalid-<unix time>`` (never loaded, never
    pruned by retention, swept later keeping the newest few for inspection); fsync the parent.
    The one way a checkpoint is set aside: a failed load, a restart, a commit over an invalid one."""
    path = Path(path)
    stamp = int(time.time())
    aside = path.with_name(f"{path.name}{INVALID_MARK}{stamp}")
    while aside.exists():  # two in the same second
        stamp += 1
        aside = path.with_name(f"{path.name}{INVALID_MARK}{stamp}")
    os.rename(path, aside)
    fsync_dir(path.parent)
    log.warning("moved %s aside to %s%s", path.name, aside.name, f" ({why})" if why else "")
    return aside


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


def rename_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` to ``dst`` in one step that never replaces anything: FileExistsError when ``dst`` exists.
    Linux ``renameat2(RENAME_NOREPLACE)``; where that is missing or the file system refuses the flag, a check
    then a rename (callers that race each other hold a lock around it)."""
    import ctypes
    import errno

    fn = getattr(_libc(), "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


@functools.cache
def _libc():  # type: ignore[no-untyped-def]
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync, rename, fsync of the parent. On a failure (a full
    disk, say) the temporary file is removed and the OSError names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def append_jsonl(path: str | os.PathLike[str], obj: Any) -> None:
    """Append one JSON line; a crash mid-write leaves at most one torn last line, which readers skip."""
    line = json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            rec = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # a torn last line from a crash, or bytes that are no JSON record: not an event
        if isinstance(rec, dict):
            out.append(rec)
    return out


class DuplicateKeyError(ValueError):
    """A YAML mapping gives one key twice (PyYAML would silently keep the last value): ``line`` is 1-based,
    ``key`` dotted from the top of the document (``optim.lr``)."""

    def __init__(self, key: str, line: int):
        self.key, self.line = key, line
        super().__init__(f"line {line}: key {key} given twice; keep one")


@functools.cache
def _yaml_loader():  # type: ignore[no-untyped-def]
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader with YAML 1.2 scalars where 1.1 surprises a person: 1e-5 is a float (1.1 reads a string), and
        only true/false are booleans (1.1 also reads yes/no/on/off as booleans, so ``async_save: yes`` or a name
        ``no`` would change type silently; under 1.2 they are strings, which a boolean field refuses by name)."""

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(_BOOL_12), list("tTfF"))
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(_FLOAT_12),
        list("-+0123456789"),
    )
    return Loader


_FLOAT_12 = r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"
_BOOL_12 = r"^(?:true|True|TRUE|false|False|FALSE)$"


def _check_duplicate_keys(node: Any, path: tuple[str, ...], seen: set[int]) -> None:
    """Raise DuplicateKeyError for the first mapping (depth first, in document order) that repeats a key."""
    import yaml

    if id(node) in seen:  # an alias: its node was checked where the anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[tuple[str, str]] = set()
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; repeats of it are YAML's own
                    continue
                ident = (key_node.tag, key_node.value)
                if ident in keys:
                    raise DuplicateKeyError(".".join((*path, key_node.value)), key_node.start_mark.line + 1)
                keys.add(ident)
                _check_duplicate_keys(value_node, (*path, key_node.value), seen)
            else:
                _check_duplicate_keys(value_node, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, (*path[:-1], f"{path[-1]}[{i}]") if path else (f"[{i}]",), seen)


def load_yaml(text: str) -> Any:
    """One YAML document with the loader above; a mapping that repeats a key raises DuplicateKeyError (a
    ValueError) instead of keeping the last value, so ``optim.lr`` written twice is never half-applied."""
    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, (), set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def dump_yaml(data: Any) -> str:
    """YAML that ``load_yaml`` reads back as ``data``: a string such as "1e-2" (a script argument) is quoted, since
    load_yaml's YAML 1.2 rule would read it as a float."""
    import re

    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT_12), list("-+0123456789"))
    return yaml.dump(data, Dumper=Dumper, sort_keys=False)


def pid_alive(pid: int) -> bool:
    """True while a process with this pid exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def peak_rss_bytes() -> int:
    """This process image's peak resident memory (VmHWM). Not ``getrusage().ru_maxrss``: across fork + exec
    that keeps the parent's high-water mark, so a small process started by a large one reports the large one."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pread_full(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``fd`` at ``offset`` (pread: the descriptor's position is left alone); False if the file
    ended first. Callers say what a short file means in their own words."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    return (
        "directory"
        if stat.S_ISDIR(mode)
        else "fifo"
        if stat.S_ISFIFO(mode)
        else "socket"
        if stat.S_ISSOCK(mode)
        else "device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "special file"
    )


def not_regular(path: str | os.PathLike[str], mode: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: a {file_kind(mode)}, not a regular file; a checkpoint holds only regular files, "
        "replace it with the real file"
    )


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path`` (symlinks followed). The open never blocks: a fifo,
    socket, device or directory there is refused in one line instead of holding the reader until something writes
    into it. FileNotFoundError propagates (callers say what a missing file means)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at ``path`` (``open_regular``), refused in one line when it is larger than
    ``max_bytes`` (``what`` says what the file should hold): never read whole just because it is there."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise CheckpointError(
                f"{path}: {size} bytes, more than {what} can be ({max_bytes} bytes at most); "
                "the file is corrupted or crafted, replace it"
            )
        pieces, done = [], 0
        while done <= max_bytes:  # a file that grows while it is read is still read no further than the cap
            piece = os.read(fd, min(1 << 30, max_bytes + 1 - done))
            if not piece:
                break
            pieces.append(piece)
            done += len(piece)
        if done > max_bytes:
            raise CheckpointError(
                f"{path}: grew past {max_bytes} bytes while being read; something writes into it, retry once it is done"
            )
        return b"".join(pieces)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite: the descriptor's position is left alone), continuing a short
    write (a nearly full tmpfs); a write of nothing is disk full (ENOSPC)."""
    view, done = memoryview(data), 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        done += n


FileIdentity = tuple[int, int, int, int, int]


def file_identity(st: os.stat_result) -> FileIdentity:
    """(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): a write, a truncation, a chmod or a utime changes it
    (ctime moves even when mtime is set back), and so does a rename; a file replaced by another has another inode."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
