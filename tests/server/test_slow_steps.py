"""Steps far slower than the engine's usual are counted and logged (server/slow_steps.py;
QA: 1.2 s decode steps against a usual 10 ms, back to back, and nothing said why)."""

from __future__ import annotations

import logging

import httpx

from kvserve.server.slow_steps import EVERY, FLOOR, MIN_STEPS, SlowSteps

from .helpers import LiveServer, metric_values, slow_engine


def usual(detector: SlowSteps, count: int = MIN_STEPS, seconds: float = 0.01) -> None:
    for _ in range(count):
        assert not detector.observe(seconds, 4, 4, now=0.0)


def test_a_step_ten_times_the_median_and_past_the_floor_is_slow(caplog):
    caplog.set_level(logging.WARNING, logger="kvserve.server")
    detector = SlowSteps()
    assert not detector.observe(5.0, 4, 4, now=0.0)  # no median yet: nothing to compare
    usual(detector)
    assert not detector.observe(0.09, 4, 4, now=1.0)  # 9x
    assert not detector.observe(FLOOR - 0.01, 4, 4, now=1.0)  # 10x+ but under the floor
    assert not detector.observe(5.0, 0, 0, now=1.0)  # no tokens: an idle wait, not a step
    # a long prefill takes its tokens' time (QA: 907 tokens in 2.7 s against 10 ms steps of
    # 4 tokens was called slow): 3 ms a token, under 10x the median 2.5 ms a token
    assert not detector.observe(2.72, 907, 1, now=1.0)
    assert detector.observe(1.2, 3, 3, now=1.0)
    [line] = [r.getMessage() for r in caplog.records]
    assert "1 engine step(s) took over 10x the median step (10.0 ms), also per token, the " \
           "slowest 1.20 s (3 sequence(s), 3 token(s)); load average" in line
    # more within EVERY seconds: counted, told in one line once it has passed
    assert detector.observe(1.5, 2, 2, now=2.0) and detector.observe(1.3, 2, 2, now=3.0)
    assert len(caplog.records) == 1  # (each observe said it was slow: the counter's)
    detector.flush(now=1.0 + EVERY)
    assert "2 engine step(s) in the last 10 s took over 10x" in caplog.records[-1].getMessage()
    assert "the slowest 1.50 s" in caplog.records[-1].getMessage()
    detector.flush(now=100.0)  # nothing pending: no line
    assert len(caplog.records) == 2


def test_slow_steps_reach_the_metrics_and_the_log(caplog):
    caplog.set_level(logging.WARNING, logger="kvserve.server")
    engine = slow_engine(0.0, max_model_len=256)
    with LiveServer(engine) as live:
        values = metric_values(httpx.get(live.url + "/metrics").text)
        series = ("kvserve:slow_steps_total", (("engine", "0"), ("model_name", "tiny")))
        assert values[series] == 0  # from boot, as vLLM's counters
        reply = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": MIN_STEPS + 4, "ignore_eos": True})
        assert reply.status_code == 200
        engine.executor.delay = 0.4  # the CPU taken away
        reply = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert reply.status_code == 200
        values = metric_values(httpx.get(live.url + "/metrics").text)
    assert values[series] >= 1
    assert any("engine step(s) took over 10x the median step" in r.getMessage()
               for r in caplog.records)
