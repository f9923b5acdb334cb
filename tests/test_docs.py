"""The documentation site builds with ``mkdocs build --strict`` (no broken link, anchor or reference), its generated
reference holds every config key, CLI command and option and public API symbol, every benchmark table is included
from its bench/results file, every shell block in docs/ says who runs it, the facts the README states (exit codes,
CLI, layout, the benchmarks' duration) are the code's, and the built site shows its diagrams and plots in a real
browser with nothing fetched from the network.

The screenshots in docs/screenshots/ are taken by ``test_the_site_in_a_browser``; it writes them there when
``SHARDKEEPER_UPDATE_SCREENSHOTS=1`` (commit them), else into a temporary folder.

How "every code block runs" is kept honest: a ``bash`` block in docs/ must sit right under one of
  ``<!-- ran-by: tests/test_tutorials.py -->``  each of its commands (continuations joined, comments dropped) must
      appear verbatim in that file, which runs the block as the page shows it; or
  ``<!-- not-run: REASON -->``  a block no test runs as written (a cluster, the Hub, a placeholder); the reason names
      the test that covers the behaviour. These are listed in the test's output (pytest -s, or -rA).
Python examples are included from the files the tests run (``--8<-- "examples/fsdp2_loop.py"``), not copied.
"""

from __future__ import annotations

import ast
import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
NOTE = re.compile(r"^<!--\s*(ran-by|not-run):\s*(.+?)\s*-->$")

pytestmark = pytest.mark.skipif(
    shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None and shutil.which("mkdocs") is None,
    reason="mkdocs not installed (the dev extra has it)",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    paths = {
        s: f"{getattr(shardkeeper, s).__module__}.{getattr(shardkeeper, s).__qualname__}" for s in shardkeeper.__all__
    }
    missing = [f"{s} ({path})" for s, path in paths.items() if f'id="{path}"' not in raw]
    assert not missing, f"shardkeeper.__all__ symbols not rendered in reference/api (add a ::: entry): {missing}"
    # rendered by mkdocstrings from the docstrings, not written by hand
    assert "doc-heading" in raw and "Resume (or start at 0)" in html.unescape(raw)


def test_every_benchmark_table_is_included_with_its_provenance(site: Path) -> None:
    included = {m for p in DOCS.rglob("*.md") for m in re.findall(r'--8<-- "bench/results/([^"]+)\.md"', p.read_text())}
    results = sorted(p.stem for p in (ROOT / "bench/results").glob("*.md"))
    assert sorted(included) == results, "every bench/results/*.md is included by exactly the benchmark pages"
    built = " ".join(
        text_of(site, f"benchmarks/{p.stem}") for p in (site / "benchmarks").iterdir() if (p / "index.html").is_file()
    )
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
                out.append(
                    (page.relative_to(ROOT), i + 1, m and m.group(1), m and m.group(2), "\n".join(lines[i + 1 : j]))
                )
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
    assert not unannotated, (
        f"shell blocks without <!-- ran-by: tests/FILE --> or <!-- not-run: REASON --> right above them: {unannotated}"
    )
    not_found = []
    for page, line, kind, note, block in blocks:
        if kind != "ran-by":
            continue
        source = ROOT / note
        assert source.is_file() and source.parts[-2] == "tests", f"{page}:{line}: ran-by names no test file: {note}"
        code = source.read_text(encoding="utf-8")
        # the file's text and its string constants (a command split over lines as implicitly joined pieces)
        strings = [
            n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        ]
        text = " ".join(" ".join([code, *strings]).split())
        not_found += [f"{page}:{line}: {c}" for c in commands(block) if c not in text]
    assert not not_found, f"commands of ran-by blocks that their test does not run verbatim: {not_found}"
    print("\nshell blocks no test runs as written:")
    for page, line, kind, note, _ in blocks:
        if kind == "not-run":
            print(f"  {page}:{line}: {note}")


# --- facts the README and the docs state, checked against where they come from -----------------------------------


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_exit_codes_are_the_documented_ones() -> None:
    from schemas.seam import documented_exit_codes

    para = re.search(r"^Exit codes: (.+?)\n\n", readme(), re.S | re.M)
    assert para, "README.md: no 'Exit codes: ...' paragraph"
    stated = {int(n) for n in re.findall(r"(?<![\w.-])(\d{1,3})(?= |\*\*| \()", para.group(1).replace("**", " "))}
    assert stated == set(documented_exit_codes()), (
        f"README.md's exit codes {sorted(stated)} != schemas.seam.documented_exit_codes() "
        f"{sorted(documented_exit_codes())}"
    )


def test_readme_cli_table_lists_every_command() -> None:
    import typer

    from shardkeeper.cli import app

    rows = [line for line in readme().split("## CLI", 1)[1].split("\n## ", 1)[0].splitlines() if line.startswith("| `")]
    command = re.compile(r"`(?:shardkeeper )?([a-z][a-z-]*)[ `]")
    stated = {m.group(1) for row in rows for m in command.finditer(row.split(" | ")[0])}
    commands = set(typer.main.get_command(app).commands)
    assert stated == commands, (
        f"README.md's CLI table: missing {sorted(commands - stated)}, unknown {sorted(stated - commands)}"
    )


def test_make_bench_time_is_one_figure() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from benchlib import MAKE_BENCH_TIME

    sources = [ROOT / "README.md", ROOT / "Makefile", *sorted(DOCS.rglob("*.md"))]
    found = []
    for path in sources:
        text = " ".join(path.read_text(encoding="utf-8").split())
        for m in re.finditer(r"make bench`?[^.]{0,80}?\((~[\d.]+ h)|Heavy: (~[\d.]+ h)", text):
            found.append((path.relative_to(ROOT), m.group(1) or m.group(2)))
    assert {str(p) for p, _ in found} >= {"README.md", "Makefile", "docs/benchmarks/index.md"}, found
    wrong = [f"{p}: {t}" for p, t in found if t != MAKE_BENCH_TIME]
    assert not wrong, f"make bench takes {MAKE_BENCH_TIME} (benchlib.MAKE_BENCH_TIME); stated otherwise: {wrong}"


def layout_block(text: str) -> list[str]:
    """The entry names of a page's ``RUN_DIR/`` block, canonical (``step-N``, ``invalid-T``): the first word of each
    entry line, and every ``*.jsonl`` of a line that names several; the block ends at its fence or at a line that
    is not indented (another folder's block)."""
    block = text.split("```\nRUN_DIR/\n", 1)[1].split("```", 1)[0]
    names = []
    for line in block.splitlines():
        if line.strip() and not line.startswith(" "):
            break
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a description's continuation line
        words = line.split()
        names += [words[0], *(w for w in words[1:] if re.fullmatch(r"[a-z]+\.jsonl", w))]
    return [re.sub(r"invalid-\d+", "invalid-T", re.sub(r"step-\d{8}", "step-N", n)) for n in names]


def test_on_disk_layout_blocks_name_what_the_code_writes(tmp_path: Path) -> None:
    from ckpt.commit.layout import INVALID_RE, RunDir, step_dir_name
    from ckpt.guards.pin import PINS_DIR
    from ckpt.memtier.tier import DIRS_NAME, ID_NAME
    from ckpt.plan import PLAN_LOCK_NAME
    from schemas.plan import PLAN_NAME
    from schemas.seam import LAUNCH_FILE, REPORT_FILE

    rd = RunDir.at(tmp_path)
    invalid = f"{step_dir_name(30)}.invalid-1795465103"
    assert INVALID_RE.match(invalid)
    paths = [
        rd.spec_path,
        rd.checkpoint(20),
        rd.partial(25),
        rd.checkpoints / invalid,
        rd.verified_record(20),
        rd.metrics,
        rd.segments,
        rd.lineage,
        rd.exports / step_dir_name(20),
    ]
    core = {
        re.sub(r"invalid-\d+", "invalid-T", re.sub(r"step-\d{8}", "step-N", p.relative_to(rd.root).as_posix()))
        + ("/" if p.suffix not in (".yaml", ".json", ".jsonl") else "")
        for p in paths
    }
    more = {
        rd.lock_path.name,
        rd.ranks_lock_path.name,
        LAUNCH_FILE,
        REPORT_FILE,
        f"{PINS_DIR}/upload.json,",
        # the run's id and memory dirs (ckpt.memtier.tier), a --restart and the dashboard's mirror (named in ckpt/,
        # tasks/)
        ID_NAME,
        DIRS_NAME,
        "metrics.before-restart-3.jsonl",
        "lineage.png,",
        PLAN_NAME,
        PLAN_LOCK_NAME,
    }  # a train-and-export flow's plan and its lock (ckpt.plan)
    for source, needs_all in ((ROOT / "README.md", False), (DOCS / "reference/on-disk.md", True)):
        names = layout_block(source.read_text(encoding="utf-8"))
        unknown = sorted(set(names) - core - more)
        missing = sorted(core - set(names))
        assert not unknown, f"{source.name}: the layout block names what the code does not write: {unknown}"
        assert not missing, f"{source.name}: the layout block leaves out {missing} (ckpt.commit.layout.RunDir)"
        if needs_all:
            assert not more - set(names), f"{source.name}: the layout block leaves out {sorted(more - set(names))}"


# --- pages people read: short concept pages, one pipeline diagram, no machine's paths ----------------------------

CONCEPT_WORDS = 800
# Pages still to be trimmed to the limit: each must still be over it (remove it from here once it fits, and the test
# holds it to the limit).
CONCEPT_WORDS_PENDING: set[str] = set()


def visible_words(markdown: str) -> int:
    """Words a reader sees before opening anything: collapsed blocks (``??? ...`` and their indented body), code
    fences and diagrams left out."""
    out, skip_indent, fence = [], None, False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if skip_indent is not None:
            if not line.strip() or len(line) - len(line.lstrip()) > skip_indent:
                continue
            skip_indent = None
        if re.match(r"\s*\?\?\?\+? ", line):
            skip_indent = len(line) - len(line.lstrip())
            continue
        out.append(line)
    return len(re.findall(r"\w[\w'’.-]*", " ".join(out)))


def test_concept_pages_fit_the_limit() -> None:
    words = {p.name: visible_words(p.read_text(encoding="utf-8")) for p in sorted((DOCS / "concepts").glob("*.md"))}
    over = {n: w for n, w in words.items() if w > CONCEPT_WORDS and n not in CONCEPT_WORDS_PENDING}
    assert not over, f"concept pages over {CONCEPT_WORDS} words (fold details into ??? blocks or move them): {over}"
    trimmed = [n for n in CONCEPT_WORDS_PENDING if words.get(n, 0) <= CONCEPT_WORDS]
    assert not trimmed, f"{trimmed} now fit {CONCEPT_WORDS} words: remove them from CONCEPT_WORDS_PENDING"


def test_the_pipeline_diagram_is_one() -> None:
    diagram = (DOCS / "snippets/pipeline.md").read_text(encoding="utf-8")
    assert diagram.startswith("```mermaid\n")
    assert diagram in readme(), "README.md's pipeline diagram differs from docs/snippets/pipeline.md"
    for page in ("index.md", "concepts/architecture.md"):
        assert '--8<-- "docs/snippets/pipeline.md"' in (DOCS / page).read_text(encoding="utf-8"), page


MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/tmp/|/root/|/Users/)\S*|\.venv/bin/")
ENVIRONMENT_REMARK = re.compile(
    r"this project'?s? machines?|on this VM|(?:can ?not|nothing can) be downloaded here", re.I
)


def test_published_text_names_no_machine() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "bench/results").glob("*.md"))]
    found = []
    for page in pages:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in (*MACHINE_PATH.finditer(line), *ENVIRONMENT_REMARK.finditer(line)):
                found.append(f"{page.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not found, (
        "published text names a machine's paths or talks about the machine it was written on "
        f"(a bench prints commands through benchlib.command_line): {found}"
    )


def test_every_plot_is_shown_and_every_shown_plot_exists() -> None:
    pngs = {p.name for p in (ROOT / "bench/results").glob("*.png")}
    shown = {
        m for p in (DOCS / "benchmarks").glob("*.md") for m in re.findall(r"\]\(plots/([^)]+\.png)\)", p.read_text())
    }
    assert pngs, "no plots in bench/results"
    assert shown <= pngs, f"benchmark pages show plots no bench drew: {sorted(shown - pngs)}"
    assert pngs <= shown, f"plots drawn by a bench but shown on no benchmark page: {sorted(pngs - shown)}"


def test_every_page_has_one_title() -> None:
    def body(page: Path) -> str:  # without its front matter (--- ... ---)
        text = page.read_text(encoding="utf-8")
        return text.split("\n---\n", 1)[1].lstrip("\n") if text.startswith("---\n") else text

    untitled = [
        str(p.relative_to(ROOT))
        for p in DOCS.rglob("*.md")
        if "snippets" not in p.parts and not body(p).startswith("# ")
    ]
    assert not untitled, f"pages without a '# Title' first line: {untitled}"


# --- the site in a real browser: diagrams drawn, plots loaded, nothing fetched from outside -------------------------

SCREENSHOTS = DOCS / "screenshots"
# name -> (page, what to scroll into view before the shot: None for the top of the page)
SHOTS = {
    "landing": ("", None),
    "tutorial": ("tutorials/own-loop/", None),
    "concept-diagram": ("concepts/commit-protocol/", ".mermaid"),
    "benchmark-plot": ("benchmarks/checkpoint/", 'img[src$="plots/goodput.png"]'),
}
DIAGRAM_PAGES = [
    "",
    "concepts/architecture/",
    "concepts/commit-protocol/",
    "concepts/resharding/",
    "concepts/memory-tier/",
]
# Material draws each diagram into a closed shadow root; opened here so that the test can look inside.
OPEN_SHADOW_ROOTS = (
    "const attach = Element.prototype.attachShadow; Element.prototype.attachShadow = "
    "function (init) { return attach.call(this, {...init, mode: 'open'}); };"
)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _browser_available() -> bool:
    import importlib.util

    from tests.harness import chromium_path

    return chromium_path() is not None and importlib.util.find_spec("playwright") is not None


@pytest.mark.browser
@pytest.mark.browser
@pytest.mark.skipif(
    not _browser_available(), reason="headless Chromium (apt-get install chromium) and playwright needed"
)
def test_the_site_in_a_browser(site: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    from tests.harness import CHROMIUM_FLAGS, chromium_path

    out = SCREENSHOTS if os.environ.get("SHARDKEEPER_UPDATE_SCREENSHOTS") == "1" else tmp_path
    out.mkdir(exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    outside: list[str] = []

    def only_loopback(route) -> None:  # the site must need nothing from the network (fonts, scripts, diagrams)
        if route.request.url.startswith(base):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.add_init_script(OPEN_SHADOW_ROOTS)
            page.route("**/*", only_loopback)
            for path in dict.fromkeys([*DIAGRAM_PAGES, *(p for p, _ in SHOTS.values())]):
                page.goto(base + path, wait_until="networkidle")
                diagrams = page.locator(".mermaid").count()
                if path in DIAGRAM_PAGES:
                    assert diagrams, f"/{path}: no diagram on the page"
                page.wait_for_function(  # every diagram drawn: an svg with text in it
                    "() => [...document.querySelectorAll('.mermaid')].every(d => d.shadowRoot && "
                    "d.shadowRoot.querySelector('svg') && d.shadowRoot.querySelector('svg').textContent.trim())",
                    timeout=20_000,
                )
                broken = page.evaluate(
                    "() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
                    ".map(i => i.getAttribute('src'))"
                )
                assert not broken, f"/{path}: images that did not load: {broken}"
            for name, (path, target) in SHOTS.items():
                page.goto(base + path, wait_until="networkidle")
                if target:
                    page.locator(target).first.evaluate(
                        "e => window.scrollTo(0, e.getBoundingClientRect().top + window.scrollY - 140)"
                    )
                    if target.startswith("img"):
                        width = page.locator(target).first.evaluate("i => i.naturalWidth")
                        assert width > 0, f"{name}: plot not loaded"
                page.wait_for_timeout(300)
                page.screenshot(path=str(out / f"{name}.png"))
            browser.close()
    finally:
        server.shutdown()
    assert not outside, f"the site asked the network for: {sorted(set(outside))}"
    for name in SHOTS:  # the committed screenshots are these pages' (SHARDKEEPER_UPDATE_SCREENSHOTS=1 retakes them)
        committed = SCREENSHOTS / f"{name}.png"
        assert committed.is_file() and committed.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{committed}: missing"
