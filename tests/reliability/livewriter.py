"""A live writer for reader tests and the readers bench (not a test module).

``LiveWriter`` is a thread that does to a run directory what a segment checkpointing every step does, as fast
as it can: copy a real checkpoint into ``step-XXXXXXXX.partial/``, rename it into place (the commit), append its
lineage event; then retire the oldest commit the way retention does (rename to ``.deleting``, rmtree) or, every
``quarantine_every``-th time, the way a failed load does (rename to ``.invalid-<time>``, swept later). Only
real checkpoints are committed, each under its own step (their stored counters and fingerprints hold), so every
verdict a reader gives has one right answer: valid, or retired while it read.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import deque
from pathlib import Path

from ckpt.commit import lineage
from ckpt.commit.layout import RunDir, parse_step


def templates_of(run: Path) -> dict[int, Path]:
    """step -> checkpoint directory of every committed checkpoint of ``run``."""
    return {parse_step(p.name) or 0: p for p in RunDir.at(run).committed()}


def new_live_run(src_run: Path, dest: Path) -> Path:
    """A run directory with ``src_run``'s run.yaml, segments and lineage, and no checkpoint (the writer adds them)."""
    dest.mkdir(parents=True)
    for name in ("run.yaml", "segments.jsonl", "lineage.jsonl", "metrics.jsonl"):
        if (src_run / name).is_file():
            shutil.copy(src_run / name, dest / name)
    (dest / "checkpoints").mkdir()
    return dest


class LiveWriter(threading.Thread):
    """Commits and retires copies of ``templates`` (step -> real checkpoint) in ``run`` until stopped; at most
    ``keep`` committed at any time once it runs (fewer than the templates, so a step is retired before it is
    committed again: every commit is a new directory)."""

    def __init__(
        self, run: Path, templates: dict[int, Path], *, keep: int = 2, quarantine_every: int = 5, pause_s: float = 0.0
    ):
        super().__init__(name="live-writer", daemon=True)
        if not 1 <= keep < len(templates):
            raise ValueError(f"keep={keep}: needs 1 <= keep < {len(templates)} templates")
        self.rd = RunDir.at(run)
        self.templates = dict(sorted(templates.items()))
        self.keep = keep
        self.quarantine_every = quarantine_every
        self.pause_s = pause_s
        self.committed = self.retired = self.quarantined = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._live: deque[Path] = deque()

    def commit(self, step: int) -> Path:
        final = self.rd.checkpoint(step)
        partial = self.rd.partial(step)
        shutil.copytree(self.templates[step], partial)
        os.rename(partial, final)
        lineage.record(
            self.rd,
            "checkpoint",
            lineage.checkpoint_event_id(step),
            step=step,
            reason="interval",
            uri=final.as_uri(),
            world_size=2,
        )
        self.committed += 1
        self._live.append(final)
        return final

    def retire_oldest(self) -> None:
        path = self._live.popleft()
        if self.quarantine_every and (self.retired + self.quarantined + 1) % self.quarantine_every == 0:
            os.rename(path, path.with_name(f"{path.name}.invalid-{time.time_ns()}"))
            self.quarantined += 1
            for old in self.rd.quarantined()[:-2]:  # the segment-start sweep keeps the newest few
                shutil.rmtree(old, ignore_errors=True)
            return
        trash = path.with_name(path.name + ".deleting")
        os.rename(path, trash)
        shutil.rmtree(trash)
        self.retired += 1

    def run(self) -> None:
        try:
            steps = list(self.templates)
            i = len(self._live)  # the commit __enter__ made
            while not self._halt.is_set():
                self.commit(steps[i % len(steps)])
                i += 1
                while len(self._live) > self.keep:
                    self.retire_oldest()
                if self.pause_s:
                    time.sleep(self.pause_s)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        if self.error is not None:
            raise RuntimeError(f"the live writer failed: {self.error!r}") from self.error

    def __enter__(self) -> LiveWriter:
        # one commit before any reader starts, so a run state always has something to find
        self.commit(next(iter(self.templates)))
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
