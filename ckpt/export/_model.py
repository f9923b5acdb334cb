"""The transformers side: the model's description (config.json, generation_config.json, names, shapes, ties)
from the manifest's record or a meta-device build, checked against the tensors; the export's README."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpt import __version__
from ckpt.commit.state import tied_weights
from ckpt.gcpause import gc_paused
from schemas import CheckpointManifest
from schemas.errors import CheckpointError, ExportError

log = logging.getLogger(__name__)
from ckpt.export._options import MODEL_PREFIX
from ckpt.export._records import ExportTensor
from ckpt.export._sink import BufferPool, produce


@dataclass(frozen=True)
class ModelDescription:
    config_json: str  # config.json, with dtype and architectures set for the export
    generation_json: str  # generation_config.json
    architecture: str  # the model class name, e.g. LlamaForCausalLM
    shapes: dict[str, tuple[int, ...]] | None  # state_dict name -> shape of the transformers model; None: recorded
    tied: dict[str, str]  # tied name -> the name it is tied to (e.g. lm_head.weight -> model.embed_tokens.weight)


def json_text(d: dict[str, Any]) -> str:
    """A config as transformers' ``to_json_string`` writes it: sorted keys, indent 2, final newline."""
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def model_from_record(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> ModelDescription | None:
    """The model files from the manifest's ``hf_model`` record (written at save from the model the trainer
    built), without importing transformers; None when the checkpoint has no usable record (older ones).
    The names and shapes are those of the manifest's inventory, which the checkpoint's files are checked
    against: no model needs to be built."""
    rec = manifest.hf_model
    script = manifest.run_spec.script is not None  # a user's script: its model, not run_spec.model, is the record's
    if script and rec is None:
        raise ExportError(
            f"{ckpt_dir / 'manifest.json'}: the script's model is not a transformers model (no hf_model "
            "record), and export writes a transformers folder; export a run whose script tracks a "
            "transformers PreTrainedModel, or read the checkpoint with torch.distributed.checkpoint"
        )
    if (
        rec is None
        or (rec.generation_config is None and not script)
        or not any(e.name.startswith(MODEL_PREFIX) for e in manifest.tensors)
    ):
        return None
    where = f"{ckpt_dir / 'manifest.json'}: field hf_model.config"
    arch = rec.config.get("architectures")
    if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
        raise CheckpointError(
            f"{where}.architectures is {arch!r}, not a list of model class names; "
            "the manifest is corrupted, pick another step"
        )
    model_type = rec.config.get("model_type", manifest.run_spec.model.model_type)
    if model_type != manifest.run_spec.model.model_type and not script:
        raise CheckpointError(
            f"{where}.model_type is {model_type!r} but run_spec.model.model_type is "
            f"{manifest.run_spec.model.model_type!r}; the manifest is inconsistent, pick another step"
        )
    config = dict(rec.config)
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype  # as the transformers path sets config.dtype
    return ModelDescription(json_text(config), json_text(rec.generation_config or {}), arch[0], None, dict(rec.tied))


def describe_model(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> ModelDescription:
    """Build the model the RunSpec describes on the meta device: names, shapes and ties, no memory."""
    with gc_paused():
        return describe_model_gc_off(ckpt_dir, manifest, dtype)


def describe_model_gc_off(ckpt_dir: Path, manifest: CheckpointManifest, dtype: str) -> ModelDescription:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = manifest.run_spec.model
    where = f"{ckpt_dir / 'manifest.json'}: run_spec.model"
    try:
        config = AutoConfig.for_model(spec.model_type, **spec.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (KeyError, ValueError, TypeError) as e:
        raise ExportError(
            f"{where} ({spec.model_type}) is not a transformers causal LM ({e}); "
            "export supports model types that AutoModelForCausalLM builds"
        ) from None
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = tied_weights(model, config)
    return ModelDescription(
        config.to_json_string(use_diff=True),
        GenerationConfig.from_model_config(config).to_json_string(use_diff=True),
        config.architectures[0],
        shapes,
        tied,
    )


def name_tensors(ckpt_dir: Path, tensors: list[ExportTensor]) -> dict[str, ExportTensor]:
    """Export name -> tensor, in the checkpoint's order (DCP keeps the model's state_dict order)."""
    if tensors and all(t.name.startswith("module.") for t in tensors):  # a DDP-wrapped model
        for t in tensors:
            t.name = t.name.removeprefix("module.")
    by_name: dict[str, ExportTensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise ExportError(
                f"{ckpt_dir}: {by_name[t.name].key} and {t.key} both export as {t.name}; "
                "the checkpoint's model keys are ambiguous"
            )
        by_name[t.name] = t
    return by_name


def check_against_inventory(
    ckpt_dir: Path, tensors: list[ExportTensor], manifest: CheckpointManifest, source: str = ".metadata"
) -> None:
    """The DCP metadata (ZeRO files) must hold exactly the model tensors the manifest recorded at save."""
    recorded = {e.name: (tuple(e.shape), e.dtype) for e in manifest.tensors if e.name.startswith(MODEL_PREFIX)}
    stored = {t.key: (t.shape, str(t.dtype).removeprefix("torch.")) for t in tensors}
    if recorded and recorded != stored:
        diff = sorted(k for k in recorded.keys() | stored.keys() if recorded.get(k) != stored.get(k))
        raise CheckpointError(
            f"{ckpt_dir / 'manifest.json'}: its tensor inventory and {source} disagree on "
            f"{', '.join(diff[:3])}; the checkpoint is inconsistent, pick another step"
        )


def drop_tied(ckpt_dir: Path, by_name: dict[str, ExportTensor], tied: dict[str, str], pool: BufferPool) -> None:
    for target, source in tied.items():
        if target in by_name and source in by_name:
            check_tied(ckpt_dir, by_name[target], by_name[source], pool)
            log.info("%s is tied to %s and equal to it: not written (as save_pretrained does)", target, source)
            del by_name[target]


def check_against_model(ckpt_dir: Path, by_name: dict[str, ExportTensor], model: ModelDescription) -> None:
    """Names and shapes must be those of the model that run_spec.model builds (tied copies aside)."""
    expected = model.shapes
    if expected is None:  # from the record: the names and shapes are the inventory's, checked already
        return
    where = f"{ckpt_dir}: the checkpoint does not match run_spec.model in its manifest"
    unexpected = [n for n in by_name if n not in expected]
    if unexpected:
        raise ExportError(f"{where}: unexpected tensors {', '.join(unexpected[:3])}; export the run's own checkpoints")
    missing = [n for n in expected if n not in by_name and not (n in model.tied and model.tied[n] in by_name)]
    if missing:
        raise ExportError(f"{where}: missing tensors {', '.join(missing[:3])}; export the run's own checkpoints")
    for name, t in by_name.items():
        if t.shape != expected[name]:
            raise ExportError(f"{where}: {name} has shape {list(t.shape)}, the model expects {list(expected[name])}")


def check_tied(ckpt_dir: Path, target: ExportTensor, source: ExportTensor, pool: BufferPool) -> None:
    digests = []
    for t in (target, source):
        h = hashlib.sha256()
        produce(t, t.dtype, pool, lambda view, release: (h.update(view), release and release()))  # noqa: B023
        digests.append(h.digest())
    if target.shape != source.shape or target.dtype != source.dtype or digests[0] != digests[1]:
        raise ExportError(
            f"{ckpt_dir}: {target.name} differs from {source.name} although the config ties them "
            "(tie_word_embeddings); the checkpoint does not match its run_spec.model"
        )


def readme_text(
    ckpt_dir: Path, manifest: CheckpointManifest, model: ModelDescription, dtype: str, num_params: int, num_shards: int
) -> bytes:
    arch = model.architecture
    base = manifest.base_model
    header = ["---", "library_name: transformers", "tags:", "- shardkeeper"]
    if base is not None and base.hub_id:
        header += [f"base_model: {base.hub_id}", "base_model_relation: finetune"]
    base_rows = []
    if base is not None:
        rev = f" @ {base.resolved_revision or base.revision}" if (base.resolved_revision or base.revision) else ""
        base_rows = [f"| base model | {base.hub_id or base.source}{rev} (fine-tuned from it) |"]
    lines = [
        *header,
        "---",
        "",
        f"# {manifest.run_name} at step {manifest.step}",
        "",
        f"Exported by shardkeeper {__version__} from checkpoint `{ckpt_dir.name}` of run `{manifest.run_name}` "
        "(master weights float32).",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | {arch} ("
        f"{manifest.hf_model.config.get('model_type') if manifest.hf_model else manifest.run_spec.model.model_type}) |",
        *base_rows,
        f"| parameters | {num_params:,} |",
        f"| dtype | {dtype} |",
        f"| training step | {manifest.step} |",
        f"| tokens seen | {manifest.tokens:,} |",
        f"| safetensors files | {num_shards} |",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")  # when the folder has tokenizer files',
        "```",
        "",
    ]
    return "\n".join(lines).encode("utf-8")


class Background:
    """Run a function in a thread; ``result()`` joins it and re-raises its error. Used for importing
    transformers (Python, holding the GIL) while the checks in the main thread run mostly in C."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="export-describe", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def declared_untied(manifest: CheckpointManifest) -> bool:
    """run_spec.model.config says ``tie_word_embeddings: false``: nothing is dropped as a tied copy, so
    the copy need not wait for transformers (seconds to import) to describe the model."""
    return manifest.run_spec.model.config.get("tie_word_embeddings") is False


def described(
    describing: Background | ModelDescription, ckpt_dir: Path, by_name: dict[str, ExportTensor], pool: BufferPool
) -> ModelDescription:
    """The model description (recorded, or built by the background thread); tied copies dropped, checked."""
    model: ModelDescription = describing if isinstance(describing, ModelDescription) else describing.result()
    drop_tied(ckpt_dir, by_name, model.tied, pool)
    check_against_model(ckpt_dir, by_name, model)
    return model
