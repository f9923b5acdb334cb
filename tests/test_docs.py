"""The documentation site builds with ``mkdocs build --strict`` (no broken link, anchor or reference), its generated
reference holds every config key, CLI command and option and public API symbol, every benchmark table is included
from its bench/results file, and every shell block in docs/ says who runs it.

How "every code block runs" is kept honest: a ``bash`` block in docs/ must sit right under one of
  ``<!-- ran-by: tests/test_tutorials.py -->``  each of its commands (continuations joined, comments dropped) must
      appear verbatim in that file, which runs the block as the page shows it; or
  ``<!-- not-run: REASON -->``  a block no test runs as written (a cluster, the Hub, a placeholder); the reason names
      the test that covers the behaviour. These are listed in the test's output (pytest -s, or -rA).
Python examples are included from the files the tests run (``--8<-- "examples/fsdp2_loop.py"``), not copied.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
NOTE = re.compile(r"^<!--\s*(ran-by|not-run):\s*(.+?)\s*-->$")

pytestmark = pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None
                                and shutil.which("mkdocs") is None, reason="mkdocs not installed (the dev extra has it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-6000:]}"
    return out


def text_of(site: Path, page: str) -> str:
    """The page's HTML with tags removed and entities unescaped (what a reader sees, roughly)."""
    raw = (site / page / "index.html").read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def config_keys() -> list[str]:
    """Every RunSpec key, walked recursively through nested models (also inside ``X | None``)."""
    import types
    import typing

    from pydantic import BaseModel

    from schemas.run import RunSpec

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        keys = []
        for name, field in model.model_fields.items():
            keys.append(prefix + name)
            ann = field.annotation
            args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
            for a in args:
                if isinstance(a, type) and issubclass(a, BaseModel):
                    keys += walk(a, f"{prefix}{name}.")
        return keys

    return walk(RunSpec, "")


def test_every_config_key_is_in_the_reference(site: Path) -> None:
    page = text_of(site, "reference/config")
    keys = config_keys()
    assert len(keys) > 50
    missing = [k for k in keys if k not in page]
    assert not missing, f"config keys missing from reference/config: {missing}"


def test_every_cli_command_and_option_is_in_the_reference(site: Path) -> None:
    import typer

    from shardkeeper.cli import app

    page = text_of(site, "reference/cli")
    root = typer.main.get_command(app)
    missing = []
    for name, cmd in root.commands.items():
        if f"shardkeeper {name}" not in page:
            missing.append(name)
        for p in cmd.params:
            missing += [f"{name} {o}" for o in p.opts if o.startswith("-") and o not in page]
    assert len(root.commands) >= 10
    assert not missing, f"missing from reference/cli: {missing}"


def test_every_public_api_symbol_is_in_the_reference(site: Path) -> None:
    import shardkeeper

    raw = (site / "reference/api/index.html").read_text(encoding="utf-8")
    # each symbol rendered by mkdocstrings under its real path (the anchor id is the object's module.qualname)
    paths = {s: f"{getattr(shardkeeper, s).__module__}.{getattr(shardkeeper, s).__qualname__}" for s in shardkeeper.__all__}
    missing = [f"{s} ({path})" for s, path in paths.items() if f'id="{path}"' not in raw]
    assert not missing, f"shardkeeper.__all__ symbols not rendered in reference/api (add a ::: entry): {missing}"
    # rendered by mkdocstrings from the docstrings, not written by hand
    assert "doc-heading" in raw and "Resume (or start at 0)" in html.unescape(raw)


def test_every_benchmark_table_is_included_with_its_provenance(site: Path) -> None:
    included = {m for p in DOCS.rglob("*.md") for m in re.findall(r'--8<-- "bench/results/([^"]+)\.md"', p.read_text())}
    results = sorted(p.stem for p in (ROOT / "bench/results").glob("*.md"))
    assert sorted(included) == results, "every bench/results/*.md is included by exactly the benchmark pages"
    built = " ".join(text_of(site, f"benchmarks/{p.stem}") for p in (site / "benchmarks").iterdir()
                     if (p / "index.html").is_file())
    for name in results:
        first = (ROOT / "bench/results" / f"{name}.md").read_text().lstrip().splitlines()[0]
        m = re.match(r"_Measured (.{10,40}?) on ", first)
        assert m, f"bench/results/{name}.md: no provenance line first"
        assert f"Measured {m.group(1)}" in built, f"bench/results/{name}.md: its provenance is not on the site"


def shell_blocks() -> list[tuple[Path, int, str | None, str | None, str]]:
    """(page, line, note kind, note text, block) for every shell block of docs/."""
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                j = i + 1
                while not lines[j].startswith("```"):
                    j += 1
                above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                m = NOTE.match(above)
                out.append((page.relative_to(ROOT), i + 1, m and m.group(1), m and m.group(2), "\n".join(lines[i + 1:j])))
                i = j
            i += 1
    return out


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped, whitespace normalised."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#\s.*$", "", line).strip()  # a comment: '#' after a space (not inside a URL)
        if line:
            out.append(" ".join(line.split()))
    return out


def test_every_shell_block_says_who_runs_it() -> None:
    blocks = shell_blocks()
    assert blocks
    unannotated = [f"{p}:{n}" for p, n, kind, _, _ in blocks if kind is None]
    assert not unannotated, ("shell blocks without <!-- ran-by: tests/FILE --> or <!-- not-run: REASON --> right "
                             f"above them: {unannotated}")
    not_found = []
    for page, line, kind, note, block in blocks:
        if kind != "ran-by":
            continue
        source = ROOT / note
        assert source.is_file() and source.parts[-2] == "tests", f"{page}:{line}: ran-by names no test file: {note}"
        text = " ".join(source.read_text(encoding="utf-8").split())
        not_found += [f"{page}:{line}: {c}" for c in commands(block) if c not in text]
    assert not not_found, f"commands of ran-by blocks that their test does not run verbatim: {not_found}"
    print("\nshell blocks no test runs as written:")
    for page, line, kind, note, _ in blocks:
        if kind == "not-run":
            print(f"  {page}:{line}: {note}")
