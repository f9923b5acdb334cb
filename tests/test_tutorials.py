"""The documentation's shell blocks, run here exactly as the pages show them.

Each constant below is the text of one ``bash`` block of docs/ (the page is named beside it). ``tests/test_docs.py``
checks the other direction: every block annotated ``<!-- ran-by: tests/test_tutorials.py -->`` in docs/ has each of
its commands, verbatim, in this file. Blocks no test runs (a real cluster, the Hub) are annotated ``<!-- not-run:
REASON -->`` instead, and test_docs.py lists them.

The blocks run in a fresh folder holding copies of configs/ and examples/ (their relative paths are the pages'),
through bash with ``set -euo pipefail``: any command that exits non-zero fails the test. The two tutorials run side
by side (one module fixture), each in its own folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT, outcome, side_by_side

pytestmark = pytest.mark.slow

# docs/tutorials/own-loop.md
OWN_LOOP = """\
shardkeeper train --script examples/fsdp2_loop.py --run-dir runs/own --until-step 20 --nproc 2 -- --lr 1e-2
shardkeeper train --run-dir runs/own --until-step 40 --nproc 1     # resumes on 1 rank: the run remembers its script
shardkeeper validate runs/own/checkpoints/step-00000040 --deep
"""

# docs/tutorials/finetune.md
FINETUNE = (
    "python -m infra.make_tiny_pretrained runs/tiny-base     "
    "# a tiny Llama (save_pretrained) + a BPE tokenizer with a chat template\n"
    "shardkeeper train --config configs/tiny-finetune.yaml --run-dir runs/tiny-ft --nproc 2 --until-step 20\n"
    "shardkeeper train --config configs/tiny-finetune.yaml --run-dir runs/tiny-ft --nproc 3 --until-step 40   "
    "# resumes (checkpoint, not the base weights)\n"
    "shardkeeper export runs/tiny-ft/checkpoints/step-00000040 runs/tiny-ft/exports/step-00000040\n"
    'python -c "from transformers import AutoModelForCausalLM, AutoTokenizer as T; '
    "p='runs/tiny-ft/exports/step-00000040'; AutoModelForCausalLM.from_pretrained(p); print(T.from_pretrained(p))\"\n"
)

# docs/how-to/publish-older-step.md (continues the fine-tune run: keep_last 3 kept steps 30, 35 and 40)
PUBLISH_OLDER = """\
shardkeeper status runs/tiny-ft
shardkeeper export runs/tiny-ft/checkpoints/step-00000030 runs/tiny-ft/exports/step-00000030 --dtype bfloat16
shardkeeper publish runs/tiny-ft/exports/step-00000030 --target "file://$PWD/published/tiny-ft"
"""


def run_block(block: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SHARDKEEPER_PROGRESS_S": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def workdir(folder: Path) -> Path:
    for name in ("configs", "examples"):
        shutil.copytree(ROOT / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The own-loop block, and the fine-tune block then the publish-older block, side by side (two chains; each
    chain in its own fresh folder): each test below reads its own. What a block raised is raised in its test."""
    own, ft = workdir(tmp_path_factory.mktemp("own-loop")), workdir(tmp_path_factory.mktemp("finetune"))
    results = side_by_side(
        [
            [("own", run_block, OWN_LOOP, own)],
            [("finetune", run_block, FINETUNE, ft), ("publish", run_block, PUBLISH_OLDER, ft)],
        ],
        2,
    )
    return {**results, "own-dir": own, "finetune-dir": ft}


def test_own_loop_tutorial(ran: dict) -> None:
    outcome(ran, "own")
    assert (ran["own-dir"] / "runs/own/checkpoints/step-00000040/manifest.json").is_file()


def test_finetune_tutorial_then_publish_an_older_step(ran: dict) -> None:
    r = outcome(ran, "finetune")
    assert "Tokenizer" in r.stdout
    r = outcome(ran, "publish")
    published = ran["finetune-dir"] / "published/tiny-ft/step-00000030"  # the target gets one folder per step
    assert (published / "shardkeeper.json").is_file(), r.stdout + r.stderr
    assert any(published.glob("*.safetensors"))
