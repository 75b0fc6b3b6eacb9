"""Per-tenant Prometheus series (issue 19): requests, refusals, prompt and generation tokens
and queued requests by tenant, with a bounded set of ``tenant`` label values (docs/tenants.md,
"Per-tenant metrics"; the queue limit is rule T6)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx

from kvserve.server.auth import ApiKey
from kvserve.server.tenant_metrics import MAX_LABEL_CHARS, TenantSeries

from .helpers import LiveServer, metric_values, slow_engine, wait_for

KEYS = [ApiKey("key-a", "A"), ApiKey("key-b", "B")]


def scrape(live: LiveServer) -> dict[tuple[str, str], float]:
    """kvserve:tenant_* samples as {(sample name, tenant): value}, a reason's after the
    name (``...ended_in_queue_total:displaced``)."""
    response = httpx.get(live.url + "/metrics", timeout=30)
    assert response.status_code == 200
    samples = {}
    for (name, labels), value in metric_values(response.text).items():
        if name.startswith("kvserve:tenant_"):
            named = dict(labels)
            reason = f":{named['reason']}" if "reason" in named else ""
            samples[(name + reason, named["tenant"])] = value
    return samples


def complete(live: LiveServer, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + "/v1/completions", json=body, timeout=60, headers=headers)


def test_tenant_series_count_each_keys_tenant():  # T6
    engine = slow_engine(0.005, max_num_seqs=1, max_num_queued_reqs_per_tenant=1)
    with LiveServer(engine, keys=KEYS) as live:
        before = scrape(live)
        for name in ("queued_requests", "requests_total", "requests_rejected_total",
                     "prompt_tokens_total", "generation_tokens_total",
                     "requests_ended_in_queue_total:queue_timeout",
                     "requests_ended_in_queue_total:displaced"):
            for tenant in ("A", "B"):  # known tenants: every series there from boot, at 0
                assert before[(f"kvserve:tenant_{name}", tenant)] == 0
        done: list[httpx.Response] = []
        blocker = threading.Thread(target=lambda: done.append(complete(
            live, "key-a", {"prompt": [11] * 20, "max_tokens": 100, "ignore_eos": True})))
        blocker.start()
        wait_for(lambda: live.state.engine.stats.num_running == 1, what="A running")
        waiter = threading.Thread(target=lambda: done.append(complete(
            live, "key-a", {"prompt": [12] * 5, "max_tokens": 2, "ignore_eos": True})))
        waiter.start()
        wait_for(lambda: live.state.engine.stats.num_waiting == 1, what="A's second queued")
        queued = scrape(live)
        assert queued[("kvserve:tenant_queued_requests", "A")] == 1
        assert queued[("kvserve:tenant_queued_requests", "B")] == 0
        assert complete(live, "key-a", {"prompt": [13] * 5, "max_tokens": 1}).status_code == 503
        assert complete(live, "key-a", {"prompt": [13] * 5, "max_tokens": 1,
                                        "n": 3}).status_code == 400
        live.state.engine.abort(live.scheduler.running[0].request_id)
        for thread in (blocker, waiter):
            thread.join(timeout=30)
        ok = complete(live, "key-b", {"prompt": [14] * 7, "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
        wait_for(live.idle, what="idle")
        after = scrape(live)
        # the tenant's 503 counts under its limit's reason too (it was counted under none)
        values = metric_values(httpx.get(live.url + "/metrics").text)
        assert values[("vllm:admission_rejections_total", (
            ("model_name", "tiny"), ("reason", "max_num_queued_reqs_per_tenant")))] == 1
    aborted = sorted(r.json()["usage"]["completion_tokens"] for r in done
                     if r.status_code == 200)
    assert [r.status_code for r in done] == [200, 200]
    assert after[("kvserve:tenant_requests_total", "A")] == 2
    assert after[("kvserve:tenant_requests_total", "B")] == 1
    # the 503's one sequence and the 400's three (n=3): sequences, as they would have queued
    assert after[("kvserve:tenant_requests_rejected_total", "A")] == 4
    assert after[("kvserve:tenant_requests_rejected_total", "B")] == 0
    assert after[("kvserve:tenant_prompt_tokens_total", "A")] == 20 + 5
    assert after[("kvserve:tenant_prompt_tokens_total", "B")] == 7
    assert after[("kvserve:tenant_generation_tokens_total", "A")] == sum(aborted)
    assert after[("kvserve:tenant_generation_tokens_total", "B")] == 3
    assert after[("kvserve:tenant_queued_requests", "A")] == 0
    assert {tenant for _, tenant in after} == {"A", "B"}  # no series for anyone else


def test_tenants_from_user_are_capped_with_an_other_bucket():
    with LiveServer() as live:
        live.state.metrics.tenants.max_series = 2
        for user in ("u1", "u2", "u3", "u1", "x" * (MAX_LABEL_CHARS + 1), None):
            body = {"prompt": [21] * 4, "max_tokens": 2, "ignore_eos": True}
            if user is not None:
                body["user"] = user
            assert complete(live, None, body).status_code == 200
        wait_for(live.idle, what="idle")
        after = scrape(live)
    requests = {tenant: value for (name, tenant), value in after.items()
                if name == "kvserve:tenant_requests_total"}
    # u1 and u2 took the two labels; u3, the overlong name and the address share "other"
    assert requests == {"user:u1": 2, "user:u2": 1, "other": 3}
    assert after[("kvserve:tenant_generation_tokens_total", "other")] == 6
    assert after[("kvserve:tenant_prompt_tokens_total", "user:u1")] == 8
    # an overlong name is not remembered (QA: 400 names of megabytes were kept)
    assert not [t for t in live.state.metrics.tenants._labels if len(t) > MAX_LABEL_CHARS]


def test_a_users_invisible_characters_are_escaped_in_its_label():
    """QA (fuzz): a ``user`` with a carriage return and a terminal escape went into the
    scrape as sent; its label writes them as \\uXXXX."""
    with LiveServer() as live:
        reply = httpx.post(live.url + "/v1/completions", json={
            "prompt": [21] * 4, "max_tokens": 2, "user": "a\rb\x1b[31m\u2028"}, timeout=30)
        assert reply.status_code == 200
        wait_for(live.idle, what="idle")
        text = httpx.get(live.url + "/metrics", timeout=30).text
    assert r'tenant="user:a\\u000db\\u001b[31m\\u2028"' in text  # \\ is \ escaped
    assert "\r" not in text and "\x1b" not in text and "\u2028" not in text


class _Engine:
    """Only what the queued-requests collector reads: a stats snapshot."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(num_waiting_by_tenant={"A": 2, "C": 1, "D": 4})


def test_known_tenants_label_every_other_tenant_other():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    series = TenantSeries(_Engine(), "tiny", registry,  # type: ignore[arg-type]
                          known=["A", "B", "operator"])
    assert [series.label(t) for t in ("A", "operator", "C", "other")] == \
        ["A", "operator", "other", "other"]
    queued = {dict(labels)["tenant"]: value for (name, labels), value in
              metric_values(generate_latest(registry).decode()).items()
              if name == "kvserve:tenant_queued_requests"}
    assert queued == {"A": 2, "B": 0, "operator": 0, "other": 5}
