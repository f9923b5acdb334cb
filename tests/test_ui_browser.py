"""The lineage artifacts as a person sees them: headless Chromium against the local Prefect UI.

Needs Debian's ``chromium`` (``apt-get install chromium``) and the ``playwright`` Python package
(never ``playwright install``: the system browser is used). Screenshots go to
``$SHARDKEEPER_SCREENSHOTS`` (default /tmp/shardkeeper-ui/) for a look by eye.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
SHOTS = Path(os.environ.get("SHARDKEEPER_SCREENSHOTS", "/tmp/shardkeeper-ui"))
TIMEOUT_MS = 30_000


def chromium_path() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


# Checked at collection, so a machine without a browser does not even start the Prefect server.
pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(chromium_path() is None, reason="headless Chromium not installed: apt-get install -y chromium "
                       "(Debian package; `make system-deps` does it as root)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="pip install playwright (the system Chromium is used: never `playwright install`)"),
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
def mirrored(prefect_server: Any, lineage_run: Path) -> tuple[Any, Any]:
    """The lineage mirrored into artifacts by a flow run: (LineageArtifacts, flow run id)."""
    from prefect import flow

    from tasks.lineage import mirror_lineage

    @flow(name="ui-lineage-check")
    def mirror() -> Any:
        return mirror_lineage(str(lineage_run), "ui-check")

    state = mirror(return_state=True)
    return state.result(), state.state_details.flow_run_id


def test_flow_run_shows_lineage_artifacts(prefect_server: Any, mirrored: tuple[Any, Any], browser: Any) -> None:
    keys, flow_run_id = mirrored
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT_MS)

    # The flow run's Artifacts tab lists the three lineage artifacts by key.
    page.goto(f"{prefect_server.url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
    page.locator("li.p-tab#artifacts").click()
    for key in (keys.table_key, keys.graph_key, keys.loss_key):
        page.locator(".artifact-card__title", has_text=key).first.wait_for()
    page.screenshot(path=str(SHOTS / "flow-run-artifacts.png"), full_page=True)

    # The graph artifact renders its markdown: title, mermaid source, the events table.
    page.locator(".artifact-card", has_text=keys.graph_key).first.click()
    page.wait_for_url("**/artifacts/artifact/**")
    page.get_by_text("Lineage of ui-check (lineage-run)").first.wait_for()
    page.get_by_text("flowchart LR", exact=False).first.wait_for()
    page.get_by_text("resume:segment-2").first.wait_for()
    page.screenshot(path=str(SHOTS / "lineage-graph.png"), full_page=True)

    # The loss curve artifact shows the PNG (a data: URI image the UI really draws).
    page.goto(f"{prefect_server.url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
    page.locator("li.p-tab#artifacts").click()
    page.locator(".artifact-card", has_text=keys.loss_key).first.click()
    page.wait_for_url("**/artifacts/artifact/**")
    image = page.locator("img[src^='data:image/png']").first
    image.wait_for()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
    assert image.evaluate("img => img.naturalWidth") == 800
    page.screenshot(path=str(SHOTS / "loss-curve.png"), full_page=True)

    # The Artifacts page lists the keys too (it shows the latest version of each key).
    page.goto(f"{prefect_server.url}/artifacts", wait_until="networkidle")
    page.get_by_text(keys.table_key, exact=True).first.wait_for()
    page.close()
