"""The README's benchmark tables are the benches' own output: every marked block equals bench/results/NAME.md,
and every published table says when, where, with what and by which command it was measured."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

benchlib = importlib.import_module("benchlib")
readme_tables = importlib.import_module("readme_tables")

HEADER = re.compile(r"^_Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC on \d+ CPU cores, [\d.]+ GiB memory, .+; (load average [\d./]+ \(1/5/15 min\) when the table was printed; )?python [\d.]+, "
                    r"torch [^,]+, [^`]*command: `python bench/[a-z0-9_]+\.py[^`]*`_$")


def test_readme_blocks_equal_the_published_tables() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rendered, problems = readme_tables.render(text)
    assert problems == []
    assert rendered == text, "a README bench table was edited by hand or not refreshed: python bench/readme_tables.py"
    assert readme_tables.main(["--check"]) == 0


def test_every_published_table_carries_its_provenance() -> None:
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert results, "no bench results published"
    for path in results:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert HEADER.match(first), f"{path.name}: header line is {first!r}"


def test_a_hand_edit_is_caught(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    (tmp_path / "demo.md").write_text("_Measured ..._\n\n| a |\n|---|\n| 1 |\n")
    readme = "intro\n<!-- bench:demo -->\n| a |\n|---|\n| 2 |\n<!-- /bench:demo -->\nrest\n"
    out, problems = readme_tables.render(readme)
    assert problems == [] and "| 1 |" in out and "| 2 |" not in out and out.endswith("rest\n")
    (tmp_path / "orphan.md").write_text("x\n")
    assert any("orphan" in p for p in readme_tables.render(readme)[1])


def test_publish_writes_header_and_table(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(benchlib, "RESULTS", tmp_path)
    path = benchlib.publish("demo", benchlib.md_table(["x", "y"], [[1, 2]], "lr"), ["bench/demo_bench.py", "--reps", "3"])
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("_Measured ") and "command: `python bench/demo_bench.py --reps 3`" in lines[0]
    assert lines[2:] == ["| x | y |", "|---|---:|", "| 1 | 2 |"]


def test_the_published_command_names_no_machine_path() -> None:
    argv = [str(ROOT / "bench/torture.py"), "--kills", "200", "--work", "/scratch/torture", "--out=/tmp/x.json",
            "--table-from", "/a/one.json", "/b/two.json", "--config", str(ROOT / "configs/tiny.yaml"), "--note", "a b"]
    assert benchlib.command_line(argv) == ("python bench/torture.py --kills 200 --work WORK --out=OUT --table-from "
                                           "TABLE_FROM TABLE_FROM --config configs/tiny.yaml --note 'a b'")
    assert benchlib.command_line(["/opt/venv/bin/../../elsewhere/x.py"]) == "python x.py"
    assert "/scratch" not in benchlib.header([str(ROOT / "bench/demo.py"), "--work", "/scratch/w"])


def test_a_plot_is_drawn_from_the_published_rows(tmp_path) -> None:
    (tmp_path / "demo.md").write_text("_Measured ..._\n\nintro\n\n| size | seconds |\n|---:|---:|\n"
                                      "| 1,000 | 1.50 (1.20–1.90) |\n| 4,096 | **2.25** (met) |\n\n"
                                      "| other |\n|---|\n| x |\n")
    rows = benchlib.table_rows("demo", results=tmp_path)
    assert rows == [{"size": "1,000", "seconds": "1.50 (1.20–1.90)"}, {"size": "4,096", "seconds": "**2.25** (met)"}]
    assert benchlib.table_rows("demo", 1, results=tmp_path) == [{"other": "x"}]
    assert benchlib.spread(rows[0]["seconds"]) == (1.5, 1.2, 1.9) and benchlib.spread(rows[1]["seconds"])[0] == 2.25
    assert benchlib.numbers(rows[1]["size"]) == [4096.0]

    def draw(fig) -> None:
        benchlib.hbars(fig.add_subplot(), [r["size"] for r in rows], [r["seconds"] for r in rows], "s", grey={0})

    first = benchlib.plot_from_table("demo", draw, results=tmp_path).read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert benchlib.plot_from_table("demo", draw, results=tmp_path).read_bytes() == first  # same rows, same bytes
