"""Copy the tables the benches generated (bench/results/NAME.md) into README.md between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, so the README shows exactly what a bench printed (the
headline ones; the documentation site includes every one, docs/benchmarks/).

    python bench/readme_tables.py           # rewrite the README's blocks
    python bench/readme_tables.py --check   # exit 1 when a block differs from its results file (a test runs this)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BLOCK = re.compile(r"(<!-- bench:([a-z0-9_-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)
INCLUDE = re.compile(r'--8<-- "bench/results/([a-z0-9_-]+)\.md"')


def render(readme: str) -> tuple[str, list[str]]:
    """The README with every block replaced by its results file, and the problems found."""
    problems: list[str] = []

    def sub(m: re.Match[str]) -> str:
        path = RESULTS / f"{m.group(2)}.md"
        if not path.is_file():
            problems.append(
                f"README.md block bench:{m.group(2)}: no bench/results/{path.name}; run the bench that publishes it"
            )
            return m.group(0)
        return m.group(1) + path.read_text(encoding="utf-8").rstrip("\n") + "\n" + m.group(4)

    out = BLOCK.sub(sub, readme)
    used = {g[1] for g in BLOCK.findall(readme)} | docs_included()
    for path in sorted(RESULTS.glob("*.md")):
        if path.stem not in used:
            problems.append(
                f"bench/results/{path.name}: neither a <!-- bench:{path.stem} --> block in README.md nor "
                f'included by a page of docs/benchmarks/ (--8<-- "bench/results/{path.name}"); add one'
            )
    return out, problems


def docs_included() -> set[str]:
    """The results the documentation site includes (docs/benchmarks/*.md: ``--8<-- "bench/results/NAME.md"``)."""
    found: set[str] = set()
    for page in (ROOT / "docs" / "benchmarks").glob("*.md"):
        found |= set(INCLUDE.findall(page.read_text(encoding="utf-8")))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 on a difference")
    args = ap.parse_args(argv)
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    new, problems = render(text)
    for p in problems:
        print(p, file=sys.stderr)
    if args.check:
        if new != text:
            print(
                "README.md: a bench table differs from bench/results/; run python bench/readme_tables.py",
                file=sys.stderr,
            )
            return 1
        return 1 if problems else 0
    if new != text:
        readme.write_text(new, encoding="utf-8")
        print("README.md: bench tables updated")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
