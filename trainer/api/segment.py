"""The public API for one's own training loop: ``shardkeeper.Segment`` (re-exported lazily by ``shardkeeper``).

    import shardkeeper as sk

    seg = sk.Segment()                      # joins the segment it was launched in (shardkeeper train --script)
    model = build(); fully_shard(model, mesh=seg.mesh)          # or a DeepSpeed engine
    seg.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
    for step in seg.steps():                # resumes the newest valid checkpoint, then yields the steps to train
        loss = train_one_step(step)
        seg.log(loss=float(loss))           # one metrics.jsonl row per step

``steps()`` owns the whole segment policy, for every client (the built-in language-model trainer in
``trainer.builtin.loop`` is one): validation before load with fallback and quarantine, refusal when every checkpoint
is invalid, saves on the run's policy (interval, async, keep_last), the emergency save at the step boundary
after SIGTERM/SIGUSR1 (then the process exits 75), the final commit, the segment report, metrics, progress.

Run a script with ``shardkeeper train --script train.py --run-dir RUN --until-step N --nproc 2``; by hand
under torchrun, pass ``Segment(run_dir=..., until_step=...)``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from ckpt.commit.fsutil import append_jsonl, load_yaml
from ckpt.commit.layout import RunDir
from schemas import RunSpec
from schemas.errors import UsageError
from schemas.seam import EXIT_PREEMPTED, SegmentLaunch
from trainer import forkserver, lifetime, timeline
from trainer.checkpointer.core import Checkpointer, TrainState
from trainer.checkpointer.node_tier import start_early
from trainer.dist import DistEnv, init_distributed, log0
from trainer.signals import PreemptionWatcher

log = logging.getLogger("shardkeeper.trainer")

__all__ = ["Segment", "SegmentPreempted", "SegmentStopped", "UsageError"]

_GUARDED = ("loss", "grad_norm")  # logged values the non-finite guard checks at every step

LAUNCH_HINT = (
    "launch it with: shardkeeper train --script FILE --run-dir RUN --until-step N [--nproc K] "
    "(or pass sk.Segment(run_dir=..., until_step=...) under torchrun)"
)


class SegmentStopped(SystemExit):
    """Raised by ``Segment.steps()`` and ``Segment.save()`` after they ended the segment themselves.

    A NaN/Inf ``loss`` or ``grad_norm`` was logged on some rank (``Segment.log``): nothing of that step is committed,
    the newest checkpoint stays the resume point, the segment's report says ``failed`` in one line. A
    ``SystemExit`` whose code is the segment's (65, ``schemas.seam.EXIT_NONFINITE``), so a script that does not
    catch it ends with that code.
    """


class SegmentPreempted(SystemExit):
    """Raised by ``Segment.steps()`` after the preemption checkpoint is committed.

    A stop signal (SIGTERM or SIGUSR1, as schedulers send before they preempt) reached a rank; every rank agreed at
    a step boundary and the checkpoint of the last completed step is committed. A ``SystemExit`` with code 75
    (``schemas.seam.EXIT_PREEMPTED``), so a script that does not catch it ends quietly with that code; run the same
    command again to continue.
    """

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


def shield_dataloader_workers() -> None:
    """DataLoader worker processes of this rank ignore SIGTERM/SIGUSR1. A preemption signals every process of a
    rank's session (torchrun's killpg, scancel, Kubernetes), and torch's worker handler turns a SIGTERM that its
    parent did not send into death, which fails the rank mid-step instead of letting it commit at the step
    boundary; the rank owns the preemption, and workers still end with it (torch's parent watchdog, SIGKILL)."""
    import signal

    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # pragma: no cover - another torch layout: workers keep torch's own handling
        return
    original = signal_handling._set_worker_signal_handlers
    if getattr(original, "_shardkeeper", False):
        return

    def set_worker_signal_handlers(*args: Any) -> None:
        original(*args)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)

    set_worker_signal_handlers._shardkeeper = True  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


# The segment of this process (one per process): trainer.api.script checks it after the user's script returns.
_CURRENT: list[Segment] = []


def current() -> Segment | None:
    return _CURRENT[-1] if _CURRENT else None


class Segment:
    """One training segment of a run, seen from a rank: resume, saves, preemption and the segment's report.

    Create it first, before the model is built: it joins the process group (NCCL on CUDA, gloo on CPU) and exposes
    ``rank``, ``world_size``, ``device`` and ``mesh``. Then ``track`` what a checkpoint holds and train inside
    ``for step in seg.steps()``. The run's ``run.yaml`` supplies the checkpoint policy and the seed.

    Args:
        run_dir: The run directory. Default: the one ``shardkeeper train`` handed the ranks; give it when the
            script runs under a plain ``torchrun``.
        until_step: The step this segment trains up to: ``steps()`` ends once the run has done this many optimizer
            steps. Default: ``shardkeeper train --until-step``; give it under a plain ``torchrun``.
        segment: This segment's number in the run (metrics rows, lineage). Default: the launcher's, else 0.

    Raises:
        UsageError: ``until_step`` is negative, or the run directory has no ``run.yaml``.
        SystemExit: Exit code 2: not launched by ``shardkeeper train`` and ``run_dir`` or ``until_step`` not given
            (one line says how to launch the script).

    Example:
        ```python
        import shardkeeper as sk

        seg = sk.Segment()              # joins the segment's process group
        model = build()
        fully_shard(model, mesh=seg.mesh)  # FSDP2, or a DeepSpeed engine
        seg.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
        for step in seg.steps():        # resumes the newest valid checkpoint
            loss = train_one_step(step)
            seg.log(loss=float(loss))
        ```
        Run it with ``shardkeeper train --script train.py --run-dir RUN --until-step N --nproc 2``.
    """

    def __init__(
        self,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        until_step: int | None = None,
        segment: int | None = None,
        _env: DistEnv | None = None,
        _spec: RunSpec | None = None,
    ):
        launch = SegmentLaunch.from_environ()
        if launch is None and (run_dir is None or until_step is None):
            print(
                f"error: sk.Segment(): not inside a shardkeeper segment (SHARDKEEPER_LAUNCH is unset); {LAUNCH_HINT}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)
        self.run_dir = RunDir.at(run_dir if run_dir is not None else launch.run_dir)  # type: ignore[union-attr,arg-type]
        self.until_step = int(until_step if until_step is not None else launch.until_step)  # type: ignore[union-attr]
        self.segment = int(segment if segment is not None else (launch.segment if launch else 0))
        if self.until_step < 0:
            raise UsageError(f"sk.Segment(until_step={self.until_step}): must be >= 0")
        if _spec is None:
            if not self.run_dir.spec_path.exists():
                raise UsageError(f"{self.run_dir.spec_path}: missing; {LAUNCH_HINT}")
            _spec = load_spec(self.run_dir)
        self.spec: RunSpec = _spec
        self.env: DistEnv = _env if _env is not None else init_distributed(launch)
        if _env is None:
            timeline.mark("process_group")
            # several nodes: their copies of the newest memory snapshot readied while the script builds its model
            # (taken over by the Checkpointer that track() makes; trainer.checkpointer.node_tier)
            start_early(self.env, self.spec, self.run_dir)
        shield_dataloader_workers()
        self._ckpt: Checkpointer | None = None
        self._objects: dict[str, Any] = {}
        self._row: dict[str, Any] = {}
        self._on_fresh: Callable[[], None] | None = None
        self.execution: dict[str, Any] | None = None  # how the ranks ran the math (the segment report records it)
        self.final_note: Callable[[], str | None] | None = None  # a note for the report of a completed segment
        self._start = 0
        self.state = TrainState()
        self.exit_code: int | None = None  # set when steps() has ended the segment
        self._nonfinite_seen = False
        self._nonfinite_first: tuple[int, Any, Any] | None = (
            None  # (step, loss, grad_norm) of this rank's first NaN/Inf
        )
        self._watcher: PreemptionWatcher | None = None
        self._stop_agreed = False  # a stop agreed inside a step (seg.save()), acted on at its boundary
        self.entered = False
        _CURRENT.append(self)

    # ------------------------------------------------------------------ where this rank is
    @property
    def rank(self) -> int:
        """This rank's index in the segment's process group, ``0 .. world_size - 1``."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """The number of ranks of this segment (it may differ from the previous segment's)."""
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        """This rank's index on its node (the GPU it uses on a CUDA node)."""
        return self.env.local_rank

    @property
    def device(self) -> torch.device:
        """The device this rank trains on: ``cuda:LOCAL_RANK`` with GPUs, else ``cpu``."""
        return self.env.device

    @property
    def mesh(self) -> Any:
        """A 1-D device mesh over all ranks (``fully_shard(module, mesh=seg.mesh)``)."""
        return self.env.mesh

    @property
    def is_rank0(self) -> bool:
        """Whether this is rank 0 (the one that writes metrics, the manifest and the report)."""
        return self.env.is_rank0

    @property
    def step(self) -> int:
        """Optimizer steps done (the checkpoint's step after a resume; inside ``steps()`` the step being trained)."""
        return self.state.step

    # ------------------------------------------------------------------ what is checkpointed
    def track(self, *, model: Any, optimizer: Any = None, **state: Any) -> Segment:
        """Name what a checkpoint holds. Call once, before ``steps()``, with the same names on every rank.

        A checkpoint holds what the model's state is, not how the run was described: any run whose model has the
        checkpoint's tensor names, global shapes and dtypes continues it (an import, the built-in trainer's run,
        another script's); another model is refused before the load, naming the first tensor that differs. A
        checkpoint another kind of run wrote holds no state of the objects in ``state``: an LR scheduler is
        fast-forwarded to its step, an object with a ``start_at_step(step)`` method is asked to start there,
        anything else starts fresh (one warning line names them); the optimizer keeps its own settings (learning
        rate, weight decay, groups) and takes the checkpoint's weights, moments and step.

        Args:
            model: An FSDP2-sharded module, a plain module, or a DeepSpeed engine.
            optimizer: The model's optimizer (AdamW: the fingerprint covers its moments). Leave it out with a
                DeepSpeed engine, which brings its own.
            **state: Any other object with ``state_dict()`` and ``load_state_dict()``, by name: an LR scheduler, a
                torchdata ``StatefulDataLoader``, an EMA... One that is equal on every rank comes back at another
                world size; one that differs per rank refuses a resume at another world size, in one line.

        Returns:
            This segment.

        Raises:
            UsageError: Called twice or after ``steps()`` started, an object without ``state_dict()`` or
                ``load_state_dict()``, other names on some rank than on rank 0 (refused on every rank before
                anything is saved), or a model or optimizer the run's backend cannot save.

        Example:
            ```python
            seg.track(model=model, optimizer=opt, scheduler=sched, loader=loader)
            ```
        """
        if self._ckpt is not None:
            raise UsageError("seg.track(): called twice; track everything in one call, before seg.steps()")
        if self.entered:
            raise UsageError("seg.track(): called after seg.steps() started; track before the loop")
        for name, obj in state.items():
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
            if missing:
                raise UsageError(
                    f"seg.track({name}=...): a {type(obj).__name__} has no {' or '.join(missing)}(); "
                    "track objects that speak the state_dict/load_state_dict protocol (or leave it out)"
                )
        self._same_on_every_rank(sorted(state))
        from trainer.api._tracked import make_checkpointer

        self._attach(make_checkpointer(self, model, optimizer, state))
        self._objects = {"model": model, "optimizer": optimizer, **state}
        return self

    def _same_on_every_rank(self, names: list[str]) -> None:
        """Every rank tracks the same names (one all-gather): a checkpoint holds each rank's state of each, and a
        resume checks them against rank 0's. Refused on every rank before anything is saved otherwise."""
        import torch.distributed as dist

        everyone: list[list[str] | None] = [None] * self.env.world_size
        dist.all_gather_object(everyone, names, group=self.env.ctrl_group)
        first = everyone[0] or []
        for rank, theirs in enumerate(everyone):
            if theirs != first:

                def shown(n: list[str] | None) -> str:
                    return "{" + ", ".join(["model", "optimizer", *(n or [])]) + "}"

                raise UsageError(
                    f"seg.track(): rank 0 tracks {shown(first)}, rank {rank} tracks {shown(theirs)}; "
                    "track the same objects on every rank (each rank's state of each is checkpointed, "
                    "and a resume needs every one)"
                )

    def _attach(self, ckpt: Checkpointer, *, on_fresh: Callable[[], None] | None = None) -> None:
        """The built-in trainer's way in: its own backend Checkpointer and its fresh-start hook (pretrained load)."""
        self._ckpt = ckpt
        self._on_fresh = on_fresh

    # ------------------------------------------------------------------ the loop
    def log(self, **metrics: Any) -> None:
        """Add values to this step's row of ``metrics.jsonl``, written by rank 0 when the step ends.

        Call it from every rank or from rank 0 alone. ``loss`` and ``grad_norm`` are checked at every step: a NaN/Inf
        logged on any rank stops the segment without committing that step (``SegmentStopped``, exit 65).

        Args:
            **metrics: Numbers (Python, 0-d or one-element torch/numpy values) and strings, by name.

        Raises:
            UsageError: A value that is not a number or a string, an integer too large for JSON readers, or a
                non-number ``loss`` / ``grad_norm``.

        Example:
            ```python
            seg.log(loss=float(loss), lr=sched.get_last_lr()[0])
            ```
        """
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) or (hasattr(v, "item") and hasattr(v, "dtype")):  # torch / numpy scalars
                v = v.item() if getattr(v, "size", 1) in (1, ()) or getattr(v, "numel", lambda: 0)() == 1 else None
            if not isinstance(v, (int, float, str, bool)) or v is None:
                raise UsageError(
                    f"seg.log({k}=...): a {type(metrics[k]).__name__} is not a number or a string; log float(value)"
                )
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2**63:
                raise UsageError(f"seg.log({k}=...): an integer of {len(str(abs(v)))} digits; log float(value)")
            if k in _GUARDED and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                raise UsageError(
                    f"seg.log({k}=...): a {type(v).__name__}; {k} must be a number (it is checked for "
                    "NaN/Inf at every step): log float(value)"
                )
            if k in _GUARDED and not math.isfinite(v):  # type: ignore[arg-type]  # a number: checked above
                self._nonfinite_seen = True  # a later finite value in the same step does not undo it
            self._row[k] = v

    def steps(self, *, tokens_per_step: int = 0, samples_per_step: int = 0) -> Iterator[int]:
        """Resume (or start at 0), then yield each step index to train.

        Before the first step it loads the newest valid checkpoint (every byte verified; one that fails is set aside
        and the previous one used) or starts fresh. Between steps it writes the metrics row and the progress line,
        agrees with every rank on a stop signal or a NaN/Inf, and saves on the run's policy (``checkpoint.interval``,
        ``memory_interval``, async). After the last step it commits a checkpoint and writes the segment's report.

        Args:
            tokens_per_step: Tokens one step trains on, all ranks together: the checkpoint's token counter and the
                tokens/s of the progress line.
            samples_per_step: Samples one step trains on, all ranks together: the checkpoint's sample counter.

        Yields:
            The index of the step to train, from the resumed step to ``until_step - 1``.

        Raises:
            SegmentPreempted: A stop signal reached a rank; the checkpoint is committed (exit 75).
            SegmentStopped: A NaN/Inf ``loss`` or ``grad_norm`` was logged; nothing of it is committed (exit 65).
            UsageError: Nothing is tracked, or ``steps()`` was called twice.
            CheckpointError: The run has checkpoints and none of them can be trusted (exit 4; one line names them).

        Example:
            ```python
            for step in seg.steps(tokens_per_step=batch * seq_len):
                loss = train_one_step(step)
                seg.log(loss=float(loss))
            ```
        """
        if self._ckpt is None:
            raise UsageError("seg.steps(): nothing is tracked; call seg.track(model=..., optimizer=...) first")
        if self.entered:
            raise UsageError("seg.steps(): called twice; one segment runs one loop")
        self.entered = True
        watcher = PreemptionWatcher(self.env.ctrl_group).install()  # before the load: a SIGTERM then is a preemption
        self._watcher = watcher
        try:
            yield from self._steps(watcher, tokens_per_step, samples_per_step)
        finally:
            watcher.uninstall()

    def _steps(self, watcher: PreemptionWatcher, tokens_per_step: int, samples_per_step: int) -> Iterator[int]:
        env, ckpt = self.env, self._ckpt
        assert ckpt is not None
        ts = ckpt.load_latest() or self._start_fresh()
        self.state = ts
        timeline.mark("loaded")
        ckpt.warm_up(ts)
        start = self._start = ts.step
        if start >= self.until_step:
            log0(env, "nothing to do: the run is at step %d, --until-step is %d", start, self.until_step)
            self._end("completed", start, start)
            return
        if watcher.should_stop():  # asked to stop during start-up or load: the loaded state is committed already
            note = stopped_early_note(start)
            log0(env, "preemption signal received before the first step: %s", note)
            self._end("preempted", start, start, note=note)
            raise SegmentPreempted()
        log0(env, "segment %d: steps %d -> %d on %d ranks", self.segment, start, self.until_step, env.world_size)
        progress = ProgressLine(start, self.until_step, tokens_per_step)
        memory_interval = self.spec.checkpoint.memory_interval
        first = True
        while ts.step < self.until_step:
            t0 = time.perf_counter()
            self._row = {}
            self._nonfinite_seen = False
            yield ts.step
            timeline.mark("first_step")  # the first mark wins: the segment's first optimizer step, on every rank
            if first:  # the segment is up: the node's fork server may import what restarted ranks will need
                first = False
                forkserver.warm()
            ts = TrainState(step=ts.step + 1, tokens=ts.tokens + tokens_per_step, samples=ts.samples + samples_per_step)
            self.state = ts
            if env.is_rank0:
                row = {
                    "step": ts.step,
                    **self._row,
                    "world_size": env.world_size,
                    "segment": self.segment,
                    "tokens": ts.tokens,
                    "step_seconds": round(time.perf_counter() - t0, 4),
                }
                append_jsonl(self.run_dir.metrics, row)
                loss = row.get("loss")
                line = progress.update(ts.step, float(loss) if isinstance(loss, (int, float)) else math.nan)
                if line:
                    log0(env, "%s", line)
            if self._nonfinite_logged() and self._nonfinite_first is None:
                self._nonfinite_first = (ts.step, self._row.get("loss", math.nan), self._row.get("grad_norm", 0.0))
            saves = (
                ts.step >= self.until_step
                or ts.step % self.spec.checkpoint.interval == 0
                or bool(memory_interval and ts.step % memory_interval == 0)
            )  # a snapshot commits too
            stop, nonfinite = self._agree(saves)
            if nonfinite:  # a script logged a NaN/Inf loss or gradient norm on some rank: never committed
                raise SegmentStopped(self.end_nonfinite(self._nonfinite_step()))
            if stop and ts.step < self.until_step:  # at the last step the segment completes (its final save below)
                log0(env, "preemption signal received: committing a checkpoint at step %d", ts.step)
                ckpt.save(ts, reason="preempted", blocking=True)
                timeline.mark("emergency_saved")
                ckpt.close()
                self._end("preempted", start, ts.step)
                raise SegmentPreempted()
            if ts.step % self.spec.checkpoint.interval == 0 and ts.step < self.until_step:
                ckpt.save(ts, reason="interval")
            elif memory_interval and ts.step % memory_interval == 0 and ts.step < self.until_step:
                ckpt.save(ts, reason="interval", tier="memory")
        ckpt.save(ts, reason="end", blocking=True)
        ckpt.close()
        self._end("completed", start, ts.step, note=self.final_note() if self.final_note else None)

    def save(self) -> None:
        """Commit a checkpoint of the tracked state now, at ``seg.step``.

        For a framework with its own save schedule on top of ``checkpoint.interval`` (the Hugging Face Trainer's
        ``save_steps``); a loop inside ``seg.steps()`` needs none. Call it between steps, on every rank; it is async
        when the run's policy says so.

        Raises:
            UsageError: Called outside ``for step in seg.steps()`` or before ``track()``.
            SegmentStopped: Some rank logged a NaN/Inf in this step: nothing is committed (exit 65).
        """
        if self._ckpt is None or not self.entered:
            raise UsageError("seg.save(): only inside `for step in seg.steps()`, after seg.track(...)")
        stop, nonfinite = self._agree(True)  # never commit a state some rank already saw a NaN/Inf in
        if nonfinite:
            raise SegmentStopped(self.end_nonfinite(self._nonfinite_step()))
        self._stop_agreed = self._stop_agreed or stop  # acted on at the step boundary, after this save
        self._ckpt.save(self.state, reason="interval")

    def _agree(self, blocking: bool) -> tuple[bool, bool]:
        """Did any rank get a stop signal, or log a NaN/Inf, as of the agreement this answers? The per-step
        collective runs while the next step computes (its answer is one step late); ``blocking`` (a step that
        saves, seg.save(), and a stop agreed one step late) waits for that one and agrees on this step too, so nothing
        unagreed is ever committed."""
        assert self._watcher is not None
        flag = self._nonfinite_first is not None or self._nonfinite_logged()
        stop, nonfinite = self._watcher.finish_agree()
        stop, self._stop_agreed = stop or self._stop_agreed, False
        if blocking or stop:  # a stop commits a checkpoint of this step: agree on this step's flags first
            now_stop, now_nonfinite = self._watcher.agree(flag)
            stop, nonfinite = stop or now_stop, nonfinite or now_nonfinite
        else:
            self._watcher.start_agree(flag)
        return stop, nonfinite

    # ------------------------------------------------------------------ non-finite training (trainer.nonfinite)
    def _nonfinite_logged(self) -> bool:
        """A script's own loop: did this step log a NaN/Inf ``loss`` or ``grad_norm`` on this rank?"""
        return self.spec.script is not None and self._nonfinite_seen

    def _nonfinite_step(self) -> Any:
        """What the rank that logged a NaN/Inf first (lowest step, then rank) saw; every rank calls it (one gather
        on the control group)."""
        import torch.distributed as dist

        from trainer.nonfinite import NonFiniteStep

        if self._nonfinite_first is None and self._nonfinite_logged():  # logged inside this step (seg.save())
            self._nonfinite_first = (
                self.state.step + 1,
                self._row.get("loss", math.nan),
                self._row.get("grad_norm", 0.0),
            )
        seen: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(seen, self._nonfinite_first, group=self.env.ctrl_group)
        step, loss, norm = min((s for s in seen if s is not None), key=lambda s: s[0])
        what: Literal["loss", "gradient norm"] = (
            "loss" if not (isinstance(loss, (int, float)) and math.isfinite(loss)) else "gradient norm"
        )
        # the script has (most likely) applied the update already: the live state is never saved
        return NonFiniteStep(
            step,
            what,
            loss=float(loss) if isinstance(loss, (int, float)) else math.nan,
            grad_norm=float(norm) if isinstance(norm, (int, float)) else math.nan,
            applied=True,
        )

    def end_nonfinite(self, err: Any, *, skipped: list[int] | None = None) -> int:
        """End the segment at a non-finite step without saving it: close the Checkpointer (a save of an earlier step
        in flight commits), report ``failed`` with one line, record the lineage event; returns EXIT_NONFINITE (65).
        Every rank calls it."""
        from trainer.nonfinite import end_segment

        assert self._ckpt is not None
        optimizer = self._objects.get("optimizer") if self.spec.script is not None else None
        lr = float(optimizer.param_groups[0]["lr"]) if optimizer is not None else self.spec.optim.lr
        code = end_segment(
            err,
            ckpt=self._ckpt,
            run_dir=self.run_dir,
            is_rank0=self.env.is_rank0,
            segment=self.segment,
            start=self._start,
            lr=lr,
            write_status=self._end,
            skipped=skipped,
        )
        self.exit_code = code
        return code

    def _start_fresh(self) -> TrainState:
        if self._on_fresh is not None:
            self._on_fresh()
        return TrainState()

    def _end(self, status: str, start: int, end: int, note: str | None = None, exit_code: int | None = None) -> None:
        write_status(
            self.run_dir,
            self.env,
            self.segment,
            status,
            start,
            end,
            note,
            execution=self.execution,
            exit_code=exit_code,
        )
        self.exit_code = exit_code if exit_code is not None else (EXIT_PREEMPTED if status == "preempted" else 0)


def load_spec(run_dir: RunDir) -> RunSpec:
    return RunSpec.model_validate(load_yaml(run_dir.spec_path.read_text()))


def stopped_early_note(step: int, *, loaded: bool = True) -> str:
    """``loaded``: the ranks loaded ``step`` before the signal (False: stopped during start-up, before the build)."""
    if step == 0:
        return "stopped before the first step with nothing trained: no checkpoint; the next segment starts clean"
    how = "(loaded)" if loaded else "(not loaded: stopped during start-up)"
    return f"stopped before the first step: nothing new to save; step-{step:08d} {how} stays the latest checkpoint"


def write_status(
    run_dir: RunDir,
    env: DistEnv,
    segment: int,
    status: str,
    start: int,
    end: int,
    note: str | None = None,
    execution: dict | None = None,
    exit_code: int | None = None,
) -> None:
    """The segment's report to the launcher (rank 0): a SegmentReport (schemas.seam), with the time every phase
    was reached (a collective: every rank's marks are gathered)."""
    import torch.distributed as dist

    from schemas.seam import SegmentReport

    timeline.mark("closed")
    marks: list[dict[str, float]] = [{} for _ in range(env.world_size)]
    dist.all_gather_object(marks, timeline.local_marks(), group=env.ctrl_group)
    if env.is_rank0:
        launch = SegmentLaunch.from_environ()
        ckpt = run_dir.checkpoint(end)
        restarts = lifetime.restart_count()
        # ranks restarted in place time their phases from their own start, not from the launch of the first ones
        origin = launch.launched_at if launch and not restarts else None
        SegmentReport(
            segment=segment,
            status=status,
            start_step=start,
            end_step=end,
            checkpoint=str(ckpt) if end and ckpt.exists() else None,
            world_size=env.world_size,
            topology=env.topology,
            note=note,
            exit_code=exit_code,
            execution=execution or None,
            times=timeline.summarize(marks, origin),
            restarts=restarts,
        ).write(run_dir.root)


class ProgressLine:
    """Rank 0's periodic progress line: step, loss, tokens/s and ETA, at the first step, then at most every
    ``every_s`` seconds (SHARDKEEPER_PROGRESS_S, default 10), and at the last step."""

    def __init__(self, start: int, until: int, tokens_per_step: int, every_s: float | None = None):
        self.start, self.until, self.tokens_per_step = start, until, tokens_per_step
        self.every_s = float(os.environ.get("SHARDKEEPER_PROGRESS_S", "10")) if every_s is None else every_s
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def update(self, step: int, loss: float) -> str | None:
        now = time.perf_counter()
        if self.last is not None and step < self.until and now - self.last < self.every_s:
            return None
        self.last = now
        done = step - self.start
        rate = done / max(now - self.t0, 1e-9)  # steps per second over this segment
        eta = (self.until - step) / rate if rate > 0 else 0.0
        speed = f"{rate * self.tokens_per_step:,.0f} tokens/s" if self.tokens_per_step else f"{rate:.2f} steps/s"
        shown = f" loss {loss:.4f}" if not math.isnan(loss) else ""
        return f"step {step}/{self.until}{shown} {speed} ETA {int(eta // 60)}m{int(eta % 60):02d}s"
