"""The composition matrix: every kind of run x every origin of its checkpoint x every way to continue it.

    python bench/composition.py                      # the covering set (25 cells, ~1 h on 2 cores)
    python bench/composition.py --cells levels       # every level of every factor once (5 cells, ~15 min)
    python bench/composition.py --cells all          # the whole product (100 cells, several hours)
    python bench/composition.py --only fsdp2-script.dcp.reshard --no-publish   # one cell, to debug it

The factors, their levels, the references and how a cell is judged are tests/compose.py's (its docstring is the
contract). Each cell goes through the real doors: the CLI in a subprocess, torchrun, and the Prefect flows in this
process against a Prefect server of its own on loopback (unless PREFECT_API_URL names one). A cell is
**continued** (its losses within 1e-6 of the uninterrupted reference and its export loads with
``from_pretrained``), **refused** (one line, exit 2, before anything launched) or **FAILED**. The table is kept as
bench/results/composition.md; the exit code is 1 when a cell FAILED.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import publish  # noqa: E402 - bench/ is on the path when run as a script

from tests.compose import (  # noqa: E402
    CONTINUATIONS,
    KINDS,
    ORIGINS,
    Cell,
    Matrix,
    Outcome,
    Sources,
    covering,
    levels_cover,
    product,
    summary,
    table,
)

CELL_SETS = {"levels": lambda: levels_cover(product()), "covering": covering, "all": product}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", choices=sorted(CELL_SETS), default="covering", help="which cells (default: covering)")
    p.add_argument("--only", action="append", default=[], metavar="KEY", help="run only this cell (repeatable)")
    p.add_argument("--work", type=Path, default=None, help="folder for the sources and the cells (default: a temp dir)")
    p.add_argument("--no-publish", action="store_true", help="print the table, do not write bench/results")
    return p.parse_args(argv)


def chosen(args: argparse.Namespace) -> list[Cell]:
    """The cells to run; an unknown --only key is bad input (one line, exit 2)."""
    if not args.only:
        return CELL_SETS[args.cells]()
    every = {c.key: c for c in product()}
    unknown = [k for k in args.only if k not in every]
    if unknown:
        raise SystemExit(
            f"error: --only {unknown[0]}: not a cell; a key is KIND.ORIGIN.CONTINUATION with KIND one of "
            f"{', '.join(KINDS)}, ORIGIN one of {', '.join(ORIGINS)}, CONTINUATION one of {', '.join(CONTINUATIONS)}"
        )
    return [every[k] for k in args.only]


def body(cells_name: str, outcomes: list[Outcome], seconds: float) -> str:
    kinds = len({o.cell.kind for o in outcomes})
    origins = len({o.cell.origin for o in outcomes})
    conts = len({o.cell.continuation for o in outcomes})
    head = (
        f"{len(outcomes)} cells ({cells_name}: {kinds} run kinds x {origins} origins x {conts} continuations "
        f"covered), {summary(outcomes)}; {seconds / 60:.0f} min on this machine."
    )
    legend = (
        "**continued: D** — the cell's losses are within D (largest relative difference; *bitwise*: identical) of "
        "the uninterrupted reference run (tests/compose.py says which), and the final checkpoint's export loads "
        "with `AutoModelForCausalLM.from_pretrained`. **refused** — one line, exit 2, before anything launched "
        "(*ranks*: the ranks refused before their first step). **FAILED** — anything else (the line says what).\n\n"
        "Continuations: *same world* `shardkeeper train` on 2 ranks; *other world* on 3; *reshard* "
        "`shardkeeper reshard --world-size 3`, then train on 3; *Prefect* the train-and-export flow (2 ranks to "
        "step 5, 3 ranks to step 8, validate, export, publish); *automation* the flow preempted by SIGTERM, handed "
        "over, finished by the resume flow as the automation runs it (segment, export, publish)."
    )
    return head + "\n\n" + table(outcomes) + "\n\n" + legend


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cells = chosen(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with tempfile.TemporaryDirectory(prefix="sk-composition-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        server = None
        if not os.environ.get("PREFECT_API_URL"):
            from infra.server import PrefectServer
            from tests.harness import free_port

            server = PrefectServer(work / "prefect-home", port=free_port()).start()
            os.environ.update(server.env())
        try:
            matrix = Matrix(Sources(work / "sources"), work / "cells")
            t0 = time.monotonic()
            outcomes = []
            for i, cell in enumerate(cells, 1):
                out = matrix.run(cell)
                outcomes.append(out)
                print(f"[{i}/{len(cells)}] {cell.key}: {out.cell_text()} ({out.seconds:.0f} s)", flush=True)
            seconds = time.monotonic() - t0
        finally:
            if server is not None:
                server.stop()
    text = body("the cells named" if args.only else args.cells, outcomes, seconds)
    if args.no_publish:
        print("\n" + text)
    else:
        publish("composition", text)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
