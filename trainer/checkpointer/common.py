"""What the Checkpointer (``trainer.checkpointer.core`` with its bases ``trainer.checkpointer.save_side`` and
``trainer.checkpointer.resume_side``),
its backends and the trainer share: the counters a checkpoint holds (TrainState), what a backend's write hands the
commit (Written), the background thread a save or re-read runs on, and the code version every manifest records."""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckpt import __version__
from schemas import FileEntry, Fingerprint, TensorEntry

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
