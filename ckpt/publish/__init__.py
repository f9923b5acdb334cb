"""Publish an export folder to the Hugging Face Hub or to any fsspec URL, idempotently.

    from ckpt.publish import publish
    publish("runs/demo/exports/step-00000020", "ORG/NAME")             # Hub; token from HF_TOKEN or `hf auth login`
    publish("runs/demo/exports/step-00000020", "s3://bucket/models")   # -> s3://bucket/models/step-00000020/

Completion contract, the same for both kinds of target: the data files land first and
``shardkeeper.json`` (sha256 and size of every published file) lands LAST. A folder or Hub revision
whose marker is missing, or whose files disagree with it, is incomplete. Publishing the same bytes
again finds every file and the marker equal and uploads nothing (``PublishResult.skipped``).

On the Hub the README.md is a generated model card (config summary, step, tokens, loss, dtype,
lineage) and every step gets a tag ``step-XXXXXXXX``. ``export.json`` (the exporter's
ExportResult) is read, when present, for checksums and provenance, and is never uploaded: it holds
local paths.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from schemas.errors import PublishError
from ckpt.fsutil import fsync_dir, fsync_file, read_jsonl
from ckpt.layout import parse_step, step_dir_name
from schemas import MANIFEST_NAME, LineageEvent, PublishResult

logger = logging.getLogger(__name__)

MARKER_NAME = "shardkeeper.json"
MARKER_FORMAT = "shardkeeper.publish/1"
EXPORT_RESULT_NAME = "export.json"
INDEX_NAME = "model.safetensors.index.json"
CARD_NAME = "README.md"
NO_TOKEN_MESSAGE = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"

_NOT_PUBLISHED = {EXPORT_RESULT_NAME, MARKER_NAME}
_WEIGHT_PATTERNS = ("*.safetensors", INDEX_NAME)
# A folder this large goes through upload_large_folder on huggingface_hub releases whose
# upload_folder is still a single commit; newer upload_folder streams and batches by itself.
_LARGE_BYTES = 5 * 10**9
_LARGE_FILES = 100
# Network retries: 3 tries, 0.5 s then 1 s apart, never starting a try after 25 s (HfApi's own
# per-request timeout bounds each try), so an unreachable endpoint fails in well under 30 s.
_RETRY_TRIES = 3
_RETRY_BACKOFF_S = 0.5
_RETRY_BUDGET_S = 25.0
_HASH_CHUNK = 8 << 20
_CARD_METADATA_KEYS = {"license", "license_name", "license_link", "language", "datasets", "base_model",
                       "pipeline_tag", "model_name", "tags"}
_FSSPEC_OPTIONS_ONLY = {"storage_options"}
_HUB_OPTIONS = {"revision", "private", "api", "endpoint", "token", "model_card_extra", "lineage"}
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


# --------------------------------------------------------------------------------------------------
# The export folder
# --------------------------------------------------------------------------------------------------


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
    root = _check_export_dir(Path(export_dir))
    rels = _publishable_files(root)
    recorded = _read_export_result(root)
    config = _read_json(root / "config.json", what="config.json")
    _check_weights(root, rels)
    files = _checksums(root, rels, recorded)
    checkpoint = recorded.get("checkpoint") if isinstance(recorded.get("checkpoint"), str) else _run_checkpoint(root)
    step = _step_of(root, checkpoint)
    dtype = recorded.get("dtype") if isinstance(recorded.get("dtype"), str) else _dtype_of(root, rels, config)
    return ExportFolder(root=root, files=files, step=step, dtype=dtype, checkpoint=checkpoint, config=config)


def _check_export_dir(root: Path) -> Path:
    if not root.exists():
        raise PublishError(f"export folder {root} does not exist: run `shardkeeper export` first or pass the right "
                           "path")
    if not root.is_dir():
        raise PublishError(f"{root} is a file, not an export folder: pass the folder that holds config.json")
    if not os.access(root, os.R_OK | os.X_OK):
        raise PublishError(f"export folder {root} is not readable: fix its permissions (chmod u+rx)")
    if not (root / "config.json").is_file():
        raise PublishError(f"{root} has no config.json: it is not an export folder; run `shardkeeper export` into it")
    return root.resolve()


def _publishable_files(root: Path) -> list[str]:
    rels = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue  # hidden files and folders (.cache/, .DS_Store) are never published
        if rel.as_posix() not in _NOT_PUBLISHED:
            rels.append(rel.as_posix())
    return rels


def _check_weights(root: Path, rels: list[str]) -> None:
    if not any(r.endswith(".safetensors") for r in rels):
        raise PublishError(f"{root} has no *.safetensors file: the export is incomplete; re-run `shardkeeper export`")
    if INDEX_NAME not in rels:
        return
    index = _read_json(root / INDEX_NAME, what=INDEX_NAME)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise PublishError(f"{root / INDEX_NAME} has no weight_map: re-run `shardkeeper export`")
    missing = sorted(set(weight_map.values()) - set(rels))
    if missing:
        raise PublishError(f"{root / INDEX_NAME} names {len(missing)} shard(s) that are missing "
                           f"({', '.join(missing[:3])}): the export is incomplete; re-run `shardkeeper export`")


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PublishError(f"cannot read {path} ({type(err).__name__}): {what} must be valid JSON; "
                           "re-run the export") from err
    if not isinstance(data, dict):
        raise PublishError(f"{path} is not a JSON object: {what} must be one; re-run the export")
    return data


def _read_export_result(root: Path) -> dict[str, Any]:
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


def _checksums(root: Path, rels: list[str], recorded: dict[str, Any]) -> dict[str, PublishedFile]:
    """sha256 of every file; export.json's value is reused for a file not modified after it was written."""
    known = recorded.get("files") if isinstance(recorded.get("files"), dict) else {}
    stamp = (root / EXPORT_RESULT_NAME).stat().st_mtime_ns if known else 0
    sizes = {rel: (root / rel).stat() for rel in rels}
    todo = [rel for rel in rels if not (isinstance(known.get(rel), str) and sizes[rel].st_mtime_ns <= stamp)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(todo)))) as pool:
        hashed = dict(zip(todo, pool.map(lambda rel: _sha256_file(root / rel), todo)))
    if len(todo) < len(rels):
        logger.debug("reused export.json checksums for %d of %d files", len(rels) - len(todo), len(rels))
    return {rel: PublishedFile(hashed.get(rel) or known[rel], sizes[rel].st_size) for rel in rels}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry_of_bytes(data: bytes) -> PublishedFile:
    return PublishedFile(hashlib.sha256(data).hexdigest(), len(data))


def _run_checkpoint(root: Path) -> str | None:
    """RUN_DIR/exports/step-X came from RUN_DIR/checkpoints/step-X (the run directory layout)."""
    candidate = root.parent.parent / "checkpoints" / root.name
    if root.parent.name == "exports" and (candidate / MANIFEST_NAME).is_file():
        return str(candidate)
    return None


def _step_of(root: Path, checkpoint: str | None) -> int | None:
    for name in (Path(checkpoint).name if checkpoint else "", root.name):
        step = parse_step(name)
        if step is not None:
            return step
    return None


def _dtype_of(root: Path, rels: list[str], config: dict[str, Any]) -> str | None:
    """Published float dtype: config.json's, else the most common float dtype in the first safetensors header."""
    value = config.get("torch_dtype") or config.get("dtype")
    if isinstance(value, str):
        return value
    first = next(r for r in rels if r.endswith(".safetensors"))
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    header = _safetensors_header(root / first) or {}
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


# --------------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------------


def model_card(export: ExportFolder, repo_id: str, *, branch: str = "main", lineage: list[LineageEvent] | None = None,
               extra: dict[str, Any] | None = None) -> str:
    """README.md for the Hub: YAML metadata (ModelCardData) + config summary, training state, lineage."""
    from huggingface_hub import ModelCard, ModelCardData

    extra = dict(extra or {})
    metadata = {k: extra.pop(k) for k in list(extra) if k in _CARD_METADATA_KEYS}
    model_type = [str(export.config["model_type"])] if export.config.get("model_type") else []
    tags = ["shardkeeper", "safetensors", *model_type, *list(metadata.pop("tags", []) or [])]
    data = ModelCardData(library_name="transformers", tags=list(dict.fromkeys(tags)), **metadata)
    revision = export.tag or branch
    lines = [f"# {repo_id.split('/')[-1]}" + (f" — step {export.step:,}" if export.step is not None else ""), "",
             f"Exported by shardkeeper from checkpoint `{_checkpoint_name(export)}`.", "",
             "```python", "from transformers import AutoModelForCausalLM", "",
             f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", revision="{revision}")', "```", "",
             "## Model", "", *_table(_config_rows(export)), "",
             "## Training", "", *_table(_training_rows(export, extra)), ""]
    chain = lineage_chain(lineage or [], export)
    if chain:
        lines += ["## Lineage", "", "| event | kind | step | parent | time |", "|---|---|---|---|---|"]
        lines += [f"| {_cell(e.id)} | {e.kind} | {'' if e.step is None else e.step} | {_cell(e.parent or '')} "
                  f"| {e.time} |" for e in chain]
        lines.append("")
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
    return str(ModelCard(text))  # parses the YAML back: a bad metadata value fails here, not on the Hub


def _checkpoint_name(export: ExportFolder) -> str:
    return Path(export.checkpoint).name if export.checkpoint else export.name


def _config_rows(export: ExportFolder) -> list[tuple[str, Any]]:
    cfg = export.config

    def first(*keys: str) -> Any:
        return next((cfg[k] for k in keys if cfg.get(k) is not None), None)

    params = _param_count(export)
    rows = [("model type", cfg.get("model_type")), ("architectures", ", ".join(cfg.get("architectures") or []) or None),
            ("hidden size", first("hidden_size", "n_embd", "d_model")),
            ("layers", first("num_hidden_layers", "n_layer", "num_layers")),
            ("attention heads", first("num_attention_heads", "n_head")), ("vocab size", cfg.get("vocab_size")),
            ("context length", first("max_position_embeddings", "n_positions")),
            ("parameters", f"{params:,}" if params is not None else None), ("dtype", export.dtype),
            ("safetensors files", sum(1 for r in export.files if r.endswith(".safetensors")))]
    return [(k, v) for k, v in rows if v is not None]


def _training_rows(export: ExportFolder, extra: dict[str, Any]) -> list[tuple[str, Any]]:
    summary = _training_summary(export)
    rows: dict[str, Any] = {"step": export.step, **summary}
    rows.update(extra)  # the caller knows best (e.g. an eval loss)
    return [(k, v) for k, v in rows.items() if v is not None]


def _training_summary(export: ExportFolder) -> dict[str, Any]:
    """Run name, tokens and loss at the step, read from the source checkpoint's run directory if present."""
    if not export.checkpoint:
        return {}
    ckpt = Path(export.checkpoint)
    out: dict[str, Any] = {}
    try:
        manifest = json.loads((ckpt / MANIFEST_NAME).read_text(encoding="utf-8"))
        out = {"run": manifest.get("run_name"), "tokens": manifest.get("tokens"), "segment": manifest.get("segment")}
        step = manifest.get("step", export.step)
        losses = [m.get("loss") for m in read_jsonl(ckpt.parent.parent / "metrics.jsonl") if m.get("step") == step]
        if losses and losses[-1] is not None:
            out["loss"] = round(float(losses[-1]), 6)
    except (OSError, ValueError, TypeError, AttributeError) as err:
        logger.debug("no training summary from %s (%s)", ckpt, type(err).__name__)
    return {k: v for k, v in out.items() if v is not None}


def _param_count(export: ExportFolder) -> int | None:
    """Sum of tensor sizes from the safetensors headers (no tensor is read)."""
    total = 0
    for rel in (r for r in export.files if r.endswith(".safetensors")):
        header = _safetensors_header(export.root / rel)
        if header is None:
            return None
        for info in header.values():
            count = 1
            for dim in info.get("shape", []):
                count *= int(dim)
            total += count
    return total


def _safetensors_header(path: Path) -> dict[str, dict[str, Any]] | None:
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


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {_cell(str(k))} | {_cell(_fmt(v))} |" for k, v in rows)]


def _fmt(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _cell(text: str) -> str:
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


# --------------------------------------------------------------------------------------------------
# Hugging Face Hub
# --------------------------------------------------------------------------------------------------


def resolve_token(token: str | None = None) -> str:
    """The token to publish with: the one given, else HF_TOKEN, else the `hf auth login` cache."""
    if token:
        return token
    from huggingface_hub import get_token

    try:
        found = get_token()
    except Exception as err:  # e.g. an OIDC exchange that failed: say so without its details
        raise PublishError(f"cannot get a Hugging Face token ({type(err).__name__}): set HF_TOKEN or run "
                           "`hf auth login`") from err
    if not found:
        raise PublishError(NO_TOKEN_MESSAGE)
    return found


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout"))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(errors)


def _http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


class _Hub:
    """One repo on one endpoint: every call gets the token as ``token=`` and bounded retries."""

    def __init__(self, api: Any, repo_id: str, token: str) -> None:
        from huggingface_hub import constants

        self.api = api
        self.repo_id = repo_id
        self._token = token
        self.endpoint = str(getattr(api, "endpoint", None) or constants.ENDPOINT).rstrip("/")
        self._network = _network_errors()

    def call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        fn: Callable[..., Any] = getattr(self.api, what)
        deadline = time.monotonic() + _RETRY_BUDGET_S
        for attempt in range(1, _RETRY_TRIES + 1):
            try:
                result = fn(*args, token=self._token, **kwargs)
                return list(result) if isinstance(result, Iterator) else result  # list_repo_tree pages lazily
            except Exception as err:
                wait = _RETRY_BACKOFF_S * 2 ** (attempt - 1)
                if not self._transient(err) or attempt == _RETRY_TRIES or time.monotonic() + wait > deadline:
                    raise PublishError(self._scrub(self._message(what, err, attempt))) from err
                logger.warning("%s on %s failed (%s); retry %d of %d in %.1f s", what, self.endpoint,
                               type(err).__name__, attempt, _RETRY_TRIES - 1, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _transient(self, err: Exception) -> bool:
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(err, OfflineModeIsEnabled):
            return False
        if isinstance(err, HfHubHTTPError):
            return _http_status(err) in (500, 502, 503, 504)
        return isinstance(err, self._network)

    def _message(self, what: str, err: Exception, attempts: int) -> str:
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        status = _http_status(err) if isinstance(err, HfHubHTTPError) else None
        where = f"{what} for {self.repo_id} on {self.endpoint}"
        if isinstance(err, OfflineModeIsEnabled):
            return f"{where} refused: HF_HUB_OFFLINE is set; unset it to publish"
        if status == 401:
            return (f"{where}: the Hub rejected the token (HTTP 401); set HF_TOKEN to a valid token or run "
                    "`hf auth login`")
        if status == 403:
            org = self.repo_id.split("/")[0]
            return f"{where}: no write access (HTTP 403); use a token with write permission on '{org}'"
        if status is not None:
            detail = (getattr(err, "server_message", None) or str(err)).strip().splitlines()
            return f"{where} failed: HTTP {status} {detail[0] if detail else ''}".rstrip()
        if self._transient(err):
            return (f"cannot reach the Hugging Face Hub at {self.endpoint}: {what} failed {attempts} times "
                    f"({type(err).__name__}); check the network, a proxy, or HF_ENDPOINT")
        first = str(err).strip().splitlines()
        return f"{where} failed: {type(err).__name__}: {first[0] if first else ''}".rstrip(": ")

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text


@dataclass(frozen=True)
class _HubState:
    head: str | None  # commit of the branch
    tags: dict[str, str]  # tag -> commit
    files: dict[str, Any]  # path -> RepoFile at the branch head


def publish_to_hub(export_dir: str | os.PathLike[str], repo_id: str, *, revision: str | None = None,
                   private: bool = True, api: Any = None, endpoint: str | None = None, token: str | None = None,
                   model_card_extra: dict[str, Any] | None = None,
                   lineage: list[LineageEvent] | None = None) -> PublishResult:
    """Upload an export folder to ``repo_id`` on branch ``revision`` (default main) and tag it ``step-XXXXXXXX``.

    Idempotent: when every file, the generated card and the marker are already at the branch head with
    the same checksums, nothing is uploaded and ``skipped=True`` (the tag is still made to point there).
    ``token`` defaults to HF_TOKEN or the `hf auth login` cache; it is passed per call, never stored.
    """
    if not _REPO_ID_RE.match(repo_id):
        raise PublishError(f"'{repo_id}' is not a Hub repo id: use ORG/NAME (letters, digits, '-', '_', '.')")
    token = resolve_token(token)  # before hashing a large export: fail fast
    export = load_export(export_dir)
    hub = _Hub(api if api is not None else _new_api(endpoint), repo_id, token)
    branch = revision or "main"
    card = model_card(export, repo_id, branch=branch, lineage=lineage, extra=model_card_extra).encode("utf-8")
    files = {**export.files, CARD_NAME: _entry_of_bytes(card)}
    marker = marker_bytes(export, files)
    generated = {CARD_NAME: card, MARKER_NAME: marker}

    hub.call("create_repo", repo_id, private=private, exist_ok=True)
    state = _hub_state(hub, branch)
    changed = [p for p in sorted([*files, MARKER_NAME])
               if not _same_on_hub(state.files.get(p), export, p, generated)]
    url = f"{hub.endpoint}/{repo_id}/tree/{export.tag or branch}"
    if not changed:
        logger.info("%s is already at %s@%s with the same checksums: nothing to upload", export.root, repo_id, branch)
        _ensure_tag(hub, export.tag, state.head, state.tags)
        return PublishResult(target=repo_id, revision=branch, commit=state.head, url=url, skipped=True, files=0)

    stale = sorted(p for p in state.files if p not in files and _is_weight_file(p))
    data = [p for p in changed if p in export.files and p != CARD_NAME]  # the card goes with the marker
    if data:
        _upload_data(hub, export, branch, data, stale, private=private)
        stale = []
    commit = _commit_card_and_marker(hub, export, branch, card, marker, stale)
    _ensure_tag(hub, export.tag, commit, state.tags)
    logger.info("published %s to %s@%s (%d files changed, commit %s)", export.root, repo_id, branch, len(changed),
                commit)
    return PublishResult(target=repo_id, revision=branch, commit=commit, url=url, skipped=False,
                         files=len([p for p in changed if p != MARKER_NAME]))


def _new_api(endpoint: str | None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint)  # no token here: it goes with each call


def _hub_state(hub: _Hub, branch: str) -> _HubState:
    """Branch head, tags and files at the head; creates the branch (from main) when it is missing."""
    refs = hub.call("list_repo_refs", hub.repo_id)
    branches = {b.name: b.target_commit for b in refs.branches}
    if branch not in branches:
        hub.call("create_branch", hub.repo_id, branch=branch, exist_ok=True)
        refs = hub.call("list_repo_refs", hub.repo_id)
        branches = {b.name: b.target_commit for b in refs.branches}
    tree = hub.call("list_repo_tree", hub.repo_id, recursive=True, revision=branch)
    files = {f.path: f for f in tree if hasattr(f, "blob_id")}  # RepoFile, not RepoFolder
    return _HubState(head=branches.get(branch), tags={t.name: t.target_commit for t in refs.tags}, files=files)


def _same_on_hub(remote: Any, export: ExportFolder, path: str, generated: dict[str, bytes]) -> bool:
    """True when the Hub file has our bytes: LFS sha256 when the Hub has one, else the git blob id."""
    if remote is None:
        return False
    data = generated.get(path)
    entry = _entry_of_bytes(data) if data is not None else export.files[path]
    if remote.size != entry.size:
        return False
    lfs = getattr(remote, "lfs", None)
    if lfs:
        return (getattr(lfs, "sha256", None) or lfs.get("sha256")) == entry.sha256
    return remote.blob_id == _git_blob_id(data if data is not None else (export.root / path).read_bytes())


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_weight_file(path: str) -> bool:
    return any(PurePosixPath(path).match(p) for p in _WEIGHT_PATTERNS)


def _upload_folder_streams() -> bool:
    """huggingface_hub >= 1.20 with hf_xet: upload_folder batches large folders into commits and resumes."""
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return importlib.util.find_spec("huggingface_hub._upload_pipeline") is not None and is_xet_available()


def _upload_data(hub: _Hub, export: ExportFolder, branch: str, paths: list[str], stale: list[str], *,
                 private: bool) -> None:
    """Upload the changed data files; the old marker and stale shards go in the same step, before the new marker."""
    total = sum(export.files[p].size for p in paths)
    message = f"shardkeeper: {export.name} weights ({export.dtype or 'unknown dtype'})"
    large = total > _LARGE_BYTES or len(paths) > _LARGE_FILES
    if large and hasattr(hub.api, "upload_large_folder") and not _upload_folder_streams():
        _delete_on_hub(hub, branch, [MARKER_NAME, *stale], f"shardkeeper: {export.name} upload started")
        if not os.access(export.root, os.W_OK):
            raise PublishError(f"export folder {export.root} is not writable and upload_large_folder keeps its resume "
                               "state in it: make it writable or upgrade huggingface_hub (>= 1.20)")
        logger.info("uploading %d files (%.1f GB) to %s@%s with upload_large_folder", len(paths), total / 1e9,
                    hub.repo_id, branch)
        # upload_large_folder takes no token argument: it uses the api's token or the same login cache
        hub.api.upload_large_folder(repo_id=hub.repo_id, folder_path=str(export.root), repo_type="model",
                                    revision=branch, private=private, allow_patterns=[glob.escape(p) for p in paths],
                                    print_report=False)
        return
    logger.info("uploading %d files (%.1f MB) to %s@%s", len(paths), total / 1e6, hub.repo_id, branch)
    hub.call("upload_folder", repo_id=hub.repo_id, folder_path=str(export.root), revision=branch,
             allow_patterns=[glob.escape(p) for p in paths],
             delete_patterns=[glob.escape(p) for p in (MARKER_NAME, *stale)], commit_message=message)


def _delete_on_hub(hub: _Hub, branch: str, paths: list[str], message: str) -> None:
    from huggingface_hub import CommitOperationDelete

    state = hub.call("get_paths_info", hub.repo_id, paths, revision=branch)
    present = [f.path for f in state if hasattr(f, "blob_id")]
    if present:
        hub.call("create_commit", hub.repo_id, operations=[CommitOperationDelete(path_in_repo=p) for p in present],
                 commit_message=message, revision=branch)


def _commit_card_and_marker(hub: _Hub, export: ExportFolder, branch: str, card: bytes, marker: bytes,
                            stale: list[str]) -> str:
    """The last commit of a publish: model card + marker (+ removal of stale shards not removed yet)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in stale]
    ops += [CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card),
            CommitOperationAdd(path_in_repo=MARKER_NAME, path_or_fileobj=marker)]
    step = f" (step {export.step})" if export.step is not None else ""
    info = hub.call("create_commit", hub.repo_id, operations=ops, revision=branch,
                    commit_message=f"shardkeeper: publish {export.name}{step}")
    return str(info.oid)


def _ensure_tag(hub: _Hub, tag: str | None, commit: str | None, tags: dict[str, str]) -> None:
    """Point ``tag`` at ``commit``: create it, or move it when the same step was re-published with other bytes."""
    if tag is None or commit is None or tags.get(tag) == commit:
        return
    if tag in tags:
        logger.warning("moving tag %s of %s from %s to %s (step re-published with other bytes)", tag, hub.repo_id,
                       tags[tag][:12], commit[:12])
        hub.call("delete_tag", hub.repo_id, tag=tag)
    hub.call("create_tag", hub.repo_id, tag=tag, revision=commit, exist_ok=True)


# --------------------------------------------------------------------------------------------------
# fsspec (s3://, gs://, file://, memory://, ...)
# --------------------------------------------------------------------------------------------------


def publish_to_fsspec(export_dir: str | os.PathLike[str], url: str, *,
                      storage_options: dict[str, Any] | None = None) -> PublishResult:
    """Copy an export folder to ``url/<export folder name>/``, data files first and the marker last.

    Object stores have no atomic rename, so a reader must treat a folder without a valid
    ``shardkeeper.json`` as incomplete (``read_publish_marker``). A local target is assembled in
    ``<name>.partial-<id>/`` and renamed into place when it does not exist yet.
    """
    export = load_export(export_dir)
    fs, base = _url_to_fs(url, storage_options)
    dest = f"{base.rstrip('/')}/{export.name}"
    shown = fs.unstrip_protocol(dest)
    marker = marker_bytes(export, export.files)
    try:
        if _fs_complete(fs, dest, export.files):
            logger.info("%s is already at %s with the same checksums: nothing to upload", export.root, shown)
            return PublishResult(target=url, url=shown, skipped=True, files=0)
        if _is_local(fs) and not fs.exists(dest):
            _publish_local_by_rename(export, Path(dest), marker)
        else:
            _publish_in_place(fs, export, dest, marker)
    except (OSError, ValueError) as err:  # PermissionError, FileNotFoundError (no bucket), botocore's wrapped errors
        raise PublishError(f"cannot write {shown} ({type(err).__name__}: {_first_line(err)}): check that the bucket or "
                           "folder exists and that storage_options / credentials allow writing") from err
    logger.info("published %s to %s (%d files)", export.root, shown, len(export.files))
    return PublishResult(target=url, url=shown, skipped=False, files=len(export.files))


def read_publish_marker(url: str, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The marker of a published folder ``url`` (``.../step-00000100``); None means incomplete or not published."""
    fs, path = _url_to_fs(url, storage_options)
    try:
        return parse_marker(fs.cat_file(f"{path.rstrip('/')}/{MARKER_NAME}"))
    except FileNotFoundError:
        return None


def _url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as err:
        protocol = url.split("://", 1)[0]
        raise PublishError(f"{protocol}:// needs an fsspec backend that is not installed ({_first_line(err)}): "
                           f"pip install 's3fs' for s3://, 'gcsfs' for gs://") from err
    except (ValueError, TypeError) as err:
        raise PublishError(f"cannot open {url} ({type(err).__name__}: {_first_line(err)}): check the URL and "
                           "storage_options") from err


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _fs_complete(fs: Any, dest: str, files: dict[str, PublishedFile]) -> bool:
    """The marker names exactly these checksums and every file is there with its size."""
    fs.invalidate_cache(dest)
    try:
        raw = fs.cat_file(f"{dest}/{MARKER_NAME}")
    except FileNotFoundError:
        return False
    doc = parse_marker(raw)
    if doc is None:
        logger.warning("%s/%s is not a valid marker: publishing again", dest, MARKER_NAME)
        return False
    if doc["files"] != {rel: e.as_json() for rel, e in files.items()}:
        logger.info("%s holds other checksums: publishing again", dest)
        return False
    sizes = _sizes_under(fs, dest)
    missing = [rel for rel, e in files.items() if sizes.get(rel) != e.size]
    if missing:
        logger.warning("%s has a marker but %s is missing or truncated: publishing again", dest, missing[0])
    return not missing


def _sizes_under(fs: Any, dest: str) -> dict[str, int]:
    root = fs._strip_protocol(dest).rstrip("/")
    found = fs.find(dest, detail=True)
    return {fs._strip_protocol(p)[len(root) + 1:]: int(info.get("size") or 0) for p, info in found.items()}


def _publish_in_place(fs: Any, export: ExportFolder, dest: str, marker: bytes) -> None:
    marker_path = f"{dest}/{MARKER_NAME}"
    if fs.exists(marker_path):
        fs.rm_file(marker_path)  # from here the folder reads as incomplete until the new marker lands
    for rel in sorted(export.files):
        if _is_local(fs):
            fs.makedirs(fs._parent(f"{dest}/{rel}"), exist_ok=True)
        fs.put_file(str(export.root / rel), f"{dest}/{rel}")
    sizes = _sizes_under(fs, dest)
    for rel in sorted(set(sizes) - set(export.files) - {MARKER_NAME}):
        fs.rm_file(f"{dest}/{rel}")  # a shard of an older export of this name
    short = [rel for rel, e in export.files.items() if sizes.get(rel) != e.size]
    if short:
        raise PublishError(f"{fs.unstrip_protocol(dest)}/{short[0]} has the wrong size after upload: publish again; "
                           "the marker was not written, so readers see the folder as incomplete")
    fs.pipe_file(marker_path, marker)


def _publish_local_by_rename(export: ExportFolder, dest: Path, marker: bytes) -> None:
    stage = dest.with_name(f"{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        for rel in sorted(export.files):
            target = stage / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(export.root / rel, target)
            fsync_file(target)
        (stage / MARKER_NAME).write_bytes(marker)
        fsync_file(stage / MARKER_NAME)
        fsync_dir(stage)
        os.rename(stage, dest)
        fsync_dir(dest.parent)
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------


def parse_target(target: str) -> tuple[str, str, str | None]:
    """("hub", "ORG/NAME", revision-or-None) for hf://ORG/NAME[@rev] and ORG/NAME; ("fsspec", url, None) for URLs."""
    import fsspec

    if target.startswith("hf://"):
        rest = target[len("hf://"):].strip("/")
        rest = rest[len("models/"):] if rest.startswith("models/") else rest
        repo_id, _, rev = rest.partition("@")
        if repo_id.startswith(("datasets/", "spaces/")) or not _REPO_ID_RE.match(repo_id):
            raise PublishError(f"'{target}' is not a Hub model repo: use hf://ORG/NAME or hf://ORG/NAME@BRANCH")
        return "hub", repo_id, rev or None
    if "://" in target:
        protocol = target.split("://", 1)[0]
        if protocol not in fsspec.available_protocols():
            raise PublishError(f"'{protocol}://' is not a storage protocol fsspec knows: use s3://, gs://, file:// "
                               "or memory://")
        return "fsspec", target, None
    if target.startswith("/"):
        return "fsspec", "file://" + target, None
    if _REPO_ID_RE.match(target):
        return "hub", target, None
    raise PublishError(f"target '{target}' is neither a Hub repo (ORG/NAME, hf://ORG/NAME) nor a URL "
                       "(s3://bucket/prefix, file:///path, memory://path)")


def publish(export_dir: str | os.PathLike[str], target: str, **kw: Any) -> PublishResult:
    """Publish to the Hub (``hf://ORG/NAME[@branch]`` or ``ORG/NAME``) or to an fsspec URL.

    Hub options (revision, private, api, endpoint, token, model_card_extra, lineage) go to
    ``publish_to_hub``; ``storage_options`` goes to ``publish_to_fsspec``. lineage and
    model_card_extra only shape the Hub model card and are ignored for URLs.
    """
    unknown = sorted(set(kw) - _HUB_OPTIONS - _FSSPEC_OPTIONS_ONLY)
    if unknown:
        raise TypeError(f"publish() got unexpected keyword arguments: {', '.join(unknown)}")
    kind, where, rev = parse_target(target)
    if kind == "hub":
        if kw.get("storage_options"):
            raise PublishError(f"storage_options apply to URL targets only; {target} is a Hub repo")
        kw.pop("storage_options", None)
        if rev and kw.get("revision") and kw["revision"] != rev:
            raise PublishError(f"{target} names branch '{rev}' but revision='{kw['revision']}' was given: pass one")
        kw["revision"] = kw.get("revision") or rev
        return publish_to_hub(export_dir, where, **kw)
    hub_only = sorted(k for k in ("revision", "api", "endpoint", "token") if kw.get(k) is not None)
    if hub_only:
        raise PublishError(f"{', '.join(hub_only)} apply to Hub targets only; {target} is a storage URL")
    return publish_to_fsspec(export_dir, where, storage_options=kw.get("storage_options"))
