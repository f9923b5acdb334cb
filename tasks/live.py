"""What a training segment is doing right now, in the Prefect UI, while it runs.

``SegmentWatch`` follows the run directory from the controller side (the ranks know nothing of Prefect):
it tails RUN_DIR/metrics.jsonl and RUN_DIR/lineage.jsonl every ``period_s`` seconds and

- moves a **progress artifact** of the train task (steps done / steps of the segment);
- every ``table_every_s`` seconds, and once at the end, writes a new version of the markdown artifact
  ``<run prefix>-live``: step, loss, tokens/s and ETA now, and the recent steps;
- emits ``shardkeeper.checkpoint.committed`` as each checkpoint is recorded (tasks/events.py).

Only whole lines are read (a line being appended is picked up at the next poll); an API error is
logged and retried at the next poll, never raised into the training task.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckpt.commit.layout import RunDir

log = logging.getLogger(__name__)

RECENT_ROWS = 10


class Tail:
    """New whole lines of a JSON-lines file since the last call (starting at its size when created)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = 0  # set aside and started again (train --restart): read the new file whole
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


class SegmentWatch:
    def __init__(
        self, run_dir: str | Path, run_name: str, until_step: int, *, period_s: float = 2.0, table_every_s: float = 30.0
    ):
        self.rd = RunDir.at(run_dir)
        self.run_name, self.until_step = run_name, until_step
        self.period_s, self.table_every_s = period_s, table_every_s
        self.metrics, self.lineage = Tail(self.rd.metrics), Tail(self.rd.lineage)
        self.rows: list[dict[str, Any]] = []
        self.start_step: int | None = None
        self.t0 = time.monotonic()
        self.last_table = self.t0
        self.progress_id: Any = None
        self.committed = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        from tasks.lineage import artifact_prefix

        return f"{artifact_prefix(self.rd.root, self.run_name)}-live"

    def start(self) -> SegmentWatch:
        from prefect.artifacts import create_progress_artifact

        try:
            self.progress_id = create_progress_artifact(
                0.0, description=f"{self.run_name}: steps done of this segment (to step {self.until_step})"
            )
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.warning("no progress artifact: %s", e)
        ctx = contextvars.copy_context()  # the Prefect settings and run context live in contextvars
        self._thread = threading.Thread(target=ctx.run, args=(self._loop,), name="segment-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._done.wait(self.period_s):
            self.poll()

    def poll(self, final: bool = False) -> None:
        from tasks.events import emit_checkpoint

        try:
            new = [r for r in self.metrics.read() if "step" in r and "loss" in r]
            if new and self.start_step is None:
                self.start_step = int(new[0]["step"]) - 1
            self.rows = (self.rows + new)[-max(RECENT_ROWS, 50) :]
            for e in self.lineage.read():
                if e.get("kind") == "checkpoint":
                    emit_checkpoint(
                        str(self.rd.root),
                        self.run_name,
                        e.get("uri"),
                        str(e.get("id")),
                        e.get("step"),
                        e.get("data") or {},
                    )
                    self.committed += 1
            if new and self.progress_id is not None:
                from prefect.artifacts import update_progress_artifact

                update_progress_artifact(self.progress_id, self.percent())
            now = time.monotonic()
            if self.rows and (final or now - self.last_table >= self.table_every_s):
                self.last_table = now
                from prefect.artifacts import create_markdown_artifact

                create_markdown_artifact(
                    self.markdown(final),
                    key=self.key,
                    description=f"Live progress of {self.run_name} ({self.rd.root.name})",
                )
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.warning("live progress of %s: %s", self.rd.root, e)

    def percent(self) -> float:
        if not self.rows or self.start_step is None:
            return 0.0
        total = max(self.until_step - self.start_step, 1)
        return round(100.0 * min(max(int(self.rows[-1]["step"]) - self.start_step, 0), total) / total, 1)

    def tokens_per_s(self) -> float | None:
        """Over the recent steps: tokens trained / seconds spent in those steps."""
        recent = [r for r in self.rows[-RECENT_ROWS:] if r.get("step_seconds")]
        if len(recent) < 2:
            return None
        tokens = int(recent[-1].get("tokens", 0)) - int(recent[0].get("tokens", 0))
        seconds = sum(float(r["step_seconds"]) for r in recent[1:])
        return tokens / seconds if seconds > 0 and tokens > 0 else None

    def markdown(self, final: bool = False) -> str:
        last = self.rows[-1]
        step = int(last["step"])
        rate = self.tokens_per_s()
        secs = [float(r["step_seconds"]) for r in self.rows[-RECENT_ROWS:] if r.get("step_seconds")]
        eta = (self.until_step - step) * (sum(secs) / len(secs)) if secs else None
        head = (
            f"# {'Last' if final else 'Live'} progress of {self.run_name} (`{self.rd.root.name}`)\n\n"
            f"**step {step} / {self.until_step}** · loss {float(last['loss']):.4f} · "
            f"{f'{rate:,.0f} tokens/s' if rate else 'tokens/s: measuring'} · "
            f"ETA {_duration(eta) if eta is not None else '?'} · world size {last.get('world_size', '?')} · "
            f"{self.committed} checkpoint(s) committed in this segment\n\n"
        )
        table = ["| step | loss | grad norm | step s | segment |", "|---:|---:|---:|---:|---:|"]
        for r in reversed(self.rows[-RECENT_ROWS:]):
            gn = r.get("grad_norm")
            table.append(
                f"| {r['step']} | {float(r['loss']):.4f} | {'' if gn is None else f'{float(gn):.3f}'} | "
                f"{r.get('step_seconds', '')} | {r.get('segment', '')} |"
            )
        return head + "\n".join(table) + "\n"

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.poll(final=True)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
