"""The composition matrix (a helper module, not a test module): every kind of run x every origin of the checkpoint it
continues x every way to continue it, generated from the product of the three factors, each cell run through the
real doors (the CLI in a subprocess, torchrun, the Prefect flows in-process against a real server) and judged the
same way.

Factors and levels:

- kind: ``config`` (the built-in trainer, ``--config configs/tiny.yaml``), ``fsdp2-script`` (a user's own FSDP2
  loop), ``deepspeed-script`` (a user's own DeepSpeed ZeRO-2 loop), ``hf-trainer`` (a Hugging Face Trainer on
  DeepSpeed ZeRO-2, shardkeeper.integrations.transformers), ``accelerate`` (an Accelerate loop,
  shardkeeper.integrations.accelerate). The four scripts are tests/scripts/llama_loop.py's kinds.
- origin: ``fresh`` (the kind trains the run from step 0), or a checkpoint another tool wrote at step 3 on 2 ranks,
  imported with ``shardkeeper import SRC --config configs/tiny.yaml`` (``--set backend=deepspeed`` for the kinds on
  DeepSpeed): ``hf-deepspeed`` (a plain Hugging Face Trainer on DeepSpeed ZeRO-2: ``out/checkpoint-3``), ``dcp``
  (a plain ``dcp.save`` of ``get_state_dict``), ``torchtitan`` (torchtitan's ``step-3/``).
- continuation: ``same-world`` (``shardkeeper train`` on 2 ranks), ``other-world`` (``train`` on 3 ranks),
  ``reshard`` (``shardkeeper reshard CKPT --world-size 3``, then ``train`` on 3), ``prefect`` (the train-and-export
  flow: a segment on 2 ranks, one on 3, validation, export, publish to a file:// target), ``automation`` (the
  train-and-export flow on 2 ranks, SIGTERM to its ranks, the flow run hands its plan over, then the resume flow for
  that run directory, as the automation runs it, finishes the plan: the segment, export, publish).

A fresh origin trains steps 1-3 on 2 ranks first (its own segment; the flows train from step 0 themselves); every
chain ends at step 8 (24 for ``automation``, room for the SIGTERM to land mid-segment).

A cell ends one of three ways (``Outcome``): **continued** -- its losses are within 1e-6 (relative) of the kind's
uninterrupted reference and the final checkpoint's export loads with ``from_pretrained``; **refused** -- one line,
exit 2, before anything launched (``refused (ranks)`` when the ranks refused it); **FAILED** -- anything else.

The references (``Matrix.reference``): the four scripts train one recipe (tests/scripts/llama_loop.py: its losses
do not depend on the world size or on which of the four kinds trains it), the recipe the checkpoint writers here
train too, so a script cell's reference is the writer's own run trained straight through past the step it saved:
for an imported origin its writer, for a fresh one the writer of the kind's own backend (the plain DCP loop for
FSDP2 and Accelerate, the plain Trainer on DeepSpeed for the DeepSpeed script and the Trainer). Two programs of one
recipe agree to ~1e-7 for the first steps and then drift apart as float noise grows (the DeepSpeed script against
the Trainer: 3e-6 at step 20, 1.4e-4 at step 24), so an ``automation`` cell (24 steps) is judged against the kind
itself from the same origin, uninterrupted: one segment on 2 ranks through the same CLI. The built-in trainer trains
its own data and optimizer: its reference is itself, from the same origin, in one segment on 2 ranks (in-process
ranks, tests.harness.spawn).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
LOOP = ROOT / "tests" / "scripts" / "llama_loop.py"

ORIGIN_STEP = 3  # the step every imported checkpoint (and a fresh run's first segment) ends at
WORLD, OTHER = 2, 3  # the origin's world size, and the other one a continuation moves to
MIDDLE = 5  # where the prefect continuation's first segment (2 ranks) hands over to its second (3 ranks)
END = 8
END_AUTOMATION = 24
SOURCE_STEPS = END_AUTOMATION  # the writers train this far (the references)
TOLERANCE = 1e-6


# ------------------------------------------------------------------------------------------ the factors
@dataclass(frozen=True)
class Kind:
    name: str
    label: str
    backend: str  # what the run says (backend: fsdp2 | deepspeed)
    script_args: tuple[str, ...] | None  # None: the built-in trainer (--config)

    @property
    def sets(self) -> list[str]:
        return ["backend=deepspeed"] if self.backend == "deepspeed" else []


KINDS = {
    k.name: k
    for k in (
        Kind("config", "built-in trainer (--config)", "fsdp2", None),
        Kind("fsdp2-script", "own FSDP2 script", "fsdp2", ("--global-batch", "6")),
        Kind("deepspeed-script", "own DeepSpeed script", "deepspeed", ("--deepspeed", "--global-batch", "6")),
        Kind("hf-trainer", "HF Trainer (DeepSpeed ZeRO-2)", "deepspeed", ("--trainer", "--deepspeed")),
        Kind("accelerate", "Accelerate (FSDP2)", "fsdp2", ("--accelerate",)),
    )
}
ORIGINS = {
    "fresh": "fresh",
    "hf-deepspeed": "imported HF Trainer + DeepSpeed ZeRO-2 checkpoint-3",
    "dcp": "imported plain DCP",
    "torchtitan": "imported torchtitan DCP",
}
CONTINUATIONS = {
    "same-world": "train, same world size (2)",
    "other-world": "train, 3 ranks",
    "reshard": "reshard to 3, then train",
    "prefect": "Prefect train-and-export 2 -> 3 ranks + export",
    "automation": "SIGTERM, then the resume automation's flow",
}
FACTORS = (tuple(KINDS), tuple(ORIGINS), tuple(CONTINUATIONS))


@dataclass(frozen=True)
class Cell:
    kind: str
    origin: str
    continuation: str

    @property
    def key(self) -> str:
        return f"{self.kind}.{self.origin}.{self.continuation}"

    @property
    def end(self) -> int:
        return END_AUTOMATION if self.continuation == "automation" else END

    @property
    def first(self) -> int:
        """The first step the cell's own segments train (a fresh run trains from 1)."""
        return 1 if self.origin == "fresh" else ORIGIN_STEP + 1


def product() -> list[Cell]:
    """Every cell: the product of the three factors, in factor order."""
    return [Cell(*c) for c in itertools.product(*FACTORS)]


def covering() -> list[Cell]:
    """A subset in which every level of every factor, and every (kind, continuation) pair, appears at least once,
    and every kind meets every origin, generated (not listed): cell i of the 25 (kind, continuation) pairs in
    product order takes origin number (i + i // 5) mod 4, which walks each kind's five continuations over the four
    origins with a shift per kind, so the (kind, origin) pairs are all met too."""
    kinds, origins, conts = FACTORS
    pairs = list(itertools.product(kinds, conts))
    return [Cell(k, origins[(i + i // len(conts)) % len(origins)], c) for i, (k, c) in enumerate(pairs)]


def levels_cover(cells: list[Cell]) -> list[Cell]:
    """The smallest generated subset of ``cells`` that still holds every level of every factor: cell i of the
    diagonal takes kind i, origin i and continuation i (each mod its number of levels), for i < the largest
    number of levels (5)."""
    kinds, origins, conts = FACTORS
    n = max(len(f) for f in FACTORS)
    return [Cell(kinds[i % len(kinds)], origins[i % len(origins)], conts[i % len(conts)]) for i in range(n)]


# ------------------------------------------------------------------------------------------ outcomes
@dataclass
class Outcome:
    cell: Cell
    status: str  # continued | refused | refused (ranks) | FAILED
    max_rel: float | None = None  # the largest relative loss difference against the reference
    exact: bool = False  # every compared loss bit-identical
    export_loads: bool | None = None
    line: str = ""  # the refusal's one line, or what failed
    seconds: float = 0.0
    reference: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "continued" or self.status == "refused"

    def cell_text(self) -> str:
        """The table cell: ``continued: 3.1e-08, export loads`` / ``refused: LINE`` / ``FAILED: WHAT``."""
        if self.status == "continued":
            diff = "bitwise" if self.exact else f"{self.max_rel:.1e}"
            return f"continued: {diff}, export loads" if self.export_loads else f"continued: {diff}, export FAILED"
        return f"{self.status}: {self.line}".replace("|", "\\|")


class Refused(Exception):
    """A door refused the cell in one line (exit 2)."""

    def __init__(self, line: str, *, by_ranks: bool = False):
        super().__init__(line)
        self.line, self.by_ranks = line, by_ranks


class CellFailed(Exception):
    """What failed in a cell (the first line of the door's error)."""


# ------------------------------------------------------------------------------------------ the writers (rank side)
def recipe() -> dict[str, Any]:
    """tests/scripts/llama_loop.py's recipe: model, data table, per-rank rows, DeepSpeed and Trainer settings."""
    return runpy.run_path(str(LOOP))


def _record(losses: list[float], loss: Any, world: int) -> None:
    import torch.distributed as dist

    total = loss.detach().float().clone()
    dist.all_reduce(total)
    losses.append(float(total) / world)


def write_deepspeed(out: str, stage: int = 2, steps: int = SOURCE_STEPS, saves: tuple[int, ...] = (2, 3)) -> None:
    """A plain DeepSpeed user: the recipe in a ZeRO-``stage`` engine, ``engine.save_checkpoint`` after ``saves``,
    on to ``steps``; every step's loss (mean over the ranks) in ``losses.json``. DeepSpeed's JIT-built shm op is
    skipped (trainer.deepspeed.shm: it serves inference all-reduce only and changes no byte of a checkpoint)."""
    import torch
    import torch.distributed as dist

    from trainer.deepspeed.shm import skip_shm_op

    skip_shm_op()  # before deepspeed is imported: its CPU comm backend would build the op in initialize
    import deepspeed

    r = recipe()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = r["tiny_llama"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=r["LR"], weight_decay=0.0)
    config = {**r["deepspeed_config"](r["BATCH"] // world), "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data, losses = r["table"](), []
    for step in range(steps):
        x = r["rows_of"](data, step, rank, world)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        _record(losses, loss, world)
        if step + 1 in saves:
            engine.save_checkpoint(out)
    if rank == 0:
        model.config.save_pretrained(out)
        (Path(out) / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def write_dcp_layouts(out: str, steps: int = SOURCE_STEPS, save_at: int = ORIGIN_STEP) -> None:
    """A plain FSDP2 user: the recipe, its state after ``save_at`` steps saved three ways (``plain/``: ``dcp.save``
    of ``get_state_dict``; ``titan/step-N/``: torchtitan's layout; ``accelerate/``: Accelerate's FSDP folders) plus
    a full ``reference.pt``, then on to ``steps``; every step's loss in ``losses.json``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r = recipe()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = r["tiny_llama"]()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=r["LR"], weight_decay=0.0)
    data, losses, root = r["table"](), [], Path(out)
    for step in range(steps):
        x = r["rows_of"](data, step, rank, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        _record(losses, loss, world)
        if step + 1 != save_at:
            continue
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=root / "plain")
        _, flat = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save(
            {
                **msd,
                "optimizer": flat,
                "lr_scheduler": {"last_epoch": save_at},
                "train_state": {"step": torch.tensor(save_at)},
            },
            checkpoint_id=root / "titan" / f"step-{save_at}",
        )
        dcp.save({"model": msd}, checkpoint_id=root / "accelerate" / "pytorch_model_fsdp_0")
        dcp.save({"optimizer": osd}, checkpoint_id=root / "accelerate" / "optimizer_0")
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        fmsd, fosd = get_state_dict(model, optimizer, options=full)
        if rank == 0:
            torch.save({"model": fmsd, "optim": fosd["state"]}, root / "reference.pt")
    if rank == 0:
        (root / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def write_trainer_deepspeed(out: str, steps: int = SOURCE_STEPS, save_at: int = ORIGIN_STEP) -> None:
    """A plain Hugging Face Trainer on DeepSpeed ZeRO-2 (no shardkeeper), the seed user's: the recipe's
    TrainingArguments, ``out/checkpoint-3`` saved by the Trainer itself (``latest``, ``global_step3/``,
    ``trainer_state.json``...), stopped after ``steps``; every step's loss (mean over the ranks) in
    ``out/losses.json``. On CPU the process group is gloo, made before the Trainer (its DeepSpeed would ask for
    oneCCL)."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback

    from trainer.deepspeed.shm import skip_shm_op

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    skip_shm_op()
    r = recipe()
    dist.init_process_group("gloo")
    world, losses = dist.get_world_size(), []

    class SaveOnce(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            control.should_save = state.global_step == save_at
            control.should_training_stop = state.global_step >= steps
            return control

    class Recording(Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            _record(losses, loss, world)
            return loss

    args = r["trainer_args"](out, world, deepspeed=True)
    trainer = Recording(
        model=r["tiny_llama"](), args=args, train_dataset=r["samples"](r["table"]()), callbacks=[SaveOnce()]
    )
    trainer.train()
    if dist.get_rank() == 0:
        (Path(out) / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the sources
class Sources:
    """The checkpoints other tools wrote (each built once, on first use, under ``root``; thread-safe) and their
    writers' losses."""

    def __init__(self, root: Path, *, reuse: bool = False):
        self.root, self.reuse = Path(root), reuse  # reuse: a folder a previous build completed (the bench's --reuse)
        self._lock = threading.Lock()
        self._built: dict[str, Path] = {}

    def _build(self, name: str, fn: Any, *args: Any) -> Path:
        from tests.harness import spawn

        with self._lock:
            if name not in self._built:
                out = self.root / name
                if self.reuse and (out / "losses.json").is_file():
                    self._built[name] = out
                    return out
                shutil.rmtree(out, ignore_errors=True)
                with _env(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=_extensions_dir()):
                    spawn(fn, WORLD, str(out), *args, timeout=900)
                self._built[name] = out
            return self._built[name]

    def deepspeed(self, stage: int = 2) -> Path:
        """A plain DeepSpeed ZeRO-``stage`` engine's folder (``latest``, ``global_step2/``, ``global_step3/``)."""
        return self._build(f"deepspeed-zero{stage}", write_deepspeed, stage)

    def dcp(self) -> Path:
        """``plain/``, ``titan/step-3/``, ``accelerate/`` and ``reference.pt`` of one FSDP2 run."""
        return self._build("dcp", write_dcp_layouts)

    def trainer_deepspeed(self) -> Path:
        """A plain Trainer's ``output_dir`` holding ``checkpoint-3`` (DeepSpeed ZeRO-2, 2 ranks)."""
        return self._build("trainer-deepspeed", write_trainer_deepspeed)

    def origin(self, name: str) -> Path:
        """What ``shardkeeper import`` is given for an origin."""
        if name == "hf-deepspeed":
            return self.trainer_deepspeed() / f"checkpoint-{ORIGIN_STEP}"
        if name == "dcp":
            return self.dcp() / "plain"
        if name == "torchtitan":
            return self.dcp() / "titan"
        raise ValueError(f"origin {name!r} is written by the kind itself")

    def losses(self, name: str) -> dict[int, float]:
        """The writer's losses by step (1-based) of the origin ``name`` (``dcp``/``torchtitan``: the DCP loop;
        ``hf-deepspeed``: the Trainer; ``deepspeed``: the plain engine)."""
        folder = {
            "hf-deepspeed": self.trainer_deepspeed,
            "dcp": self.dcp,
            "torchtitan": self.dcp,
            "deepspeed": self.deepspeed,
        }[name]()
        return {i + 1: v for i, v in enumerate(json.loads((folder / "losses.json").read_text()))}


def _extensions_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))


class _env:
    """Environment variables set for a block (the ranks spawn inherits them)."""

    def __init__(self, **values: str):
        self.values, self.old = values, {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------------ the doors
def cli_env() -> dict[str, str]:
    return {
        **os.environ,
        "SHARDKEEPER_DEVICE": "cpu",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
        "TORCH_EXTENSIONS_DIR": _extensions_dir(),
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


def shardkeeper(*argv: str, timeout: float = 900) -> str:
    """``shardkeeper ARGV`` in a subprocess (as a user types it); returns its stdout. Exit 2 raises Refused with
    the one ``error:`` line (by the ranks when they refused the segment), any other failure CellFailed."""
    done = subprocess.run(
        [sys.executable, "-m", "shardkeeper", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=ROOT,
    )
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    if done.returncode == 2 and len(errors) == 1:
        raise Refused(errors[0][len("error: ") :], by_ranks="refused before its first step" in errors[0])
    if done.returncode != 0:
        what = errors[-1] if errors else (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CellFailed(f"shardkeeper {argv[0]} exit {done.returncode}: {what}")
    return done.stdout


class Matrix:
    """Runs cells (``run``) in folders under ``work`` against ``sources``; the flows' cells need a Prefect API
    (PREFECT_API_URL set in this process: a session's server fixture, or the bench's own)."""

    def __init__(self, sources: Sources, work: Path):
        self.sources, self.work = sources, Path(work)
        self._refs: dict[tuple[Any, ...], dict[int, float]] = {}
        self._firsts: dict[str, Path] = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------- one cell
    def run(self, cell: Cell) -> Outcome:
        """Run one cell end to end and judge it; never raises."""
        t0 = time.monotonic()
        folder = self.work / cell.key
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        run = folder / "run"
        out = Outcome(cell, "FAILED")
        try:
            ref_name, ref = self.reference(cell)
            out.reference = ref_name
            getattr(self, "_" + cell.continuation.replace("-", "_"))(cell, run)
            got = _metrics(run)
            steps = range(cell.first, cell.end + 1)
            missing = [s for s in steps if s not in got]
            if missing:
                raise CellFailed(f"no loss logged for step(s) {missing[:5]} of {cell.first}..{cell.end}")
            diffs = [abs(got[s] - ref[s]) / abs(ref[s]) for s in steps]
            bad = [s for s, d in zip(steps, diffs, strict=True) if not math.isfinite(d)]
            if bad:  # max() would skip a NaN that is not first
                raise CellFailed(f"a non-finite loss or reference at step(s) {bad[:5]}")
            out.max_rel = max(diffs)
            out.exact = all(got[s] == ref[s] for s in steps)
            out.export_loads = loads_with_from_pretrained(self._export_of(cell, run, folder))
            ok = out.max_rel <= TOLERANCE and out.export_loads
            out.status = "continued" if ok else "FAILED"
            if not ok:
                out.line = (
                    f"losses differ from {ref_name} by up to {out.max_rel:.2e}"
                    if out.max_rel > TOLERANCE
                    else "the export does not load with from_pretrained"
                )
        except Refused as e:
            out.status, out.line = ("refused (ranks)" if e.by_ranks else "refused"), e.line
        except Exception as e:  # noqa: BLE001 - a cell's failure is its outcome
            out.status, out.line = "FAILED", _first_line(e)
            (folder / "failure.txt").write_text(traceback.format_exc())
        out.seconds = time.monotonic() - t0
        return out

    # -------------------------------------------------------------------------------- origins
    def start(self, cell: Cell, run: Path) -> None:
        """The run as the cell's continuation finds it: a fresh run trained to step 3 on 2 ranks by the kind (one
        launch per kind, copied), or another tool's checkpoint imported."""
        kind = KINDS[cell.kind]
        if cell.origin == "fresh":
            first = self._first_segment(kind)
            shutil.copytree(first, run, ignore=shutil.ignore_patterns(".lock"))
            return
        self.import_into(kind, cell.origin, run)

    def import_into(self, kind: Kind, origin: str, run: Path) -> str:
        """``shardkeeper import`` of the origin into a new run for ``kind``; returns what it printed."""
        argv = ["import", str(self.sources.origin(origin)), "--config", TINY, "--run-dir", str(run)]
        return shardkeeper(*argv, *[a for s in kind.sets for a in ("--set", s)])

    def _first_segment(self, kind: Kind) -> Path:
        with self._lock:
            if kind.name not in self._firsts:
                run = self.work / "first" / kind.name
                shutil.rmtree(run, ignore_errors=True)
                shardkeeper(*train_argv(kind, run, WORLD, ORIGIN_STEP, new=True))
                self._firsts[kind.name] = run
            return self._firsts[kind.name]

    # -------------------------------------------------------------------------------- continuations
    def _same_world(self, cell: Cell, run: Path) -> None:
        self.start(cell, run)
        shardkeeper(*train_argv(KINDS[cell.kind], run, WORLD, cell.end))

    def _other_world(self, cell: Cell, run: Path) -> None:
        self.start(cell, run)
        shardkeeper(*train_argv(KINDS[cell.kind], run, OTHER, cell.end))

    def _reshard(self, cell: Cell, run: Path) -> None:
        self.start(cell, run)
        shardkeeper("reshard", str(run / "checkpoints" / f"step-{ORIGIN_STEP:08d}"), "--world-size", str(OTHER))
        shardkeeper(*train_argv(KINDS[cell.kind], run, OTHER, cell.end))

    def _prefect(self, cell: Cell, run: Path) -> None:
        from schemas.requests import SegmentPlan

        if cell.origin != "fresh":
            self.start(cell, run)  # the flow trains a fresh run from step 0 itself
        segments = [SegmentPlan(nproc=WORLD, until_step=MIDDLE), SegmentPlan(nproc=OTHER, until_step=cell.end)]
        state = run_flow(flow_request(KINDS[cell.kind], run, segments))
        if not state.is_completed():
            raise CellFailed(f"train-and-export ended {state.name}: {_state_message(state)}")

    def _automation(self, cell: Cell, run: Path) -> None:
        from flows.resume import resume
        from schemas.requests import SegmentPlan

        if cell.origin != "fresh":
            self.start(cell, run)
        request = flow_request(
            KINDS[cell.kind], run, [SegmentPlan(nproc=WORLD, until_step=cell.end)], max_preemption_retries=0
        )
        done = threading.Event()
        watcher = sigterm_when_training(run, done, after_step=cell.first)
        try:
            state = run_flow(request)
        finally:
            done.set()
            watcher.join(10)
        if state.name != "HandedOver":
            raise CellFailed(
                f"the preempted train-and-export flow run ended {state.name}, not HandedOver: {_state_message(state)}"
            )
        resumed = resume(run_dirs=[str(run)], roots=[], backoff_s=0.0, return_state=True)
        if not resumed.is_completed():
            raise CellFailed(f"the resume flow run ended {resumed.name}: {_state_message(resumed)}")
        item = resumed.result().items[0]
        if item.action != "resumed" or item.plan_status != "completed":
            raise CellFailed(f"the resume flow left the run {item.action} (plan {item.plan_status}): {item.reason}")

    def _export_of(self, cell: Cell, run: Path, folder: Path) -> Path:
        """The export of the run's final checkpoint: the flow's (its plan records it), else ``shardkeeper export``."""
        plan = run / "plan.json"
        if plan.is_file():
            exported = json.loads(plan.read_text()).get("exported")
            if not exported:
                raise CellFailed("the plan records no export")
            return Path(exported["out"])
        out = folder / "export"
        shardkeeper("export", str(run / "checkpoints" / f"step-{cell.end:08d}"), str(out))
        return out

    # -------------------------------------------------------------------------------- references
    def reference(self, cell: Cell) -> tuple[str, dict[int, float]]:
        """The uninterrupted run a cell's losses are compared with (see the module docstring): its name, and its
        losses by step."""
        kind = KINDS[cell.kind]
        if kind.script_args is not None:
            if cell.continuation == "automation":
                return "the kind itself, uninterrupted", self._own_reference(kind, cell.origin)
            if cell.origin != "fresh":
                return f"the {cell.origin} writer's own run", self.sources.losses(cell.origin)
            writer = "hf-deepspeed" if kind.backend == "deepspeed" else "dcp"
            return f"the {writer} writer's own run", self.sources.losses(writer)
        return "the built-in trainer in one segment", self._config_reference(cell.origin, cell.end)

    def _own_reference(self, kind: Kind, origin: str) -> dict[int, float]:
        """A script kind from ``origin`` (fresh: step 0; else the origin imported) to step 24 in one segment on 2
        ranks, through the CLI as a user runs it."""
        with self._lock:
            key = (kind.name, origin, END_AUTOMATION)
            if key not in self._refs:
                run = self.work / "reference" / f"{kind.name}.{origin}"
                shutil.rmtree(run, ignore_errors=True)
                if origin == "fresh":
                    shardkeeper(*train_argv(kind, run, WORLD, END_AUTOMATION, new=True))
                else:
                    self.import_into(kind, origin, run)
                    shardkeeper(*train_argv(kind, run, WORLD, END_AUTOMATION))
                self._refs[key] = _metrics(run)
            return self._refs[key]

    def _config_reference(self, origin: str, end: int) -> dict[int, float]:
        """The built-in trainer from ``origin`` to ``end`` in one segment on 2 in-process ranks (the longest end
        asked serves every shorter one: one segment's losses do not depend on where it stops)."""
        from tests.harness import spawn
        from trainer.segment import run_segment

        with self._lock:
            key = (origin, END_AUTOMATION)
            if key not in self._refs:
                run = self.work / "reference" / origin
                shutil.rmtree(run, ignore_errors=True)
                if origin == "fresh":
                    from tests.harness import new_run, tiny_spec

                    new_run(run, tiny_spec())
                else:
                    self.import_into(KINDS["config"], origin, run)
                spawn(run_segment, WORLD, str(run), END_AUTOMATION, 0, timeout=900)
                self._refs[key] = _metrics(run)
            return self._refs[key]


# ------------------------------------------------------------------------------------------ the commands
def train_argv(kind: Kind, run: Path, nproc: int, until: int, *, new: bool = False) -> list[str]:
    """``shardkeeper train`` for ``kind`` as a user types it: the config (a new run) or the script and its
    arguments; the backend of a DeepSpeed kind; for a run that exists, the run directory says the rest."""
    argv = ["train", "--run-dir", str(run), "--nproc", str(nproc), "--until-step", str(until)]
    if kind.script_args is None:
        return [*argv, "--config", TINY, "--set", "checkpoint.keep_last=100"] if new else argv
    sets = [a for s in kind.sets for a in ("--set", s)]
    return [*argv, "--script", str(LOOP), *sets, "--", *kind.script_args]


def flow_request(kind: Kind, run: Path, segments: list[Any], **more: Any) -> Any:
    """The train-and-export request for ``kind``'s run: its config or its script, the segments, export (float32)
    and a publish to a file:// target beside the run."""
    from schemas.requests import TrainExportRequest

    who: dict[str, Any] = (
        {"config": TINY}
        if kind.script_args is None
        else {"script": str(LOOP), "script_args": list(kind.script_args), "overrides": kind.sets}
    )
    return TrainExportRequest(
        run_dir=str(run),
        segments=segments,
        export_dtype="float32",
        backoff_s=0.0,
        publish_target=(run.parent / "published").as_uri(),
        **who,
        **more,
    )


def run_flow(request: Any) -> Any:
    """train-and-export in this process; its final state (Refused for a request it refused in one line)."""
    from prefect.exceptions import ParameterTypeError

    from flows.train_and_export import train_and_export
    from schemas.errors import ConfigError, RunDirError

    state = train_and_export(**request.parameters(), return_state=True)
    if state.is_failed():
        try:
            state.result()
        except (ConfigError, RunDirError, ParameterTypeError) as e:
            raise Refused(" ".join(str(e).split())) from None
        except BaseException:  # noqa: BLE001 - the state says it
            pass
    return state


def sigterm_when_training(run: Path, done: threading.Event, after_step: int) -> threading.Thread:
    """SIGTERM the run's torchrun process group (as a scheduler preempts a job) once ``after_step`` is logged."""
    from tests.reliability.procs import segment_processes

    def watch() -> None:
        while not done.is_set():
            if max(_metrics(run), default=0) >= after_step:
                for p in segment_processes(run, "torchrun"):
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except (ProcessLookupError, PermissionError):
                        continue
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def loads_with_from_pretrained(folder: Path) -> bool:
    """The export loads with ``AutoModelForCausalLM.from_pretrained`` and computes finite logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    return bool(torch.isfinite(logits).all())


def _metrics(run: Path) -> dict[int, float]:
    """The loss of each step in metrics.jsonl (a resumed segment's value wins)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out[row["step"]] = row["loss"]
    return out


def _state_message(state: Any) -> str:
    return " ".join(str(state.message or "").split())[:300]


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:400]


# ------------------------------------------------------------------------------------------ the table
def table(outcomes: list[Outcome]) -> str:
    """The matrix as markdown: one row per (kind, origin), one column per continuation."""
    by = {o.cell: o for o in outcomes}
    kinds, origins, conts = FACTORS
    head = ["run kind", "origin", *[CONTINUATIONS[c] for c in conts]]
    rows = []
    for k, o in itertools.product(kinds, origins):
        cells = [by[Cell(k, o, c)].cell_text() if Cell(k, o, c) in by else "" for c in conts]
        if any(cells):
            rows.append([KINDS[k].label, ORIGINS[o], *cells])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def summary(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


__all__ = [
    "CONTINUATIONS",
    "FACTORS",
    "KINDS",
    "ORIGINS",
    "Cell",
    "Matrix",
    "Outcome",
    "Sources",
    "covering",
    "levels_cover",
    "product",
    "table",
]
