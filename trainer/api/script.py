"""Run a user's training script as the ranks of a segment (``shardkeeper train --script FILE -- ARGS``).

Every rank runs the script as ``__main__`` with ``sys.argv = [FILE, *ARGS]`` and the script's folder first on
``sys.path``, after ``trainer.segment`` has tied the rank's life to the launcher and taken the shared run lock.
The script trains through the public API (``shardkeeper.Segment``), which commits, resumes and reports exactly
as the built-in trainer does. How the rank ends:

- ``seg.steps()`` ran to the end: the segment's exit code (0); after a preemption's checkpoint: 75.
- the script raised: its own traceback (its frames and the libraries', not shardkeeper's) goes to stderr and to
  ``RUN_DIR/.script-traceback.txt`` (the first failing rank's; not that of a rank whose collective only lost its
  peer), and one line names the file, line and exception; 1.
- a shardkeeper error inside the API (a checkpoint that cannot be loaded, a misuse of the API): its one line.
- the script returned without entering ``seg.steps()``, or left the loop early: one line saying so; 1.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

from ckpt.commit.layout import RunDir
from schemas import ScriptSpec
from schemas.errors import ShardkeeperError
from schemas.seam import SCRIPT_TRACEBACK_FILE, collective_error

# Frames of these folders are shardkeeper's (and runpy's), not the user's: left out of the script's traceback.
_OURS = tuple(
    str(Path(__file__).resolve().parents[2] / d) + os.sep
    for d in ("trainer", "ckpt", "schemas", "shardkeeper", "launch")
)


class ScriptFailed(ShardkeeperError):
    """The user's script raised or misused the API; the message is the one line. Exit 1, a failure: exit 2 is bad
    input (the API's own UsageError, the script's argument parser), which the launcher reports as a segment refused
    before its first step when nothing was trained."""

    exit_code = 1


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if not f.filename.startswith(_OURS) and "runpy" not in Path(f.filename).name]


def user_traceback(exc: BaseException) -> str:
    """The script's traceback without shardkeeper's frames (chained exceptions keep their own frames)."""
    te = traceback.TracebackException.from_exception(exc)
    keep = {(f.filename, f.lineno, f.name) for f in _user_frames(exc)}
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if (f.filename, f.lineno, f.name) in keep])
    return "".join(te.format())


def _save_traceback(run_dir: RunDir, text: str) -> None:
    """The first failing rank's traceback, for the controller (other ranks' usually follow from it). A rank whose
    collective lost its peer does not write one: the controller would show it above the real cause."""
    try:
        fd = os.open(run_dir.root / SCRIPT_TRACEBACK_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"[rank {os.environ.get('RANK', '0')}] {text}")


def run_script(script: ScriptSpec, run_dir: RunDir) -> int:
    """Run ``script`` on this rank; returns the rank's exit code or raises ScriptFailed/ShardkeeperError (one line)."""
    import torch.distributed as dist

    path = Path(script.path)
    sys.argv = [str(path), *script.args]
    sys.path.insert(0, str(path.parent))
    ended = False
    try:
        code = _run(path, run_dir)
        ended = True
        return code
    finally:
        # Only a rank that ended without an error ends its process group here: a failing one writes its failure
        # line first (trainer.segment) and its group ends with the process, so that its peers, whose next
        # collective fails when it is gone, report that after its line, never before it.
        if ended and dist.is_initialized():
            dist.destroy_process_group()


def _run(path: Path, run_dir: RunDir) -> int:
    from trainer.api import segment as api

    try:
        runpy.run_path(str(path), run_name="__main__")
    except api.SegmentPreempted:
        return int(api.SegmentPreempted().code)  # the checkpoint is committed and the report written
    except SystemExit as e:
        if e.code not in (None, 0):
            if isinstance(e.code, int):
                return e.code
            raise ScriptFailed(f"{path.name} exited: {e.code}") from None
    except ShardkeeperError:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's exception: their traceback, then one line
        text = user_traceback(e)
        print(text, file=sys.stderr, end="", flush=True)
        message = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if collective_error(message) is None:  # a collective that lost its peer: another rank's failure came first
            _save_traceback(run_dir, text)
        frames = _user_frames(e)
        at = f"{Path(frames[-1].filename).name} line {frames[-1].lineno}" if frames else path.name
        raise ScriptFailed(f"{at}: {message} (the script's traceback is above)") from None
    return _finished(path)


def _finished(path: Path) -> int:
    from trainer.api import segment as api

    seg = api.current()
    if seg is None or not seg.entered:
        raise ScriptFailed(
            f"{path}: returned without entering seg.steps(); a script trains inside "
            "`for step in seg.steps():` after sk.Segment() and seg.track(...) (see the README)"
        )
    if seg.exit_code is None:
        raise ScriptFailed(
            f"{path}: left the `for step in seg.steps()` loop before its end (break or return?) at step "
            f"{seg.step}; nothing after the last committed checkpoint was saved. Let the loop run to "
            "--until-step; a shorter segment is --until-step"
        )
    return seg.exit_code
