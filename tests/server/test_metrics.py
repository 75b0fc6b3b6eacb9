"""/metrics in Prometheus text, vLLM's names: parsed with prometheus_client and seen to move,
preemptions included (a tiny KV pool)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx

from .helpers import LiveServer, engine_spec, metric_values, wait_for

M = (("model_name", "tiny"),)
E = (("engine", "0"), ("model_name", "tiny"))  # an engine's own series (one engine: 0)


def scrape(live: LiveServer) -> dict:
    response = httpx.get(live.url + "/metrics")
    assert response.status_code == 200
    return metric_values(response.text)


def test_metrics_move_and_count_preemptions(caplog):
    # 12 blocks of 16 = 192 tokens; six requests growing to 140 tokens each must preempt
    with LiveServer(num_kv_blocks=12, max_model_len=512) as live:
        before = scrape(live)
        assert not [name for name, _ in before if name.endswith("_created")]  # vllm-compat.md
        # vLLM labels its one engine 0, on the scheduler's series and the request series
        # alike (the request series carried the model only: sum by (engine) came back empty)
        assert ("vllm:num_requests_running", E) in before
        assert ("vllm:num_requests_running", M) not in before
        assert ("vllm:time_to_first_token_seconds_count", E) in before
        assert before[("vllm:num_preemptions_total", E)] == 0
        assert before[("vllm:kv_cache_usage_perc", E)] == 0
        assert before[("vllm:cache_config_info", (
            ("block_size", "16"), ("cache_dtype", "auto"), ("enable_prefix_caching", "True"),
            ("engine", "0"), ("kv_cache_max_concurrency", "0.4"),
            ("kv_cache_size_tokens", "192"), ("model_name", "tiny"), ("num_cpu_blocks", "None"),
            ("num_gpu_blocks", "12")))] == 1  # vLLM's labels (QA: no engine to join on)
        # vLLM's buckets (QA: 0 ... 100 here, no 4), and the process series it exports
        assert ("vllm:request_num_preemptions_bucket", (*E[:1], ("le", "4.0"), *M)) in before
        assert before[("process_resident_memory_bytes", ())] > 0

        def one(index: int) -> httpx.Response:
            return httpx.post(live.url + "/v1/completions", timeout=60, json={
                "prompt": [100 + index] * 40, "max_tokens": 100, "ignore_eos": True})
        with caplog.at_level(logging.INFO, logger="kvserve.server"), \
                ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(one, range(6)))
        assert [r.status_code for r in responses] == [200] * 6
        wait_for(live.idle, what="idle")
        after = scrape(live)
        preemptions = after[("vllm:num_preemptions_total", E)]
        assert preemptions > 0
        assert sum(r.json()["kvserve"]["num_preemptions"] for r in responses) == preemptions
        assert after[("vllm:generation_tokens_total", E)] == 600
        assert after[("vllm:prompt_tokens_total", E)] == 240
        assert after[("vllm:request_success_total", (E[0], ("finished_reason", "length"),
                                                     *M))] == 6
        assert after[("vllm:e2e_request_latency_seconds_count", E)] == 6
        assert after[("vllm:time_to_first_token_seconds_count", E)] == 6
        assert after[("vllm:inter_token_latency_seconds_count", E)] == 594
        assert after[("vllm:request_num_preemptions_count", E)] == 6
        assert after[("kvserve:recomputed_tokens_total", E)] > 0
        assert after[("kvserve:preemption_stall_seconds_count", E)] >= 1
        assert after[("vllm:num_requests_running", E)] == 0
        # vLLM 0.32's per-request and per-step histograms, and the waiting gauge by reason
        assert after[("vllm:request_prompt_tokens_sum", E)] == 240
        assert after[("vllm:request_generation_tokens_sum", E)] == 600
        assert after[("vllm:request_params_max_tokens_sum", E)] == 600
        assert after[("vllm:request_params_n_sum", E)] == 6
        assert after[("vllm:request_max_num_generation_tokens_sum", E)] == 600
        for phase in ("inference", "prefill", "decode"):
            assert after[(f"vllm:request_{phase}_time_seconds_count", E)] == 6
        assert after[("vllm:request_inference_time_seconds_sum", E)] >= \
            after[("vllm:request_decode_time_seconds_sum", E)] > 0
        assert after[("vllm:request_time_per_output_token_seconds_count", E)] == 6
        assert after[("vllm:iteration_tokens_total_sum", E)] == \
            after[("kvserve:scheduled_tokens_total", E)] >= 240 + 600 - 6
        assert after[("kvserve:prefill_only_steps_total", E)] == 0  # mixed steps (Q1)
        assert after[("kvserve:preemption_guard_waits_total", E)] == 0  # no guard (P2)
        for reason in ("capacity", "deferred"):
            assert after[("vllm:num_requests_waiting_by_reason",
                          (*E, ("reason", reason)))] == 0
        lines = [r.getMessage() for r in caplog.records if "preemption request_id=" in
                 r.getMessage()]
        assert len(lines) == preemptions and "num_tokens_lost=" in lines[0]


def test_boot_lines_and_stats_line(caplog):
    from kvserve.server.stats_log import StatsLogger

    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            LiveServer(num_kv_blocks=64, max_model_len=512) as live:
        messages = [r.getMessage() for r in caplog.records]
        assert "KV cache size: 1024 tokens (64 blocks of 16)" in messages
        assert "Maximum concurrency for 512 tokens per request: 2.00x" in messages
        stats = StatsLogger(live.state)
        httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                       "ignore_eos": True})
        line = stats.line()
        assert line is not None and "Avg generation throughput" in line
        assert "Running: 0 reqs, Waiting: 0 reqs" in line and "Preemptions: 0" in line
        assert stats.line() is None  # nothing happened since
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_stats_line_s_hit_rate_is_over_the_recent_prompts_as_vllm_s():
    """The dashboard pass: the line's "Prefix cache hit rate" was the window's, so every
    window without a new prompt (decode only) read 0.0%; vLLM's is over its most recent
    1000 requests' lookups."""
    from types import SimpleNamespace

    from kvserve.core import SchedulerStats
    from kvserve.server.stats_log import RECENT_PROMPTS, StatsLogger

    metrics = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0, num_prompts=0)
    engine = SimpleNamespace(observers=[], stats=None)
    logger = StatsLogger(SimpleNamespace(metrics=metrics, engine=engine))

    def window(prompts: int, queries: int, hits: int) -> str:
        metrics.num_prompts += prompts
        metrics.num_prompt_tokens += 10 * prompts
        metrics.num_generation_tokens += 5
        old = engine.stats
        engine.stats = SchedulerStats(
            4, 0, 0, 0.5, 50, 100, 1, 0, 0, 8, queries + (old.prefix_cache_queries if old
                                                           else 0),
            hits + (old.prefix_cache_hits if old else 0), {}, {})
        line = logger.line()
        assert line is not None
        return line.split("Prefix cache hit rate: ")[1].split("%")[0]

    assert window(4, 240, 128) == "53.3"
    assert window(0, 0, 0) == "53.3"  # decoding: no lookups (it read 0.0)
    assert window(4, 240, 0) == "26.7"
    assert window(RECENT_PROMPTS, 1000, 0) == "0.0"  # the first windows left behind


def test_a_cache_smaller_than_max_model_len_is_warned_at_boot(caplog):  # J2
    """vLLM refuses to start; kvserve serves and stops such a sequence at the pool's size
    (J2), which an operator learned only from a 0.25x in an INFO line."""
    with caplog.at_level(logging.INFO, logger="kvserve.server"), \
            LiveServer(num_kv_blocks=16, max_model_len=512):
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the KV cache holds 256 tokens, fewer than max_model_len 512: a "
                        "sequence stops at 256 tokens with stop_reason 'kv_capacity' (rule "
                        "J2); lower --max-model-len or give the cache more memory"]


def test_the_engine_checks_its_state_each_time_it_falls_idle(caplog):
    """After each busy spell the engine checks the scheduler's invariants (I1-I4); a broken
    one is logged and counted in kvserve:invariant_violations, and serving goes on."""
    with LiveServer(num_kv_blocks=12, max_model_len=512) as live:
        def complete() -> None:
            checks = live.state.engine.idle_checks
            response = httpx.post(live.url + "/v1/completions", timeout=60,
                                  json={"prompt": [7] * 20, "max_tokens": 4})
            assert response.status_code == 200
            wait_for(lambda: live.state.engine.idle_checks > checks, what="idle check")

        complete()
        assert scrape(live)[("kvserve:invariant_violations_total", E)] == 0
        pool = live.state.engine.engine.scheduler.kv.pool
        pool.free_queue.num_free -= 1  # a leak: the count no longer matches the queue
        with caplog.at_level(logging.ERROR, logger="kvserve.engine"):
            complete()
        assert scrape(live)[("kvserve:invariant_violations_total", E)] == 1
        assert any("I1: free queue holds" in r.getMessage() for r in caplog.records)
        pool.free_queue.num_free += 1
        complete()
        assert scrape(live)[("kvserve:invariant_violations_total", E)] == 1


def test_every_http_answer_is_counted_by_route_method_and_status_class():
    """vLLM's http_requests_total and http_request_duration_seconds: client errors and 503s
    showed in no series and, with uvicorn quiet, in no log (QA)."""
    with LiveServer(num_kv_blocks=16, max_model_len=256) as live:
        assert httpx.post(live.url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert httpx.post(live.url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": -1}).status_code == 400
        assert httpx.post(live.url + "/v1/completions", json={
            "prompt": "hi", "model": "gpt-9"}).status_code == 404
        assert httpx.get(live.url + "/nowhere").status_code == 404
        for invented in ("FOO1", "FOO2"):  # the parser takes any method: one label for all
            assert httpx.request(invented, live.url + "/v1/models").status_code == 405
        for probe in ("/health", "/ping", "/load", "/version"):
            assert httpx.get(live.url + probe).status_code == 200
        scrape(live)
        slash = httpx.get(live.url + "/metrics/")  # vLLM's serves it (the pass: a 307)
        assert slash.status_code == 200 and "vllm:num_requests_running" in slash.text
        values = scrape(live)
    route = (("handler", "/v1/completions"), ("method", "POST"))
    assert values[("http_requests_total", (*route, ("status", "2xx")))] == 1
    assert values[("http_requests_total", (*route, ("status", "4xx")))] == 2
    assert values[("http_requests_total", (("handler", "none"), ("method", "GET"),
                                           ("status", "4xx")))] == 1
    assert values[("http_request_duration_seconds_count", route)] == 3
    models = (("handler", "/v1/models"), ("method", "other"))
    assert values[("http_requests_total", (*models, ("status", "4xx")))] == 2
    assert not [key for key in values if ("method", "FOO1") in key[1]]
    assert values[("http_request_duration_seconds_sum", route)] > 0
    # scrapes and probes are left out, as vLLM's instrumentator leaves them (the metrics
    # pass: a dashboard's request rate counted them)
    assert not [key for key in values if key[0] == "http_requests_total" and any(
        label == ("handler", path) for label in key[1]
        for path in ("/metrics", "/metrics/", "/health", "/ping", "/load", "/version"))]


def test_prompt_tokens_by_source_split_computed_from_cached():
    """vLLM's vllm:prompt_tokens_by_source, vllm:prompt_tokens_cached and
    vllm:request_prefill_kv_computed_tokens (QA: a current vLLM dashboard's panels were
    empty): a repeated prompt's blocks are cache hits."""
    with LiveServer(num_kv_blocks=64, max_model_len=512) as live:
        before = scrape(live)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            assert before[("vllm:prompt_tokens_by_source_total", (
                E[0], *M, ("source", source)))] == 0
        body = {"prompt": list(range(200, 250)), "max_tokens": 1}
        for _ in range(2):
            assert httpx.post(live.url + "/v1/completions", json=body, timeout=60
                              ).status_code == 200
        after = scrape(live)
        hit = after[("vllm:prompt_tokens_by_source_total", (E[0], *M, ("source",
                                                                         "local_cache_hit")))]
        computed = after[("vllm:prompt_tokens_by_source_total", (
            E[0], *M, ("source", "local_compute")))]
        assert hit == 48 and computed == 100 - 48  # three whole blocks of 16 hit
        assert after[("vllm:prompt_tokens_cached_total", E)] == hit
        assert after[("vllm:request_prefill_kv_computed_tokens_sum", E)] == computed
        assert after[("vllm:request_prefill_kv_computed_tokens_count", E)] == 2


def test_n_and_the_longest_answer_are_per_prompt_max_tokens_per_sequence_as_vllm():
    """vLLM 0.32 observes request_params_n and request_max_num_generation_tokens once per
    prompt (its parent request) and request_params_max_tokens once per sequence (QA: n and
    max_tokens once per HTTP request here, the longest answer not at all)."""
    # in an engine process, as served: its answers race the add's reply
    with LiveServer(spec=engine_spec(num_kv_blocks=32, max_model_len=256)) as live:
        assert httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 3,
            "ignore_eos": True}).status_code == 200
        # one-token answers may finish before add_requests returns (QA, review: a group
        # registered after that never completed, its n unobserved)
        for _ in range(8):
            assert httpx.post(live.url + "/v1/completions", timeout=60, json={
                "prompt": [5, 6], "n": 3, "max_tokens": 1}).status_code == 200
        wait_for(live.idle, what="idle")
        values = scrape(live)
    assert (values[("vllm:request_params_n_count", E)],
            values[("vllm:request_params_n_sum", E)]) == (2 + 8, 4 + 24)
    assert (values[("vllm:request_params_max_tokens_count", E)],
            values[("vllm:request_params_max_tokens_sum", E)]) == (4 + 24, 12 + 24)
    assert (values[("vllm:request_max_num_generation_tokens_count", E)],
            values[("vllm:request_max_num_generation_tokens_sum", E)]) == (2 + 8, 6 + 8)


def test_a_dead_replicas_requests_whose_clients_had_left_are_counted_failed():
    """The chaos pass: a client that left a moment before its replica died had its abort
    never reach the engine, so no answer counted its request (not abort, not failed) and
    the metrics followed it for the server's life."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.server.auth import KeyRing
    from kvserve.server.state import ServerState

    from .helpers import make_engine

    serving = AsyncEngine(make_engine(num_kv_blocks=16))
    serving.death_observers = []  # as a data-parallel engine has them
    state = ServerState(serving, "tiny", KeyRing([]))
    assert serving.death_observers == [state._replica_died]
    for request_id in ("gone", "answering"):
        state.metrics.request_added(request_id, 0.0, 4)
    state.ids_in_use.add("answering")  # its answer is still open: it will count it
    state._replica_died(1, 0.0, ["gone", "answering"])
    values = metric_values(state.metrics.render().decode())
    assert values[("kvserve:requests_failed_total",
                   (("model_name", "tiny"), ("reason", "engine_died")))] == 1
    state._replica_died(1, 0.0, ["gone"])  # once only
    values = metric_values(state.metrics.render().decode())
    assert values[("kvserve:requests_failed_total",
                   (("model_name", "tiny"), ("reason", "engine_died")))] == 1


def test_a_failed_sequences_computed_prompt_is_in_its_sources_too():
    """The review: a sequence whose engine died after its first token was in
    vllm:prompt_tokens_total but in no prompt_tokens_by_source series, so the totals
    drifted apart for good (README says they add up)."""
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    from kvserve.engine.core_loop import StepReport
    from kvserve.engine.engine import CompletionChunk
    from kvserve.server.metrics import ServerMetrics

    info = SimpleNamespace(max_model_len=256, num_kv_blocks=16, block_size=16,
                           enable_prefix_caching=True, num_host_blocks=0, tokenizer=None)
    engine = SimpleNamespace(info=info, observers=[], num_replicas=1, replicas=1,
                             engine_figures=lambda: [], router_figures=lambda: None,
                             stats=MagicMock())
    metrics = ServerMetrics(engine, "tiny")
    for request_id in ("ran", "waited"):
        metrics.request_added(request_id, 0.0, 10)
    metrics.observe(StepReport(time=0.1, num_scheduled_tokens=10, seconds=0.01,
                               chunks=[CompletionChunk("ran", [5], "x")], events=[],
                               stats=None))
    metrics.requests_failed(["ran", "waited"])  # their engine died under them
    series = metrics.series(0)
    assert series.prompt_tokens._value.get() == 10  # the one whose prompt was computed
    assert sum(c._value.get() for c in series.by_source.values()) == 10
