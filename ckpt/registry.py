"""The registry of checkpoint formats: what differs between a DCP and a DeepSpeed checkpoint, behind one
interface, so the commit protocol (validate, retention, reshard) never branches on ``manifest.format``.

The formats themselves live a floor up, in ``ckpt/formats/`` (they read and write tensors); each registers
one ``CheckpointFormat`` here when ``ckpt.formats`` is imported. The core only knows the interface;
``get_format`` loads the format package on first use, as a plugin registry loads its entry points.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from schemas import CheckpointManifest, Fingerprint
from schemas.errors import CheckpointError

FORMATS_PACKAGE = "ckpt.formats"


class CheckpointFormat(Protocol):
    """One on-disk checkpoint format (``CheckpointManifest.format``)."""

    name: str
    #: committed sub-checkpoints a checkpoint of this format may hold (their own manifest, not listed in ours)
    nested: frozenset[str]

    def path_error(self, rel: str) -> str | None:
        """Why a manifest may not list ``rel`` in this format (None: the path is admissible)."""

    def check_layout(self, ckpt_dir: Path, manifest: CheckpointManifest) -> list[str]:
        """The files the format's own metadata references are the manifest's, per rank; errors, one line each."""

    def recompute_fingerprint(self, ckpt_dir: Path, manifest: CheckpointManifest) -> Fingerprint:
        """Fingerprint of the stored state, read one tensor at a time through the allow-list readers
        (stored counters checked too); raises CheckpointError naming the file."""

    def convert_from(self, src_dir: Path, target: Path, *, zero_stage: int | None = None) -> Path:
        """Write a checkpoint of the other format as a committed checkpoint of this one at ``target``."""

    def reshard(self, ckpt_dir: Path, manifest: CheckpointManifest, world_size: int):
        """Make the checkpoint loadable at ``world_size``: (target dir, method, seconds); method "none"
        when it already is."""


FORMATS: dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> CheckpointFormat:
    if name not in FORMATS:
        importlib.import_module(FORMATS_PACKAGE)  # registers the built-in formats
    try:
        return FORMATS[name]
    except KeyError:
        raise CheckpointError(f"checkpoint format {name!r} is not known; known: {', '.join(sorted(FORMATS))}") from None


def nested_names() -> frozenset[str]:
    """Every registered format's sub-checkpoint names (e.g. DeepSpeed's ``universal``)."""
    if not FORMATS:
        importlib.import_module(FORMATS_PACKAGE)
    return frozenset().union(*(f.nested for f in FORMATS.values()))
