"""A griffe extension for the API reference (mkdocs.yml, mkdocstrings' ``extensions``): keyword parameters whose
name starts with ``_`` are the library's own hooks (``Segment(_env=..., _spec=...)`` for the built-in trainer), not
part of the public signature, so the reference leaves them out of signatures and parameter tables."""

from __future__ import annotations

from typing import Any

import griffe


class HidePrivateParameters(griffe.Extension):
    """Drop ``_name`` parameters from every function the reference renders."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        for param in [p for p in func.parameters if p.name.startswith("_") and p.name not in ("self", "cls")]:
            del func.parameters[param.name]
