"""Lineage rendering (mermaid, table, loss curve with markers) and its mirror into Prefect artifacts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckpt.lineage import read_events
from tasks.render import (
    lineage_markdown,
    loss_by_step,
    loss_curve_png,
    markdown_table,
    markers,
    mermaid,
    read_metrics,
    slug,
    table_rows,
)
from schemas import LineageEvent

ROOT = Path(__file__).resolve().parent.parent


def test_slug_and_artifact_prefix() -> None:
    from tasks.lineage import artifact_keys, artifact_prefix

    assert slug("Tiny Llama_v2 (run #3)") == "tiny-llama-v2-run-3"
    assert slug("???") == "run"
    assert artifact_prefix("/x/runs/Demo", "tiny-llama") == "tiny-llama-demo"
    assert artifact_prefix("/x/runs/tiny-llama-7", "tiny-llama") == "tiny-llama-7"
    assert artifact_prefix("/x/runs/demo") == "demo"
    assert artifact_keys("tiny-llama-demo") == ("tiny-llama-demo-lineage", "tiny-llama-demo-lineage-graph",
                                                "tiny-llama-demo-loss-curve")


def test_loss_takes_the_last_written_value_per_step(lineage_run: Path) -> None:
    curve = loss_by_step(read_metrics(lineage_run))
    assert list(curve) == list(range(1, 11))
    assert curve[7] == pytest.approx(5.0 - 0.7) and curve[8] == pytest.approx(5.0 - 0.8)  # the failed segment's values lost


def test_markers_at_resume_and_reshard_points(lineage_run: Path) -> None:
    found = [(m.step, m.kind, m.from_world_size, m.to_world_size) for m in markers(read_metrics(lineage_run))]
    assert found == [(6, "resume", 2, 2), (6, "reshard", 2, 3)]


def test_loss_curve_png(lineage_run: Path, tmp_path: Path) -> None:
    out = loss_curve_png(lineage_run, tmp_path / "plots" / "loss.png", title="demo")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    (tmp_path / "empty").mkdir()
    assert loss_curve_png(tmp_path / "empty", tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def _event(id: str, kind: str, parent: str | None = None, **data: Any) -> LineageEvent:
    return LineageEvent(id=id, kind=kind, parent=parent, time="2026-01-01T00:00:00Z", data=data)  # type: ignore[arg-type]


def test_mermaid_folds_chains_of_interval_checkpoints() -> None:
    events = [_event("checkpoint:step-00000001", "checkpoint", reason="interval", world_size=2)]
    for s in range(2, 6):
        events.append(_event(f"checkpoint:step-0000000{s}", "checkpoint", f"checkpoint:step-0000000{s - 1}",
                             reason="interval", world_size=2))
    events.append(_event("checkpoint:step-00000006", "checkpoint", "checkpoint:step-00000005", reason="end", world_size=2))
    events.append(_event("export:x", "export", "checkpoint:step-00000006", dtype="bfloat16"))
    text = mermaid(events)
    assert text.startswith("flowchart LR")
    assert "step-00000003" not in text  # folded
    assert "-. 4 checkpoints .->" in text and "bfloat16" in text
    assert text.count("-->") == 1  # end checkpoint -> export


def test_markdown_table_and_rows(lineage_run: Path) -> None:
    events = read_events(lineage_run)
    rows = table_rows(events)
    assert len(rows) == len(events) and rows[0]["kind"] == "checkpoint"
    assert any(r["details"] == "from_world_size=2, to_world_size=3, method=dcp-load-time" for r in rows)
    md = lineage_markdown(events, title="Lineage of demo")
    assert md.startswith("# Lineage of demo") and "```mermaid" in md and "world size 2 → 3" in md
    odd = markdown_table([_event("a|b", "export", None, target="x|y")])
    assert "a\\|b" in odd and "x\\|y" in odd


def test_lineage_render_imports_no_prefect() -> None:
    code = "import sys, tasks.render; assert 'prefect' not in sys.modules and 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def mirror_in_flow(run_dir: Path, run_name: str) -> tuple[Any, Any]:
    """Run the mirror-lineage task inside a flow; return its LineageArtifacts and the flow run id."""
    from prefect import flow

    from tasks.lineage import mirror_lineage

    @flow(name="mirror-lineage-test")
    def mirror() -> Any:
        return mirror_lineage(str(run_dir), run_name)

    state = mirror(return_state=True)
    return state.result(), state.state_details.flow_run_id


def artifacts_with_keys(keys: list[str]) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))

    return asyncio.run(go())


def test_mirror_lineage_creates_versioned_artifacts(prefect_server: Any, lineage_run: Path) -> None:
    result, flow_run_id = mirror_in_flow(lineage_run, "Artifacts Test")
    assert result.table_key == "artifacts-test-lineage-run-lineage" and result.events == len(read_events(lineage_run))
    keys = [result.table_key, result.graph_key, result.loss_key]
    arts = {a.key: a for a in artifacts_with_keys(keys) if a.flow_run_id == flow_run_id}
    assert set(arts) == set(keys)
    rows = json.loads(arts[result.table_key].data)
    assert [r["id"] for r in rows] == [e.id for e in read_events(lineage_run)]
    assert "flowchart LR" in arts[result.graph_key].data
    loss = arts[result.loss_key].data
    assert "![loss curve of Artifacts Test (lineage-run)](data:image/png;base64," in loss
    assert "| 6 | reshard | 2 → 3 |" in loss and Path(result.loss_png).is_file()
    _, second_id = mirror_in_flow(lineage_run, "Artifacts Test")  # a second version under the same key
    # counted among this test's own two flow runs only: the session's server is shared with other tests
    versions = [a for a in artifacts_with_keys([result.table_key]) if a.flow_run_id in (flow_run_id, second_id)]
    assert len(versions) == 2 and {a.flow_run_id for a in versions} == {flow_run_id, second_id}
