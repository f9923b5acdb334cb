"""``shardkeeper``: every stage of the pipeline from the command line, without Prefect.

    shardkeeper prepare-data --config configs/my-data.yaml
    shardkeeper train --config configs/tiny.yaml --run-dir runs/demo --nproc 2 --until-step 20
    shardkeeper validate runs/demo/checkpoints/step-00000020 --deep
    shardkeeper reshard runs/demo/checkpoints/step-00000020 --world-size 3
    shardkeeper convert runs/ds/checkpoints/step-00000020 --to dcp runs/fsdp
    shardkeeper import out/checkpoint-500 --config configs/tiny.yaml --run-dir runs/adopted
    shardkeeper export runs/demo/checkpoints/step-00000020 runs/demo/exports/step-00000020 --dtype bfloat16
    shardkeeper publish runs/demo/exports/step-00000020 --repo-id ORG/NAME
    shardkeeper lineage runs/demo [--json]

A user mistake prints one line ("error: FILE: what is wrong; the fix") and exits non-zero.
"""

from __future__ import annotations

import errno
import logging
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from rich.logging import RichHandler

from schemas.errors import ShardkeeperError
from schemas.seam import EXIT_CANCELLED, RANK_ERROR_PREFIX

if TYPE_CHECKING:
    from schemas import RunSpec

try:  # typer >= 0.20 vendors click as typer._click; older ones raise click's own exceptions
    from typer._click.exceptions import ClickException as _TyperClickException
    from typer._click.exceptions import NoArgsIsHelpError as _NO_ARGS_HELP
except ImportError:  # pragma: no cover
    _TyperClickException = click.ClickException  # type: ignore[assignment,misc]
    _NO_ARGS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # type: ignore[assignment]
_CLICK_ERRORS = (_TyperClickException, click.ClickException)

from shardkeeper._cli_app import _RANK_LOG, _STATE, app, console, out  # noqa: E402,F401 - the app and its consoles


class _PlainLines(logging.StreamHandler):
    """A log record as one plain line on whatever ``sys.stderr`` is when it is written (as Rich's console does)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:  # StreamHandler's own assignment; the stream is always sys.stderr
        pass


# What would end or rewrite a line in a log file or for str.splitlines: control characters (line breaks, escape
# sequences) and Unicode's line separators.
_BREAKS = re.compile("[\\x00-\\x08\\x0a-\\x1f\\x7f\\x85\\u2028\\u2029]")


class _OneLine(logging.Formatter):
    """The ranks' time format ("2026-12-07 00:43:20,991"), then the level and the message with any control character
    or line separator in it escaped (``\\n``, ``\\x1b``: a path may hold one): a record is one line; a traceback
    (``--verbose``) follows it as is."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = _BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), record.message)
        return super().formatMessage(record)


def _setup_logging(verbose: bool) -> None:
    """The CLI's log handler on the root logger, at INFO (DEBUG with ``verbose``): Rich's on a terminal; anywhere else
    (a pipe, a file, CI) one plain line per record, since Rich lays a record out in columns and wraps it at the
    console's width (80 when piped: a warning reached grep and log files cut mid-path). Decided by ``isatty``: Rich's
    own test also says yes to FORCE_COLOR and TTY_COMPATIBLE, which CI logs set. A later call (``main`` run again in
    one process) replaces the handler an earlier call installed; a root logger configured by someone else is left
    as it is."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_shardkeeper_cli", False)]:
        root.removeHandler(old)
    if not root.handlers:
        handler: logging.Handler
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):  # no stderr, or a closed one
            tty = False
        if tty:
            handler = RichHandler(console=console, show_path=False, markup=False)
            handler.setFormatter(logging.Formatter("%(message)s"))
        else:
            handler = _PlainLines()
            handler.setFormatter(_OneLine())
        handler._shardkeeper_cli = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # botocore says "Found credentials in environment variables" at INFO for every s3:// client (all of it with -v)
    for name in ("botocore", "aiobotocore", "s3fs"):
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


@app.callback()
def _main(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="debug logging, all rank output, tracebacks")
    ] = False,
) -> None:
    _STATE["verbose"] = verbose
    _setup_logging(verbose)


def _rank_output(line: str) -> None:
    """The ranks' progress log reaches the terminal; their tracebacks, warnings and torchrun's summary only with
    -v (a failure is reported once, as one line, after the launch)."""
    own_error = "not restarted in place: " in line and "an error of its own" in line  # the failure line says it
    if _STATE["verbose"] or (_RANK_LOG.match(line) and RANK_ERROR_PREFIX not in line and not own_error):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    # str, not Path: Path("") would silently become the current directory; preflight refuses an empty one.
    run_dir: Annotated[str, typer.Option(help="run directory (created; resumed if it holds checkpoints)")],
    config: Annotated[
        Path | None,
        typer.Option(
            help="RunSpec YAML, e.g. configs/tiny.yaml (default: the run's own "
            "run.yaml on a resume; optional with --script)"
        ),
    ] = None,
    nproc: Annotated[int, typer.Option(help="ranks per node")] = 1,
    until_step: Annotated[int, typer.Option(help="train until this many optimizer steps are done")] = 20,
    launcher: Annotated[str, typer.Option(help="local (torchrun here) | slurm (an sbatch job)")] = "local",
    nodes: Annotated[
        int,
        typer.Option(
            help="nodes (world size = nodes x nproc); with --launcher local, several "
            "torchrun agents on this machine joined by c10d rendezvous"
        ),
    ] = 1,
    slurm_partition: Annotated[str | None, typer.Option(help="Slurm partition (default: the cluster's)")] = None,
    slurm_time: Annotated[
        int | None,
        typer.Option(help="Slurm time limit in minutes; the ranks get SIGTERM 60 s before it and commit a checkpoint"),
    ] = None,
    slurm_arg: Annotated[
        list[str] | None, typer.Option(help="extra sbatch option, e.g. --slurm-arg=--account=ml (repeatable)")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set optim.lr=1e-3")] = None,
    timeout: Annotated[float | None, typer.Option(help="stop (with a checkpoint) after this many seconds")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    restart: Annotated[
        bool,
        typer.Option(
            help="the run's checkpoints are all invalid: set them aside (step-*.invalid-*) and start over from step 0"
        ),
    ] = False,
    script: Annotated[
        str | None,
        typer.Option(
            help="train with your own script (it uses shardkeeper.Segment); "
            "its arguments follow --, e.g. --script train.py -- --lr 1e-3"
        ),
    ] = None,
) -> None:
    """Train one segment with torchrun; resumes from the latest valid checkpoint; always commits one at the end.
    With --script, every rank runs your script, which trains through shardkeeper.Segment (resumes of a script run
    need neither --config nor --script: the run remembers both).

    Exit code: 0 completed, 75 preempted (checkpoint committed; run the same command to resume), 1 failed,
    65 a non-finite loss or gradient (nothing of that step committed; see optim.on_nonfinite), 3 the run directory
    is locked (another segment, or its ranks, still running), 2 bad input: refused before anything is written, or
    by the ranks before their first step (what only a script knows; the run's status stays as it was)."""
    from launch.early import install_early_stop_handlers
    from shardkeeper.config import check_until_step, plain_path, train_spec
    from shardkeeper.stages import plan_topology, train_segment

    install_early_stop_handlers()  # a SIGTERM before the ranks start is a preemption too, not a crash
    check_until_step("--until-step", until_step)
    for flag, value in (("--run-dir", run_dir), ("--config", config), ("--script", script)):
        plain_path(flag, value)
    if timeout is not None and not timeout > 0:
        raise ShardkeeperError(f"--timeout {timeout:g}: must be a positive number of seconds; omit it for no timeout")
    if launcher != "slurm" and (slurm_partition or slurm_time or slurm_arg):
        raise ShardkeeperError("--slurm-partition/--slurm-time/--slurm-arg apply to --launcher slurm only")
    options = (
        {"partition": slurm_partition, "time_min": slurm_time, "extra_args": tuple(slurm_arg or ())}
        if launcher == "slurm"
        else {}
    )
    extra = list(ctx.args)
    if extra and script is None:
        raise ShardkeeperError(f"unexpected argument {extra[0]!r}; script arguments go after --script FILE --")
    spec = train_spec(config, set_, run_dir, script=script, script_args=extra)
    topo = plan_topology(spec, nproc, nodes=nodes, launcher=launcher, device=device, launcher_options=options)
    res = train_segment(
        spec,
        run_dir,
        topo,
        until_step,
        timeout_s=timeout,
        restart=restart,
        sink=_rank_output,
        launcher_options=options,
        warm_up=True,
    )
    where = f"{topo.world_size} ranks" + (f" ({topo.nodes} nodes x {topo.procs_per_node})" if topo.nodes > 1 else "")
    job = (
        (
            f" [Slurm job {res.scheduler_job} {res.scheduler_state}"
            f"{f', requeued {res.requeues}x' if res.requeues else ''}]"
        )
        if res.scheduler_job
        else ""
    )
    msg = (
        f"segment {res.segment} {res.status}: steps {res.start_step} -> {res.end_step} "
        f"on {where} in {res.seconds:.1f} s{job}"
    )
    if res.restarts and res.status != "failed":  # a failure's line says them
        msg += f", ranks restarted in place {res.restarts}x ({'; '.join(res.restart_causes)})"
    times = res.times
    if times is not None and times.time_to_first_step_s is not None:
        msg += (
            f" (first step {times.time_to_first_step_s:.1f} s after the restarted ranks started"
            if res.restarts
            else f" (first step after {times.time_to_first_step_s:.1f} s"
        )
        msg += (
            f", emergency checkpoint in {times.emergency_save_s:.1f} s)" if times.emergency_save_s is not None else ")"
        )
    if res.status == "refused":  # bad input only the ranks could see: one line, the run's status unchanged
        console.print(
            f"error: segment {res.segment} refused before its first step on {where} (nothing trained; the "
            f"run stays as it was): {_failure_line(res.failure)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    elif res.status == "failed":
        if res.traceback:  # the user's script raised: its own traceback first, then the one line
            console.print(res.traceback.rstrip(), markup=False, highlight=False, soft_wrap=True)
        console.print(f"error: {msg}: {_failure_line(res.failure)}", markup=False, highlight=False, soft_wrap=True)
    else:
        note = f" ({res.note})" if res.note else ""
        console.print(f"[green]{msg}[/green]; checkpoint {res.checkpoint}{note}", highlight=False)
    raise typer.Exit(res.exit_code)


@app.command("prepare-data")
def prepare_data_cmd(
    config: Annotated[Path, typer.Option(help="RunSpec YAML with data.source: dataset")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set data.split=train")] = None,
    num_proc: Annotated[
        int | None, typer.Option(help="tokenizer processes (default: SHARDKEEPER_DATA_PROC or every CPU)")
    ] = None,
) -> None:
    """Tokenize the run's dataset (train split, and eval.split) into the data cache, as `train` would before
    launching; prints each cache path and its token count. A second call finds it in the cache."""
    from shardkeeper.config import check_model_config, load_run_spec
    from trainer.builtin.prepare import cache_root, prepare_data

    if num_proc is not None and num_proc < 1:
        raise ShardkeeperError(f"--num-proc {num_proc}: must be at least 1")
    spec = load_run_spec(config, set_)
    if spec.data.source != "dataset":
        raise ShardkeeperError(
            f"{config}: data.source is {spec.data.source!r}; prepare-data tokenizes a "
            "data.source: dataset (with data.dataset)"
        )
    vocab = check_model_config(spec).vocab_size
    prepared = prepare_data(spec, vocab_size=vocab, num_proc=num_proc, progress=sys.stderr.isatty())
    assert prepared is not None
    for role, p in (("train", prepared.train), ("eval", prepared.eval)):
        if p is None:
            continue
        how = "found in the cache" if p.cached else f"tokenized in {p.seconds:.1f} s"
        targets = f", {p.targets:,} targets" if p.mask_path else ""
        out.print(
            f"{role} [{p.split}]: {p.tokens:,} tokens ({p.rows:,} rows{targets}, {p.dtype}) {how}: {p.path}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    out.print(f"key {prepared.train.key}; cache {cache_root()}", markup=False, highlight=False, soft_wrap=True)


def _failure_line(failure: str | None) -> str:
    """One line for the failed segment: the ranks' own error line, or the last line they printed."""
    lines = [ln.strip() for ln in (failure or "").splitlines() if ln.strip()]
    if not lines:
        return "the ranks exited without an error message; rerun with -v to see their output"
    hint = "" if len(lines) == 1 and "; " in lines[0] else "; rerun with -v to see the ranks' output"
    return " ".join(lines[-1].split()) + hint


@app.command()
def validate(
    ckpt_dir: Annotated[
        str, typer.Argument(help="a step-XXXXXXXX checkpoint directory (or s3://.../checkpoints/step-XXXXXXXX)")
    ],
    deep: Annotated[bool, typer.Option(help="verify the checksum of every byte and the fingerprint")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the ValidationReport as JSON")] = False,
) -> None:
    """Exit 0 if the checkpoint is valid; otherwise one line naming the file and the cause, exit 4."""
    from shardkeeper.stages import validate_checkpoint

    report = validate_checkpoint(ckpt_dir, deep=deep)
    if as_json:
        out.print_json(report.model_dump_json())
    if not report.valid:
        console.print(f"error: {report.errors[0]}", markup=False, highlight=False)
        raise typer.Exit(4)
    if not as_json:
        kind = "deep" if deep else "quick"
        out.print(
            f"valid ({kind}): {ckpt_dir} step {report.step}, {report.files_checked} files"
            + (f", {report.bytes_checked / 1e6:.1f} MB hashed" if deep else "")
            + f", {report.seconds:.2f} s"
            + ("" if deep else _unverified_note(ckpt_dir)),
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def _unverified_note(ckpt_dir: str) -> str:
    """A quick validation checks sizes and structure, not bytes: say so when nothing has re-read this checkpoint
    since its commit (a preemption's checkpoint is verified by its next load), so "valid" is not taken for more."""
    from ckpt.commit.layout import RunDir
    from ckpt.validate.checks import is_verified

    if "://" in ckpt_dir:  # on the store: committed, and read back (downloaded and hashed) since its upload or not
        from shardkeeper.remote import reread_url

        return (
            ""
            if reread_url(ckpt_dir)
            else "; committed, not re-read since its upload (--deep downloads and hashes every object)"
        )
    root = RunDir.of_checkpoint(ckpt_dir)
    if root is None or is_verified(root, Path(ckpt_dir)):
        return ""
    return "; its bytes were not re-read since its commit (--deep hashes every byte)"


@app.command()
def reshard(
    ckpt_dir: Annotated[Path, typer.Argument(help="checkpoint to make loadable at a new world size")],
    world_size: Annotated[int, typer.Option(help="world size of the next segment")],
) -> None:
    """Prepare a checkpoint for another world size (a recorded no-op for DCP, which reshards at load)."""
    from shardkeeper.stages import reshard as do_reshard

    res = do_reshard(ckpt_dir, world_size)
    out.print(
        f"{res.method}: {res.source} (world size {res.from_world_size}) -> {res.to_world_size}; load {res.target}"
    )


@app.command()
def convert(
    ckpt_dir: Annotated[Path, typer.Argument(help="checkpoint to convert (step-XXXXXXXX)")],
    target: Annotated[
        Path,
        typer.Argument(metavar="OUT_OR_RUN_DIR", help="a new run directory, or a step-XXXXXXXX directory to create"),
    ],
    to: Annotated[str, typer.Option("--to", help="dcp (fsdp2) | deepspeed")],
    zero_stage: Annotated[int | None, typer.Option(help="ZeRO stage of the new run (--to deepspeed)")] = None,
) -> None:
    """Convert a checkpoint between backends (DeepSpeed ZeRO <-> DCP/FSDP2), streaming one parameter at a time."""
    from ckpt.commit.manifest import read_manifest
    from shardkeeper.stages import convert_checkpoint

    done = convert_checkpoint(ckpt_dir, to, target, zero_stage=zero_stage)
    if done == target:  # a bare step directory: no run to continue yet
        out.print(
            f"converted {ckpt_dir} -> {done} ({to}); to train on from it, convert into a run directory instead "
            f"({shlex.join(['shardkeeper', 'convert', str(ckpt_dir), 'RUN_DIR', '--to', to])})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return
    manifest = read_manifest(done)  # the run.yaml beside it names the backend (and a script run's script)
    out.print(
        f"converted {ckpt_dir} -> {done} ({to}); continue with: "
        f"{train_command(None, [], str(target), next_until_step(manifest.run_spec, manifest.step))}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def train_command(config: Path | str | None, overrides: list[str] | None, run_dir: str, until_step: int) -> str:
    """The ``shardkeeper train`` command that continues a run, quoted for a POSIX shell, runnable as printed: the
    config and every --set as given (their relative paths resolve from where the printing command ran), the run
    directory (whose run.yaml keeps the backend, the --set values and a script run's script)."""
    argv = ["shardkeeper", "train", *(["--config", str(config)] if config is not None else [])]
    argv += [a for kv in overrides or [] for a in ("--set", kv)]
    return shlex.join([*argv, "--run-dir", run_dir, "--until-step", str(until_step)])


def next_until_step(spec: RunSpec, step: int) -> int:
    """A concrete --until-step for a printed continuation from ``step``: the end of the run's LR schedule (the
    whole run, for the built-in trainer) when it lies ahead, else one checkpoint interval on."""
    total = spec.schedule.total_steps if spec.script is None else 0
    return total if total > step else step + spec.checkpoint.interval


@app.command("import")
def import_cmd(
    src: Annotated[
        Path,
        typer.Argument(
            help="checkpoint another tool wrote: DeepSpeed (latest + global_stepN/), "
            "HF Trainer checkpoint-N/, DCP, torchtitan step-N/, Accelerate FSDP"
        ),
    ],
    config: Annotated[Path, typer.Option(help="RunSpec YAML of the run to continue it (its model must match)")],
    run_dir: Annotated[str, typer.Option(help="new run directory (created; must hold no checkpoint)")],
    step: Annotated[
        int | None, typer.Option(help="which checkpoint when SRC holds several (default: the latest)")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set backend=deepspeed")] = None,
) -> None:
    """Adopt a checkpoint written by another tool (weights, AdamW moments, step) as a committed checkpoint of a run."""
    from shardkeeper.config import load_run_spec
    from shardkeeper.importing import import_checkpoint

    if not run_dir.strip():
        raise ShardkeeperError("--run-dir is empty; pass the folder of the new run")
    spec = load_run_spec(config, set_)
    res = import_checkpoint(src, spec, run_dir, step=step, config_name=str(config))
    out.print(
        f"imported {res.source} ({res.layout}, step {res.step}, {res.tensors} tensors) -> {res.checkpoint} "
        f"({res.format}) in {res.seconds:.1f} s; continue with: "
        f"{train_command(config, set_, run_dir, next_until_step(spec, res.step))}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


@app.command()
def export(
    # str, not Path: Path("s3://b/x") would fold the URL's "//"
    ckpt_dir: Annotated[
        str, typer.Argument(help="checkpoint to export (a folder or s3://.../checkpoints/step-XXXXXXXX)")
    ],
    out_dir: Annotated[str, typer.Argument(help="folder to create (transformers from_pretrained layout), or s3://...")],
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16")] = "float32",
    max_shard_size: Annotated[str, typer.Option(help="largest safetensors file, e.g. 5GB, 500MB")] = "5GB",
    overwrite: Annotated[bool, typer.Option(help="replace an existing out_dir")] = False,
    tokenizer_from: Annotated[
        Path | None,
        typer.Option(
            help="carry the tokenizer files of this folder (default: the run's data.tokenizer or base model's)"
        ),
    ] = None,
    no_tokenizer: Annotated[bool, typer.Option("--no-tokenizer", help="carry no tokenizer files")] = False,
) -> None:
    """Stream a checkpoint into safetensors (+ index, config.json, tokenizer files) with bounded memory."""
    from shardkeeper.config import plain_path
    from shardkeeper.stages import export_and_record

    for flag, value in (("CKPT_DIR", ckpt_dir), ("OUT_DIR", out_dir), ("--tokenizer-from", tokenizer_from)):
        plain_path(flag, value)
    if no_tokenizer and tokenizer_from is not None:
        raise ShardkeeperError("--tokenizer-from and --no-tokenizer: pass one of them")
    res = export_and_record(
        ckpt_dir,
        out_dir,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=sys.stderr.isatty(),
        tokenizer_from=False if no_tokenizer else tokenizer_from,
    )
    out.print(
        f"exported {res.num_tensors} tensors ({res.total_bytes / 1e6:.1f} MB, {res.dtype}) in {res.num_shards} "
        f"shard(s) to {res.out_dir} in {res.seconds:.2f} s"
    )


@app.command()
def publish(
    export_dir: Annotated[Path, typer.Argument(help="an export folder")],
    repo_id: Annotated[str | None, typer.Option(help="Hub repo ORG/NAME")] = None,
    target: Annotated[str | None, typer.Option(help="or an fsspec URL: s3://bucket/prefix, file:///path")] = None,
    revision: Annotated[
        str | None,
        typer.Option(help="branch to publish to (default: main); every step also gets the tag step-XXXXXXXX"),
    ] = None,
) -> None:
    """Upload an export to the Hub (token from HF_TOKEN or `hf auth login`) or to a bucket; idempotent."""
    from shardkeeper.config import plain_path
    from shardkeeper.stages import publish_export

    for flag, value in (("EXPORT_DIR", export_dir), ("--repo-id", repo_id), ("--target", target)):
        plain_path(flag, value)
    if bool(repo_id) == bool(target):
        raise ShardkeeperError("publish: give exactly one of --repo-id ORG/NAME or --target URL")
    if not export_dir.is_dir():
        what = "is a file, not an export folder" if export_dir.exists() else "no such export folder"
        raise ShardkeeperError(f"{export_dir}: {what}; pass the folder written by `shardkeeper export`")
    res = publish_export(export_dir, repo_id or target or "", revision=revision)
    out.print(res.line(), markup=False, highlight=False, soft_wrap=True)


import shardkeeper._cli_runs  # noqa: E402,F401 - registers lineage, status and manifest on the app


def main(argv: list[str] | None = None) -> int:
    """The console script and ``python -m shardkeeper``: every user mistake is one line on stderr, exit 2
    (or the error's own code); a traceback only for a bug, and then only with -v."""
    _STATE["verbose"] = False
    try:
        rc = app(args=argv, prog_name="shardkeeper", standalone_mode=False)
        return rc if isinstance(rc, int) else 0
    except ShardkeeperError as e:
        return _error(str(e), e.exit_code)
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _error(str(e.code), 2))
    except (KeyboardInterrupt, typer.Abort):
        console.print("interrupted")
        return EXIT_CANCELLED  # 128 + SIGINT
    except _CLICK_ERRORS as e:
        return _usage_error(e)
    except OSError as e:  # a user path that cannot be read or written
        return _os_error(e)
    except ValueError as e:
        return _error(f"{' '.join(str(e).split())}; check the arguments", 2)
    except Exception as e:  # noqa: BLE001 - a bug: say so in one line, traceback with -v or in the log
        return _internal_error(e)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException derives from BaseException: its failure
        inner = _inner_failure(e)
        if isinstance(inner, ShardkeeperError):
            return _error(str(inner), inner.exit_code)
        if isinstance(inner, OSError):
            return _os_error(inner)
        return _internal_error(e)


def _os_error(e: OSError) -> int:
    where = f"{e.filename}: " if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):  # not the user's input: the machine's disk
        return _error(
            f"{where}{e.strerror}: the disk is full; free space and rerun the same command (a run "
            "resumes from its newest committed checkpoint)",
            1,
        )
    return _error(f"{where}{e.strerror or e}; check the path and its permissions", 2)


def _inner_failure(e: BaseException) -> BaseException | None:
    """The first ShardkeeperError or OSError among the failures a DCP CheckpointException carries (per rank) and
    their causes, else None."""
    failures = getattr(e, "failures", None)
    found: list[BaseException] = []
    for exc, *_ in failures.values() if isinstance(failures, dict) else ():
        for _ in range(16):
            if not isinstance(exc, BaseException):
                break
            found.append(exc)
            exc = exc.__cause__ or exc.__context__
    for kind in (ShardkeeperError, OSError):
        first = next((x for x in found if isinstance(x, kind)), None)
        if first is not None:
            return first
    return None


def _usage_error(e: Exception) -> int:
    if isinstance(e, _NO_ARGS_HELP):
        e.show()  # type: ignore[attr-defined]
        return 0
    ctx = getattr(e, "ctx", None)
    cmd = ctx.command_path if ctx is not None else "shardkeeper"
    return _error(f"{e.format_message().rstrip('.')}; see `{cmd} --help`", 2)  # type: ignore[attr-defined]


def _error(message: str, code: int) -> int:
    console.print(f"error: {' '.join(message.split())}", markup=False, highlight=False, soft_wrap=True)
    return code


def _internal_error(e: BaseException) -> int:
    import traceback

    text = "".join(traceback.format_exception(e))
    if _STATE["verbose"]:
        sys.stderr.write(text)
    log_path = _write_crash_log(text)
    where = f"the traceback is in {log_path}" if log_path else "rerun with -v for the traceback"
    return _error(
        f"internal error ({type(e).__name__}: {str(e)[:200]}); this is a bug in shardkeeper, please report it; {where}",
        1,
    )


def _write_crash_log(text: str) -> Path | None:
    import os

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardkeeper"
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / "last-error.log"
        path.write_text(text)
        return path
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())


def run() -> None:
    """The process entry (console script, ``python -m shardkeeper``): ``main``'s exit code, and once it is
    decided, further stop signals are ignored. A SIGTERM that arrives during interpreter shutdown would otherwise
    meet the default handler (CPython restores it at finalization) and turn an orderly 75 into a kill."""
    import signal

    rc = main()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    remote = sys.modules.get("shardkeeper.remote")
    if remote is not None and remote.abandoned_uploads():
        # a stop gave up an upload whose requests still run: exit now, not once they end (they commit nothing)
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
