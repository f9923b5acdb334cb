"""The run's lineage: an append-only JSON-lines file of LineageEvents that lives in the run directory,
so it survives without a Prefect server. Prefect artifacts mirror it (tasks/lineage.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import append_jsonl, read_jsonl
from ckpt.commit.layout import RunDir
from schemas import LineageEvent


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record(
    run_dir: RunDir | str | Path,
    kind: str,
    id: str,
    *,
    parent: str | None = None,
    step: int | None = None,
    uri: str | None = None,
    **data: Any,
) -> LineageEvent:
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir.at(run_dir)
    event = LineageEvent(id=id, kind=kind, parent=parent, time=now_iso(), step=step, uri=uri, data=data)  # type: ignore[arg-type]
    rd.root.mkdir(parents=True, exist_ok=True)
    append_jsonl(rd.lineage, event.model_dump(mode="json"))
    return event


def read_events(run_dir: RunDir | str | Path) -> list[LineageEvent]:
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir.at(run_dir)
    return [LineageEvent.model_validate(e) for e in read_jsonl(rd.lineage)]


def checkpoint_event_id(step: int) -> str:
    return f"checkpoint:step-{step:08d}"
