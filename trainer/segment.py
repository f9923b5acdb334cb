"""One training segment on every rank: resume from the latest valid checkpoint, train until a step,
commit a checkpoint at the end (or on preemption).

Launched by ``shardkeeper train`` through torchrun; by hand, on 2 CPU ranks:

    torchrun --standalone --nproc-per-node 2 -m trainer.segment RUN_DIR 20 0

(RUN_DIR must hold run.yaml; positional arguments only, because torchrun claims options that
prefix its own.) Exit codes: 0 completed, 75 preempted (checkpoint committed, or nothing to save
when stopped before the first step), 65 a non-finite loss or gradient norm (nothing of that step saved;
trainer.nonfinite), 1 failed.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __name__ == "__main__":
    # A rank: tie its life to torchrun and the launcher, record early SIGTERMs and take the shared run
    # lock before the heavy imports below (seconds on a busy node); see trainer.lifetime.
    # Nothing heavier than the stdlib before guard_rank: schemas (pydantic) would widen the window in which a
    # SIGTERM still kills the rank instead of being recorded.
    from trainer.lifetime import guard_rank

    try:
        _RANKS_LOCK_FD = guard_rank(sys.argv[1:2])
    except Exception as _e:
        from schemas.errors import ShardkeeperError

        if not isinstance(_e, ShardkeeperError):
            raise
        print(f"error: {_e}", file=sys.stderr)
        sys.exit(_e.exit_code)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ckpt.commit.layout import RunDir  # noqa: E402
from schemas.errors import ShardkeeperError  # noqa: E402
from schemas.seam import EXIT_PREEMPTED, RANK_ERROR_PREFIX, RANK_NOTES_ENV, SegmentLaunch, collective_error  # noqa: E402
from trainer import (
    lifetime,  # noqa: E402
    timeline,  # noqa: E402
)
from trainer.api.segment import load_spec, stopped_early_note, write_status  # noqa: E402
from trainer.dist import DistEnv, init_distributed, log0  # noqa: E402

timeline.mark("imports")  # the rank's heavy imports are done (torch; transformers comes with trainer.builtin.loop)

if TYPE_CHECKING:
    from trainer.builtin.loop import Trainer

log = logging.getLogger("shardkeeper.trainer")


def build_segment(run_dir: RunDir, until_step: int, segment: int, env: DistEnv) -> Trainer:
    """The built-in trainer of the run's backend: FSDP2 in trainer.builtin.loop, DeepSpeed ZeRO in
    trainer.deepspeed.backend."""
    if load_spec(run_dir).backend == "deepspeed":
        from trainer.deepspeed.backend import DeepSpeedTrainer

        return DeepSpeedTrainer(run_dir, until_step, segment, env)
    from trainer.builtin.loop import Trainer

    return Trainer(run_dir, until_step, segment, env)


def run_segment(run_dir: str | Path, until_step: int, segment: int = 0, launch: SegmentLaunch | None = None) -> int:
    """Entry for one rank (torchrun or a spawn harness sets RANK/WORLD_SIZE/MASTER_*). Returns the exit code.
    ``launch``: what the launcher handed the ranks (schemas.seam); None when started by hand."""
    timeline.begin_segment()
    env = init_distributed(launch)
    timeline.mark("process_group")
    ended = False
    try:
        rd = RunDir.at(run_dir)
        if stop_agreed(env):  # a SIGTERM during start-up: do not build (and load) a model only to drop it
            code = _preempted_before_build(rd, env, segment)
        else:
            from trainer.checkpointer.node_tier import start_early

            start_early(env, load_spec(rd), rd)  # several nodes: their copies readied while the model builds
            seg = build_segment(rd, until_step, segment, env)
            timeline.mark("model_built")
            code = seg.run()
        ended = True
        return code
    finally:
        # A failing rank writes its failure line (main) before its process group ends with the process: its peers'
        # collectives, which fail once it is gone, report that after its line (launch.attribution).
        if ended and dist.is_initialized():
            dist.destroy_process_group()


def stop_agreed(env: DistEnv) -> bool:
    """Did any rank get a stop signal during start-up? (A collective: every rank calls it.)"""
    flag = torch.tensor([0 if lifetime.stop_requested() is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=env.ctrl_group)
    return bool(flag.item())


def _preempted_before_build(run_dir: RunDir, env: DistEnv, segment: int) -> int:
    from ckpt.validate.checks import latest_valid

    found = latest_valid(run_dir) if env.is_rank0 else None
    step = found[1].step if found else 0
    note = stopped_early_note(step, loaded=False)
    log0(env, "preemption signal received during start-up: %s", note)
    write_status(run_dir, env, segment, "preempted", step, step, note)
    return EXIT_PREEMPTED


def _setup_logging() -> None:
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if rank == "0" else logging.WARNING
    logging.basicConfig(level=level, format=_log_format(), stream=sys.stderr)


def _log_format() -> str:
    """The rank's log lines (the launcher shows lines of this shape as the rank's)."""
    return f"%(asctime)s [rank{os.environ.get('RANK', '0')}] %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m trainer.segment RUN_DIR UNTIL_STEP [SEGMENT]", file=sys.stderr)
        return 2
    _setup_logging()
    try:
        torch.set_num_threads(_threads())
        spec = load_spec(RunDir.at(argv[0]))
        if spec.script is not None:  # a user's script trains through the public API (trainer.api.segment.Segment)
            from trainer.api.script import run_script

            _SCRIPT[0] = True
            return run_script(spec.script, RunDir.at(argv[0]))
        return run_segment(
            argv[0], int(argv[1]), int(argv[2]) if len(argv) == 3 else 0, launch=SegmentLaunch.from_environ()
        )
    except ShardkeeperError as e:
        _report_failure(f"{e}", e.exit_code)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - any rank failure reaches the user as one line
        import traceback

        traceback.print_exc(file=sys.stderr)  # the full story, for `shardkeeper train -v`
        _report_failure(
            f"{type(e).__name__}: {' '.join(str(e).split())[:400]}; see the rank's traceback (shardkeeper train -v)", 1
        )
        return 1


def _threads() -> int:
    raw = os.environ.get("OMP_NUM_THREADS", "1")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ShardkeeperError(f"OMP_NUM_THREADS={raw!r}: must be a positive integer; set e.g. OMP_NUM_THREADS=1")
    return int(raw)


def _report_failure(cause: str, code: int) -> None:
    """The last line this rank writes: the launcher shows the first such line as the segment's failure. A failure
    that only follows another rank's (a collective that lost its peer or timed out) also leaves a note for the
    node's agent, which may then restart the ranks in place (trainer.agent); any other is the rank's own."""
    rank = os.environ.get("RANK", "0")
    sys.stderr.flush()
    _REPORT[0] = f"{RANK_ERROR_PREFIX} rank {rank}: {cause}"
    phrase = collective_error(cause)
    notes = os.environ.get(RANK_NOTES_ENV)
    if phrase and notes:
        try:
            Path(notes, f"consequence-{rank}").write_text(phrase, encoding="utf-8")
        except OSError:
            pass  # no note: the agent takes the failure as the rank's own and does not restart
    print(_REPORT[0], file=sys.stderr, flush=True)
    log.debug("rank %s exits with code %d", rank, code)


_SCRIPT = [False]  # this rank ran a user's script
_REPORT: list[str | None] = [None]  # the failure line this rank reported


SCRIPT_ATEXIT_S = 10.0  # how long a script's atexit handlers may take before its rank exits regardless


def _exit_now(code: int) -> None:
    """Flush what can be flushed (a stream an atexit handler closed cannot), then exit with ``code``, always."""
    try:
        logging.shutdown()
        _flush(sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    finally:
        os._exit(code)


def _flush(*streams: Any) -> None:
    """Flush each stream that still can be (an atexit handler may have closed or replaced one)."""
    for stream in streams:
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _write_stderr(line: str) -> None:
    """One line straight to file descriptor 2 (sys.stderr may be closed, or its lock held by a stuck thread)."""
    try:
        os.write(2, f"{line}\n".encode(errors="replace"))
    except OSError:
        pass


def _exit_without_teardown(code: int) -> None:
    """The built-in trainer's rank leaves as a normal exit would (its non-daemon threads joined, atexit handlers
    run: DataLoader workers are reaped there), minus the interpreter's finalization of every module and tensor,
    which takes a second or more per rank with torch and transformers loaded and only delays the launcher."""
    import atexit
    import threading

    threading._shutdown()  # what the interpreter does first: executors told to stop, non-daemon threads joined
    atexit._run_exitfuncs()
    _exit_now(code)


def _exit_script(code: int) -> None:
    """A script's rank ends when its segment has. Its atexit handlers run, as at any Python exit (a temporary
    directory removed, a tracker's run closed), but a thread or child process the script left behind (a non-daemon
    logger, a forked helper) must not keep the rank, and so torchrun and the launcher, waiting forever: its
    non-daemon threads are not joined, and handlers still running after ``SCRIPT_ATEXIT_S`` are abandoned.
    The rank's failure line is written again after them, so it stays the last line the launcher reads."""
    import atexit
    import faulthandler
    import threading
    import time

    def give_up() -> None:  # no handler, no flush: a stuck atexit handler may hold their locks
        time.sleep(SCRIPT_ATEXIT_S)
        warning = log.makeRecord(
            log.name,
            logging.WARNING,
            __file__,
            0,
            f"the script's atexit handlers did not finish within {SCRIPT_ATEXIT_S:.0f} s; the rank exits without them",
            None,
            None,
        )
        _write_stderr(logging.Formatter(_log_format()).format(warning))
        if _REPORT[0]:
            _write_stderr(_REPORT[0])
        os._exit(code)

    threading.Thread(target=give_up, name="shardkeeper-exit", daemon=True).start()
    try:
        # a handler stuck in C code, holding the GIL (give_up cannot run): exit 1 after 5 s more; fd 2, not
        # sys.stderr, which the script may have replaced or closed
        faulthandler.dump_traceback_later(SCRIPT_ATEXIT_S + 5, exit=True, file=2)
        atexit._run_exitfuncs()
    finally:
        _flush(sys.stdout, sys.stderr)  # what the handlers printed comes before the line below
        if _REPORT[0]:
            _write_stderr(_REPORT[0])
        _exit_now(code)


if __name__ == "__main__":
    _code = main()
    if _SCRIPT[0]:
        _exit_script(_code)
    _exit_without_teardown(_code)
