"""Loading a RunSpec from YAML plus ``--set key.path=value`` overrides, with one-line errors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ckpt.commit.fsutil import DuplicateKeyError, load_yaml
from schemas import RunSpec
from schemas.errors import ConfigError
from schemas.run import MAX_STEPS, SCRIPT_UNUSED, control_chars


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
    if err["type"] == "value_error":  # our validators' messages name the field and the fix themselves
        text = str(err["msg"]).removeprefix("Value error, ")
        return f"{source}: {text}" if not loc or text.startswith(field) else f"{source}: field {field}: {text}"
    if err["type"] in _STRICT_TYPES:
        key = next((str(x) for x in reversed(loc) if isinstance(x, str)), field)  # optim.betas.1 -> betas
        return f"{source}: field {field}: {_strict_type(err['type'], got, key)}"
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{source}: field {field}: {err['msg']}{got_s}; fix the value"


_STRICT_TYPES = {
    "int_type": "a whole number",
    "bool_type": "true or false",
    "float_type": "a number",
    "string_type": "a string",
}


def _strict_type(kind: str, got: Any, key: str) -> str:
    """A value of another type than the field's, with the way to write it (values are never converted:
    RunSpec's docstring)."""
    what = {
        bool: "a boolean",
        int: "an integer",
        float: "a decimal number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }.get(type(got), type(got).__name__)
    fix = {
        "int_type": f"write a whole number without quotes or decimals, e.g. {key}: 8",
        "bool_type": f"write true or false, e.g. {key}: true",
        "float_type": f"write a number without quotes, e.g. {key}: 0.001",
        "string_type": f'quote it, e.g. {key}: "{got}"',
    }[kind]
    return f"expected {_STRICT_TYPES[kind]}, got {got!r} ({what}); {fix}"


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
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ConfigError(f"--set {item!r}: expected key.path=value, e.g. --set optim.lr=1e-3")
        try:
            out[key.strip()] = load_yaml(raw) if raw.strip() else None
        except DuplicateKeyError as e:
            raise ConfigError(f"--set {item!r}: the value's {e}") from None
        except yaml.YAMLError:
            raise ConfigError(
                f"--set {item!r}: the value is not valid YAML; quote it, e.g. --set 'name=\"a: b\"'"
            ) from None
    return out


def load_run_spec(
    path: str | Path, overrides: list[str] | None = None, *, overrides_base: str | Path | None = None
) -> RunSpec:
    """``overrides_base``: the folder relative paths in ``overrides`` are taken against (a flow's base_dir);
    None: the working directory (typed at a shell)."""
    plain_path("--config", path)
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO or device would block the read
        raise ConfigError(f"{path}: not a regular file; pass --config with a YAML file such as configs/tiny.yaml")
    try:
        raw = load_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no such config file; pass --config with a YAML RunSpec such as configs/tiny.yaml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"{path}: is a directory, not a config file; pass --config with a YAML file such as configs/tiny.yaml"
        ) from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot read the config file (permission denied); fix its permissions") from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{path}: not a text file (not UTF-8); pass a YAML RunSpec such as configs/tiny.yaml"
        ) from None
    except DuplicateKeyError as e:
        raise ConfigError(f"{path} {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of RunSpec keys at the top level")
    given = parse_overrides(overrides)
    raw = resolve_config_paths(raw, path.absolute().parent, skip=set(given))
    for key, value in given.items():
        _set_path(raw, key, value, f"--set {key}")
    raw = resolve_config_paths(raw, Path(overrides_base) if overrides_base else Path.cwd(), only=set(given))
    return spec_from_dict(raw, str(path), cwd_paths=False, set_keys=set(given))


def plain_path(flag: str, value: str | Path | None) -> None:
    """A path a person typed (``--config``, ``--run-dir``, ``--script``, an export folder ...) holds no control
    character: a newline in it would end a line of a generated batch script, manifest or log."""
    bad = control_chars(str(value)) if value is not None else []
    if bad:
        raise ConfigError(f"{flag} {str(value)!r}: contains control characters ({', '.join(bad)}); use a plain path")


def check_until_step(flag: str, value: int) -> None:
    """A step count a person typed: at least 1, at most MAX_STEPS (far beyond any run; int64 counters hold more)."""
    if value < 1:
        raise ConfigError(f"{flag} {value}: must be at least 1")
    if value > MAX_STEPS:
        raise ConfigError(
            f"{flag} {value}: more than {MAX_STEPS:,} optimizer steps, which no run takes (a typo?); "
            "pass the step to train until, e.g. 2000"
        )


# Paths a config file may hold: (section, key, may it be a Hub id instead of a local path).
CONFIG_PATHS = (
    ("model", "pretrained", True),
    ("data", "dataset", True),
    ("data", "tokenizer", True),
    ("data", "path", False),
)


def train_spec(
    config: str | Path | None,
    overrides: list[str] | None,
    run_dir: str | Path,
    *,
    script: str | Path | None = None,
    script_args: list[str] | None = None,
    overrides_base: str | Path | None = None,
) -> RunSpec:
    """The RunSpec of a ``train``: ``config`` when given; else the run's own run.yaml (a resume); else, for a
    script run, the defaults (name from the script). ``script`` makes it a script run (its path made absolute)."""
    local_spec = Path(run_dir) / "run.yaml" if str(run_dir) and "://" not in str(run_dir) else None
    if config is not None:
        spec = load_run_spec(config, overrides, overrides_base=overrides_base)
    elif local_spec is not None and local_spec.is_file():
        spec = load_run_spec(local_spec, overrides, overrides_base=overrides_base)
    elif local_spec is None and (stored := _stored_spec(str(run_dir))) is not None:  # s3://: another machine's run
        spec = load_run_spec(stored, overrides, overrides_base=overrides_base)
    elif script is not None:
        given = parse_overrides(overrides)
        raw: dict[str, Any] = {"name": Path(script).stem or "run"}
        for key, value in given.items():
            _set_path(raw, key, value, f"--set {key}")
        raw = resolve_config_paths(raw, Path(overrides_base) if overrides_base else Path.cwd(), only=set(given))
        spec = spec_from_dict(raw, "--set", cwd_paths=False, set_keys=set(given))
    else:
        raise ConfigError(
            f"--config: required for a new run ({run_dir} holds no run.yaml); pass --config "
            "configs/tiny.yaml, or --script FILE to train with your own script"
        )
    spec = with_script(spec, script, script_args, base=overrides_base)
    refuse_unused_overrides(spec, overrides)
    return spec


def refuse_unused_overrides(spec: RunSpec, overrides: list[str] | None) -> None:
    """A ``--set`` a script run never reads (SCRIPT_UNUSED: its batches, data, schedule, precision ...) would be
    recorded and change nothing: refused in one line naming the key (ConfigError)."""
    if spec.script is None:
        return
    for key in parse_overrides(overrides):
        top = key.split(".", 1)[0]
        if top in SCRIPT_UNUSED:
            raise ConfigError(
                f"--set {key}: a script run ({Path(spec.script.path).name}) never reads it "
                f"({_SCRIPT_OWNS.get(top, _SCRIPT_OWNS['global_batch_size'])}); pass the value to the "
                "script as its own argument (after --), or remove the --set"
            )


# Why a script run does not read a SCRIPT_UNUSED key, for refuse_unused_overrides' line.
_SCRIPT_OWNS = {
    "global_batch_size": "the script splits its own batches",
    "data": "the script reads its own data",
    "schedule": "the script sets its own LR schedule",
    "precision": "the script chooses its own dtypes",
    "eval": "the script evaluates on its own",
    "performance": "these are options of the built-in trainer's model",
}


def _stored_spec(url: str) -> Path | None:
    """An object-store run's run.yaml, fetched into its local cache (where the resume's pull puts it anyway); None
    when the store holds none (a new run). Store errors are one line (ObjectStoreError)."""
    from ckpt.store.base import ObjectStoreError, cache_dir, explain, is_remote, open_fs

    if not is_remote(url):
        return None
    local = cache_dir(url) / "run.yaml"
    fs, path = open_fs(url)
    try:
        if not fs.exists(f"{path.rstrip('/')}/run.yaml"):
            return local if local.is_file() else None
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".run.yaml.{os.getpid()}.tmp")
        fs.get_file(f"{path.rstrip('/')}/run.yaml", str(tmp))
        os.replace(tmp, local)
    except OSError as e:
        raise ObjectStoreError(explain(e, url, "reading run.yaml")) from None
    return local


def with_script(
    spec: RunSpec, script: str | Path | None, script_args: list[str] | None = None, *, base: str | Path | None = None
) -> RunSpec:
    """``spec`` trained by ``script`` (its path made absolute against ``base``, default the working directory)."""
    from schemas import ScriptSpec

    if script is None:
        return spec
    folder = Path(base) if base else Path.cwd()
    path = Path(script) if Path(script).is_absolute() else folder / script
    return spec.model_copy(update={"script": ScriptSpec(path=str(path.absolute()), args=list(script_args or []))})


def resolve_config_paths(
    raw: dict[str, Any], base: Path, *, only: set[str] | None = None, skip: set[str] | None = None
) -> dict[str, Any]:
    """Relative paths written in a config file resolve against the file's folder, wherever shardkeeper runs from
    (a flow's worker, a Slurm job, another shell); they are recorded absolute. A value that may be a Hub id
    (``meta-llama/Llama-3.2-1B``, ``wikitext``) stays as written unless it names something that exists beside
    the config or starts with ``./`` or ``../``. ``--set`` values are the caller's: relative to the working
    directory, as typed (``only``: just those dotted keys; ``skip``: not those)."""
    for section, key, may_be_hub in CONFIG_PATHS:
        dotted = f"{section}.{key}"
        if dotted in (skip or ()) or (only is not None and dotted not in only):
            continue
        block = raw.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if not isinstance(value, str) or not value or "://" in value:
            continue
        path = Path(value).expanduser()
        if path.is_absolute():
            continue
        candidate = _join(base, path)
        explicit = value.startswith(("./", "../")) or value in (".", "..")
        if may_be_hub and not explicit and not candidate.exists():
            continue
        raw = {**raw, section: {**block, key: str(candidate)}}  # type: ignore[dict-item]
    return raw


def _join(base: Path, path: Path) -> Path:
    """``base / path`` as open() would find it: a ``..`` after a symlinked folder goes to the link target's parent
    (``os.path.normpath`` would drop the folder lexically and name another place); the last component is kept,
    so a model folder that is itself a symlink is recorded by the name the config gives it."""
    joined = base / path
    if joined.name in ("", ".", ".."):
        return Path(os.path.realpath(joined))
    return Path(os.path.realpath(joined.parent)) / joined.name


def spec_from_dict(
    raw: dict[str, Any], source: str, *, cwd_paths: bool = True, set_keys: set[str] | None = None
) -> RunSpec:
    """``cwd_paths``: a relative local model.pretrained is taken against the working directory (a run.yaml
    written before paths were recorded absolute); off for a config file, whose paths ``resolve_config_paths``
    already decided against the file's folder -- else the same file would name another model in another cwd.
    ``set_keys``: the dotted keys ``--set`` gave; an error in one of them (or in a section holding one) is
    reported as ``--set``'s, not the file's."""
    raw = _pretrained_model_type(raw, cwd_paths)
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        field = ".".join(str(x) for x in e.errors()[0]["loc"])
        from_set = field and any(
            k == field or k.startswith(field + ".") or field.startswith(k + ".") for k in set_keys or ()
        )
        raise ConfigError(explain(e, "--set" if from_set else source)) from None


def _pretrained_model_type(raw: dict[str, Any], cwd_paths: bool = True) -> dict[str, Any]:
    """With model.pretrained and no model.model_type, the model type is the pretrained config.json's (read from
    the folder or the Hub cache, nothing downloaded). When it cannot be read yet, preflight says why. A relative
    local folder becomes absolute (the ranks, a resume or a flow may run from another directory)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("pretrained"), str):
        return raw
    local = Path(model["pretrained"]).expanduser()
    if cwd_paths and local.is_dir() and not local.is_absolute():  # the ranks may run elsewhere: record where it is
        model = {**model, "pretrained": str(local.absolute())}
        raw = {**raw, "model": model}
    if "model_type" in model:
        return raw
    from ckpt.pretrained import read_config, resolve
    from schemas import ModelSpec

    try:
        folder, _ = resolve(ModelSpec(pretrained=model["pretrained"], revision=model.get("revision")))
        model_type = read_config(folder, model["pretrained"])["model_type"]
    except (ConfigError, ValueError):
        return raw
    return {**raw, "model": {**model, "model_type": model_type}}


def dump_run_spec(spec: RunSpec) -> str:
    from ckpt.commit.fsutil import dump_yaml

    return dump_yaml(spec.model_dump(mode="json"))


# Keyword arguments every transformers config takes besides its own fields (consumed by
# PretrainedConfig.__init__, so they do not show up in to_dict()).
_CONFIG_KWARGS = frozenset({"attn_implementation", "torch_dtype", "dtype", "rope_theta", "rope_scaling"})


def check_model_config(spec: RunSpec) -> Any:
    """model.model_type and model.config as transformers will see them on the ranks: an unknown model type,
    a key that is no option of the config class (transformers would silently keep a typo as an attribute),
    values the config class refuses, and data.seq_len above the model's positions. Returns the config."""
    import difflib

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if spec.model.pretrained is not None:
        return check_pretrained_config(spec)
    mt = spec.model.model_type
    if mt not in CONFIG_MAPPING:
        close = difflib.get_close_matches(mt, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else "use a decoder type such as llama, qwen2 or mistral"
        raise ConfigError(f"model.model_type {mt!r}: not a transformers model type; {hint}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model.model_type {mt!r}: transformers has no causal LM for it (AutoModelForCausalLM); "
            "use a decoder model type such as llama, qwen2 or mistral"
        )
    default = AutoConfig.for_model(mt)
    known = _config_options(default)
    for key in spec.model.config:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean model.config.{close[0]}?" if close else "remove it or fix its spelling"
            raise ConfigError(f"model.config.{key}: not an option of {type(default).__name__} ({mt}); {hint}")
    kwargs = {"attn_implementation": "sdpa", **spec.model.config}
    try:
        with quiet_transformers():
            cfg = AutoConfig.for_model(mt, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, TypeError or its own validation errors
        raise ConfigError(
            f"model.config: transformers refuses this {mt} config ({_first_line(e)}); fix the values"
        ) from None
    return check_positions_and_vocab(spec, cfg)


def check_pretrained_config(spec: RunSpec) -> Any:
    """model.pretrained: the folder (or Hub cache entry), its config.json as transformers reads it with
    model.config's overrides, its model type against model.model_type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ckpt.pretrained import CONFIG, read_config, resolve

    m = spec.model
    folder, _ = resolve(m, local_files_only=True)
    raw = read_config(folder, m.pretrained or "")
    where = folder / CONFIG
    if raw["model_type"] != m.model_type:
        raise ConfigError(
            f"model.model_type {m.model_type!r}: {where} says {raw['model_type']!r}; remove "
            "model.model_type (it is taken from the pretrained config) or fix it"
        )
    if m.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{where}: model_type {m.model_type!r} has no causal LM in transformers "
            "(AutoModelForCausalLM); fine-tune a decoder model such as llama, qwen2 or mistral"
        )
    try:
        with quiet_transformers():
            cfg = AutoConfig.from_pretrained(folder, **{"attn_implementation": "sdpa", **m.config})
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, TypeError, OSError, its own errors
        raise ConfigError(
            f"{where}: transformers cannot read it with model.config's overrides ({_first_line(e)}); "
            "fix the overrides or re-save the model"
        ) from None
    return check_positions_and_vocab(spec, cfg)


def check_positions_and_vocab(spec: RunSpec, cfg: Any) -> Any:
    positions = getattr(cfg, "max_position_embeddings", None)
    if isinstance(positions, int) and spec.data.seq_len > positions:
        raise ConfigError(
            f"data.seq_len {spec.data.seq_len}: longer than model.config.max_position_embeddings "
            f"{positions}; lower data.seq_len or raise max_position_embeddings"
        )
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(
            f"model.config.vocab_size {vocab!r}: must be a positive integer; set it to the tokenizer's size"
        )
    return cfg


def _config_options(default: Any) -> set[str]:
    import inspect

    cls = type(default)
    names = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {}) | _CONFIG_KWARGS
    names |= set(getattr(cls, "__dataclass_fields__", {}) or {})
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            with contextlib.suppress(TypeError, ValueError):
                names |= {p for p in inspect.signature(init).parameters if p not in ("self", "kwargs", "args")}
    return names


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[-1] if lines and lines[0].endswith(":") else (lines[0] if lines else type(e).__name__)
    return text[:300]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own warnings about the values (printed to stderr) would double the one error line."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
