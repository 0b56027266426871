"""/dashboard's endpoints on the live server: the page, its snapshots and their stream.

A snapshot on an idle server shows every block free or cached; ten viewers watching a
request that forks all see it (its sequences, its shared blocks), get the same
snapshots, and cost no more snapshots than one viewer (they share them, at most
`dashboard_max_rate` a second while the engine is busy), so the engine thread spends
under 1% of the time in snapshots (the viewers' only cost to it: serializing and sending
run on the event loop; experiments/dashboard_cost.py measures the step rate with and
without them); the key is needed as for /v1
(a bearer header or `?key=`); closing the streams leaves no viewer counted. The page in
a real browser: test_dashboard_browser.py.
"""

import asyncio
import json
import time

import httpx

from tests.helpers.server_harness import API_KEY, COMPLETION_PROMPTS, MODEL, assert_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_the_page_and_snapshot_need_the_key(live_server):
    base = live_server.base_url
    for path in ("/dashboard", "/dashboard/snapshot", "/dashboard/events"):
        assert_error(httpx.get(base + path, timeout=30), 401, "API key")
        assert_error(httpx.get(base + path + "?key=wrong", timeout=30), 401, "/dashboard?key=")
    page = httpx.get(base + f"/dashboard?key={API_KEY}", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert f"KV pool of <code>{MODEL}</code>" in page.text and "new EventSource(" in page.text
    assert "/*DASHBOARD_JS*/" not in page.text
    assert httpx.get(base + "/dashboard", headers=AUTH, timeout=30).status_code == 200
    assert "/dashboard" not in httpx.get(base + "/openapi.json", headers=AUTH, timeout=30).text  # not an API


def test_an_idle_servers_snapshot(live_server):
    live_server.wait_idle()
    snap = httpx.get(live_server.base_url + "/dashboard/snapshot", headers=AUTH, timeout=60).json()
    bm = live_server.engine.block_manager
    assert snap["requests"] == [] and snap["allocator"] == "paged" and snap["block_size"] == bm.block_size
    assert len(snap["blocks"]) == bm.num_blocks and snap["blocks"][0] == "4"
    assert set(snap["blocks"][1:]) <= {"0", "3"}  # free, or free and still cached
    c = snap["counters"]
    assert c["num_blocks_free"] == bm.num_usable_blocks and c["num_blocks_used"] == 0
    assert c["num_blocks_cached"] == bm.num_blocks_cached and c["num_running"] == c["num_waiting"] == 0


async def _watch(base: str, until: list[float]) -> list[dict]:
    """One viewer: every snapshot its event stream delivers before `until[0]` (which the
    scenario moves to shortly after its request is answered: a slow or busy machine
    takes longer to serve it, and the viewers must see the idle picture that follows)."""
    snaps = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("GET", f"/dashboard/events?key={API_KEY}") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.aiter_lines()
            next_line = asyncio.ensure_future(anext(lines))  # not cancelled by a timeout: that breaks the stream
            while time.monotonic() < until[0]:
                done, _ = await asyncio.wait({next_line}, timeout=min(0.5, max(until[0] - time.monotonic(), 0.01)))
                if not done:
                    continue
                try:
                    line = next_line.result()
                except StopAsyncIteration:
                    break
                if line.startswith("data: "):
                    snaps.append(json.loads(line[len("data: "):]))
                next_line = asyncio.ensure_future(anext(lines))
            next_line.cancel()
    return snaps


def test_ten_viewers_share_the_snapshots_of_a_forking_request(live_server):
    live_server.wait_idle()
    feed = live_server.app.state.dashboard
    before, before_seconds = feed.num_snapshots, feed.snapshot_seconds

    async def scenario():
        until = [time.monotonic() + 120]  # moved once the request is answered
        viewers = [asyncio.create_task(_watch(live_server.base_url, until)) for _ in range(10)]
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(base_url=live_server.base_url, headers=AUTH, timeout=120) as client:
            r = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": COMPLETION_PROMPTS[2] * 4, "n": 2, "temperature": 1.0, "seed": 1,
                "max_tokens": 48, "ignore_eos": True})
            assert r.status_code == 200, r.text
        until[0] = time.monotonic() + 3  # the idle picture comes at the next interval
        return await asyncio.gather(*viewers)

    start = time.monotonic()
    all_snaps = asyncio.run(scenario())
    elapsed = time.monotonic() - start
    taken = feed.num_snapshots - before
    for snaps in all_snaps:
        assert snaps, "a viewer got no snapshot"
        running = [s for s in snaps if s["requests"]]
        assert running, "no snapshot showed the request"
        forked = [s for s in running if len(s["requests"][0]["seqs"]) == 2]
        assert forked and max(s["counters"]["num_blocks_shared"] for s in forked) > 0
        tables = [q["blocks"] for q in forked[0]["requests"][0]["seqs"]]
        assert tables[0][0] == tables[1][0] and forked[0]["blocks"][tables[0][0]] == "2"  # the prompt's first block
        assert snaps[-1]["requests"] == []  # the idle engine's last picture
    # one snapshot per viewer's opening (taken at once even on an idle engine), then one per interval
    # while busy plus the idle one: shared, not ten times as many
    rate = live_server.app.state.settings.dashboard_max_rate
    assert taken <= 10 + rate * elapsed + 3, (taken, elapsed)
    # the engine thread's whole cost of the ten viewers: its time in snapshots, under 1% of the run
    assert feed.snapshot_seconds - before_seconds <= 0.01 * elapsed, (feed.snapshot_seconds - before_seconds, elapsed)
    by_step = {}
    for snaps in all_snaps:  # the same snapshot (by step and time) is the same for every viewer
        for s in snaps:
            by_step.setdefault((s["counters"]["num_steps"], s["time"]), json.dumps(s, sort_keys=True))
            assert by_step[(s["counters"]["num_steps"], s["time"])] == json.dumps(s, sort_keys=True)
    deadline = time.monotonic() + 10
    while feed.num_viewers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.num_viewers == 0
    live_server.assert_all_blocks_free()
