"""Scale on paper: manifest, validation and retention planning at 8 -> 4,096 simulated ranks, up to 10^5 files.

    python bench/scale_bench.py                     # ~1-2 min, a few hundred MB of metadata-only files in /tmp
    python bench/scale_bench.py --ranks 8 512 4096 --files-per-rank 24

No training runs: for each world size it writes what a DCP save of that many ranks leaves on disk, at
the real layout and through the real code -- ``files_per_rank`` data files per rank (``__R_I.distcp``,
each holding one small tensor chunk), a real DCP ``.metadata`` (torch's own Metadata, pickled as DCP
does) that references every file, and a ``manifest.json`` (schemas.CheckpointManifest) listing every file
with its size and xxh3-128 checksum -- then times, as medians (min-max) of ``--reps`` runs:

- **manifest**: assembling the manifest from the ranks' file entries and writing it (rank 0's share of a
  save, O(files));
- **per-rank entries**: one rank hashing its own files and building its FileEntry list (what every rank
  does at save: O(own files), flat in the world size);
- **validate (quick)**: ``ckpt.validate.checks.validate`` -- manifest parse, every path confined and stat'ed, the
  directory walk for unlisted files, the DCP layout and tensor-inventory cross-checks, every rank present --
  of a checkpoint this process validated before (what the trainer's rank 0 and a long-lived flow see: the
  manifest and ``.metadata`` are re-hashed and, unchanged, not re-parsed; every file is stat'ed again);
- **retention plan**: ``ckpt.validate.retention.plan`` -- ``apply_retention``'s decision -- over 3 committed
  checkpoints of that size with ``keep_last=2``, as the trainer calls it right after a commit (the previous
  checkpoints carry the verification record of their post-commit re-read, the new one not yet);
- **first in a process**: the same two with nothing remembered (``ckpt.validate.checks.forget_known``): every
  manifest and ``.metadata`` parsed, the latter by the pure-Python allow-list unpickler.

Below the table: validate + plan in process CPU seconds (contention from other jobs inflates wall time, much
less CPU time) and the load average, so a run on a shared machine can be read.

Goal: validation + retention planning at 4,096 ranks < 2 s; cost linear in files.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import fmt, timed  # noqa: E402 - bench/ is on the path when run as a script

CHUNK = 16  # float32 values per data file: the files are real, just small


def write_checkpoint(ckpt: Path, ranks: int, files_per_rank: int, step: int) -> Any:
    """A committed DCP checkpoint of ``ranks`` x ``files_per_rank`` data files; returns its manifest."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    ckpt.mkdir(parents=True)
    payload = bytes(4 * CHUNK)
    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for r in range(ranks):
        for i in range(files_per_rank):
            name, fname = f"model.block{r}.w{i}", f"__{r}_{i}.distcp"
            (ckpt / fname).write_bytes(payload)
            state[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([CHUNK]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([CHUNK]))],
            )
            storage[MetadataIndex(fqn=name, offset=torch.Size([0]), index=0)] = _StorageInfo(
                relative_path=fname, offset=0, length=len(payload)
            )
    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage)))
    return build_manifest(ckpt, ranks, files_per_rank, step, state)


def rank_entries(ckpt: Path, rank: int, files_per_rank: int) -> list[Any]:
    """What one rank does at save: hash its own files, one FileEntry each."""
    from ckpt.commit.hashing import hash_file
    from schemas.checkpoint import FileEntry

    out = []
    for i in range(files_per_rank):
        size, digest = hash_file(ckpt / f"__{rank}_{i}.distcp")
        out.append(FileEntry(path=f"__{rank}_{i}.distcp", size=size, xxh3_128=digest, rank=rank))
    return out


def build_manifest(ckpt: Path, ranks: int, files_per_rank: int, step: int, state: dict[str, Any]) -> Any:
    """Rank 0's share: gather every rank's entries (here: computed in turn), add .metadata, write manifest.json."""
    from ckpt.commit.hashing import hash_file
    from ckpt.commit.manifest import write_manifest
    from schemas import ClusterTopology
    from schemas.checkpoint import CheckpointManifest, DtypePolicy, FileEntry, Fingerprint, TensorEntry
    from shardkeeper.config import load_run_spec

    files = [e for r in range(ranks) for e in rank_entries(ckpt, r, files_per_rank)]
    size, digest = hash_file(ckpt / ".metadata")
    files.append(FileEntry(path=".metadata", size=size, xxh3_128=digest))
    spec = load_run_spec(ROOT / "configs" / "tiny.yaml")
    manifest = CheckpointManifest(
        format="dcp",
        run_name="scale",
        step=step,
        tokens=step,
        samples=step,
        segment=0,
        reason="interval",
        created_at=datetime.now(UTC).isoformat(),
        files=files,
        tensors=[TensorEntry(name=n, shape=[CHUNK], dtype="float32") for n in state],
        model_signature="0" * 64,
        topology=ClusterTopology(nodes=max(ranks // 8, 1), procs_per_node=min(ranks, 8)),
        dtype_policy=DtypePolicy(compute="float32", reduce="float32"),
        code_version="bench",
        fingerprint=Fingerprint(model={}, optim={}, optim_step=float(step)),
        run_spec=spec,
    )
    write_manifest(ckpt, manifest)
    return manifest


def measure(tmp: Path, ranks: int, files_per_rank: int, reps: int) -> dict[str, Any]:
    from ckpt.commit.layout import RunDir
    from ckpt.commit.manifest import read_manifest, write_manifest
    from ckpt.validate.checks import forget_known, record_verified, validate
    from ckpt.validate.retention import plan as retention_plan

    run = RunDir.at(tmp / f"run-{ranks}")
    t0 = time.perf_counter()
    ckpts = [write_checkpoint(run.checkpoint(step), ranks, files_per_rank, step) for step in (10, 20, 30)]
    for step in (10, 20):  # the trainer's post-commit re-read has verified the older ones, not the newest yet
        record_verified(run, run.checkpoint(step), how="reread", bytes_read=0)
    setup_s = time.perf_counter() - t0
    target = run.checkpoint(30)
    report = validate(target)
    if not report.valid:
        raise SystemExit(f"error: the simulated checkpoint at {ranks} ranks is not valid: {report.errors[0]}")
    manifest = ckpts[-1]

    def plan() -> set[int]:
        return retention_plan(run, keep_last=2, keep_every=None).doomed

    def cold(fn: Any) -> Any:
        def run_cold() -> Any:
            forget_known()
            return fn()

        return run_cold

    doomed = plan()
    assert doomed == {10}, doomed
    out = {
        "ranks": ranks,
        "files": len(manifest.files),
        "setup_s": setup_s,
        "manifest": timed(lambda: write_manifest(target, read_manifest(target).model_copy()), reps),
        "rank": timed(lambda: rank_entries(target, ranks - 1, files_per_rank), reps),
        "validate_cold": timed(cold(lambda: validate(target)), reps),
        "retention_cold": timed(cold(plan), reps),
    }
    validate(target)  # as after a commit: the newest checkpoint was validated by this process
    out["validate"] = timed(lambda: validate(target), reps)
    out["retention"] = timed(plan, reps)
    out["both_cpu"] = timed(lambda: (validate(target), plan()), reps, clock=time.process_time)
    return out


def draw_lines(
    fig,
    name: str,
    x_column: str,
    columns: list[tuple[str, str]],
    *,
    goal: float,
    goal_label: str,
    xlabel: str,
    title: str,
    legend: str = "best",
    ylog: bool = True,
) -> None:
    """Seconds (median, min–max) of each column against ``x_column`` (log), the goal as a line; ``ylog``: seconds
    on a log scale too."""
    from benchlib import numbers, spread, table_rows

    rows = table_rows(name)
    xs = [numbers(r[x_column])[0] for r in rows]
    ax = fig.add_subplot()
    for column, label in columns:
        vals = [spread(r[column]) for r in rows if r.get(column) not in (None, "", "n/a")]
        if len(vals) != len(rows):
            continue
        ax.errorbar(
            xs,
            [v[0] for v in vals],
            yerr=[[v[0] - v[1] for v in vals], [v[2] - v[0] for v in vals]],
            marker="o",
            capsize=3,
            label=label,
        )
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.axhline(goal, color="grey", ls=":", lw=1)
    ax.annotate(
        goal_label, (xs[-1], goal), xytext=(0, 4), textcoords="offset points", color="grey", fontsize=8, ha="right"
    )
    ax.set_xscale("log")
    if ylog:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # room for the legend above the lines
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds (median, min–max)" + ("; log" if ylog else ""))
    ax.set_title(title)
    ax.legend(loc=legend, fontsize=8, ncol=1 if ylog else 2)


def plot() -> Path:
    """bench/results/scale.png: validation and retention planning against the world size, from the published table
    (the goal: both under 2 s at 4,096 ranks)."""
    from benchlib import plot_from_table

    def draw(fig) -> None:
        draw_lines(
            fig,
            "scale",
            "ranks",
            [
                ("validate + plan", "validate + retention plan"),
                ("validate (quick)", "validate (quick)"),
                ("manifest read + write (rank 0)", "manifest read + write (rank 0)"),
                ("validate, first in a process", "validate, first in a process"),
            ],
            goal=2.0,
            goal_label="goal: validate + plan < 2 s",
            xlabel="ranks (24 data files each; log)",
            title="Checks that run at every commit and resume, against the world size",
            legend="lower right",
        )

    return plot_from_table("scale", draw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--files-per-rank", type=int, default=24, help="data files per rank (4,096 x 24 = 98,304)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plot-only", action="store_true", help="redraw bench/results/scale.png from the published table")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot()
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        for ranks in args.ranks:
            rows.append(measure(Path(tmp), ranks, args.files_per_rank, args.reps))
            shutil.rmtree(Path(tmp) / f"run-{ranks}", ignore_errors=True)
    from benchlib import md_table, publish

    table = []
    for r in rows:
        per_file = statistics.median(r["validate"]) / r["files"] * 1e6
        both = [v + p for v, p in zip(r["validate"], r["retention"])]
        table.append(
            [
                f"{r['ranks']:,}",
                f"{r['files']:,}",
                fmt(r["manifest"], 3),
                fmt(r["rank"], 3),
                fmt(r["validate"], 3),
                fmt(r["retention"], 3),
                fmt(both, 3),
                f"{per_file:.1f}",
                fmt(r["validate_cold"], 3),
                fmt(r["retention_cold"], 3),
            ]
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    publish(
        "scale",
        f"Scale on paper, seconds: median (min–max) of {args.reps} after a warm-up, "
        f"{args.files_per_rank} data files per rank:\n\n"
        + md_table(
            [
                "ranks",
                "files",
                "manifest read + write (rank 0)",
                "one rank's entries at save",
                "validate (quick)",
                "retention plan (3 checkpoints)",
                "validate + plan",
                "µs per file (validate)",
                "validate, first in a process",
                "retention plan, first in a process",
            ],
            table,
            "r" * 10,
        )
        + "\n\nvalidate + plan, process CPU seconds: "
        + " · ".join(f"{r['ranks']:,} ranks {fmt(r['both_cpu'], 3)}" for r in rows)
        + f" · load average at the end (1, 5, 15 min): {load}",
    )
    plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
