"""Issue 18: ``GET /dashboard``, the scheduler live over server-sent events, tested in a real
headless Chromium from Debian's packages (driven through chromedriver's W3C WebDriver API)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve.server.auth import ApiKey
from kvserve.server.dashboard import LiveView

from .helpers import LiveServer, slow_engine, wait_for

SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--window-size=1360,1500"]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"


class Observed:
    def __init__(self, figures: list | None = None) -> None:
        self.observers: list = []
        self.figures = figures or []

    def engine_figures(self) -> list:
        return self.figures


def test_nothing_is_collected_while_nobody_watches():
    engine = Observed()
    view = LiveView(engine)
    assert engine.observers == []  # the engine pays nothing
    view.watch()
    view.watch()
    assert engine.observers == [view.observe]
    view.leave()
    assert engine.observers == [view.observe]
    view.leave()
    assert engine.observers == [] and view.snapshot(0)[1]["samples"] == []
    view.origin -= 20.0  # the server has run 20 s; a watcher comes
    view.watch()  # its times count from now, as the page says (QA: from boot)
    assert view.snapshot(0)[1]["now"] < 5.0
    view.leave()


def test_replicas_reporting_out_of_order_keep_the_series_in_time_order():
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats

    view = LiveView(Observed())
    view.watch()
    stats = SchedulerStats(1, 0, 0, 0.1, 90, 100, 1, 0, 0, 8, 0, 0, {}, {})
    for engine, at in ((0, 5.0), (1, 4.999), (0, 5.01)):  # replica 1's step came in late
        view.observe(SimpleNamespace(engine=engine, time=view.origin + at, seconds=0.0,
                                     num_scheduled_tokens=8, stats=stats, events=[],
                                     chunks=[]))
    times = [sample[0] for sample in view.snapshot(0)[1]["samples"]]
    assert times == sorted(times) == [5.0, 5.0, 5.01]
    view.leave()


def test_a_dead_replica_counts_nothing_in_flight():
    """A replica's death puts its last stats at rest (as /metrics reads a dead replica), so
    the dashboard stops counting its requests while it restarts; it used to keep them."""
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats

    engine = Observed()
    engine.death_observers = []
    view = LiveView(engine)
    view.watch()
    assert engine.death_observers == [view.replica_died]
    busy = SchedulerStats(3, 2, 0, 0.5, 50, 100, 1, 0, 0, 8, 0, 0, {}, {})
    for index in (0, 1):
        view.observe(SimpleNamespace(engine=index, time=view.origin + 1.0, seconds=0.0,
                                     num_scheduled_tokens=8, stats=busy, events=[],
                                     chunks=[]))
    view.replica_died(1, view.origin + 1.5)
    view.observe(SimpleNamespace(engine=0, time=view.origin + 2.0, seconds=0.0,
                                 num_scheduled_tokens=8, stats=busy, events=[], chunks=[]))
    last = view.snapshot(0)[1]["samples"][-1]
    assert (last[1], last[2]) == (3, 2)  # replica 0's running and waiting only
    view.leave()
    assert engine.death_observers == []


def test_a_dead_replicas_requests_end_on_the_timeline():
    """QA: the requests a replica held when it died stayed "running" on the timeline."""
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats

    view = LiveView(Observed())
    view.watch()
    arrived = [SimpleNamespace(kind="arrived", request_id=rid, time=view.origin + 1.0)
               for rid in ("a", "b", "c")]
    stats = SchedulerStats(3, 0, 0, 0.5, 50, 100, 1, 0, 0, 8, 0, 0, {}, {})
    view.observe(SimpleNamespace(engine=0, time=view.origin + 1.0, seconds=0.0,
                                 num_scheduled_tokens=0, stats=stats, events=arrived,
                                 chunks=[]))
    view.replica_died(0, view.origin + 2.5, ["a", "b"])
    finished = {r["id"]: r["finished"] for r in view.snapshot(0)[1]["requests"]}
    assert finished == {"a": 2.5, "b": 2.5, "c": None}
    view.leave()


def test_an_aborted_request_ends_on_the_timeline_and_in_the_figures():
    """The pass: an abort's report runs no tokens and has no events, only the request's
    finished chunk; the page kept the request running (its bar growing) and the last step's
    figures (1 running, KV in use) while /metrics read 0."""
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats

    view = LiveView(Observed())
    view.watch()
    busy = SchedulerStats(1, 0, 0, 0.1, 90, 100, 5, 0, 0, 1, 1, 0, {}, {})
    arrived = SimpleNamespace(kind="arrived", request_id="a", time=view.origin + 1.0)
    view.observe(SimpleNamespace(engine=0, time=view.origin + 1.0, seconds=0.0,
                                 num_scheduled_tokens=4, stats=busy, events=[arrived],
                                 chunks=[]))
    idle = SchedulerStats(0, 0, 0, 0.0, 100, 100, 5, 0, 0, 0, 1, 0, {"abort": 1}, {})
    aborted = SimpleNamespace(request_id="a", new_token_ids=[], finished=True)
    view.observe(SimpleNamespace(engine=0, time=view.origin + 3.0, seconds=0.0,
                                 num_scheduled_tokens=0, stats=idle, events=[],
                                 chunks=[aborted]))
    snapshot = view.snapshot(0)[1]
    assert [r["finished"] for r in snapshot["requests"]] == [3.0]
    assert snapshot["samples"][-1][:4] == [3.0, 0, 0, 0.0]
    view.leave()


def test_a_watcher_sees_the_figures_as_they_stand_before_any_step():
    """The pass: the page of an idle server read 0 preemptions and a 0% hit rate (no step,
    no sample) while /metrics counted 4 and 26.7%."""
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats
    from kvserve.engine.async_engine import EngineFigures

    stats = SchedulerStats(0, 0, 0, 0.0, 100, 100, 50, 4, 0, 0, 240, 64, {"stop": 8}, {})
    view = LiveView(Observed([EngineFigures(0, stats, 0)]))
    view.watch()
    [sample] = view.snapshot(0)[1]["samples"]
    assert sample == [0.0, 0, 0, 0.0, 4, round(64 / 240, 4)]
    view.leave()
    # replicas: an idle one's pool counts too (the pass: a replica that had not stepped
    # since the page opened was left out, so one busy replica read as the cluster's 80%)
    busy = SchedulerStats(1, 0, 0, 0.8, 20, 100, 50, 0, 0, 8, 0, 0, {}, {})
    view = LiveView(Observed([EngineFigures(0, stats, 0), EngineFigures(1, stats, 0)]))
    view.watch()
    view.observe(SimpleNamespace(engine=0, time=view.origin + 1.0, seconds=0.0,
                                 num_scheduled_tokens=8, stats=busy, events=[], chunks=[]))
    assert view.snapshot(0)[1]["samples"][-1][3] == 0.4  # 80 of the two pools' 200 blocks
    view.leave()


def test_the_stream_ends_when_the_shutdown_begins():
    """The pass: an open dashboard held the server's exit for as long as the tab stayed
    open (SIGTERM, and a second one, waited on its stream)."""
    with LiveServer(num_kv_blocks=64, **SETTINGS) as live:
        lines: list[str] = []
        ended = threading.Event()

        def read() -> None:
            with httpx.stream("GET", live.url + "/dashboard/events", timeout=30) as reply:
                for line in reply.iter_lines():
                    lines.append(line)
            ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: any(line.startswith("data: ") for line in lines),
                 what="the first snapshot")
        assert not ended.is_set()
        live.state.shutting_down = True
        assert ended.wait(timeout=10), "the stream went on after the shutdown began"
        live.state.shutting_down = False


def test_the_page_opens_its_stream_relative_to_itself():
    """The pass: behind a proxy serving the server under --root-path, the page opened
    /dashboard/events at the host's root, which the proxy does not route."""
    from kvserve.server.dashboard_page import PAGE

    assert 'new EventSource("dashboard/events" + location.search)' in PAGE
    assert '"/dashboard' not in PAGE


def first_message(url: str, headers: dict[str, str] | None = None) -> dict:
    with httpx.stream("GET", url, headers=headers, timeout=10) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("no event")


def test_the_stream_needs_an_admin_key_when_keys_are_configured():
    keys = [ApiKey("admin-key", "ops", admin=True), ApiKey("user-key", "t1"),
            ApiKey("Zm9v+YmFy/YmF6=", "ops2", admin=True)]
    with LiveServer(keys=keys, num_kv_blocks=64, **SETTINGS) as live:
        assert httpx.get(live.url + "/dashboard").status_code == 401
        user = {"Authorization": "Bearer user-key"}
        assert httpx.get(live.url + "/dashboard", headers=user).status_code == 403
        assert httpx.get(live.url + "/dashboard/events?key=user-key").status_code == 403
        page = httpx.get(live.url + "/dashboard?key=admin-key")
        assert page.status_code == 200 and "<script" in page.text
        # a base64 key pasted as it is (the pass: its "+" was read as a space), or encoded
        for pasted in ("Zm9v+YmFy/YmF6=", "Zm9v%2BYmFy%2FYmF6%3D"):
            assert httpx.get(live.url + "/dashboard?key=" + pasted).status_code == 200
        assert "http" not in page.text.split("<script", 1)[1].replace(
            "http://www.w3.org/2000/svg", "")  # nothing fetched from elsewhere
        snapshot = first_message(live.url + "/dashboard/events?key=admin-key")
        assert set(snapshot) == {"now", "samples", "requests"}
        twice = httpx.get(live.url + "/dashboard?key=admin-key&key=user-key")
        assert twice.status_code == 401 and "?key= is given more than once" in twice.text
        view = live.app.state.dashboard
        wait_for(lambda: view.watchers == 0, what="the stream closed")
        assert view.observe not in live.state.engine.observers


def test_the_model_name_reaches_the_page_as_text_and_the_page_is_kept_to_itself():
    """QA: a --served-model-name holding </script> ran as script on the page whose URL
    carries the admin key; the page now takes it as HTML text, and its headers keep it from
    other sites, frames and caches."""
    keys = [ApiKey("admin-key", "ops", admin=True)]
    with LiveServer(keys=keys, num_kv_blocks=64, **SETTINGS) as live:
        live.state.model_name = '</script><script>document.title="PWNED"</script>"x'
        page = httpx.get(live.url + "/dashboard?key=admin-key")
        assert page.status_code == 200
        assert "PWNED" not in page.text.split("</h1>", 1)[1]  # nowhere past the heading
        assert "&lt;/script&gt;&lt;script&gt;document.title=&quot;PWNED&quot;" in page.text
        assert page.text.count("<script>") == 1  # the page's own, and no other
        headers = page.headers
        assert "default-src 'none'" in headers["content-security-policy"]
        assert (headers["x-content-type-options"], headers["x-frame-options"],
                headers["referrer-policy"], headers["cache-control"]) == (
            "nosniff", "DENY", "no-referrer", "no-store")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Browser:
    """Headless Chromium behind chromedriver, spoken to with plain HTTP (W3C WebDriver)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.profile = tempfile.mkdtemp(prefix="kvserve-chromium-")
        self.driver = subprocess.Popen([shutil.which("chromedriver") or "chromedriver",
                                        f"--port={self.port}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        wait_for(self._ready, timeout=30, what="chromedriver")
        reply = httpx.post(self.base + "/session", timeout=60, json={"capabilities": {
            "alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
                "binary": shutil.which("chromium"),
                "args": [*CHROME_FLAGS, f"--user-data-dir={self.profile}"]}}}})
        assert reply.status_code == 200, reply.text
        self.session = f"{self.base}/session/{reply.json()['value']['sessionId']}"

    def _ready(self) -> bool:
        try:
            return httpx.get(self.base + "/status", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, url: str) -> None:
        httpx.post(self.session + "/url", json={"url": url}, timeout=60).raise_for_status()

    def run(self, script: str):  # type: ignore[no-untyped-def]
        reply = httpx.post(self.session + "/execute/sync", timeout=30,
                           json={"script": script, "args": []})
        reply.raise_for_status()
        return reply.json()["value"]

    def screenshot(self) -> bytes:
        reply = httpx.get(self.session + "/screenshot", timeout=30)
        reply.raise_for_status()
        return base64.b64decode(reply.json()["value"])

    def close(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.delete(self.session, timeout=30)
        self.driver.terminate()
        self.driver.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


STATE = """return {updates: +document.body.dataset.updates, steps: +document.body.dataset.steps,
  lines: [...document.querySelectorAll('#queues polyline')].map(p => p.getAttribute('points')),
  bars: document.querySelectorAll('#timeline g.request rect').length,
  running: document.getElementById('f-running').textContent};"""


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (make test installs "
                           "them)")
def test_the_dashboard_loads_draws_and_updates_in_a_browser_while_a_load_runs():
    engine = slow_engine(0.03, num_kv_blocks=48, **SETTINGS)
    with LiveServer(engine) as live:
        browser = Browser()
        try:
            browser.get(live.url + "/dashboard")
            wait_for(lambda: browser.run(STATE)["updates"] >= 1, timeout=30, what="loaded")
            view = live.app.state.dashboard
            assert view.watchers == 1 and view.observe in live.state.engine.observers
            before = browser.run(STATE)
            assert before["steps"] == 1  # the figures as they stood: no step ran yet
            replies: list[int] = []

            def one(index: int) -> None:
                reply = httpx.post(live.url + "/v1/completions", timeout=120, json={
                    "prompt": [7] * 32 + [5 + index] * (20 + 9 * index), "max_tokens": 24,
                    "ignore_eos": True})
                replies.append(reply.status_code)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
                time.sleep(0.05)
            wait_for(lambda: browser.run(STATE)["steps"] >= 40, timeout=90, what="steps drawn")
            during = browser.run(STATE)
            assert during["updates"] > before["updates"]
            assert during["bars"] > 0 and all(during["lines"])
            if os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT"):
                SCREENSHOT.write_bytes(browser.screenshot())
            else:
                assert browser.screenshot()[:8] == b"\x89PNG\r\n\x1a\n"
            for thread in threads:
                thread.join(timeout=120)
            assert replies == [200] * 8
            wait_for(lambda: browser.run(STATE)["running"] == "0", timeout=30,
                     what="the figures to show the engine idle")
        finally:
            browser.close()
        wait_for(lambda: view.watchers == 0, timeout=10, what="the page's stream closed")
        assert view.observe not in live.state.engine.observers
