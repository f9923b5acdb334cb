"""The memory tier: checkpoints in host shared memory (a tmpfs such as /dev/shm) that outlive the rank processes.

A memory snapshot is a checkpoint like any other: the same DCP files, written by the same hashing writer into
``MEMORY_DIR/checkpoints/step-XXXXXXXX.partial/`` and committed by the same protocol (manifest with checksums
and fingerprint, atomic rename). Only its place differs, so every reader that validates a storage checkpoint
validates a snapshot the same way. A run has a random id (``RUN_DIR/.run-id``, made at its first segment):
``MEMORY_DIR/tier.json`` names the run a memory dir belongs to (its run directory and that id), and every
snapshot's manifest carries the id of the run that wrote it. Another run's snapshots -- a deleted run's at the same
path, or one copied into this run's memory dir -- are never loaded nor persisted. A live run's rank 0 holds
``MEMORY_DIR/tier.lock``. ``RUN_DIR/.memory-dirs`` lists the memory dirs the run's segments claimed, so that a
segment with the memory tier off, or with another memory dir, still finds their snapshots.

What this module holds (no torch needed): where a run's memory tier lives, whose it is, its retention (the
newest ``KEEP`` snapshots) and the preflight's checks (capacity; never a run directory). Persisting a snapshot to
storage is ``ckpt.memtier.persist``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from ckpt.commit.fsutil import (
    INVALID_MARK,
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    mkdir_durable,
    read_regular,
    rename_noreplace,
)
from ckpt.commit.layout import STAGE_SUFFIX, RunDir, parse_step, step_dir_name
from ckpt.guards.flock import LOCK_EX, FileLock, FlockRefused
from ckpt.memtier.nodes import NODES_DIR, node_dirs, node_root
from ckpt.validate.retention import plan_retention, remove_checkpoint_dir
from schemas import CheckpointManifest, RunSpec
from schemas.errors import CheckpointError, ConfigError, RunDirError

log = logging.getLogger(__name__)

KEEP = 2  # snapshots kept in memory: the newest, and the one before it while the next is written
SNAPSHOTS_AT_ONCE = KEEP + 1  # the capacity check: the two kept, and a third being written
OVERHEAD = 1.3  # a snapshot over its fp32 master + AdamW bytes: RNG, extras, DCP metadata, manifest
OWNER_NAME = "tier.json"
DEFAULT_ROOT = Path("/dev/shm/shardkeeper")
MEMORY = "memory"
STORAGE = "storage"


def default_dir_name(spec: RunSpec, run_dir: RunDir) -> str:
    """The run's name and a hash of its run directory: two runs never share a default memory dir."""
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name)[:64]
    return f"{name}-{hashlib.sha256(str(run_dir.root).encode()).hexdigest()[:12]}"


def memory_root(spec: RunSpec, run_dir: RunDir, node: str | None = None) -> Path | None:
    """Where the run's memory tier lives; None when checkpoint.memory_interval is off. ``node``: the memory dir of
    that node of a run on several nodes (``ckpt.memtier.nodes``)."""
    pol = spec.checkpoint
    if pol.memory_interval is None:
        return None
    root = Path(pol.memory_dir).absolute() if pol.memory_dir else DEFAULT_ROOT / default_dir_name(spec, run_dir)
    return node_root(root, node) if node else root


def memory_run_dir(spec: RunSpec, run_dir: RunDir, node: str | None = None) -> RunDir | None:
    root = memory_root(spec, run_dir, node)
    return RunDir(root) if root is not None else None


def memory_of(run_dir: RunDir) -> RunDir | None:
    """The memory tier of a run directory, from its run.yaml (None when off, or when run.yaml is unreadable)."""
    from ckpt.commit.fsutil import load_yaml

    try:
        spec = RunSpec.model_validate(load_yaml(run_dir.spec_path.read_text()))
    except Exception:  # noqa: BLE001 - a reader (status, dashboard) shows storage then
        return None
    return memory_run_dir(spec, run_dir)


def memory_dirs(mem: RunDir | None) -> list[RunDir]:
    """The memory tier's dir and the node dirs under it visible on this host (a run on several nodes)."""
    return [] if mem is None else [mem, *(RunDir(p) for p in node_dirs(mem.root))]


def owned_memory_dirs(run_dir: RunDir) -> list[RunDir]:
    """A reader's view (status, dashboard): the memory dirs on this host that hold this run's snapshots."""
    return [m for m in memory_dirs(memory_of(run_dir)) if m.checkpoints.is_dir() and not owner_problem(m, run_dir)]


def newest_valid_snapshot(run_dir: RunDir) -> tuple[Path, CheckpointManifest] | None:
    """The run's newest snapshot in memory that passes quick validation and was written by this run (a node's
    copy counts when it holds every file)."""
    from ckpt.validate.checks import checked_manifest

    best = None
    for mem in owned_memory_dirs(run_dir):
        for path in reversed(mem.committed()):
            if best is not None and (parse_step(path.name) or 0) <= best[1].step:
                break
            try:
                manifest = checked_manifest(path)
            except Exception:  # noqa: BLE001 - invalid or retired meanwhile: the next older one
                continue
            if written_by_other_run(manifest, run_dir) is None:
                best = (path, manifest)
                break
    return best


def snapshot_event_id(step: int) -> str:
    """The lineage id of a memory snapshot (a storage checkpoint of the same step is ``checkpoint:step-...``)."""
    return f"checkpoint:step-{step:08d}@memory"


# ----------------------------------------------------------------------------------------------- ownership
ID_NAME = ".run-id"  # in the run directory: the run's identity (a new run at the same path has another)
LEGACY_ID_NAME = ".memory-tier-id"  # where earlier versions kept it (written at the run's first snapshot): still read
DIRS_NAME = ".memory-dirs"  # in the run directory: the memory dirs its segments claimed, one absolute path a line
LOCK_NAME = "tier.lock"  # in the memory dir: flock held by the writing segment's rank 0 for its life


def identity(run_dir: RunDir, *, create: bool = False) -> str | None:
    """The run's identity: a random id (a uuid, not the run's name) kept in ``RUN_DIR/.run-id``, made by the
    train stage at the run's first segment (an older run's next segment makes one; one that had a memory tier
    keeps the id earlier versions wrote at its first snapshot). None when it has none and ``create`` is False (a
    new run, even at the path of a deleted one). Two processes creating it at once agree on one id."""
    for name in (ID_NAME, LEGACY_ID_NAME):
        found = _read_id(run_dir.root / name)
        if found:
            return found
    if not create:
        return None
    path = run_dir.root / ID_NAME
    tmp = path.with_name(f"{ID_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    atomic_write_text(tmp, uuid.uuid4().hex + "\n")
    try:
        rename_noreplace(tmp, path)  # the first creator's id wins
        fsync_dir(path.parent)
    except FileExistsError:
        tmp.unlink(missing_ok=True)
    found = _read_id(path)
    if not found:
        raise RunDirError(
            f"{path}: empty; the run's id is lost, remove the file (the run gets a new one; its memory "
            "snapshots of before are then not used)"
        )
    return found


_ID_BYTES = 4096  # an id is 33 bytes; the file is never read further


def _read_id(path: Path) -> str:
    """The id in ``path``, "" when there is none. A file that cannot be one -- not a regular file (a fifo is never
    waited on), too large, not text, more than one word -- is refused in one line naming it and the fix."""
    try:
        raw = read_regular(path, _ID_BYTES, "a run id")
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except (CheckpointError, OSError) as e:
        why = str(e).removeprefix(f"{path}: ").split(";")[0] if isinstance(e, CheckpointError) else e.strerror or e
        raise RunDirError(
            f"{path}: not readable as a run id ({why}); the run's id is lost, remove the file (the run "
            "gets a new one; its memory snapshots of before are then not used)"
        ) from None
    try:
        found = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        found = None
    if found is None or len(found.split()) > 1 or not found.isprintable():
        raise RunDirError(
            f"{path}: not a run id (a line of letters and digits); the run's id is lost, remove the "
            "file (the run gets a new one; its memory snapshots of before are then not used)"
        )
    return found


def written_by_other_run(manifest: CheckpointManifest, run_dir: RunDir) -> str | None:
    """None when a snapshot's manifest may be this run's; else why not, in words. A snapshot without a run id
    (written before snapshots carried one) is this run's when its memory dir is (tier.json, checked apart)."""
    if manifest.run_id is None:
        return None
    mine = identity(run_dir)
    if manifest.run_id == mine:
        return None
    return f"written by another run (run id {manifest.run_id}; this run's is {mine or 'not made yet'})"


def set_aside(path: Path) -> Path:
    """Rename a snapshot that must never be used to ``NAME.invalid-<unix time>`` (as ``ckpt.commit.fsutil.quarantine``,
    without its log line: the caller says one); retention removes it once the run is past its step."""
    import time

    stamp = int(time.time())
    while True:
        aside = path.with_name(f"{path.name}{INVALID_MARK}{stamp}")
        try:
            rename_noreplace(path, aside)
        except FileExistsError:
            stamp += 1
            continue
        fsync_dir(path.parent)
        return aside


def tier_root(mem: RunDir) -> Path:
    """The memory tier's root of a memory dir (a node's dir lies under it, in ``nodes/``)."""
    return mem.root.parent.parent if mem.root.parent.name == NODES_DIR else mem.root


def remember(run_dir: RunDir, root: Path) -> None:
    """Add a memory tier's root to the run's list (``RUN_DIR/.memory-dirs``) unless it is there."""
    if root in recorded_roots(run_dir):
        return
    with open(run_dir.root / DIRS_NAME, "a", encoding="utf-8") as f:  # one short line: appended whole
        f.write(f"{root}\n")
        f.flush()
        os.fsync(f.fileno())


def recorded_roots(run_dir: RunDir) -> list[Path]:
    """The memory tier roots the run's segments claimed (absolute paths only; in order, once each)."""
    try:
        lines = (run_dir.root / DIRS_NAME).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(Path(ln) for ln in lines if ln.startswith("/")))


def forget(run_dir: RunDir, root: Path) -> None:
    """Drop a reclaimed memory tier's root from the run's list."""
    kept = [p for p in recorded_roots(run_dir) if p != root]
    atomic_write_text(run_dir.root / DIRS_NAME, "".join(f"{p}\n" for p in kept))


def owner_problem(mem: RunDir, run_dir: RunDir) -> str | None:
    """None when the memory dir's snapshots are this run's (tier.json's id is the run directory's id, not only
    its path: a new run at the path of a deleted one is another run); else one line naming whose they are."""
    path = mem.root / OWNER_NAME
    try:
        owner = read_owner(mem.root)
    except FileNotFoundError:
        return f"{path}: missing; the snapshots there belong to no known run"
    except (OSError, ValueError) as e:
        return f"{path}: unreadable ({e})"
    mine = identity(run_dir)
    if owner.get("run_dir") != str(run_dir.root) or not mine or owner.get("id") != mine:
        whose = owner.get("run_dir")
        if whose == str(run_dir.root):
            return (
                f"{mem.root} holds snapshots of an earlier run at {whose} (its id {owner.get('id')!r} is not "
                f"this run's {mine!r} in {run_dir.root / ID_NAME})"
            )
        return f"{mem.root} holds snapshots of the run in {whose!r}, not of {run_dir.root}"
    return None


_OWNER_BYTES = 1 << 16  # tier.json holds a path and an id


def read_owner(root: Path) -> dict:
    """A memory dir's tier.json: the JSON object naming its run. FileNotFoundError when there is none; ValueError
    when it is no such object -- a fifo, directory or device there is never waited on, nor a larger file read."""
    path = root / OWNER_NAME
    try:
        raw = read_regular(path, _OWNER_BYTES, "a memory tier's tier.json")
    except CheckpointError as e:
        raise ValueError(str(e).removeprefix(f"{path}: ").split(";")[0]) from None
    owner = json.loads(raw)
    if not isinstance(owner, dict):
        raise ValueError(f"a JSON {type(owner).__name__}, not the object naming the run")
    return owner


class TierLock:
    """The flock on ``MEMORY_DIR/tier.lock`` that the writing segment's rank 0 holds for its life: a second
    run never claims a memory dir a live run writes into."""

    def __init__(self, mem: RunDir) -> None:
        self.path = mem.root / LOCK_NAME
        self._lock = FileLock(self.path)

    @property
    def fd(self) -> int | None:
        """The lock file's descriptor while this object holds the lock, else None."""
        return self._lock.fd

    def acquire(self) -> bool:
        """Take the lock without waiting. Returns False when another process holds it, or the file system refuses
        the flock (the memory dir is then treated as in use: nothing claimed, nothing removed). Raises OSError when
        the lock file cannot be opened."""
        try:
            return self._lock.acquire(LOCK_EX, 0.0)
        except FlockRefused:
            return False

    def release(self) -> None:
        self._lock.release()


def _foreign_entries(root: Path) -> list[str]:
    """What a memory dir without our tier.json holds besides what a claim itself creates (empty)."""
    out = []
    for p in sorted(root.iterdir()):
        if (
            p.name == LOCK_NAME
            or (p.name == NODES_DIR and p.is_dir())
            or (  # node dirs: tiers of their own
                p.name == "checkpoints" and p.is_dir() and not any(p.iterdir())
            )
        ):
            continue
        out.append(p.name)
    return out


def claim(mem: RunDir, run_dir: RunDir, lock: TierLock) -> str | None:
    """Before the first snapshot (rank 0): make the memory dir this run's and hold its lock. Returns None, or
    one line why the memory tier is not used (nothing deleted, nothing written there): a non-empty directory
    that is not a memory tier (no tier.json), or one a live run holds, or one holding the only copy of a step of the
    run that owns it (its storage has nothing as new). Any other run's snapshots in a memory tier dir (tier.json
    present, lock free) are removed: they could never be loaded into this run."""
    root = mem.root
    where = f"checkpoint.memory_dir {root}"
    if root.exists() and not root.is_dir():
        return f"{where}: not a directory; the memory tier is off"
    if root.is_dir() and not (root / OWNER_NAME).exists():
        foreign = _foreign_entries(root)
        if foreign:
            return (
                f"{where}: not empty and not a memory tier (no {OWNER_NAME}; holds {', '.join(foreign[:3])}); "
                "nothing there is touched, the memory tier is off: set checkpoint.memory_dir to an empty or new "
                "directory"
            )
    mkdir_durable(root)
    if lock.fd is None and not lock.acquire():
        return (
            f"{where}: in use by another live run (it holds {root / LOCK_NAME}); the memory tier is off for "
            "this segment: give each run its own checkpoint.memory_dir"
        )
    mine = identity(run_dir, create=True)
    problem = owner_problem(mem, run_dir)
    if problem is None:
        mkdir_durable(mem.checkpoints)
        _remember_claimed(run_dir, mem)
        return None
    unsaved = _only_copy(mem)
    if unsaved is not None:
        lock.release()
        return (
            f"{where}: {problem}, and its {unsaved}; nothing there is touched, the memory tier is off: resume "
            "that run once (it persists the snapshot) or give each run its own checkpoint.memory_dir"
        )
    if (root / OWNER_NAME).exists():
        log.warning("%s; removing them: this run's snapshots go there now", problem)
        if mem.checkpoints.is_dir():
            for p in mem.checkpoints.iterdir():
                shutil.rmtree(p, ignore_errors=True)
    mkdir_durable(mem.checkpoints)
    atomic_write_json(root / OWNER_NAME, {"run_dir": str(run_dir.root), "id": mine})
    _remember_claimed(run_dir, mem)
    return None


def _remember_claimed(run_dir: RunDir, mem: RunDir) -> None:
    try:
        remember(run_dir, tier_root(mem))
    except OSError as e:  # the list only helps a later segment find this dir; the snapshots do not need it
        log.debug("%s: not recorded in %s: %s", mem.root, run_dir.root / DIRS_NAME, e)


def _only_copy(mem: RunDir) -> str | None:
    """What of the owning run's state only this memory dir holds: its newest snapshot when that run (the run
    directory tier.json names, with the same identity) still exists and its storage has no checkpoint as new (a
    segment killed before the launcher could persist it). None when the owner is gone or its storage is as new."""
    try:
        owner = read_owner(mem.root)
        whose = RunDir.at(owner["run_dir"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    try:
        if not owner.get("id") or identity(whose) != owner.get("id"):
            return None
    except RunDirError:  # the owner's own id is unreadable: it cannot claim this dir back either
        return None
    snaps = [parse_step(p.name) or 0 for p in mem.committed()]
    stored = [parse_step(p.name) or 0 for p in whose.committed()]
    if not snaps or max(snaps) <= max(stored, default=-1):
        return None
    return f"snapshot {step_dir_name(max(snaps))} is newer than any checkpoint in {whose.checkpoints} (its only copy)"


def still_owner(mem: RunDir, run_dir: RunDir) -> str | None:
    """Right before a snapshot's commit (rank 0): None while tier.json still names this run; else one line."""
    problem = owner_problem(mem, run_dir)
    return (
        (
            f"memory tier lost: {problem}; the snapshot is not committed and the memory tier is off for the rest "
            "of this segment (storage checkpoints continue)"
        )
        if problem
        else None
    )


def retain(mem: RunDir, keep: int = KEEP) -> list[Path]:
    """Keep the newest ``keep`` committed snapshots; remove older ones, and every leftover (partial, set aside,
    half-deleted) older than the newest snapshot.

    Which snapshots go is storage retention's rule (``ckpt.validate.retention.plan_retention``, every snapshot
    counted valid: validating one would re-read memory), and each goes the way a storage checkpoint does
    (``remove_checkpoint_dir``: renamed to ``.deleting`` first). One that cannot be removed now (a reader holds it)
    is logged and retried at the next snapshot.

    Args:
        mem: the memory dir.
        keep: how many of the newest committed snapshots stay; 0 removes them all.

    Returns:
        What was to be removed (the snapshots, then the leftovers).

    Raises:
        ValueError: ``keep`` is negative.
    """
    committed = mem.committed()
    steps = [parse_step(p.name) or 0 for p in committed]
    newest = max(steps, default=None)
    drop = set(steps) if keep == 0 else plan_retention(steps, set(steps), keep_last=keep, keep_every=None)
    doomed = [p for p, step in zip(committed, steps, strict=True) if step in drop]
    if newest is not None:
        for p in mem.checkpoints.iterdir():
            base = p.name.split(".", 1)[0]
            step = parse_step(base)
            # not the stage dir: it may hold the next snapshot's files, mapped (ckpt.memtier.stage); a stale one
            # goes with the next recycle or stage
            if p.name != base and step is not None and step < newest and not p.name.endswith(STAGE_SUFFIX):
                doomed.append(p)
    for p in doomed:
        try:
            remove_checkpoint_dir(p)
        except OSError as e:  # a reader may hold it: retried at the next snapshot
            log.debug("memory retention: %s stays for now: %s", p.name, e)
    return doomed


def in_memory_tier(ckpt_dir: Path) -> bool:
    """Whether a checkpoint directory is a memory snapshot (its ``checkpoints/`` lies in a memory dir
    with tier.json)."""
    return ckpt_dir.parent.name == "checkpoints" and (ckpt_dir.parent.parent / OWNER_NAME).is_file()


# ----------------------------------------------------------------------------------------------- capacity
def check_memory_tier(
    spec: RunSpec, run_dir: RunDir, *, state_bytes: float | None, ranks_on_node: int, here: bool = True
) -> None:
    """Preflight of checkpoint.memory_interval (one line each, nothing written): the fsdp2 backend only; the
    memory dir is, contains and lies inside no run directory; it (or its nearest existing parent) is a writable
    directory; three snapshots (x1.3 overhead) of every rank on the node (``state_bytes`` each: what one rank's
    checkpoint holds) fit its free space. ``here``: the ranks run on this host (else only the backend, and that the
    memory dir is an absolute path)."""
    root = memory_root(spec, run_dir)
    if root is None:
        return
    where = "checkpoint.memory_dir" if spec.checkpoint.memory_dir else f"checkpoint.memory_dir (default {root})"
    if spec.backend != "fsdp2":
        raise ConfigError(
            f"checkpoint.memory_interval: the memory tier checkpoints the fsdp2 backend only (this run is "
            f"{spec.backend}); remove checkpoint.memory_interval or use backend: fsdp2"
        )
    if spec.checkpoint.memory_dir and not spec.checkpoint.memory_dir.startswith("/"):
        # refused here, for a new segment, not by the schema: manifests and run.yaml files already written with one
        # still parse
        raise ConfigError(
            f"checkpoint.memory_dir {spec.checkpoint.memory_dir!r}: a relative path (each rank would "
            "resolve it against its own working directory, most likely on a disk); write an absolute "
            "path on a tmpfs, e.g. /dev/shm/my-run, or leave it out for the default"
        )
    if not here:
        return
    if not spec.checkpoint.memory_dir and not DEFAULT_ROOT.parent.is_dir():
        raise ConfigError(
            f"{where}: {DEFAULT_ROOT.parent} is missing, the memory tier has nowhere to write; mount a "
            "tmpfs there (docker: --shm-size), set checkpoint.memory_dir to a tmpfs directory, or remove "
            "checkpoint.memory_interval"
        )
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("/"))
    inside = _run_dir_near(root, Path(run_dir.root).absolute())
    if inside:
        raise ConfigError(
            f"{where}: {root} {inside}; the memory tier empties its directory and would take that run's "
            "checkpoints: set checkpoint.memory_dir to a directory of its own (e.g. under /dev/shm)"
        )
    if not probe.is_dir():
        raise ConfigError(
            f"{where}: {probe} is not a directory; set checkpoint.memory_dir to a directory on a tmpfs "
            "(e.g. under /dev/shm)"
        )
    if not os.access(probe, os.W_OK | os.X_OK) or _read_only(probe):
        raise ConfigError(
            f"{where}: {probe} is missing or read-only, the memory tier cannot write there; mount a "
            "writable /dev/shm (docker: --shm-size), set checkpoint.memory_dir to a writable tmpfs "
            "directory, or remove checkpoint.memory_interval"
        )
    if state_bytes is None:
        return
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    held = _held_bytes(root)  # this run's own snapshots are replaced, their room counts as free
    need = SNAPSHOTS_AT_ONCE * OVERHEAD * ranks_on_node * state_bytes
    if need > free + held:
        gib = 1 << 30
        raise ConfigError(
            f"{where}: three memory snapshots (two kept, one being written) of {ranks_on_node} rank(s) "
            f"need ~{need / gib:.2f} GiB, but {probe} has "
            f"{(free + held) / gib:.2f} GiB free; enlarge it "
            f"(docker/podman: --shm-size={max(1, int(need * 1.25 / gib) + 1)}g; "
            "Kubernetes: an emptyDir with medium Memory), set checkpoint.memory_dir to a larger tmpfs, or remove "
            "checkpoint.memory_interval"
        )


def _is_run_dir(path: Path) -> bool:
    """A run directory: run.yaml, or committed checkpoints without a memory tier's tier.json."""
    try:
        if (path / "run.yaml").exists():
            return True
        ckpts = path / "checkpoints"
        return (
            ckpts.is_dir()
            and not (path / OWNER_NAME).exists()
            and any(parse_step(p.name.split(".", 1)[0]) is not None for p in ckpts.iterdir())
        )
    except OSError:
        return False


def _run_dir_near(root: Path, run_dir: Path) -> str | None:
    """How ``root`` (a memory dir) meets a run directory: is it, lies inside it, or contains one (two levels
    down); None when it does not. This run's own run directory counts, existing or not."""
    if root == run_dir or run_dir in root.parents:
        return f"is or lies inside this run's --run-dir {run_dir}"
    if root in run_dir.parents:
        return f"contains this run's --run-dir {run_dir}"
    for p in (root, *root.parents):
        if _is_run_dir(p):
            return f"is or lies inside the run directory {p}"
    if root.is_dir():
        level = [root]
        for _ in range(2):
            level = [c for d in level for c in _children(d)]
            hit = next((c for c in level if _is_run_dir(c)), None)
            if hit is not None:
                return f"contains the run directory {hit}"
    return None


def _children(d: Path) -> list[Path]:
    try:
        return [c for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
    except OSError:
        return []


def _read_only(path: Path) -> bool:
    """Whether ``path`` lies on a read-only mount (which os.access does not see for root); writes nothing."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return True


def _held_bytes(root: Path) -> int:
    total = 0
    if root.is_dir():
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
    return total
