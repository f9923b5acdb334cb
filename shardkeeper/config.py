"""Loading a RunSpec from YAML plus ``--set key.path=value`` overrides, with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ckpt.errors import ConfigError
from ckpt.fsutil import load_yaml
from schemas import RunSpec


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    cls: Any = model
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part)) if hasattr(cls, "model_fields") else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        cls = field.annotation
    return sorted(cls.model_fields)


def explain(e: ValidationError, source: str, model: type[BaseModel] = RunSpec) -> str:
    """The first validation error as one line: file, field, problem, fix."""
    err = e.errors()[0]
    loc = tuple(err["loc"])
    field = ".".join(str(x) for x in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        known = _known_keys(model, loc)
        hint = f" (known keys here: {', '.join(known)})" if known else ""
        return f"{source}: unknown key {field}; remove it or fix its spelling{hint}"
    if err["type"] == "missing":
        return f"{source}: missing key {field}; add it"
    got = err.get("input")
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{source}: field {field}: {err['msg']}{got_s}; fix the value"


def _set_path(tree: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{source}: cannot set {dotted}: {part} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set optim.lr=1e-3")
        out[key.strip()] = load_yaml(raw) if raw.strip() else None
    return out


def load_run_spec(path: str | Path, overrides: list[str] | None = None) -> RunSpec:
    path = Path(path)
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file; pass --config with a YAML RunSpec such as configs/tiny.yaml") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of RunSpec keys at the top level")
    for key, value in parse_overrides(overrides).items():
        _set_path(raw, key, value, f"--set {key}")
    return spec_from_dict(raw, str(path))


def spec_from_dict(raw: dict[str, Any], source: str) -> RunSpec:
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(explain(e, source)) from None


def dump_run_spec(spec: RunSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
