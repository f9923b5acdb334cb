"""Non-finite steps: a step whose loss or global gradient norm is NaN/Inf is never applied, and never committed.

Each backend's ``train_step`` calls ``NonFiniteGuard.check`` once per step, after the step's loss is summed over
the ranks and its global gradient norm is known, and before the optimizer applies anything (FSDP2: before
``optimizer.step``; DeepSpeed: its engine drops a step whose global gradient norm is not finite inside
``engine.step``, and a rank whose loss is not finite poisons its gradients so that the engine does). Both values
are already global -- the loss sum is all-reduced, the norm is reduced over every shard -- and NaN/Inf survive
any order of summation, so every rank reaches the same verdict without another collective.

``optim.on_nonfinite``:

* ``stop`` (default): ``check`` raises ``NonFiniteStep``; the loop calls ``end_segment``, which closes the
  Checkpointer without saving (an async save of an earlier, good step finishes and commits), writes the segment
  report ``failed`` with one line naming the step, the likely causes and the fix, records a ``nonfinite`` lineage
  event, and returns ``EXIT_NONFINITE`` (65). The newest committed checkpoint stays the resume point.
* ``skip_step``: the update is dropped (gradients zeroed, no optimizer step; the data and the LR schedule move on
  with the step), the metrics row says ``"skipped": true``, and the segment's report counts the skipped steps;
  ``optim.max_skipped`` + 1 non-finite steps in a row stop the segment as above.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal, Protocol

from schemas import OptimSpec
from schemas.errors import ShardkeeperError
from schemas.seam import EXIT_NONFINITE

log = logging.getLogger("shardkeeper.trainer")

What = Literal["loss", "gradient norm"]


class NonFiniteStep(ShardkeeperError):
    """The loss or the global gradient norm of optimizer step ``step`` (1-based: the step whose checkpoint would be
    ``step-<step>``) is NaN/Inf; its update was not applied (unless ``applied``: the backend applied it before the
    check could stop it; the live state is then never saved either)."""

    exit_code = EXIT_NONFINITE

    def __init__(
        self,
        step: int,
        what: What,
        *,
        loss: float,
        grad_norm: float,
        in_a_row: int = 1,
        max_skipped: int | None = None,
        applied: bool = False,
    ):
        self.step, self.what, self.loss, self.grad_norm = step, what, loss, grad_norm
        self.in_a_row, self.max_skipped, self.applied = in_a_row, max_skipped, applied
        super().__init__(f"non-finite {what} at step {step}")

    def line(self, resume_step: int | None, lr: float) -> str:
        """The one line the segment ends with: what, where, likely causes, the fix."""
        head = f"non-finite {self.what} at step {self.step} (loss {self.loss:.6g}, gradient norm {self.grad_norm:.6g})"
        if self.max_skipped is not None:
            head += f", {self.in_a_row} non-finite steps in a row (optim.max_skipped {self.max_skipped})"
        causes = (
            f"likely causes: a learning rate too high (optim.lr {lr:g}), bad data at this step, NaN/Inf in the "
            "pretrained weights, fp16/bf16 overflow"
        )
        kept = (
            f"nothing of step {self.step} was committed"
            if not self.applied
            else f"step {self.step}'s update was applied before the check, so the live state was not saved"
        )
        if resume_step:
            where = f"step-{resume_step:08d} stays the latest checkpoint"
            fix = f"lower optim.lr or check the data, then rerun the same command to resume from step {resume_step}"
        else:
            where = "the run has no checkpoint yet"
            fix = "lower optim.lr or check the data, then rerun the same command to start again from step 0"
        return f"{head}; {causes}; {kept}, {where}; {fix} (optim.on_nonfinite: skip_step skips such steps)"


class NonFiniteGuard:
    """One per segment: the verdict on every step (``check``) and the count of skipped ones."""

    def __init__(self, optim: OptimSpec, *, is_rank0: bool = True):
        self.policy = optim.on_nonfinite
        self.max_skipped = optim.max_skipped
        self.is_rank0 = is_rank0
        self.in_a_row = 0
        self.skipped: list[int] = []  # the steps of this segment whose update was dropped
        self.last_skipped = False

    def check(self, step: int, loss: float, grad_norm: float, *, dropped: bool = False, applied: bool = False) -> bool:
        """The verdict on optimizer step ``step`` (1-based), before its update is applied. False: apply it; True:
        drop it (skip_step); raises NonFiniteStep to stop the segment. ``dropped``: the backend already dropped the
        update for a gradient it found non-finite (DeepSpeed's overflow check); ``applied``: the backend already
        applied it (then a non-finite step can only stop)."""
        self.last_skipped = False
        if not math.isfinite(loss):
            what: What | None = "loss"
        elif dropped or not math.isfinite(grad_norm):
            what = "gradient norm"
        else:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        if applied or self.policy == "stop" or self.in_a_row > self.max_skipped:
            raise NonFiniteStep(
                step,
                what,
                loss=loss,
                grad_norm=grad_norm,
                in_a_row=self.in_a_row,
                max_skipped=self.max_skipped if self.policy == "skip_step" else None,
                applied=applied,
            )
        self.skipped.append(step)
        self.last_skipped = True
        if self.is_rank0:
            log.warning(
                "non-finite %s at step %d (loss %.6g, gradient norm %.6g): update skipped (%d in a row, at "
                "most optim.max_skipped %d)",
                what,
                step,
                loss,
                grad_norm,
                self.in_a_row,
                self.max_skipped,
            )
        return True

    def row(self) -> dict[str, bool]:
        """What the step's metrics.jsonl row adds: ``"skipped": true`` when its update was dropped."""
        return {"skipped": True} if self.last_skipped else {}

    def note(self) -> str | None:
        """The segment report's note when steps were skipped."""
        if not self.skipped:
            return None
        shown = ", ".join(map(str, self.skipped[:10])) + (" ..." if len(self.skipped) > 10 else "")
        return f"skipped {len(self.skipped)} non-finite step(s) (optim.on_nonfinite skip_step): {shown}"


class _Checkpointer(Protocol):
    @property
    def last_committed_step(self) -> int | None: ...

    def close(self) -> None: ...


def end_segment(
    err: NonFiniteStep,
    *,
    ckpt: _Checkpointer,
    run_dir: object,
    is_rank0: bool,
    segment: int,
    start: int,
    lr: float,
    write_status: Callable[..., None],
    skipped: list[int] | None = None,
) -> int:
    """Stop the segment at a non-finite step: close the Checkpointer WITHOUT saving (a save in flight from an earlier
    good step finishes), report ``failed`` with the one line (and EXIT_NONFINITE) through ``write_status(status,
    start, end, note=, exit_code=)`` (a collective), record the lineage event, and return EXIT_NONFINITE. Every rank
    calls it (they all raised at the same step)."""
    try:
        ckpt.close()
    except ShardkeeperError as e:  # the earlier save failed: it is not what the segment ends on, but say so
        if is_rank0:
            log.error("the checkpoint save in flight before the non-finite step failed: %s", e)
    resume = ckpt.last_committed_step or 0
    line = err.line(resume, lr)
    if is_rank0:
        from ckpt.commit import lineage

        log.error("%s: the segment stops without saving this step (the full line is in its report)", err)
        lineage.record(
            run_dir,
            "nonfinite",
            f"nonfinite:segment-{segment}:step-{err.step:08d}",  # type: ignore[arg-type]
            parent=f"segment:{segment}",
            step=err.step,
            what=err.what,
            loss=_number(err.loss),
            grad_norm=_number(err.grad_norm),
            in_a_row=err.in_a_row,
            applied=err.applied,
            resume_step=resume,
            segment=segment,
            skipped=list(skipped or []),
        )
    write_status("failed", start, resume, note=line, exit_code=EXIT_NONFINITE)
    return EXIT_NONFINITE


def _number(x: float) -> float | str:
    """A JSON-safe value: NaN/Inf as their names (JSON has no such numbers)."""
    return x if math.isfinite(x) else str(x)
