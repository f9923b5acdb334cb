"""What makes an export usable beyond the weights: the tokenizer files (tokenizer.json, tokenizer_config.json,
special tokens, chat template, ...) carried from where the run's tokenizer came from, checked against what the
run recorded when it started, and the card metadata of a fine-tune (``base_model``).

Where the tokenizer comes from (``tokenizer_source``): the ``tokenizer_from`` argument (``shardkeeper export
--tokenizer-from PATH``), else the run's ``data.tokenizer`` when its RunSpec has one, else the base model's folder
recorded in the manifest (``base_model.local_path``; for a Hub id its cache snapshot). A run from random weights
without a tokenizer exports the weights alone, as before. ``tokenizer_from=False`` (``--no-tokenizer``) never
carries one.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from ckpt.pretrained import TOKENIZER_FILES, is_hub_id, resolve
from schemas import CheckpointManifest, ModelSpec
from schemas.errors import ConfigError, ExportError

log = logging.getLogger(__name__)
from ckpt.export._sink import write_small_file  # noqa: E402

NO_TOKENIZER = False


def tokenizer_source(
    ckpt_dir: Path, manifest: CheckpointManifest, tokenizer_from: str | Path | bool | None
) -> tuple[Path | None, dict[str, str]]:
    """The folder to carry tokenizer files from, and the sha256 the run recorded of them ({} when unchecked)."""
    if tokenizer_from is False:
        return None, {}
    if tokenizer_from not in (None, True, ""):
        folder = Path(str(tokenizer_from)).expanduser()
        if not folder.is_dir():
            raise ExportError(
                f"--tokenizer-from {tokenizer_from}: no such folder; pass the folder holding "
                "tokenizer.json / tokenizer_config.json"
            )
        if not any((folder / n).is_file() for n in TOKENIZER_FILES):
            raise ExportError(
                f"--tokenizer-from {folder}: holds none of {', '.join(TOKENIZER_FILES[:3])}, ...; pass "
                "a tokenizer folder (save_pretrained)"
            )
        return folder, {}
    data_tokenizer = getattr(manifest.run_spec.data, "tokenizer", None)
    base = manifest.base_model
    if data_tokenizer:
        folder = Path(str(data_tokenizer)).expanduser()
        if not folder.is_dir():
            raise ExportError(
                f"{ckpt_dir / 'manifest.json'}: run_spec.data.tokenizer {data_tokenizer} is not a folder "
                "here; pass --tokenizer-from PATH (or --no-tokenizer)"
            )
        recorded = base.files if base is not None and Path(base.local_path) == folder.resolve() else {}
        return folder, recorded
    if base is None:
        return None, {}
    folder = Path(base.local_path)
    if not folder.is_dir() and is_hub_id(base.source):
        try:
            folder, _ = resolve(ModelSpec(pretrained=base.source, revision=base.resolved_revision or base.revision))
        except ConfigError as e:
            raise ExportError(
                f"{ckpt_dir / 'manifest.json'}: the base model's tokenizer is not here ({e}); pass "
                "--tokenizer-from PATH (or --no-tokenizer)"
            ) from None
    if not folder.is_dir():
        raise ExportError(
            f"{ckpt_dir / 'manifest.json'}: base_model.local_path {folder} (the run's tokenizer) is "
            "not here; pass --tokenizer-from PATH with the base model's tokenizer (or --no-tokenizer)"
        )
    return folder, base.files


def copy_tokenizer(tmp: Path, folder: Path, recorded: dict[str, str]) -> dict[str, str]:
    """Copy the tokenizer files of ``folder`` into the export; a file the run recorded must be unchanged."""
    out: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        src = folder / name
        if not src.is_file():
            continue
        data = src.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if name in recorded and recorded[name] != digest:
            raise ExportError(
                f"{src}: changed since the run started (its sha256 differs from the manifest's "
                "base_model.files); pass --tokenizer-from PATH with the tokenizer the run used"
            )
        out[name] = write_small_file(tmp / name, data)
    if not out:
        log.warning("%s: no tokenizer files to carry into the export", folder)
    return out


def card_metadata(manifest: CheckpointManifest) -> dict[str, str]:
    """Hub card metadata of a fine-tune: base_model (a Hub id) and base_model_relation."""
    base = manifest.base_model
    if base is None or not base.hub_id:
        return {}
    return {"base_model": base.hub_id, "base_model_relation": "finetune"}
