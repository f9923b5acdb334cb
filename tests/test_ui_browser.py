"""The lineage artifacts as a person sees them: headless Chromium against the local Prefect UI.

Needs Debian's ``chromium`` (``apt-get install chromium``) and the ``playwright`` Python package
(never ``playwright install``: the system browser is used). Screenshots go to
``$SHARDKEEPER_SCREENSHOTS`` (default /tmp/shardkeeper-ui/) for a look by eye.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import CHROMIUM_FLAGS, chromium_path

SHOTS = Path(os.environ.get("SHARDKEEPER_SCREENSHOTS", "/tmp/shardkeeper-ui"))
TIMEOUT_MS = 30_000


# Checked at collection, so a machine without a browser does not even start the Prefect server.
pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="headless Chromium not installed: apt-get install -y chromium "
        "(Debian package; `make system-deps` does it as root)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="pip install playwright (the system Chromium is used: never `playwright install`)",
    ),
]


@pytest.fixture
def browser() -> Iterator[Any]:
    """Chromium through Playwright's sync API (which runs an event loop: call Prefect before it starts)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def mirrored(prefect_server: Any, lineage_run: Path, tiny_run: Path, tmp_path: Path) -> tuple[Any, ...]:
    """Artifacts made by one flow run: the lineage of the hand-written run (resume, failure, reshard, export),
    the lineage of a real run (checkpoints on disk) and the overview of a root with a completed and a
    preempted run. Returns (hand-written keys, real keys, flow run id, overview key, {key: artifact id})."""
    from prefect import flow

    from tasks.lineage import mirror_lineage, mirror_runs_overview
    from tests.harness import copy_run, mark_preempted

    root = tmp_path / "ui-root"
    real = copy_run(tiny_run, root / "ui-real")
    mark_preempted(copy_run(tiny_run, root / "ui-stopped"), 9)

    @flow(name="ui-lineage-check")
    def mirror() -> Any:
        return (
            mirror_lineage(str(lineage_run), "ui-check"),
            mirror_lineage(str(real), "ui-check"),
            mirror_runs_overview([str(root)]),
        )

    state = mirror(return_state=True)
    keys, real_keys, overview = state.result()
    return keys, real_keys, state.state_details.flow_run_id, overview, artifact_ids(state.state_details.flow_run_id)


def artifact_ids(flow_run_id: Any) -> dict[str, str]:
    """key -> id of the artifacts of one flow run (read before Playwright starts its event loop)."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def go() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    return {a.key: str(a.id) for a in asyncio.run(go()) if a.key}


def image_loaded(page: Any) -> Any:
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
    return image


def test_flow_run_shows_lineage_artifacts(prefect_server: Any, mirrored: tuple[Any, ...], browser: Any) -> None:
    keys, real_keys, flow_run_id, overview, ids = mirrored
    artifact = lambda key: f"{prefect_server.url}/artifacts/artifact/{ids[key]}"  # noqa: E731 - one page per artifact
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)

    # The flow run's Artifacts tab lists the lineage artifacts by key.
    page.goto(f"{prefect_server.url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
    page.locator("li.p-tab#artifacts").click()
    for key in (keys.table_key, keys.graph_key, keys.loss_key, keys.checkpoints_key, overview):
        page.locator(".artifact-card__title", has_text=key).first.wait_for()
    page.screenshot(path=str(SHOTS / "flow-run-artifacts.png"), full_page=True)

    # The graph artifact is an image the UI draws (not mermaid source), with the checkpoints-now table under it.
    started = time.monotonic()
    page.goto(artifact(real_keys.graph_key), wait_until="networkidle")
    page.get_by_text("Lineage of ui-check (ui-real)").first.wait_for()
    graph = image_loaded(page)
    render_s = time.monotonic() - started
    assert graph.evaluate("img => img.naturalWidth") >= 400
    assert page.get_by_text("flowchart", exact=False).count() == 0
    page.get_by_text("Checkpoints now").first.wait_for()
    page.locator("td", has_text="dcp").first.wait_for()
    on_disk = sorted(
        p.name
        for p in Path(real_keys.graph_png).parent.joinpath("checkpoints").glob("step-*")
        if (p / "manifest.json").is_file()
    )
    # the markdown table under the graph: one row per checkpoint on disk, its step in the first cell
    cells = page.locator("table tbody tr td:first-child").all_inner_texts()
    assert cells == [str(int(name.split("-")[1])) for name in on_disk], cells
    page.screenshot(path=str(SHOTS / "lineage-graph-real.png"), full_page=True)
    print(f"\nlineage graph page rendered in {render_s:.2f} s")

    # The hand-written run's graph: segments as lanes (one failed), the reshard 2 -> 3, the export.
    page.goto(artifact(keys.graph_key), wait_until="networkidle")
    page.get_by_text("Lineage of ui-check (lineage-run)").first.wait_for()
    assert image_loaded(page).evaluate("img => img.naturalWidth") >= 800
    page.get_by_text("Checkpoints now (0)").first.wait_for()
    assert page.get_by_text("flowchart LR", exact=False).count() == 0
    page.screenshot(path=str(SHOTS / "lineage-graph.png"), full_page=True)

    # Checkpoints now: one row per checkpoint on disk of the real run (and only those).
    page.goto(artifact(real_keys.checkpoints_key), wait_until="networkidle")
    for name in on_disk:
        page.get_by_text(name, exact=False).first.wait_for()
    assert page.locator("td", has_text="/checkpoints/step-").count() == len(on_disk)
    page.screenshot(path=str(SHOTS / "checkpoints-now.png"), full_page=True)

    # Runs overview: the completed and the preempted run of the root.
    page.goto(artifact(overview), wait_until="networkidle")
    for text in ("ui-real", "ui-stopped", "preempted", "completed"):
        page.locator("td", has_text=text).first.wait_for()
    page.screenshot(path=str(SHOTS / "runs-overview.png"), full_page=True)

    # The hand-written run: the loss curve PNG with the failure marked.
    page.goto(artifact(keys.loss_key), wait_until="networkidle")
    assert image_loaded(page).evaluate("img => img.naturalWidth") == 800
    page.get_by_text("failed").first.wait_for()
    page.screenshot(path=str(SHOTS / "loss-curve.png"), full_page=True)

    # The key's own page on the Artifacts tab (the list itself is paginated: with the whole suite's artifacts on
    # the shared server, this run's keys need not be on its first page).
    page.goto(f"{prefect_server.url}/artifacts/key/{keys.table_key}", wait_until="networkidle")
    page.get_by_text(keys.table_key, exact=False).first.wait_for()
    page.close()
