"""The export folder as publish sees it (files, checksums, provenance) and the completion marker
(``shardkeeper.json``) that lands last on every target."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt.commit.layout import RunDir, parse_step, step_dir_name
from schemas import MANIFEST_NAME
from schemas.errors import PublishError

logger = logging.getLogger(__name__)


MARKER_NAME = "shardkeeper.json"
MARKER_FORMAT = "shardkeeper.publish/1"
EXPORT_RESULT_NAME = "export.json"
INDEX_NAME = "model.safetensors.index.json"
CARD_NAME = "README.md"
NO_TOKEN_MESSAGE = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"

NOT_PUBLISHED = {EXPORT_RESULT_NAME, MARKER_NAME}
WEIGHT_PATTERNS = ("*.safetensors", INDEX_NAME)
# A folder this large goes through upload_large_folder on huggingface_hub releases whose
# upload_folder is still a single commit; newer upload_folder streams and batches by itself.
LARGE_BYTES = 5 * 10**9
LARGE_FILES = 100
# Network retries: 3 tries, 0.5 s then 1 s apart, never starting a try after 25 s (HfApi's own
# per-request timeout bounds each try), so an unreachable endpoint fails in well under 30 s.
RETRY_TRIES = 3
RETRY_BACKOFF_S = 0.5
RETRY_BUDGET_S = 25.0
HASH_CHUNK = 8 << 20
CARD_METADATA_KEYS = {
    "license",
    "license_name",
    "license_link",
    "language",
    "datasets",
    "base_model",
    "base_model_relation",
    "pipeline_tag",
    "model_name",
    "tags",
}
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class PublishedFile:
    sha256: str
    size: int

    def as_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class ExportFolder:
    """What publishing needs to know about an export folder, read and checksummed once."""

    root: Path
    files: dict[str, PublishedFile]  # posix path relative to root -> checksum; export.json excluded
    step: int | None
    dtype: str | None
    checkpoint: str | None  # source checkpoint directory, when export.json names it
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def tag(self) -> str | None:
        return step_dir_name(self.step) if self.step is not None else None


def load_export(export_dir: str | os.PathLike[str]) -> ExportFolder:
    """Check that ``export_dir`` is a complete export folder and checksum its files (sha256)."""
    root = check_export_dir(Path(export_dir))
    rels = publishable_files(root)
    recorded = read_export_result(root)
    config = read_json(root / "config.json", what="config.json")
    check_weights(root, rels)
    try:
        files = checksums(root, rels, recorded)
    except FileNotFoundError as err:  # the folder was replaced while it was read (a re-export with --overwrite)
        raise PublishError(
            f"{err.filename or root}: disappeared while being checksummed; the export folder is being "
            "written (a re-export?): publish again once it is complete"
        ) from None
    checkpoint = recorded.get("checkpoint") if isinstance(recorded.get("checkpoint"), str) else run_checkpoint(root)
    step = step_of(root, checkpoint)
    dtype = recorded.get("dtype") if isinstance(recorded.get("dtype"), str) else dtype_of(root, rels, config)
    return ExportFolder(root=root, files=files, step=step, dtype=dtype, checkpoint=checkpoint, config=config)


def check_export_dir(root: Path) -> Path:
    if not root.exists():
        raise PublishError(
            f"export folder {root} does not exist: run `shardkeeper export` first or pass the right path"
        )
    if not root.is_dir():
        raise PublishError(f"{root} is a file, not an export folder: pass the folder that holds config.json")
    if not os.access(root, os.R_OK | os.X_OK):
        raise PublishError(f"export folder {root} is not readable: fix its permissions (chmod u+rx)")
    if not (root / "config.json").is_file():
        raise PublishError(f"{root} has no config.json: it is not an export folder; run `shardkeeper export` into it")
    return root.resolve()


def publishable_files(root: Path) -> list[str]:
    rels = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue  # hidden files and folders (.cache/, .DS_Store) are never published
        if rel.as_posix() not in NOT_PUBLISHED:
            rels.append(rel.as_posix())
    return rels


def check_weights(root: Path, rels: list[str]) -> None:
    if not any(r.endswith(".safetensors") for r in rels):
        raise PublishError(f"{root} has no *.safetensors file: the export is incomplete; re-run `shardkeeper export`")
    if INDEX_NAME not in rels:
        return
    index = read_json(root / INDEX_NAME, what=INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise PublishError(f"{root / INDEX_NAME} has no weight_map: re-run `shardkeeper export`")
    missing = sorted(set(weight_map.values()) - set(rels))
    if missing:
        raise PublishError(
            f"{root / INDEX_NAME} names {len(missing)} shard(s) that are missing "
            f"({', '.join(missing[:3])}): the export is incomplete; re-run `shardkeeper export`"
        )


def read_json(path: Path, *, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PublishError(
            f"cannot read {path} ({type(err).__name__}): {what} must be valid JSON; re-run the export"
        ) from err
    if not isinstance(data, dict):
        raise PublishError(f"{path} is not a JSON object: {what} must be one; re-run the export")
    return data


def read_export_result(root: Path) -> dict[str, Any]:
    """export.json is optional input: a missing or unreadable one only means more hashing."""
    path = root / EXPORT_RESULT_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        logger.warning("ignoring %s (%s): every file will be hashed", path, type(err).__name__)
        return {}
    return data if isinstance(data, dict) else {}


def checksums(root: Path, rels: list[str], recorded: dict[str, Any]) -> dict[str, PublishedFile]:
    """sha256 of every file; export.json's value is reused for a file not modified after it was written."""
    known = recorded.get("files") if isinstance(recorded.get("files"), dict) else {}
    stamp = (root / EXPORT_RESULT_NAME).stat().st_mtime_ns if known else 0
    sizes = {rel: (root / rel).stat() for rel in rels}
    todo = [rel for rel in rels if not (isinstance(known.get(rel), str) and sizes[rel].st_mtime_ns <= stamp)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(todo)))) as pool:
        hashed = dict(zip(todo, pool.map(lambda rel: sha256_file(root / rel), todo)))
    if len(todo) < len(rels):
        logger.debug("reused export.json checksums for %d of %d files", len(rels) - len(todo), len(rels))
    return {rel: PublishedFile(hashed.get(rel) or known[rel], sizes[rel].st_size) for rel in rels}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def entry_of_bytes(data: bytes) -> PublishedFile:
    return PublishedFile(hashlib.sha256(data).hexdigest(), len(data))


def run_checkpoint(root: Path) -> str | None:
    """RUN_DIR/exports/step-X came from RUN_DIR/checkpoints/step-X (the run directory layout)."""
    run = RunDir.containing(root)
    candidate = run.checkpoints / root.name
    if root.resolve().parent == run.exports and (candidate / MANIFEST_NAME).is_file():
        return str(candidate)
    return None


def step_of(root: Path, checkpoint: str | None) -> int | None:
    for name in (Path(checkpoint).name if checkpoint else "", root.name):
        step = parse_step(name)
        if step is not None:
            return step
    return None


def dtype_of(root: Path, rels: list[str], config: dict[str, Any]) -> str | None:
    """Published float dtype: config.json's, else the most common float dtype in the first safetensors header."""
    value = config.get("torch_dtype") or config.get("dtype")
    if isinstance(value, str):
        return value
    first = next(r for r in rels if r.endswith(".safetensors"))
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    header = safetensors_header(root / first) or {}
    found = [names[t["dtype"]] for t in header.values() if t.get("dtype") in names]
    return max(set(found), key=found.count) if found else None


def marker_bytes(export: ExportFolder, files: dict[str, PublishedFile]) -> bytes:
    """The completion marker: deterministic bytes, so equal exports give byte-equal markers."""
    doc = {
        "format": MARKER_FORMAT,
        "name": export.name,
        "step": export.step,
        "dtype": export.dtype,
        "checkpoint": Path(export.checkpoint).name if export.checkpoint else None,
        "files": {rel: files[rel].as_json() for rel in sorted(files)},
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


def parse_marker(raw: bytes) -> dict[str, Any] | None:
    """The marker's content, or None when it is not a shardkeeper marker (corrupt, truncated, foreign)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("files"), dict):
        return None
    return doc


def safetensors_header(path: Path) -> dict[str, dict[str, Any]] | None:
    """Tensor name -> {dtype, shape, data_offsets}, or None when the file is not readable safetensors."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 0 < n < (100 << 20) else None
    except (OSError, struct.error, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    return {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
