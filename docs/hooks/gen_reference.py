"""Reference pages generated from the code at every ``mkdocs build`` (an mkdocs hook, see mkdocs.yml):

* ``reference/config.md``      every RunSpec key (walked recursively) with its type, default and description,
                               from the pydantic models in ``schemas/run.py``; the flow parameters from
                               ``schemas/requests.py``;
* ``reference/cli.md``         every ``shardkeeper`` command and option, from the typer app in ``shardkeeper/cli.py``;
* ``reference/exit-codes.md``  the ``EXIT_*`` constants of ``schemas/seam.py`` and the error classes of
                               ``schemas/errors.py`` with their exit codes;
* ``reference/schemas.md``     the manifest, the segment report, the lineage event and the plan, field by field;
* ``benchmarks/plots/NAME.png`` the plots the benches drew beside their tables (``bench/results/NAME.png``), served
                               as they are, so that a benchmark page shows them without a copy in docs/.

Nothing here is written by hand: change a description in the code and the site follows.
``python docs/hooks/gen_reference.py OUT_DIR`` writes the same pages into a folder (to read them without mkdocs).
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _esc(text: Any) -> str:
    """A table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`" if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| `null`" if type(None) in args else "")
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(ann, "__name__", str(ann)).replace("NoneType", "null")


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(factory)"
        if hasattr(value, "model_dump"):
            return "(section)"
        return f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "**required**"
    if field.default is None:
        return "`null`"
    return f"`{field.default!r}`"


def _model_in(ann: Any) -> type | None:
    """The pydantic model a field holds (also inside ``X | None``), else None."""
    from pydantic import BaseModel

    candidates = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def walk(model: type, prefix: str = "") -> list[tuple[str, Any, type | None]]:
    """(dotted key, field info, nested model or None) for every field of ``model``, nested ones after their section."""
    rows: list[tuple[str, Any, type | None]] = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        nested = _model_in(field.annotation)
        rows.append((key, field, nested))
        if nested is not None:
            rows.extend(walk(nested, key + "."))
    return rows


def _constraints(field: Any) -> str:
    out = []
    for m in field.metadata:
        for attr, sym in (
            ("gt", ">"),
            ("ge", "≥"),
            ("lt", "<"),
            ("le", "≤"),
            ("min_length", "min length"),
            ("pattern", "pattern"),
        ):
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sym} {v}")
    return "; ".join(out)


def model_table(model: type, prefix: str = "", *, recurse: bool = True) -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    rows = walk(model, prefix) if recurse else [(prefix + n, f, None) for n, f in model.model_fields.items()]
    for key, field, nested in rows:
        typ = f"section ({nested.__name__})" if nested is not None else _type_name(field.annotation)
        if nested is not None and typing.get_origin(field.annotation) in (typing.Union, types.UnionType):
            typ += " \\| `null`"
        cons = _constraints(field)
        desc = (field.description or "") + (f" ({cons})" if cons else "")
        lines.append(f"| `{key}` | {typ} | {_default(field)} | {_esc(desc)} |")
    return "\n".join(lines)


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else ""


def config_page() -> str:
    from schemas import requests
    from schemas.run import PRETRAINED_OVERRIDES, RunSpec
    from shardkeeper.stages import MUTABLE_FIELDS, MUTABLE_SECTIONS

    parts = [
        "# Configuration keys",
        "",
        '!!! info "Generated"',
        "    This page is generated from the pydantic models in `schemas/run.py` and `schemas/requests.py` at every",
        "    build (`docs/hooks/gen_reference.py`); a description changes in the code, not here.",
        "",
        "A run is described by one `RunSpec` in a YAML file (`--config`), every key optional; `--set KEY=VALUE`",
        "overrides one key on the command line (`--set optim.lr=1e-3`). Unknown keys are refused in one line naming",
        "the key and the known keys of that section. The first segment writes the resolved spec to `RUN_DIR/run.yaml`;",
        "later segments may change only the sections "
        + ", ".join(f"`{s}`" for s in MUTABLE_SECTIONS)
        + " and the keys "
        + ", ".join(f"`{sec}.{k}`" for sec, keys in MUTABLE_FIELDS.items() for k in keys)
        + " (`shardkeeper.stages.MUTABLE_SECTIONS`, `MUTABLE_FIELDS`); anything else is refused in one line.",
        "",
        "## RunSpec",
        "",
        _doc(RunSpec) or "Everything that determines a training run.",
        "",
        model_table(RunSpec),
        "",
        "`model.config` with `model.pretrained` may only override: "
        + ", ".join(f"`{k}`" for k in sorted(PRETRAINED_OVERRIDES))
        + " (`schemas.run.PRETRAINED_OVERRIDES`).",
        "",
        "## Flow parameters",
        "",
        "The Prefect deployments take flat parameters (`prefect deployment run ... --param KEY=VALUE`); a bad one",
        "fails the flow run before anything starts, in one line.",
        "",
    ]
    for cls in (requests.TrainExportRequest, requests.ResumeRequest, requests.SegmentPlan):
        parts += [f"### {cls.__name__}", "", _doc(cls), "", model_table(cls, recurse=False), ""]
    return "\n".join(parts)


def _arg_name(p: Any) -> str:
    return p.metavar or p.name.upper()


def _is_argument(p: Any) -> bool:
    return "Argument" in type(p).__name__


def _param_type(p: Any) -> str:
    desc = getattr(p, "type_descriptor", None)
    if desc is not None:
        ann = desc.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
            ann = args[0]
        return _type_name(ann).replace("`", "")
    ptype = getattr(p, "type", None)  # plain click
    return getattr(ptype, "name", "").upper()


def _param_row(p: Any) -> str:
    if _is_argument(p):
        name = f"`{_arg_name(p)}`"
        req = "**required**" if p.required else "optional"
        typ = _param_type(p)
    else:
        name = ", ".join(f"`{o}`" for o in list(p.opts) + list(p.secondary_opts))
        typ = "" if p.is_flag else _param_type(p)
        if p.is_flag:
            req = "flag"
        elif p.required:
            req = "**required**"
        else:
            req = f"default `{p.default}`" if p.default not in (None, (), []) else "optional"
        if p.multiple:
            req += ", repeatable"
    return f"| {name} | {_esc(typ)} | {req} | {_esc(p.help or '')} |"


def cli_page() -> str:
    import typer

    from shardkeeper.cli import app

    root = typer.main.get_command(app)
    parts = [
        "# CLI: `shardkeeper`",
        "",
        '!!! info "Generated"',
        "    This page is generated from the typer app in `shardkeeper/cli.py` at every build",
        "    (`docs/hooks/gen_reference.py`): every command and every option, with the help text `--help` prints.",
        "",
        _esc(root.help or ""),
        "",
        "Global options (before the command):",
        "",
        "| option | type | | help |",
        "|---|---|---|---|",
        *(_param_row(p) for p in root.params),
        "",
        "A user mistake prints one line (`error: FILE: what is wrong; the fix`) and exits non-zero; see",
        "[Exit codes](exit-codes.md).",
        "",
    ]
    for name, cmd in root.commands.items():
        args = " ".join(_arg_name(p) for p in cmd.params if _is_argument(p))
        parts += [
            f"## `shardkeeper {name}`",
            "",
            "```text",
            f"shardkeeper {name} [OPTIONS] {args}".rstrip(),
            "```",
            "",
            inspect.cleandoc(cmd.help or ""),
            "",
            "| argument / option | type | | help |",
            "|---|---|---|---|",
            *(_param_row(p) for p in cmd.params if not p.hidden),
            "",
        ]
        if getattr(cmd, "context_settings", {}).get("allow_extra_args"):
            parts += ["Arguments after `--` are passed on (with `--script`: to your script).", ""]
    return "\n".join(parts)


def _exit_constants() -> list[tuple[str, int, str]]:
    """``EXIT_NAME = N  # comment`` lines of schemas/seam.py, comments included (they are the documentation)."""
    import schemas.seam as seam

    src = Path(seam.__file__).read_text(encoding="utf-8").splitlines()
    out = []
    for node in ast.parse("\n".join(src)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith("EXIT_"):
                line = src[node.lineno - 1]
                comment = line.split("#", 1)[1].strip() if "#" in line else ""
                out.append((name, getattr(seam, name), comment))
    return out


def exit_codes_page() -> str:
    import schemas.errors as errors

    parts = [
        "# Exit codes",
        "",
        '!!! info "Generated"',
        "    From the `EXIT_*` constants of `schemas/seam.py` (with their comments) and the error classes of",
        "    `schemas/errors.py` (`docs/hooks/gen_reference.py`).",
        "",
        "## How a segment ended",
        "",
        "`shardkeeper train`, torchrun's ranks and a Slurm job return these; the segment's report",
        "(`RUN_DIR/.segment-status.json`, `schemas.seam.SegmentReport`) says the same in its `status`.",
        "",
        "| code | constant | meaning |",
        "|---|---|---|",
    ]
    for name, code, comment in _exit_constants():
        parts.append(f"| {code} | `schemas.seam.{name}` | {_esc(comment or name[5:].lower())} |")
    parts += [
        "",
        "A Kubernetes pod entry (`python -m launch.k8s_pod`) maps a preempted segment to **143** (128 + SIGTERM)",
        "instead, which Kubeflow's `restartPolicy: ExitCode` and the JobSet's `podFailurePolicy` retry; see",
        "[Kubernetes](../tutorials/kubernetes.md).",
        "",
        "## Refusals (`ShardkeeperError`)",
        "",
        "A refusal is one line naming the file or field and the fix; the CLI exits with the class's `exit_code`.",
        "",
        "| code | error | when |",
        "|---|---|---|",
    ]
    seen: list[type] = []

    def visit(cls: type) -> None:
        seen.append(cls)
        for sub in cls.__subclasses__():
            if sub.__module__ == errors.__name__:
                visit(sub)

    visit(errors.ShardkeeperError)
    for cls in sorted(seen, key=lambda c: (c.exit_code, c.__name__)):
        parts.append(f"| {cls.exit_code} | `schemas.errors.{cls.__name__}` | {_esc(_doc(cls) or '')} |")
    return "\n".join(parts) + "\n"


def schemas_page() -> str:
    from schemas.checkpoint import CheckpointManifest, FileEntry, Fingerprint, TensorEntry, ValidationReport
    from schemas.plan import Driver, RunPlan, SegmentProgress, StageDone
    from schemas.results import LineageEvent, SegmentResult
    from schemas.seam import SegmentLaunch, SegmentReport

    parts = [
        "# Schemas of the files in a run directory",
        "",
        '!!! info "Generated"',
        "    From the pydantic models in `schemas/` (`docs/hooks/gen_reference.py`). Where each file lives:",
        "    [On-disk layout](on-disk.md).",
        "",
    ]
    for cls, where in (
        (CheckpointManifest, "`checkpoints/step-XXXXXXXX/manifest.json`"),
        (FileEntry, "an entry of the manifest's `files`"),
        (TensorEntry, "an entry of the manifest's tensor inventory"),
        (Fingerprint, "the manifest's `fingerprint`"),
        (ValidationReport, "what `shardkeeper validate --json` prints"),
        (LineageEvent, "one line of `lineage.jsonl` (`shardkeeper lineage --json`)"),
        (SegmentLaunch, "`.segment-launch.json`: what the launcher hands the ranks"),
        (SegmentReport, "`.segment-status.json`: rank 0's report of how the segment ended"),
        (SegmentResult, "what the train stage returns (Prefect task result, `segments.jsonl`)"),
        (RunPlan, "`plan.json`: a train-and-export flow run's plan and its progress"),
        (SegmentProgress, "an entry of the plan's `progress`"),
        (StageDone, "the plan's `exported` and `published`"),
        (Driver, "who drove the plan or launched a segment (`started_by`, `driver`, `by`)"),
    ):
        parts += [f"## {cls.__name__}", "", f"{where}. {_esc(_doc(cls))}", "", model_table(cls, recurse=False), ""]
    return "\n".join(parts)


PAGES = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/exit-codes.md": exit_codes_page,
    "reference/schemas.md": schemas_page,
}


# --- the mkdocs hook -------------------------------------------------------------------------------------------
PLOTS = ROOT / "bench" / "results"


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for png in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/plots/{png.name}", abs_src_path=str(png)))
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for uri, make in PAGES.items():
        (out / uri).parent.mkdir(parents=True, exist_ok=True)
        (out / uri).write_text(make(), encoding="utf-8")
        print(out / uri)
