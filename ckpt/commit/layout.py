"""The run directory and checkpoint naming: the on-disk contract.

RUN_DIR/
  run.yaml                    the RunSpec (written by the first segment)
  checkpoints/step-00000100/  manifest.json + backend files   (committed)
  checkpoints/step-00000110.partial/                          (being written, or abandoned)
  metrics.jsonl  segments.jsonl  lineage.jsonl
  .lock                       flock of the launching process (ckpt.guards.lock.RunLock)
  .lock.ranks                 shared flock + pids of the live ranks (ckpt.guards.lock.hold_ranks_lock)
  plan.json                   a train-and-export flow's plan and its progress (schemas.plan.RunPlan, ckpt.plan)
  .lock.plan                  flock of the flow run that drives that plan (ckpt.plan.PlanLock)
  verified/step-00000100.json  the last full re-read of that checkpoint (ckpt.validate.checks.record_verified)
  .pins/upload.json + .lock   a checkpoint a live process still reads (the s3 uploader): retention keeps it
                              (ckpt.guards.pin)
  exports/step-00000100/
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ckpt.guards.lock import LOCK_NAME, RANKS_LOCK_NAME
from schemas import MANIFEST_NAME

STEP_RE = re.compile(r"^step-(\d{8})$")
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
RECYCLE_SUFFIX = (
    ".recycle"  # a retired memory snapshot whose files the next one overwrites (ckpt.memtier.recycle.recycle)
)
STAGE_SUFFIX = f"{RECYCLE_SUFFIX}-next"  # the stage dir: the next snapshot's files, laid out ahead (ckpt.memtier.stage)
INVALID_RE = re.compile(r"^step-(\d{8})\.invalid-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> RunDir:
        return cls(Path(path).resolve())

    @classmethod
    def containing(cls, step_dir: str | Path) -> RunDir:
        """The directory a ``checkpoints/step-XXXXXXXX`` or ``exports/step-XXXXXXXX`` folder sits in (which
        may not be a run directory: a checkpoint copied out of its run)."""
        return cls(Path(step_dir).resolve().parent.parent)

    @classmethod
    def of_checkpoint(cls, step_dir: str | Path) -> RunDir | None:
        """The run directory of a checkpoint or export folder when it is one (it has a run.yaml), else None."""
        root = cls.containing(step_dir)
        return root if root.spec_path.exists() else None

    def has_lineage(self) -> bool:
        return self.lineage.exists()

    @property
    def spec_path(self) -> Path:
        return self.root / "run.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def exports(self) -> Path:
        return self.root / "exports"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def segments(self) -> Path:
        return self.root / "segments.jsonl"

    @property
    def lineage(self) -> Path:
        return self.root / "lineage.jsonl"

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def ranks_lock_path(self) -> Path:
        return self.root / RANKS_LOCK_NAME

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    def partial(self, step: int) -> Path:
        return self.checkpoints / (step_dir_name(step) + PARTIAL_SUFFIX)

    def committed(self) -> list[Path]:
        """Step directories that carry a manifest, oldest first (validity is checked by ckpt.validate.checks)."""
        if not self.checkpoints.is_dir():
            return []
        found = [
            p
            for p in self.checkpoints.iterdir()
            if p.is_dir() and parse_step(p.name) is not None and (p / MANIFEST_NAME).is_file()
        ]
        return sorted(found, key=lambda p: parse_step(p.name) or 0)

    @property
    def verified(self) -> Path:
        return self.root / "verified"

    def verified_record(self, step: int) -> Path:
        """``verified/step-XXXXXXXX.json``: the last full re-read of that checkpoint (ckpt.validate.checks)."""
        return self.verified / (step_dir_name(step) + ".json")

    def quarantined(self) -> list[Path]:
        """``step-XXXXXXXX.invalid-<time>`` directories, oldest quarantine first."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.iterdir() if INVALID_RE.match(p.name)]
        return sorted(found, key=lambda p: (int(INVALID_RE.match(p.name).group(2)), p.name))  # type: ignore[union-attr]

    def partials(self) -> list[Path]:
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if p.name.endswith(PARTIAL_SUFFIX))
