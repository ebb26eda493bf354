"""The Prefect UI as a person sees it, in headless Chromium (Debian's `chromium`, driven by Playwright's
Python package; `.ci/run` installs the first, the test extras the second): a short `reflow train`
against a real `prefect server start` (UI on), then the parent run's curves artifact shows its image
(loaded: natural width > 0) and an iteration's timings artifact shows shares that add up to ~100 %.
Set REFLOW_UI_SCREENSHOT=DIR to keep screenshots of both pages (docs/ holds one of the curves)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from tests.ckpt_fixtures import free_port, reap, run_train, write_config

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or find_spec("playwright") is None,
                       reason="needs Debian's chromium (apt-get install chromium) and Playwright's Python "
                              "package (pip install -e '.[test]')"),
]


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """`prefect server start` with its UI, in a Prefect home of its own; its URL."""
    port, home = free_port(), tmp_path_factory.mktemp("ui_prefect")
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_UI_API_URL": f"{url}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    with open(home / "server.log", "w") as log:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host",
                                 "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(f"{url}/api/health"):
            assert proc.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield url, home
    finally:
        reap(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:  # deliberate: not listening yet
        return False


def _artifact(api: str, key: str) -> dict:
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": [key]}}}, timeout=30).json()
    assert found, f"no artifact {key}"
    return found[0]


def test_curves_image_and_timing_shares_in_the_ui(ui_server, tiny_policy, tmp_path):
    from playwright.sync_api import sync_playwright

    url, home = ui_server
    cfg = write_config(tmp_path / "ui.yaml", tiny_policy, f"file://{tmp_path}/runs", "ui", num_iterations=2)
    rc, out = run_train(cfg, {"PREFECT_API_URL": f"{url}/api", "PREFECT_HOME": str(home)})
    assert rc == 0, out[-3000:]
    curves, timings = _artifact(f"{url}/api", "ui-curves"), _artifact(f"{url}/api", "ui-iteration-timings")
    shots = os.environ.get("REFLOW_UI_SCREENSHOT")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(f"{url}/artifacts/artifact/{curves['id']}")
        image = page.wait_for_selector("img[src^='data:image/png']", timeout=60_000)
        page.wait_for_function("img => img.complete", arg=image)
        assert image.evaluate("img => img.naturalWidth") > 0, "the curves image did not load"
        if shots:
            page.screenshot(path=str(Path(shots) / "ui-curves.png"))
        page.goto(f"{url}/artifacts/artifact/{timings['id']}")
        page.wait_for_selector("text=orchestration", timeout=60_000)
        cells = [c.strip() for c in page.locator("td").all_inner_texts()]
        if shots:
            page.screenshot(path=str(Path(shots) / "ui-timings.png"))
        browser.close()
    assert {"report", "orchestration", "generate", "train"} <= set(cells), cells
    shares = [float(c.rstrip("%")) for c in cells if c.endswith("%")]
    assert len(shares) >= 6 and sum(shares) == pytest.approx(100, abs=1), cells
