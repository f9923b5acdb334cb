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

import logging
import os
from typing import Any

from schemas import PublishResult
from schemas.errors import PublishError

logger = logging.getLogger(__name__)
from ckpt.publish._folder import REPO_ID_RE
from ckpt.publish._hub import publish_to_hub
from ckpt.publish.fsspec_target import publish_to_fsspec

FSSPEC_OPTIONS_ONLY = {"storage_options"}
HUB_OPTIONS = {"revision", "private", "api", "endpoint", "token", "model_card_extra", "lineage"}


def parse_target(target: str) -> tuple[str, str, str | None]:
    """("hub", "ORG/NAME", revision-or-None) for hf://ORG/NAME[@rev] and ORG/NAME; ("fsspec", url, None) for URLs."""
    import fsspec

    if target.startswith("hf://"):
        rest = target[len("hf://") :].strip("/")
        rest = rest[len("models/") :] if rest.startswith("models/") else rest
        repo_id, _, rev = rest.partition("@")
        if repo_id.startswith(("datasets/", "spaces/")) or not REPO_ID_RE.match(repo_id):
            raise PublishError(f"'{target}' is not a Hub model repo: use hf://ORG/NAME or hf://ORG/NAME@BRANCH")
        return "hub", repo_id, rev or None
    if "://" in target:
        protocol = target.split("://", 1)[0]
        if protocol not in fsspec.available_protocols():
            raise PublishError(
                f"'{protocol}://' is not a storage protocol fsspec knows: use s3://, gs://, file:// or memory://"
            )
        return "fsspec", target, None
    if target.startswith("/"):
        return "fsspec", "file://" + target, None
    if REPO_ID_RE.match(target):
        return "hub", target, None
    raise PublishError(
        f"target '{target}' is neither a Hub repo (ORG/NAME, hf://ORG/NAME) nor a URL "
        "(s3://bucket/prefix, file:///path, memory://path)"
    )


def publish(export_dir: str | os.PathLike[str], target: str, **kw: Any) -> PublishResult:
    """Publish to the Hub (``hf://ORG/NAME[@branch]`` or ``ORG/NAME``) or to an fsspec URL.

    Hub options (revision, private, api, endpoint, token, model_card_extra, lineage) go to
    ``publish_to_hub``; ``storage_options`` goes to ``publish_to_fsspec``. lineage and
    model_card_extra only shape the Hub model card and are ignored for URLs.
    """
    unknown = sorted(set(kw) - HUB_OPTIONS - FSSPEC_OPTIONS_ONLY)
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


from ckpt.publish._card import lineage_chain, model_card  # noqa: E402
from ckpt.publish._folder import (
    CARD_NAME,
    EXPORT_RESULT_NAME,
    INDEX_NAME,
    MARKER_FORMAT,
    MARKER_NAME,  # noqa: E402
    ExportFolder,
    PublishedFile,
    load_export,
    marker_bytes,
    parse_marker,
)
from ckpt.publish._hub import resolve_token  # noqa: E402
from ckpt.publish.fsspec_target import read_publish_marker  # noqa: E402

__all__ = [
    "CARD_NAME",
    "EXPORT_RESULT_NAME",
    "INDEX_NAME",
    "MARKER_FORMAT",
    "MARKER_NAME",
    "ExportFolder",
    "PublishedFile",
    "lineage_chain",
    "load_export",
    "marker_bytes",
    "model_card",
    "parse_marker",
    "parse_target",
    "publish",
    "publish_to_fsspec",
    "publish_to_hub",
    "read_publish_marker",
    "resolve_token",
]
