"""A Hugging Face ``Trainer`` under shardkeeper: every save is a shardkeeper commit, every resume is shardkeeper's.

    import shardkeeper as sk
    from shardkeeper.integrations.transformers import Trainer     # instead of transformers.Trainer

    seg = sk.Segment()                                             # before the model: joins the process group
    args = TrainingArguments(..., max_steps=TOTAL, per_device_train_batch_size=GLOBAL // seg.world_size)
    trainer = Trainer(model=model, args=args, train_dataset=ds, segment=seg)
    trainer.train()                                                # resumes the newest valid checkpoint

Run it with ``shardkeeper train --script train.py --run-dir RUN --until-step N --nproc K`` (``--set
backend=deepspeed`` when ``TrainingArguments(deepspeed=...)``); ``examples/hf_trainer.py`` is a complete script.

What changes against a plain Trainer:

- Load: after the Trainer has prepared model, optimizer and scheduler (DeepSpeed engine, FSDP2 module or a
  single process), ``Segment.steps()`` loads the newest checkpoint that validates, falling back to older ones
  (quarantine), at any world size (FSDP2 reshards through DCP, DeepSpeed through the universal conversion).
  The Trainer's counters (``global_step``, ``epoch``, flos, tokens seen, ``log_history``) and its LR scheduler
  are tracked objects of the checkpoint; the sampler position follows from ``global_step`` as in the Trainer's
  own resume (the skipped batches of the resumed epoch), and the RNG comes back as the Trainer's own resume
  restores it (again after the first batch is fetched). ``train(resume_from_checkpoint=...)`` is not needed
  (``True``/``None`` mean the same). Given a path: a checkpoint of this run resumes the run's newest valid one;
  another tool's checkpoint (an HF Trainer or DeepSpeed ``checkpoint-N``, a DCP folder: what ``shardkeeper import``
  reads) is imported into a run that has no checkpoint yet, described by the live model and optimizer (rank 0
  converts while the others wait), then resumed; a run that already has checkpoints resumes its newest valid one,
  and one line says so (``trainer.api.adopt.resume_from``).
- Any checkpoint whose model tensors match the Trainer's model continues, whoever wrote it (``shardkeeper import``,
  the built-in trainer, another script): its LR scheduler is fast-forwarded to the checkpoint's step and the
  counters start at that step when the checkpoint holds none of them, and the optimizer keeps the
  ``TrainingArguments``' settings.
- Save: the Trainer's save policy (``save_steps``, ``save_strategy``) and the run's ``checkpoint.interval``
  both commit a shardkeeper checkpoint (manifest with checksums and fingerprint, re-read, retention) instead of
  ``output_dir/checkpoint-N``; SIGTERM commits at the next step boundary and the process exits 75.
- The segment ends at ``--until-step``: ``TrainingArguments.max_steps`` is the length of the whole run (the LR
  schedule), ``--until-step`` how far this segment goes (at most ``max_steps``).
- ``metrics.jsonl`` gets one row per optimizer step: the step's loss (mean over the ranks) and learning rate.

Keep the global batch when the world size changes (``per_device_train_batch_size * gradient_accumulation_steps
* world_size``), or the same step sees other samples. Sharding: DeepSpeed (``deepspeed=``, on GPUs and on
CPU), FSDP2 (``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``: Accelerate enables FSDP on GPUs only) or a
replicated model (DDP, the Trainer's default on several ranks; DCP saves one copy).

Refused: ``load_best_model_at_end`` (it reloads a ``checkpoint-N`` folder; export the step you choose instead).
Not restored: Python's and NumPy's RNG (a data collator that draws from them, e.g. masked-LM masking, sees other
numbers after a resume), callbacks' own state (``ExportableState``), a gradient scaler (fp16).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import transformers

from schemas.errors import UsageError
from trainer.api.segment import Segment

log = logging.getLogger("shardkeeper.integrations.transformers")

__all__ = ["ShardkeeperTrainerMixin", "Trainer", "TrainerCounters"]

# TrainerState fields that continue across segments (the same on every rank); the others are recomputed from the
# TrainingArguments at every start, or are per rank (is_world_process_zero).
_COUNTERS = (
    "global_step",
    "epoch",
    "total_flos",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "log_history",
)


class TrainerCounters:
    """The Trainer's resumable counters as a tracked object (``state_dict``/``load_state_dict``).

    The counters are the ``TrainerState`` fields that continue across segments: ``global_step``, ``epoch``,
    ``total_flos``, ``num_input_tokens_seen``, ``best_metric``, ``best_global_step`` and ``log_history``.

    Args:
        trainer: The Trainer whose ``state`` is read and written.
    """

    def __init__(self, trainer: transformers.Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """Return the counters by field name (the same on every rank)."""
        st = self.trainer.state
        return {k: getattr(st, k) for k in _COUNTERS}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Set the Trainer's counters from ``sd``; a field ``sd`` lacks keeps its value.

        Args:
            sd: What ``state_dict`` returned when the checkpoint was saved.
        """
        for k in _COUNTERS:
            if k in sd:
                setattr(self.trainer.state, k, list(sd[k]) if k == "log_history" else sd[k])

    def start_at_step(self, step: int) -> None:
        """Continue at ``step`` from a checkpoint that holds no Trainer counters (an import, the built-in trainer).

        Only ``global_step`` is set (the sampler position follows from it); the other counters start fresh.

        Args:
            step: The checkpoint's step.
        """
        self.trainer.state.global_step = step


class ShardkeeperTrainerMixin:
    """Run a ``transformers.Trainer`` class under shardkeeper: put it first among the bases.

    Every save becomes a shardkeeper commit and every resume shardkeeper's (see the module docstring);
    ``Trainer`` is this mixin over ``transformers.Trainer``.

    Args:
        *args: The Trainer class's own positional arguments.
        segment: The segment to train in; default: a new ``shardkeeper.Segment()`` (created before the Trainer's
            own set-up, as it joins the process group the Trainer's Accelerator uses).
        **kwargs: The Trainer class's own keyword arguments.

    Raises:
        UsageError: ``TrainingArguments(load_best_model_at_end=True)`` (its ``checkpoint-N`` folders are not
            written; export the step you choose instead).
        SystemExit: Exit code 2: no ``segment`` given and the script was not launched by ``shardkeeper train``
            (as ``shardkeeper.Segment()``).

    Example:
        ```python
        from trl import SFTTrainer

        class MyTrainer(ShardkeeperTrainerMixin, SFTTrainer):
            pass

        trainer = MyTrainer(model=model, args=args, train_dataset=ds, segment=seg)
        trainer.train()
        ```
    """

    def __init__(self, *args: Any, segment: Segment | None = None, **kwargs: Any):
        # The Segment first: it joins (or creates) the process group the Trainer's Accelerator then uses.
        self.sk_segment = segment if segment is not None else Segment()
        self._sk_steps: Any = None  # the Segment.steps() generator, advanced once per optimizer step
        self._sk_done = False  # the segment reached --until-step (its last checkpoint is committed)
        self._sk_save_wanted = False  # the Trainer's own save policy asked for a checkpoint at this step
        self._sk_loss: torch.Tensor | None = None  # this optimizer step's loss on this rank (micro-batches summed)
        self._sk_rng: dict[str, torch.Tensor] | None = None  # the RNG right after the load (re-applied like HF does)
        self._sk_advanced_at = -1
        self._sk_resume_from: str | os.PathLike[str] | None = None  # train(resume_from_checkpoint=PATH)
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:  # type: ignore[attr-defined]
            raise UsageError(
                "TrainingArguments(load_best_model_at_end=True): the Trainer's checkpoint-N folders are "
                "not written under shardkeeper (its checkpoints are the run's); train with it off, then "
                "export the step you choose: shardkeeper export RUN/checkpoints/step-N OUT"
            )

    # ------------------------------------------------------------------ entry
    def train(
        self, resume_from_checkpoint: str | os.PathLike[str] | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Train this segment: resume the run's newest valid checkpoint (or start), train to ``--until-step``.

        Args:
            resume_from_checkpoint: ``None``, ``True`` or ``False``: the run's newest valid checkpoint (the run
                directory decides). A path: a checkpoint of this run resumes the run's newest valid one; another
                tool's (an HF Trainer or DeepSpeed ``checkpoint-N``, a DCP folder) is imported into a run that has
                no checkpoint yet, then resumed; a run that already has checkpoints resumes its newest valid one
                and one line says so (``trainer.api.adopt.resume_from``).
            *args: Passed on to the Trainer's ``train``.
            **kwargs: Passed on to the Trainer's ``train``.

        Returns:
            What the Trainer's ``train`` returns (a ``TrainOutput``).

        Raises:
            UsageError: ``--until-step`` beyond ``TrainingArguments.max_steps``, a loaded Trainer state at another
                step than its checkpoint, or anything ``Segment.track`` / ``Segment.steps`` refuses.
            CheckpointError: The run has checkpoints and none can be trusted, or ``resume_from_checkpoint`` names
                a checkpoint that cannot be imported (one line says why).
            SegmentPreempted: A stop signal reached a rank; the checkpoint is committed (exit 75).
            SegmentStopped: A NaN/Inf loss was logged; nothing of it is committed (exit 65).
        """
        path = resume_from_checkpoint
        self._sk_resume_from = path if isinstance(path, (str, os.PathLike)) and not isinstance(path, bool) else None
        return super().train(None, *args, **kwargs)  # type: ignore[misc]

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """The Trainer prepares model, optimizer and scheduler; then the segment loads into them (or starts)."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)  # type: ignore[misc]
        self._sk_begin(max_steps)
        return model, train_dataloader

    def _sk_tracked(self) -> tuple[Any, Any]:
        if self.is_deepspeed_enabled:  # type: ignore[attr-defined]
            return self.model_wrapped, None  # type: ignore[attr-defined]  # the engine brings its optimizer
        model = self.model  # type: ignore[attr-defined]  # FSDP2: the sharded module; DDP: the replica inside
        opt = self.optimizer  # type: ignore[attr-defined]
        return model, getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one

    def _sk_begin(self, max_steps: int) -> None:
        seg, args = self.sk_segment, self.args  # type: ignore[attr-defined]
        if seg.until_step > max_steps:
            raise UsageError(
                f"--until-step {seg.until_step} is beyond the Trainer's max_steps {max_steps} (the run's "
                f"whole length, which sets the LR schedule); pass --until-step {max_steps} or less, or "
                "raise TrainingArguments.max_steps"
            )
        model, optimizer = self._sk_tracked()
        seg.track(
            model=model,
            optimizer=optimizer,
            scheduler=self.lr_scheduler,  # type: ignore[attr-defined]
            trainer_state=TrainerCounters(self),  # type: ignore[arg-type]  # the mixin is always on a Trainer
        )
        global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * seg.world_size
        if self._sk_resume_from is not None:  # before the load: it may import another tool's checkpoint into the run
            from trainer.api.adopt import resume_from

            resume_from(
                seg,
                os.fspath(self._sk_resume_from),
                samples_per_step=global_batch,
                what="Trainer.train(resume_from_checkpoint)",
            )
        self._sk_steps = seg.steps(samples_per_step=global_batch)
        try:
            next(self._sk_steps)  # the load (or a fresh start), up to the first step to train
        except StopIteration:
            self._sk_done = True
        state = self.state  # type: ignore[attr-defined]
        if state.global_step != seg.step:
            raise UsageError(
                f"the loaded Trainer state is at global_step {state.global_step}, the checkpoint at step "
                f"{seg.step}; was it written by another script?"
            )
        self._sk_advanced_at = seg.step
        self._sk_rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and seg.device.type == "cuda":
            self._sk_rng["cuda"] = torch.cuda.get_rng_state(seg.device)

    # ------------------------------------------------------------------ the loop
    def _run_epoch(self, *args: Any, **kw: Any) -> Any:
        """Skip what the checkpoint already trained: whole epochs, then the batches of the resumed epoch (the
        Trainer computed its skip from a fresh state, before the load)."""
        if self._sk_done:
            self.control.should_training_stop = True  # type: ignore[attr-defined]
            return None
        done = self.state.global_step  # type: ignore[attr-defined]
        if done > 0:
            per_epoch = kw["num_update_steps_per_epoch"]
            resumed_epoch = done // per_epoch
            if kw["epoch"] < resumed_epoch:
                return None
            kw["epochs_trained"] = resumed_epoch
            kw["steps_trained_in_current_epoch"] = (done % per_epoch) * self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
            kw["resume_from_checkpoint"] = str(self.sk_segment.run_dir.root)
        return super()._run_epoch(*args, **kw)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: Any) -> None:
        """The Trainer calls this after fetching the first batch of a resumed epoch: the RNG as loaded."""
        if self._sk_rng is None:
            return
        torch.set_rng_state(self._sk_rng["cpu"])
        if "cuda" in self._sk_rng:
            torch.cuda.set_rng_state(self._sk_rng["cuda"], self.sk_segment.device)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]
        self._sk_loss = loss.detach().float() if self._sk_loss is None else self._sk_loss + loss.detach().float()
        return loss

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """After the Trainer's own logging, evaluation and save decision: end the step in the segment."""
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        if self.state.global_step != self._sk_advanced_at and not self._sk_done:  # type: ignore[attr-defined]
            self._sk_advance()
        if self._sk_save_wanted:
            self._sk_save_wanted = False
            if not self._sk_done:  # at --until-step the final commit is this step's checkpoint
                self.sk_segment.save()

    def _sk_advance(self) -> None:
        """One optimizer step done: its metrics row, then the segment's step boundary (preemption checkpoint and
        exit 75, the interval save, or the final commit at --until-step)."""
        seg = self.sk_segment
        self._sk_advanced_at = self.state.global_step  # type: ignore[attr-defined]
        loss = self._sk_loss if self._sk_loss is not None else torch.zeros((), device=seg.device)
        self._sk_loss = None
        total = loss.detach().clone()
        if seg.world_size > 1:
            dist.all_reduce(total)
        lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else None  # type: ignore[attr-defined]
        seg.log(loss=float(total) / seg.world_size, **({"lr": float(lr)} if lr is not None else {}))
        try:
            next(self._sk_steps)
        except StopIteration:
            self._sk_done = True
            self.control.should_training_stop = True  # type: ignore[attr-defined]
            return

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save policy fired: commit a shardkeeper checkpoint at this step (after its boundary)."""
        self._sk_save_wanted = True


class Trainer(ShardkeeperTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` under shardkeeper: commits, validated resume at any world size, preemption.

    Takes ``segment=`` besides the Trainer's own arguments; what changes against a plain Trainer is in the module
    docstring and the tutorial "Hugging Face Trainer and Accelerate".

    Args:
        *args: ``transformers.Trainer``'s positional arguments.
        segment: The segment to train in; default: a new ``shardkeeper.Segment()``.
        **kwargs: ``transformers.Trainer``'s keyword arguments.

    Raises:
        UsageError: ``TrainingArguments(load_best_model_at_end=True)``; from ``train()``: ``--until-step`` beyond
            ``max_steps``, or what ``Segment.track`` / ``Segment.steps`` refuses.
        SystemExit: Exit code 2: no ``segment`` given and the script was not launched by ``shardkeeper train``.

    Example:
        ```python
        import shardkeeper as sk
        from shardkeeper.integrations.transformers import Trainer

        seg = sk.Segment()
        args = TrainingArguments(..., max_steps=TOTAL, per_device_train_batch_size=GLOBAL // seg.world_size)
        Trainer(model=model, args=args, train_dataset=ds, segment=seg).train()
        ```
    """
