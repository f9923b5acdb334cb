"""What the Checkpointer (``trainer.checkpointer.core``), its collaborators, its backends and the trainer share: the
counters a checkpoint holds (TrainState), what a backend's write hands the commit (Written), where the segment's
checkpoints stand (Progress), the background thread a save or re-read runs on, the code version every manifest
records, and the members of the Checkpointer each collaborator uses (SaverHost, ResumerHost, NodeTierHost)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ckpt import __version__
from schemas import BaseModelRecord, CheckpointManifest, DataRecord, FileEntry, Fingerprint, TensorEntry

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch
    import torch.distributed as dist

    from ckpt.commit.layout import RunDir

log = logging.getLogger("shardkeeper.checkpoint")


def _lower_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts, which inherit it) ``nice`` steps nicer. Linux
    only: there a thread id names one thread; elsewhere PRIO_PROCESS would renice the whole process."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # a sandbox refusing it costs speed, never the save
        log.debug("could not lower the background thread's priority: %s", e)


def background_pool(name: str, nice: int) -> ThreadPoolExecutor:
    """One background thread for checkpoint work, at a lower CPU priority than training (see
    CheckpointPolicy.background_nice)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,))


@dataclass
class TrainState:
    """Counters that, with the model/optimizer/RNG state, determine the continuation."""

    step: int = 0
    tokens: int = 0
    samples: int = 0


def code_version() -> str:
    sha = os.environ.get("SHARDKEEPER_GIT_SHA")
    return f"shardkeeper {__version__}" + (f" ({sha})" if sha else "")


@dataclass
class Written:
    """What a backend's ``write`` hands the commit."""

    entries: list[FileEntry]  # this rank's files: path, size, digest
    tensors: list[TensorEntry]  # the tensor inventory of the checkpoint (the same on every rank)
    fingerprint: Fingerprint
    problem: str | None = None  # one line: this rank's save failed; nothing is committed
    phases: dict[str, float] = field(default_factory=dict)  # timings for the save's stats


@dataclass
class Progress:
    """Where this segment's checkpoints stand, on this rank: written by the save and the resume, read by the commit."""

    parent: str | None = None  # directory name of the checkpoint the next one follows
    parent_event: str | None = None  # lineage id of that checkpoint (either tier)
    last_committed_step: int | None = None  # the newest step committed or resumed from, either tier
    last_memory_step: int | None = None  # the newest memory snapshot
    last_storage_step: int | None = None  # the newest storage checkpoint
    committed_snapshot: CheckpointManifest | None = None  # rank 0: the manifest of the newest snapshot


def agree_in(group: Any, world_size: int, problem: str | None) -> str | None:
    """Every rank of ``group`` (of ``world_size``) learns every rank's problem (one all-gather): the first one, or
    None; all move on, or all fail, together."""
    import torch.distributed as dist

    found: list[str | None] = [None] * world_size
    dist.all_gather_object(found, problem, group=group)
    return next((p for p in found if p), None)


class NodeTierHost(Protocol):
    """What ``trainer.checkpointer.node_tier.NodeTier`` uses of its Checkpointer: its agreement and its one line for
    a failed save."""

    def agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None: ...

    def save_problem(self, exc: BaseException, partial: Path) -> str: ...


class SaverHost(NodeTierHost, Protocol):
    """What ``trainer.checkpointer.saver.Saver`` uses of its Checkpointer: the backend's save hooks, the commit, the
    memory tier (its dir, and turning it off) and the end of a failed save."""

    SUPPORTS_ASYNC: bool
    BACKEND: str
    memory: RunDir | None

    def snapshot(self, ts: TrainState) -> Any: ...

    def stage(self, snapshot: Any) -> Any: ...

    def prepare_staging(self, ts: TrainState) -> None: ...

    def write(self, snapshot: Any, ts: TrainState, partial: Path) -> Written: ...

    def after_snapshot(self, step: int) -> None: ...

    def _prepare_partial(
        self, step: int, group: dist.ProcessGroup | None = None, target: RunDir | None = None
    ) -> bool: ...

    def _commit(
        self,
        ts: TrainState,
        reason: str,
        entries: list[FileEntry],
        tensors: list[TensorEntry],
        fingerprint: Fingerprint,
        t0: float,
        async_save: bool,
        problem: str | None = None,
        target: RunDir | None = None,
        like: CheckpointManifest | None = None,
    ) -> bool: ...

    def _tier_off(self, problem: str) -> None: ...

    def abort_save(self, partial: Path, problem: str, group: dist.ProcessGroup | None) -> None: ...


class ResumerHost(Protocol):
    """What ``trainer.checkpointer.resumer.Resumer`` uses of its Checkpointer: the backend's load hooks (its
    ``check_loadable`` included, which a backend may extend), what the user's run tracks (set after construction),
    the memory dir, and the agreement."""

    FORMAT: Literal["dcp", "deepspeed"]
    BACKEND: str
    ONE_PASS: bool
    applied: bool  # whether the last load attempt may have written into the live state (a one-pass restore sets it)
    eager_load: bool  # whether the next one-pass restore may write each chunk as soon as it is hashed
    shared_metadata: Any  # the next load's DCP .metadata as another rank parsed it (reader.SharedMetadata), or None
    memory: RunDir | None
    extra: dict[str, Any]
    data: DataRecord | None
    base_model: BaseModelRecord | Future | None

    @property
    def is_leader(self) -> bool: ...

    def agree(self, problem: str | None, group: dist.ProcessGroup | None = None) -> str | None: ...

    def restore(self, path: Path, manifest: CheckpointManifest) -> tuple[TrainState, bool]: ...

    def read_extras(self, path: Path, rank: int) -> dict[str, torch.Tensor]: ...

    def fingerprint(self, group: dist.ProcessGroup | None, method: str = ...) -> Fingerprint: ...

    def check_loadable(self, path: Path, manifest: CheckpointManifest) -> None: ...

    def model_inventory(self) -> list[TensorEntry]: ...
