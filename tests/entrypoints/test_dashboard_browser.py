"""/dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright).

The page loads with no console error; while a request that forks runs, it shows shared
blocks and outlines the request's blocks when its row is hovered; after the burst, with
the engine idle, the numbers it shows (blocks used / free / cached, running and waiting)
equal what /metrics reports at the same moment. A screenshot taken mid-burst is kept as
experiments/plots/dashboard.png (the README shows it).

Chromium comes from the system (`make install-test` installs Debian's package when it is
missing, as .ci/run does); Playwright only drives it, so no browser is downloaded.
"""

import asyncio
import os
import shutil
import threading

import httpx
import pytest

from tests.helpers.server_harness import API_KEY, COMPLETION_PROMPTS, MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCREENSHOT = os.path.join(ROOT, "experiments", "plots", "dashboard.png")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "the dashboard test needs Chromium: `apt-get install chromium` (make install-test does it)"
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _shown(page) -> dict:
    return {name: int(page.inner_text(f"#n-{name}")) for name in ("used", "free", "cached", "running", "waiting")}


def _metrics(live) -> dict:
    m = live.metrics()
    total = live.engine.block_manager.num_usable_blocks
    used = round(m[("paged_jax_kv_cache_usage_perc", ())] * total)
    return {"used": used, "free": total - used, "cached": int(m[("paged_jax_num_blocks_cached", ())]),
            "running": int(m[("paged_jax_num_requests_running", ())]),
            "waiting": int(m[("paged_jax_num_requests_waiting", ())])}


def test_the_page_shows_the_pool_and_agrees_with_metrics(live_server, browser):
    live_server.wait_idle()
    errors = []
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{live_server.base_url}/dashboard?key={API_KEY}")
    page.wait_for_function("Number(document.body.dataset.snapshots || 0) >= 1", timeout=30_000)
    assert page.inner_text("#status") == "live"

    def burst():  # a forking request with a long shared prompt, and a few others beside it
        async def run():
            async with httpx.AsyncClient(base_url=live_server.base_url, headers=AUTH, timeout=300) as client:
                bodies = [{"model": MODEL, "prompt": COMPLETION_PROMPTS[2] * 6, "n": 3, "temperature": 1.0,
                           "seed": 3, "max_tokens": 96, "ignore_eos": True}]
                bodies += [{"model": MODEL, "prompt": p, "max_tokens": 32, "ignore_eos": True}
                           for p in COMPLETION_PROMPTS]
                for r in await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies)):
                    assert r.status_code == 200, r.text
        asyncio.run(run())

    sender = threading.Thread(target=burst)
    sender.start()
    try:
        page.wait_for_function("Number(document.getElementById('n-shared').textContent) > 0", timeout=60_000)
        seen = int(page.evaluate("document.body.dataset.snapshots"))  # a few more points for the time series
        page.wait_for_function(f"Number(document.body.dataset.snapshots) >= {seen + 6}", timeout=30_000)
        row = page.locator("#requests tr", has_text="cmpl-").first  # a request's row outlines its blocks
        row.hover()
        page.wait_for_function("document.querySelector('#requests tr.highlighted') !== null", timeout=10_000)
        os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
        page.screenshot(path=SCREENSHOT, full_page=True)
    finally:
        sender.join()
    live_server.wait_idle()
    page.mouse.move(0, 0)
    # idle: the page's last snapshot is the engine's final state, as /metrics sees it now
    page.wait_for_function("Number(document.getElementById('n-running').textContent) === 0", timeout=30_000)
    page.wait_for_timeout(500)
    shown, metrics = _shown(page), _metrics(live_server)
    assert shown == metrics, (shown, metrics)
    assert shown["cached"] > 0  # the burst's prompts stayed in the prefix cache
    assert not errors, errors
    assert os.path.getsize(SCREENSHOT) > 10_000
    page.close()
