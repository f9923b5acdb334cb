"""Validate Kubernetes manifests against the vendored CRD schemas (infra/k8s/schemas/, see SOURCES.md there),
without a cluster: as close to ``kubectl apply --validate=strict`` as a JSON Schema validator gets.

A CRD's ``openAPIV3Schema`` is OpenAPI 3.0 with Kubernetes extensions; this module reads it with
``jsonschema`` (imported lazily, so ``launch`` still imports with the stdlib and schemas only) and adds what
the API server checks beyond plain JSON Schema:

- ``x-kubernetes-int-or-string``: controller-gen writes an ``anyOf`` [integer, string] beside it; one without
  it gets that ``anyOf`` here;
- ``x-kubernetes-list-type: set`` (items unique) and ``map`` (items unique by ``x-kubernetes-list-map-keys``:
  two containers with one name, two env vars with one name are refused);
- ``format: int32 | int64``: the integer's range;
- strict fields: an object schema that lists ``properties`` and has neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields`` refuses other keys (the API server would drop them silently;
  ``--validate=strict`` refuses them): a misspelt field is an error here, not a surprise on the cluster.

Not checked: CEL rules (``x-kubernetes-validations``), ``metadata`` beyond its type, admission webhooks.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from schemas.errors import ShardkeeperError

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "infra" / "k8s" / "schemas"
SCHEMA_FILES = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.v1.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_jobsets.v1alpha2.json",
}
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}

# core/v1 ConfigMap, hand-written (no CRD to vendor): string data only, names checked by the renderer.
CONFIGMAP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "data"],
    "properties": {
        "apiVersion": {"enum": ["v1"]},
        "kind": {"enum": ["ConfigMap"]},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "data": {"type": "object", "additionalProperties": {"type": "string"}},
        "immutable": {"type": "boolean"},
    },
}


class ManifestInvalid(ShardkeeperError):
    """A manifest the schema refuses; ``errors`` holds one line per problem (path: message)."""

    def __init__(self, what: str, errors: list[str]):
        self.errors = errors
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(f"{what}: {errors[0]}{more}")


_SUBSCHEMA = ("items", "additionalProperties", "not")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI schema with Kubernetes' extensions turned into JSON Schema (see the module doc).
    Walks schema keywords only, so a field that happens to be called "properties" or "nullable" is a name."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(sub) for sub in out[key]]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _validator_class() -> Any:
    import jsonschema

    def list_type(validator: Any, kind: str, instance: Any, schema: dict[str, Any]) -> Any:
        if not isinstance(instance, list) or kind not in ("set", "map"):
            return
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen: dict[str, int] = {}
        for i, item in enumerate(instance):
            key = (
                json.dumps([item.get(k) for k in keys])
                if kind == "map" and isinstance(item, dict)
                else json.dumps(item, sort_keys=True)
            )
            if key in seen:
                what = f"key {dict(zip(keys, json.loads(key)))}" if kind == "map" else "value"
                yield jsonschema.ValidationError(
                    f"items {seen[key]} and {i} have the same {what} (x-kubernetes-list-type: {kind})"
                )
            seen.setdefault(key, i)

    def int_format(validator: Any, fmt: str, instance: Any, schema: dict[str, Any]) -> Any:
        bounds = INT_RANGES.get(fmt)
        if (
            bounds
            and isinstance(instance, int)
            and not isinstance(instance, bool)
            and not bounds[0] <= instance <= bounds[1]
        ):
            yield jsonschema.ValidationError(f"{instance} is out of range for {fmt}")

    return jsonschema.validators.extend(
        jsonschema.Draft7Validator, {"x-kubernetes-list-type": list_type, "format": int_format}
    )


@functools.cache
def _validator(api_version: str, kind: str) -> Any:
    if (api_version, kind) == ("v1", "ConfigMap"):
        schema: dict[str, Any] = CONFIGMAP_SCHEMA
    elif (api_version, kind) == ("batch/v1", "Job"):
        schema = job_schema()
    else:
        name = SCHEMA_FILES.get((api_version, kind))
        if name is None:
            raise ManifestInvalid(f"{kind} ({api_version})", [f"no vendored schema; known: {sorted(SCHEMA_FILES)}"])
        schema = json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
    cls = _validator_class()
    strict_schema = strict(schema)
    cls.check_schema(strict_schema)
    return cls(strict_schema)


def job_schema() -> dict[str, Any]:
    """batch/v1 Job: its ``spec`` is the JobSpec that the JobSet CRD embeds (controller-gen of k8s.io/api)."""
    jobset = json.loads((SCHEMA_DIR / SCHEMA_FILES[("jobset.x-k8s.io/v1alpha2", "JobSet")]).read_text(encoding="utf-8"))
    template = jobset["properties"]["spec"]["properties"]["replicatedJobs"]["items"]["properties"]["template"]
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"enum": ["batch/v1"]},
            "kind": {"enum": ["Job"]},
            "metadata": {"type": "object"},
            "spec": copy.deepcopy(template["properties"]["spec"]),
        },
    }


def problems(manifest: Any) -> list[str]:
    """Every schema violation of one manifest, as 'path: message' lines (empty when it is valid)."""
    if not isinstance(manifest, dict):
        return [f"<root>: expected a mapping, got {type(manifest).__name__}"]
    api_version, kind = manifest.get("apiVersion"), manifest.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return ["<root>: apiVersion and kind must be strings"]
    try:
        validator = _validator(api_version, kind)
    except ManifestInvalid as e:
        return e.errors
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def validate(manifest: dict[str, Any]) -> None:
    """Raise ManifestInvalid naming the object and its first problem."""
    found = problems(manifest)
    if found:
        name = (manifest.get("metadata") or {}).get("name", "?") if isinstance(manifest, dict) else "?"
        raise ManifestInvalid(f"{manifest.get('kind', '?')} {name}", found)


def validate_all(manifests: list[dict[str, Any]]) -> None:
    for m in manifests:
        validate(m)
