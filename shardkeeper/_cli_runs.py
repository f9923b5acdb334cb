"""CLI commands that look at runs rather than run a stage: ``lineage``, ``status`` (also of a folder of runs or an
object store) and ``manifest`` (a segment rendered as Kubernetes manifests). Registered on the app of
``shardkeeper._cli_app`` when ``shardkeeper.cli`` is imported."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ckpt.commit.layout import RunDir
from schemas.errors import ShardkeeperError
from shardkeeper._cli_app import app, console, out


@app.command("lineage")
def lineage_cmd(
    run_dir: Annotated[str, typer.Argument(help="run directory (or s3://bucket/prefix)")],
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print the events as JSON Lines: one JSON object per line, oldest first (not one JSON document)",
        ),
    ] = False,
) -> None:
    """Show every checkpoint, resume, reshard, export and publish of a run, with its parent (a summary first)."""
    from ckpt.commit.lineage import read_events

    existing_remote = None
    if _is_remote(run_dir):
        from shardkeeper.remote import lineage_source

        rd, existing_remote = lineage_source(run_dir)
    else:
        rd = RunDir.at(run_dir)
    if not rd.spec_path.exists() and not rd.has_lineage():
        raise ShardkeeperError(f"{run_dir}: not a run directory (no run.yaml); pass the --run-dir used for training")
    events = read_events(rd)
    if as_json:
        for e in events:
            out.print(e.model_dump_json(), markup=False, highlight=False, soft_wrap=True)
        return
    kinds = [e.kind for e in events]
    steps = [e.step for e in events if e.kind == "checkpoint" and e.step is not None]
    existing = len(rd.committed()) if existing_remote is None else existing_remote
    out.print(
        f"{rd.root.name if existing_remote is None else _name(run_dir)}: "
        f"{kinds.count('checkpoint')} checkpoints written ({existing} exist now), latest step "
        f"{max(steps) if steps else 0}; {kinds.count('segment')} segment events, {kinds.count('resume')} resumes, "
        f"{kinds.count('reshard')} reshards, {kinds.count('export')} exports, {kinds.count('publish')} publishes"
        + (f"; last event {events[-1].time}" if events else ""),
        markup=False,
        highlight=False,
        soft_wrap=False,
    )
    # Narrow terminals and pipes (80 columns) drop the id column (kind + step say it) and shorten parents;
    # what is still too long folds onto the next line instead of being cut to "…".
    wide = out.width >= 120
    table = Table()
    for col in ("time", "kind", *(("id",) if wide else ()), "step", "parent", "details"):
        table.add_column(col, overflow="fold")
    for e in events:
        details = ", ".join(
            f"{k}={v}"
            for k, v in e.data.items()
            if k
            in (
                "world_size",
                "reason",
                "status",
                "from_world_size",
                "to_world_size",
                "dtype",
                "method",
                "target",
                "first_step_s",
                "emergency_save_s",
                "layout",
                "tier",
            )
            and not (k == "tier" and v == "storage")
        )  # only the memory tier is news
        parent = e.parent or ""
        if not wide:
            parent = parent.removeprefix("checkpoint:")
            details = details.replace("world_size=", "ws=").replace("from_ws=", "from=").replace("to_ws=", "to=")
        table.add_row(
            e.time[11:19] if len(e.time) >= 19 else e.time,
            e.kind,
            *((e.id,) if wide else ()),
            "" if e.step is None else str(e.step),
            parent,
            details,
        )
    out.print(table)


@app.command("status")
def status_cmd(
    path: Annotated[str, typer.Argument(help="a run directory, or a folder of run directories (or s3://...)")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document: a list of run states")] = False,
) -> None:
    """Where each run stands: how its last segment ended (or that it trains now), its newest valid checkpoint."""
    from shardkeeper.stages import run_state, scan_runs

    if _is_remote(path):
        from shardkeeper.remote import remote_run_urls

        _show_states(path, [run_state(u) for u in remote_run_urls(path)], as_json, single_url=path)
        return
    path = Path(path)
    if not path.exists():
        raise ShardkeeperError(
            f"{path}: no such run directory or folder; pass a --run-dir used for training or the "
            "folder that holds run directories"
        )
    if not path.is_dir():
        raise ShardkeeperError(f"{path}: is a file; pass a run directory or the folder that holds run directories")
    rd = RunDir.at(path)
    states = [run_state(path)] if rd.spec_path.exists() or rd.checkpoints.is_dir() else scan_runs(str(path), [])
    _show_states(str(path), states, as_json, single_url=str(rd.root))


def _show_states(path: str, states: list, as_json: bool, *, single_url: str) -> None:
    import json

    if not states:
        raise ShardkeeperError(
            f"{path}: holds no run directory (none with a run.yaml or checkpoints/); pass a "
            "--run-dir used for training or the folder that holds them"
        )
    if as_json:
        print(json.dumps([s.model_dump(mode="json") for s in states], indent=2))
        return
    table = Table(title=f"runs under {path}" if len(states) > 1 or states[0].run_dir != single_url else None)
    for col in ("run", "status", "step", "until", "world size", "newest valid checkpoint", "tier"):
        table.add_column(col, overflow="fold")
    for st in states:
        status = "running" if st.locked else (st.last_status or "new")
        table.add_row(
            _name(st.run_dir),
            status,
            str(st.step),
            "" if st.last_until_step is None else str(st.last_until_step),
            "" if st.world_size is None else str(st.world_size),
            (_name(st.checkpoint) + (" (committed, not re-read)" if st.reread is False else ""))
            if st.checkpoint
            else "none",
            st.tier or "",
        )
    out.print(table)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def manifest(
    ctx: typer.Context,
    run_dir: Annotated[
        str,
        typer.Option(
            help="run directory as the pods see it: NAME (under /runs on the PVC) or "
            "an absolute path (the PVC is mounted at its parent)"
        ),
    ],
    config: Annotated[
        Path | None, typer.Option(help="RunSpec YAML, e.g. configs/tiny.yaml (optional with --script)")
    ] = None,
    script: Annotated[
        str | None,
        typer.Option(
            help="train with your own script (shardkeeper.Segment): its path inside the image; its arguments follow --"
        ),
    ] = None,
    nodes: Annotated[int, typer.Option(help="pods (one torchrun each)")] = 1,
    nproc: Annotated[int, typer.Option(help="ranks per pod (GPUs per pod with --device cuda)")] = 1,
    until_step: Annotated[int, typer.Option(help="train until this many optimizer steps are done")] = 20,
    segment: Annotated[int, typer.Option(help="index of this segment in the run (one more for each segment)")] = 0,
    kind: Annotated[str, typer.Option(help="pytorchjob (Kubeflow training-operator) | jobset (JobSet)")] = "pytorchjob",
    image: Annotated[
        str, typer.Option(help="container image with shardkeeper and torch installed")
    ] = "shardkeeper:latest",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace")] = "default",
    pvc: Annotated[
        str, typer.Option(help="ReadWriteMany PersistentVolumeClaim holding the run directory")
    ] = "shardkeeper-runs",
    grace_s: Annotated[
        int,
        typer.Option(
            help="seconds a checkpoint needs after SIGTERM (torchrun's shutdown "
            "timeout; the pod's grace period is 30 s more)"
        ),
    ] = 60,
    device: Annotated[str, typer.Option(help="cuda (nvidia.com/gpu per rank, NCCL) | cpu (gloo)")] = "cuda",
    set_: Annotated[list[str] | None, typer.Option("--set", help="override, e.g. --set optim.lr=1e-3")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="write the YAML here instead of stdout")] = None,
) -> None:
    """Render one segment as Kubernetes manifests (a ConfigMap + a PyTorchJob or JobSet), validated against the
    vendored CRD schemas; apply them with `kubectl apply -f FILE`. Nothing is submitted from here."""
    from launch.base import LaunchRequest
    from launch.kubernetes import K8sOptions, describe, render_validated, to_yaml
    from schemas import ClusterTopology
    from shardkeeper.config import check_until_step, plain_path, train_spec

    for flag, value in (("--nodes", nodes), ("--nproc", nproc), ("--until-step", until_step)):
        if value < 1:
            raise ShardkeeperError(f"{flag} {value}: must be at least 1")
    check_until_step("--until-step", until_step)
    for flag, path in (("--run-dir", run_dir), ("--config", config), ("--script", script), ("--out", out_file)):
        plain_path(flag, path)
    if segment < 0:
        raise ShardkeeperError(f"--segment {segment}: must be 0 or more")
    if device not in ("cpu", "cuda"):
        raise ShardkeeperError(f"--device {device!r}: choose cuda or cpu")
    if config is None and script is None:
        raise ShardkeeperError("--config or --script: give the run's RunSpec YAML, or your training script")
    if ctx.args and script is None:
        raise ShardkeeperError(f"unexpected argument {ctx.args[0]!r}; script arguments go after --script FILE --")
    spec = train_spec(config, set_, "", script=script, script_args=list(ctx.args))
    if script is not None and not script.startswith("/"):  # a path inside the image: keep it as given there
        spec = spec.model_copy(update={"script": spec.script.model_copy(update={"path": script})})  # type: ignore[union-attr]
    problem = spec.world_size_refusal(nodes * nproc, choose="--nodes x --nproc")  # None for a script run
    if problem is not None:
        raise ShardkeeperError(f"--nodes {nodes} --nproc {nproc}: {problem}")
    topo = ClusterTopology(
        nodes=nodes,
        procs_per_node=nproc,
        device_type=device,  # type: ignore[arg-type]
        backend="nccl" if device == "cuda" else "gloo",
        launcher="kubernetes",
    )
    req = LaunchRequest(run_dir=run_dir, until_step=until_step, segment=segment, topology=topo)  # type: ignore[arg-type]
    docs = render_validated(
        spec, req, K8sOptions(image=image, namespace=namespace, pvc=pvc, grace_s=grace_s, kind=kind)
    )
    text = to_yaml(docs)
    if out_file is None:
        sys.stdout.write(text)
    else:
        out_file.write_text(text, encoding="utf-8")
    console.print(
        f"{describe(docs)}; validated against the vendored CRD schema"
        + (f"; written to {out_file}: kubectl apply -f {out_file}" if out_file else ""),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def _is_remote(path: str) -> bool:
    from ckpt.store.objstore import is_remote

    return is_remote(path)


def _name(path: str) -> str:
    """The last component of a path or URL."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]
