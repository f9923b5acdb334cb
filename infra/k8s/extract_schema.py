"""Vendor a CRD's validation schema: read a CustomResourceDefinition YAML, keep only the named version's
``spec.versions[].schema.openAPIV3Schema``, drop every ``description`` string (documentation only: no
validation keyword depends on it), and write it as sorted, compact JSON.

    python -m infra.k8s.extract_schema CRD.yaml VERSION OUT.json

How each file under infra/k8s/schemas/ was made is recorded in infra/k8s/schemas/SOURCES.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def strip_descriptions(node: Any) -> Any:
    """The schema without its ``description`` strings. A *property* called "description" maps to a
    schema (a dict), never to a string, so it is kept."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def extract(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return strip_descriptions(v["schema"]["openAPIV3Schema"])
    names = [v["name"] for v in crd["spec"]["versions"]]
    raise SystemExit(f"error: {crd['metadata']['name']}: no version {version!r}; it has {names}")


def main(argv: list[str]) -> int:
    import yaml

    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    src, version, out = argv
    crd = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    Path(out).write_text(
        json.dumps(extract(crd, version), sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
