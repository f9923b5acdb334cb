"""The house rules of DESIGN.md ("Layers"), checked by an AST walk over every module, imports inside
functions included: no package imports one above it, no forbidden third-party import per layer, and no
import cycle between modules (lazy imports count: a cycle is a cycle however late it closes)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "ckpt", "trainer", "launch", "shardkeeper", "tasks", "flows", "infra")


@dataclass(frozen=True)
class Layer:
    name: str
    may_import: tuple[str, ...]  # project layers (their names) this one may import
    never: tuple[str, ...] = ()  # third-party or project roots never imported, even lazily
    not_at_import: tuple[str, ...] = ()  # only inside functions


CORE = ("schemas", "ckpt")
LAYERS = {
    "schemas": Layer("schemas", ("schemas",), never=("torch", "prefect", "transformers", "deepspeed")),
    "ckpt": Layer("ckpt", CORE, never=("prefect", "transformers")),
    "ckpt.formats": Layer("ckpt.formats", (*CORE, "ckpt.formats"), never=("prefect", "transformers")),
    # the memory tier stages snapshots through the DCP format's writer: above the formats, below the trainer
    "ckpt.memtier": Layer("ckpt.memtier", (*CORE, "ckpt.formats", "ckpt.memtier"), never=("prefect", "transformers")),
    "ckpt.export": Layer(
        "ckpt.export",
        (*CORE, "ckpt.formats", "ckpt.memtier", "ckpt.export"),
        never=("prefect",),
        not_at_import=("transformers",),
    ),
    "ckpt.publish": Layer("ckpt.publish", (*CORE, "ckpt.formats", "ckpt.publish"), never=("prefect", "torch")),
    "launch": Layer("launch", ("schemas", "launch"), never=("torch", "prefect", "transformers", "deepspeed")),
    "trainer": Layer("trainer", (*CORE, "ckpt.formats", "ckpt.memtier", "launch", "trainer"), never=("prefect",)),
    # the controller checks a token file with the trainer's own reader before launching: lazily, so the CLI
    # starts without torch
    "shardkeeper": Layer(
        "shardkeeper",
        (*CORE, "ckpt.formats", "ckpt.memtier", "ckpt.export", "ckpt.publish", "launch", "trainer", "shardkeeper"),
        never=("prefect",),
        not_at_import=("torch", "transformers", "deepspeed", "trainer"),
    ),
    # rank-side integrations with other frameworks (Trainer subclass, Accelerate): they run under torchrun like
    # trainer/, import their framework when imported, and nothing imports them but users' scripts
    "shardkeeper.integrations": Layer(
        "shardkeeper.integrations",
        (*CORE, "ckpt.formats", "ckpt.memtier", "trainer", "shardkeeper.integrations"),
        never=("prefect",),
    ),
    "tasks": Layer(
        "tasks",
        (*CORE, "ckpt.memtier", "launch", "shardkeeper", "tasks"),
        not_at_import=("torch", "transformers", "deepspeed"),
    ),
    "flows": Layer("flows", ("schemas", "shardkeeper", "tasks", "flows"), never=("torch", "ckpt", "trainer")),
    "infra": Layer(
        "infra",
        (
            *CORE,
            "ckpt.formats",
            "ckpt.memtier",
            "ckpt.export",
            "ckpt.publish",
            "launch",
            "trainer",
            "shardkeeper",
            "tasks",
            "flows",
            "infra",
        ),
    ),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The most specific layer a module belongs to (ckpt.export._sink -> ckpt.export; ckpt.validate.checks -> ckpt)."""
    best = ""
    for name in LAYERS:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best = name
    return best


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    target: str  # dotted module (or module.name for "from m import name")
    lazy: bool  # inside a function


def imports_of(path: Path, module: str) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[Import] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend(Import(path, child.lineno, a.name, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                out.extend(Import(path, child.lineno, f"{base}.{a.name}", lazy) for a in child.names)
                out.append(Import(path, child.lineno, base, lazy))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # typing-only imports never run
            visit(child, inner)

    visit(tree, False)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def all_modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = all_modules()


def resolve(target: str) -> str | None:
    """The project module an import target names (``pkg.mod.name`` -> ``pkg.mod``), or None (third party)."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def test_every_import_respects_the_layers() -> None:
    problems = []
    for module, path in MODULES.items():
        layer = LAYERS[layer_of(module)]
        for imp in imports_of(path, module):
            root = imp.target.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}"
            if root in layer.never or any(imp.target == n or imp.target.startswith(n + ".") for n in layer.never):
                problems.append(f"{where} (layer {layer.name} must never import {root})")
            elif root in layer.not_at_import and not imp.lazy:
                problems.append(f"{where} at import time (layer {layer.name} imports {root} only inside functions)")
            target = resolve(imp.target)
            if target is not None and layer_of(target) not in layer.may_import:
                problems.append(f"{where} (layer {layer.name} must not import {layer_of(target)}: it is not below it)")
    assert not problems, "\n".join(sorted(set(problems)))


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for imp in imports_of(path, module):
            target = resolve(imp.target)
            if target is not None and target != module and not module.startswith(target + "."):
                graph[module].add(target)  # a package's own __init__ is not an edge back from its modules
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    out.append(comp)
    return out


def test_the_walk_sees_lazy_imports_and_cycles(tmp_path: Path) -> None:
    """The checker itself: an import inside a function is found and marked lazy; a two-module cycle is found."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from torch import nn\n    return nn\n")
    found = {(i.target, i.lazy) for i in imports_of(src, "pkg.m")}
    assert ("os", False) in found and ("torch.nn", True) in found
    assert [sorted(c) for c in _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) if len(c) > 1] == [["a", "b"]]


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in tests/harness.py (and tests/reliability's helper modules), never in a test module."""
    problems = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for imp in imports_of(path, module_name(path)):
            last = [p for p in imp.target.split(".") if p.startswith("test_")]
            if imp.target.startswith("tests.") and last:
                problems.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}")
    assert not problems, "\n".join(problems)


# --- private modules start with "_" -----------------------------------------------------------------------------

# Modules of a sub-package that nothing outside their folder imports, public all the same because they are reached by
# name rather than by an import: run with ``python -m``, imported by users' scripts, or named in a string.
PUBLIC_BY_NAME = {
    "trainer.checkpointer.resumer": "bench/memtier_bench.py profiles it by dotted name",
    "infra.k8s.extract_schema": "run with python -m (infra/k8s/schemas/SOURCES.md)",
    "infra.k8s.work_pool": "run with python -m (docs/tutorials/kubernetes.md)",
}


def _importers() -> dict[str, set[str]]:
    """Project module -> the modules that import it: project code, the bench scripts and the examples users copy
    (not tests; not bench/out/, where a bench installs third-party packages)."""
    sources = dict(MODULES)
    for folder in ("bench", "examples"):
        sources.update({module_name(p): p for p in sorted((ROOT / folder).glob("*.py"))})
    users: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in sources.items():
        for imp in imports_of(path, module):
            target = resolve(imp.target)
            if target is not None and target != module:
                users[target].add(module)
    return users


def _folder(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _outside(module: str, users: set[str]) -> set[str]:
    folder = _folder(module)
    return {u for u in users if u != folder and not u.startswith(folder + ".")}


def test_private_modules_are_imported_only_inside_their_folder() -> None:
    """A module (or folder) named ``_x`` is the folder's own business: code outside it (tests aside) goes through
    the folder's ``__init__`` or its public modules."""
    problems = []
    for module, users in _importers().items():
        private = [p for p in module.split(".") if p.startswith("_")]
        if not private:
            continue
        owner = module.split("." + private[0])[0]  # the folder that holds the first private part
        leaks = {u for u in users if u != owner and not u.startswith(owner + ".")}
        problems += [f"{u} imports {module}, private to {owner}" for u in sorted(leaks)]
    assert not problems, "\n".join(problems)


def test_sub_package_modules_used_only_inside_their_folder_are_private() -> None:
    """In a sub-package (a folder inside a layer, e.g. ckpt/export/), a module that nothing outside the folder
    imports starts with ``_``, unless it is reached by name (PUBLIC_BY_NAME, each with its reason)."""
    importers = _importers()
    problems = []
    for module, path in MODULES.items():
        if path.name == "__init__.py" or module.count(".") < 2 or module.rpartition(".")[2].startswith("_"):
            continue
        if not _outside(module, importers[module]) and module not in PUBLIC_BY_NAME:
            problems.append(f"{path.relative_to(ROOT)}: only its own folder imports it; rename it _{path.name}")
    stale = sorted(m for m in PUBLIC_BY_NAME if m not in MODULES or _outside(m, importers[m]))
    assert not problems, "\n".join(problems)
    assert not stale, f"PUBLIC_BY_NAME lists modules that are gone or now imported from outside: {stale}"
