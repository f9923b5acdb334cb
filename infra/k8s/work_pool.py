"""The Prefect Kubernetes work pool of shardkeeper: ``infra/k8s/work-pool-template.json`` is a base job template
in the shape prefect-kubernetes' worker uses (``job_configuration`` with a ``job_manifest`` and a ``variables``
JSON Schema), for flow-run pods that run the flows next to the runs volume and may submit the segments'
manifests (``infra/k8s/flow-runner-rbac.yaml``).

    prefect work-pool create shardkeeper-k8s --type kubernetes --base-job-template infra/k8s/work-pool-template.json
    python -m infra.k8s.work_pool check     # what the tests check, without a cluster or a server

``check`` returns every problem as a line: the template passes the Prefect server's own check
(``validate_base_job_template``: each placeholder is a declared variable), its ``variables`` are a valid JSON
Schema that its defaults satisfy, the manifest rendered with those defaults (placeholders replaced by Prefect's
``apply_values``, then the worker's own rewrites: ``env`` as a list, ``command`` split into ``args``) keeps the
paths the worker requires, and is a valid batch/v1 Job for ``launch.k8s_validate``.
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent / "work-pool-template.json"
# prefect-kubernetes' _get_base_job_manifest(): the worker refuses a manifest without these paths and values.
WORKER_REQUIRED = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "spec": {
        "template": {
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "restartPolicy": "Never",
                "containers": [{"name": "prefect-job"}],
            }
        }
    },
}


def load_template(path: Path = TEMPLATE) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def defaults(template: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v["default"]) for k, v in template["variables"]["properties"].items() if "default" in v}


def render_manifest(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The Job the worker would create for ``values`` (over the defaults)."""
    from prefect.utilities.templating import apply_values

    config = apply_values(copy.deepcopy(template["job_configuration"]), {**defaults(template), **values})
    manifest = config["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    env = container.get("env") or {}
    if isinstance(env, dict):  # the worker turns the env mapping into a container env list
        container["env"] = [{"name": k, "value": v} for k, v in env.items() if v is not None]
    if isinstance(container.get("args"), str):  # and the command string into args
        container["args"] = shlex.split(container["args"])
    return manifest


def missing_worker_paths(manifest: Any, required: Any = WORKER_REQUIRED, path: str = "") -> list[str]:
    if isinstance(required, dict):
        if not isinstance(manifest, dict):
            return [f"{path or '/'}: expected a mapping"]
        return [
            p
            for k, v in required.items()
            for p in (
                missing_worker_paths(manifest[k], v, f"{path}/{k}") if k in manifest else [f"{path}/{k}: missing"]
            )
        ]
    if isinstance(required, list):
        if not isinstance(manifest, list) or len(manifest) < len(required):
            return [f"{path}: expected a list of at least {len(required)}"]
        return [p for i, v in enumerate(required) for p in missing_worker_paths(manifest[i], v, f"{path}/{i}")]
    return [] if manifest == required else [f"{path}: must be {required!r}, is {manifest!r}"]


def check(template: dict[str, Any]) -> list[str]:
    import jsonschema
    from prefect.server.schemas.actions import validate_base_job_template

    from launch import k8s_validate

    try:
        validate_base_job_template(template)
    except ValueError as e:
        return [f"base job template: {e}"]
    variables = template["variables"]
    try:
        jsonschema.Draft202012Validator.check_schema(variables)
    except jsonschema.SchemaError as e:
        return [f"variables: not a valid JSON Schema: {e.message}"]
    found = [
        f"variables default: {e.message}"
        for e in jsonschema.Draft202012Validator(variables).iter_errors(defaults(template))
    ]
    manifest = render_manifest(template, {"name": "flow-run", "command": "prefect flow-run execute"})
    found += [f"job_manifest{p}" for p in missing_worker_paths(manifest)]
    job = copy.deepcopy(manifest)
    pod = job["spec"]["template"]["spec"]
    # Prefect's worker insists on these two in the pod spec (they belong to the JobSpec); the API server drops
    # them as unknown pod fields, so the strict Job schema is asked about the rest.
    pod.pop("parallelism", None)
    pod.pop("completions", None)
    found += [f"job_manifest: {p}" for p in k8s_validate.problems(job)]
    return found


def main(argv: list[str]) -> int:
    if argv[:1] != ["check"]:
        print("usage: python -m infra.k8s.work_pool check [TEMPLATE.json]", file=sys.stderr)
        return 2
    path = Path(argv[1]) if len(argv) > 1 else TEMPLATE
    found = check(load_template(path))
    for line in found:
        print(f"error: {path}: {line}", file=sys.stderr)
    if not found:
        print(f"{path}: valid base job template (variables, defaults, worker paths, batch/v1 Job)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
