"""The Hub model card: config summary, step, tokens, loss, dtype and the checkpoint's lineage."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ckpt.commit.fsutil import read_jsonl
from ckpt.commit.layout import RunDir
from schemas import MANIFEST_NAME, LineageEvent

logger = logging.getLogger(__name__)
from ckpt.publish._folder import CARD_METADATA_KEYS, ExportFolder, safetensors_header


def model_card(
    export: ExportFolder,
    repo_id: str,
    *,
    branch: str = "main",
    lineage: list[LineageEvent] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """README.md for the Hub: YAML metadata (ModelCardData) + config summary, training state, lineage."""
    from huggingface_hub import ModelCard, ModelCardData

    extra = dict(extra or {})
    metadata = {**inherited_metadata(export), **{k: extra.pop(k) for k in list(extra) if k in CARD_METADATA_KEYS}}
    model_type = [str(export.config["model_type"])] if export.config.get("model_type") else []
    tags = ["shardkeeper", "safetensors", *model_type, *list(metadata.pop("tags", []) or [])]
    data = ModelCardData(library_name="transformers", tags=list(dict.fromkeys(tags)), **metadata)
    revision = export.tag or branch
    lines = [
        f"# {repo_id.split('/')[-1]}" + (f" — step {export.step:,}" if export.step is not None else ""),
        "",
        f"Exported by shardkeeper from checkpoint `{checkpoint_name(export)}`.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", revision="{revision}")',
        "```",
        "",
        *(
            [f'Every published step is a tag (`revision="step-XXXXXXXX"`); `{branch}` holds the newest step.', ""]
            if export.tag
            else []
        ),
        "## Model",
        "",
        *md_table(config_rows(export)),
        "",
        "## Training",
        "",
        *md_table(training_rows(export, extra)),
        "",
    ]
    chain = lineage_chain(lineage or [], export)
    if chain:
        lines += ["## Lineage", "", "| event | kind | step | parent | time |", "|---|---|---|---|---|"]
        lines += [
            f"| {md_cell(e.id)} | {e.kind} | {'' if e.step is None else e.step} | {md_cell(e.parent or '')} "
            f"| {e.time} |"
            for e in chain
        ]
        lines.append("")
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
    return str(ModelCard(text))  # parses the YAML back: a bad metadata value fails here, not on the Hub


# What the export's own README.md (written by `shardkeeper export`) says that the Hub card must keep: a
# fine-tune's base model and relation, and the datasets.
INHERITED_KEYS = ("base_model", "base_model_relation", "datasets")


def inherited_metadata(export: ExportFolder) -> dict[str, Any]:
    """base_model / base_model_relation / datasets from the export's README.md front matter, else from the
    source checkpoint's manifest (its base_model record)."""
    out: dict[str, Any] = {}
    card = export.root / "README.md"
    if card.is_file():
        from huggingface_hub import ModelCard

        try:
            data = ModelCard.load(card).data.to_dict()
            out = {k: data[k] for k in INHERITED_KEYS if data.get(k)}
        except (OSError, ValueError) as err:
            logger.debug("no metadata from %s (%s)", card, type(err).__name__)
    if "base_model" not in out:
        base = manifest_of(export).get("base_model") or {}
        if isinstance(base, dict) and base.get("hub_id"):
            out.update(base_model=base["hub_id"], base_model_relation="finetune")
    return out


def manifest_of(export: ExportFolder) -> dict[str, Any]:
    if not export.checkpoint:
        return {}
    try:
        data = json.loads((Path(export.checkpoint) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoint_name(export: ExportFolder) -> str:
    return Path(export.checkpoint).name if export.checkpoint else export.name


def config_rows(export: ExportFolder) -> list[tuple[str, Any]]:
    cfg = export.config

    def first(*keys: str) -> Any:
        return next((cfg[k] for k in keys if cfg.get(k) is not None), None)

    params = param_count(export)
    rows = [
        ("model type", cfg.get("model_type")),
        ("architectures", ", ".join(cfg.get("architectures") or []) or None),
        ("hidden size", first("hidden_size", "n_embd", "d_model")),
        ("layers", first("num_hidden_layers", "n_layer", "num_layers")),
        ("attention heads", first("num_attention_heads", "n_head")),
        ("vocab size", cfg.get("vocab_size")),
        ("context length", first("max_position_embeddings", "n_positions")),
        ("parameters", f"{params:,}" if params is not None else None),
        ("dtype", export.dtype),
        ("safetensors files", sum(1 for r in export.files if r.endswith(".safetensors"))),
    ]
    return [(k, v) for k, v in rows if v is not None]


def training_rows(export: ExportFolder, extra: dict[str, Any]) -> list[tuple[str, Any]]:
    summary = training_summary(export)
    rows: dict[str, Any] = {"step": export.step, **summary}
    rows.update(extra)  # the caller knows best (e.g. an eval loss)
    return [(k, v) for k, v in rows.items() if v is not None]


def training_summary(export: ExportFolder) -> dict[str, Any]:
    """Run name, tokens and loss at the step, read from the source checkpoint's run directory if present."""
    if not export.checkpoint:
        return {}
    ckpt = Path(export.checkpoint)
    out: dict[str, Any] = {}
    try:
        manifest = json.loads((ckpt / MANIFEST_NAME).read_text(encoding="utf-8"))
        out = {"run": manifest.get("run_name"), "tokens": manifest.get("tokens"), "segment": manifest.get("segment")}
        base = manifest.get("base_model") or {}
        if isinstance(base, dict) and base.get("source"):
            rev = base.get("resolved_revision") or base.get("revision")
            out["base model"] = f"{base.get('hub_id') or base['source']}" + (f" @ {rev}" if rev else "")
        data = (manifest.get("run_spec") or {}).get("data") or {}
        if isinstance(data, dict) and data.get("dataset"):  # optional: runs on a named dataset
            out["dataset"] = f"{data['dataset']}" + (f" ({data['split']})" if data.get("split") else "")
        step = manifest.get("step", export.step)
        rows = read_jsonl(RunDir.containing(ckpt).metrics)
        losses = [m.get("loss") for m in rows if m.get("step") == step]
        if losses and losses[-1] is not None:
            out["loss"] = round(float(losses[-1]), 6)
        evals = [m.get("eval_loss") for m in rows if m.get("eval_loss") is not None and (m.get("step") or 0) <= step]
        if evals:  # optional: runs with held-out evaluation
            out["eval loss"] = round(float(evals[-1]), 6)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        logger.debug("no training summary from %s (%s)", ckpt, type(err).__name__)
    return {k: v for k, v in out.items() if v is not None}


def param_count(export: ExportFolder) -> int | None:
    """Sum of tensor sizes from the safetensors headers (no tensor is read)."""
    total = 0
    for rel in (r for r in export.files if r.endswith(".safetensors")):
        header = safetensors_header(export.root / rel)
        if header is None:
            return None
        for info in header.values():
            count = 1
            for dim in info.get("shape", []):
                count *= int(dim)
            total += count
    return total


def md_table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {md_cell(str(k))} | {md_cell(md_format(v))} |" for k, v in rows)]


def md_format(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def lineage_chain(events: list[LineageEvent], export: ExportFolder) -> list[LineageEvent]:
    """The parent chain (root first) that ends at this export's event, or at its checkpoint's."""
    by_id = {e.id: e for e in events}
    ends = [e for e in events if e.kind == "export" and (e.uri or "").rstrip("/").endswith("/" + export.name)]
    ends = ends or [e for e in events if e.kind == "checkpoint" and export.step is not None and e.step == export.step]
    if not ends:
        return []
    chain: list[LineageEvent] = []
    node: LineageEvent | None = ends[-1]
    while node is not None and node not in chain and len(chain) < 200:
        chain.append(node)
        node = by_id.get(node.parent) if node.parent else None
    return chain[::-1]
