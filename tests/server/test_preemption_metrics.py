"""Issue 12 in the server: preemptions by mode, the host tier's copies and usage in /metrics,
``num_swaps`` in each response's ``kvserve`` object, the host tier in the boot log and the
mode (and, under auto, both prices) in each preemption line (docs/preemption.md); the step mix
(docs/scheduler.md, Q1) in the boot log."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from kvserve.core import SchedulerConfig
from kvserve.engine.preemption_prices import MeasuredPreemptionPrices
from kvserve.server.stats_log import steps_line

from .helpers import LiveServer, metric_values, wait_for

M = (("model_name", "tiny"),)
E = (("engine", "0"), ("model_name", "tiny"))  # an engine's own series (one engine: 0)


def scrape(live: LiveServer) -> dict:
    response = httpx.get(live.url + "/metrics")
    assert response.status_code == 200
    return metric_values(response.text)


def by(label: str, value: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((*E, (label, value))))


def pressure(live: LiveServer) -> list[dict]:
    """Six requests growing to 140 tokens each on 12 blocks of 16 (192 tokens): preempts."""
    def one(index: int) -> httpx.Response:
        return httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": [100 + index] * 40, "max_tokens": 100, "ignore_eos": True})
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(one, range(6)))
    assert [r.status_code for r in responses] == [200] * 6
    wait_for(live.idle, what="idle")
    return [r.json() for r in responses]


def test_swap_preemptions_are_counted_by_mode_and_recompute_nothing(caplog):
    seen = {"swapped": 0, "host_used": 0}

    def watch(report) -> None:
        seen["swapped"] = max(seen["swapped"], report.stats.num_swapped)
        used = report.stats.num_host_blocks - report.stats.num_free_host_blocks
        seen["host_used"] = max(seen["host_used"], used)

    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            LiveServer(num_kv_blocks=12, max_model_len=512, preemption_mode="swap",
                       num_host_blocks=64) as live:
        live.state.engine.observers.append(watch)
        before = scrape(live)
        assert before[("kvserve:preemptions_total", by("mode", "swap"))] == 0
        assert before[("kvserve:host_kv_cache_usage_perc", E)] == 0
        bodies = pressure(live)
        after = scrape(live)
    preemptions = after[("vllm:num_preemptions_total", E)]
    assert preemptions > 0
    assert after[("kvserve:preemptions_total", by("mode", "swap"))] == preemptions
    assert after[("kvserve:preemptions_total", by("mode", "recompute"))] == 0
    assert after[("kvserve:preemptions_total", by("mode", "priority"))] == 0
    swapped_out = after[("kvserve:swapped_blocks_total", by("direction", "out"))]
    assert swapped_out == after[("kvserve:swapped_blocks_total", by("direction", "in"))] > 0
    assert after[("kvserve:recomputed_tokens_total", E)] == 0
    assert after[("vllm:num_requests_swapped", E)] == 0  # all back and finished
    assert after[("kvserve:host_kv_cache_usage_perc", E)] == 0
    assert seen["swapped"] >= 1 and seen["host_used"] >= 1  # the gauges' sources moved
    assert sum(b["kvserve"]["num_swaps"] for b in bodies) == preemptions
    assert all(b["kvserve"]["num_recomputed_tokens"] == 0 for b in bodies)
    messages = [r.getMessage() for r in caplog.records]
    assert "Host KV cache (swap space): 1024 tokens (64 blocks of 16, 0.5 MiB); " \
           "preemption mode: swap" in messages
    lines = [m for m in messages if m.startswith("preemption request_id=")]
    assert len(lines) == preemptions
    assert all("mode=swap num_tokens_lost=0 " in line and "reason='swap'" in line
               for line in lines)


def test_auto_logs_both_prices_and_recompute_is_counted_as_such(caplog):
    # A copy dearer than any recompute: every victim recomputes, and the line says why.
    prices = MeasuredPreemptionPrices(1.0, 10**9, 1e-6, 0.0)
    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            LiveServer(num_kv_blocks=12, max_model_len=512, preemption_mode="auto",
                       num_host_blocks=64, preemption_prices=prices) as live:
        bodies = pressure(live)
        after = scrape(live)
    preemptions = after[("vllm:num_preemptions_total", E)]
    assert preemptions > 0
    assert after[("kvserve:preemptions_total", by("mode", "recompute"))] == preemptions
    assert after[("kvserve:swapped_blocks_total", by("direction", "out"))] == 0
    assert sum(b["kvserve"]["num_swaps"] for b in bodies) == 0
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("preemption request_id=")]
    assert len(lines) == preemptions
    assert all("mode=recompute" in line and "(auto: recompute " in line and ", swap " in line
               for line in lines)


def test_without_a_host_tier_the_boot_log_says_so_and_the_series_are_zero(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            LiveServer(num_kv_blocks=32, max_model_len=256) as live:
        values = scrape(live)
        body = httpx.post(live.url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": 2}).json()
    boot = [r.getMessage() for r in caplog.records]
    assert "Host KV cache (swap space): none; preemption mode: recompute" in boot
    assert "Steps: mixed (decodes and prefill chunks share each step, vLLM V1); " \
        "max_num_seqs 256, max_num_batched_tokens 2048" in boot
    assert values[("vllm:num_requests_swapped", E)] == 0
    assert values[("kvserve:host_kv_cache_usage_perc", E)] == 0
    assert values[("kvserve:swapped_blocks_total", by("direction", "in"))] == 0
    assert body["kvserve"]["num_swaps"] == 0


@pytest.mark.parametrize("settings, line", [
    ({"step_mix": "prefill-first"},
     "Steps: prefill-first (pending prefills run alone while decodes wait, SGLang's default; "
     "no bound in a row); max_num_seqs 256, max_num_batched_tokens 2048"),
    ({"step_mix": "prefill-first", "max_prefill_only_steps": 3, "max_num_seqs": 64},
     "Steps: prefill-first (pending prefills run alone while decodes wait, SGLang's default; "
     "at most 3 in a row); max_num_seqs 64, max_num_batched_tokens 2048"),
    ({"watermark": 0.5, "admission_policy": "reserve"},  # the operator pass: unnamed
     "Steps: mixed (decodes and prefill chunks share each step, vLLM V1); max_num_seqs 256, "
     "max_num_batched_tokens 2048, watermark 0.5 (of the KV blocks, kept free to admit), "
     "admission policy reserve"),
    ({"scheduling_policy": "priority", "enable_priority_preemption": True},
     "Steps: mixed (decodes and prefill chunks share each step, vLLM V1); max_num_seqs 256, "
     "max_num_batched_tokens 2048, urgent preemption of running priority values more than "
     "10 above an arrival's"),
])
def test_the_boot_log_names_the_step_mix_q1(settings, line):
    info = SimpleNamespace(scheduler_config=SchedulerConfig(**settings))
    assert steps_line(SimpleNamespace(engine=SimpleNamespace(info=info))) == line


def test_the_host_tiers_boot_line_is_per_replica_with_replicas():
    """Each replica holds its own tier: the line said 255.9 MiB beside the KV cache line's
    "per replica, 2 replicas" (the data-parallel pass)."""
    from types import SimpleNamespace

    from kvserve.server.stats_log import host_tier_line

    info = SimpleNamespace(scheduler_config=SimpleNamespace(preemption_mode="swap"),
                           num_host_blocks=64, block_size=16, host_kv_cache_bytes=1 << 20)
    one = host_tier_line(SimpleNamespace(engine=SimpleNamespace(info=info)))
    assert one == ("Host KV cache (swap space): 1024 tokens (64 blocks of 16, 1.0 MiB); "
                   "preemption mode: swap")
    two = host_tier_line(SimpleNamespace(engine=SimpleNamespace(info=info, num_replicas=2)))
    assert two == ("Host KV cache (swap space): 1024 tokens (64 blocks of 16, 1.0 MiB) per "
                   "replica, 2 replicas; preemption mode: swap")
