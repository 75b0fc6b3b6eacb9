"""`kvserve bench serve`'s client against servers that break the protocol (httpx's mock
transport stands in for them): each such answer fails its request with a reason, never the
run, and nothing is counted as it was not (the bench tools pass)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from kvserve.bench.client import RequestResult, Target
from kvserve.bench.report import format_table, summarize
from kvserve.bench.runner import RunResult, _send, scrape_metrics
from kvserve.bench.workload import BenchRequest, parse_range

REQUEST = BenchRequest(0, [1000, 1001, 1002], 3, max_tokens=4)
SSE = {"content-type": "text/event-stream; charset=utf-8"}


def event(data: object) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def text(piece: str) -> bytes:
    return event({"choices": [{"index": 0, "text": piece}]})


USAGE = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
DONE = b"data: [DONE]\n\n"


def exchange(handler: Callable[[httpx.Request], httpx.Response], stream: bool = True,
             timeout: float | None = 30.0) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = Target("http://bench.test", "m", stream=stream)
            return await _send(client, target, REQUEST, None, timeout)
    return asyncio.run(go())


def streamed(*chunks: bytes, headers: dict[str, str] = SSE) -> RequestResult:
    return exchange(lambda request: httpx.Response(200, headers=headers,
                                                   content=b"".join(chunks)))


def test_a_whole_stream_with_usage_completes():
    result = streamed(*(text(t) for t in "abcd"), USAGE, DONE)
    assert result.ok and result.error is None
    assert (result.num_output_tokens, result.usage_missing) == (4, False)
    assert result.generated_text == "abcd" and len(result.itls) == 3


def test_a_stream_without_usage_counts_its_events_and_says_so():
    """QA: 0 output tok/s and no TPOT, exit 0, from a server that sends no usage."""
    result = streamed(*(text(t) for t in "abcd"), DONE)
    assert result.ok and (result.num_output_tokens, result.usage_missing) == (4, True)
    summary = summarize(RunResult([result], 1.0, None, None))
    assert summary["output_tokens"] == 4 and summary["usage_missing"] == 1
    assert summary["tpot"]["p50_ms"] is not None
    assert "warning: 1 answer(s) came with no usage" in format_table(summary)


@pytest.mark.parametrize(("chunks", "headers", "reason"), [
    ((text("a"), text("b")), SSE, "the stream ended before [DONE] (2 text events)"),
    ((b"<html>proxy login</html>",), {"content-type": "text/html"},
     "HTTP 200 but text/html, not an event stream"),
    ((json.dumps({"choices": [{"text": "ab"}]}).encode(),), {"content-type": "application/json"},
     "HTTP 200 but application/json, not an event stream"),
    ((text("a"), b"data: {not json\n\n", DONE), SSE,
     "a stream event is not a JSON object: '{not json'"),
    ((event({"error": "engine died"}), DONE), SSE, "stream error: engine died"),
    ((event({"error": None}), DONE), SSE, "stream error: None"),
    ((event({"choices": [1]}), DONE), SSE, "bad answer: AttributeError"),
])
def test_an_answer_that_breaks_the_protocol_fails_its_request(chunks, headers, reason):
    """QA: these counted as completed, or raised out of the run with every result lost."""
    result = streamed(*chunks, headers=headers)
    assert not result.ok and result.error is not None and result.error.startswith(reason)


def test_a_whole_answer_that_is_no_json_fails_and_one_without_usage_is_told():
    html = exchange(lambda r: httpx.Response(200, content=b"<html></html>"), stream=False)
    assert not html.ok and html.error.startswith("HTTP 200 but not a JSON answer")
    body = {"choices": [{"text": "abcd"}]}
    plain = exchange(lambda r: httpx.Response(200, json=body), stream=False)
    assert plain.ok and plain.usage_missing and plain.num_output_tokens == 0
    assert "their output tokens are not counted" in format_table(
        {**summarize(RunResult([plain], 1.0, None, None)), "stream": False})


def test_an_answer_not_streamed_has_no_tpot():
    """QA: --no-stream showed a measured-looking TPOT of 0.00 ms (its TTFT is its E2E)."""
    body = {"choices": [{"text": "abcd"}], "usage": {"completion_tokens": 4}}
    result = exchange(lambda r: httpx.Response(200, json=body), stream=False)
    assert result.ok and result.ttft == result.e2e
    summary = summarize(RunResult([result], 1.0, None, None))
    assert summary["tpot"]["p50_ms"] is None and summary["mean_tpot_ms"] is None


def test_the_timeout_bounds_the_whole_answer():
    """QA: --timeout bounded each read, so a server sending a token now and then held the
    run for ever."""
    async def trickle() -> AsyncIterator[bytes]:
        while True:
            yield text("a")
            await asyncio.sleep(0.05)

    result = exchange(lambda r: httpx.Response(200, headers=SSE, content=trickle()),
                      timeout=0.3)
    assert not result.ok and not result.disconnected
    assert result.error == "no whole answer within the timeout (0.3 s)"


def test_a_share_gauge_is_averaged_over_engines_and_counters_summed():
    """QA: two engines at 80% read 1.6."""
    page = ('vllm:kv_cache_usage_perc{engine="0"} 0.8\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.6\n'
            'vllm:num_preemptions_total{engine="0"} 3\n'
            'vllm:num_preemptions_total{engine="1"} 2\n')

    async def go() -> dict[str, float] | None:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, text=page))
        async with httpx.AsyncClient(transport=transport) as client:
            return await scrape_metrics(client, "http://bench.test")
    figures = asyncio.run(go())
    assert figures is not None
    assert figures["vllm:kv_cache_usage_perc"] == pytest.approx(0.7)
    assert figures["vllm:num_preemptions_total"] == 5


@pytest.mark.parametrize(("text_", "message"), [
    ("1:", "is not N or LOW:HIGH"),  # QA: taken as 1
    ("99999999999999999999", "at most 10,000,000 tokens"),  # QA: built until killed
])
def test_a_length_range_is_refused_by_name(text_, message):
    with pytest.raises(ValueError, match=message):
        parse_range(text_, "--input-len")


def test_a_sessions_turn_is_sent_once_its_previous_turn_has_ended(tmp_path, monkeypatch):
    """The CLI pass: bench sent a conversation's next turn while the previous answer still
    streamed (simulate holds it back: a chat client reads the answer first), and never sent
    the session id; a turn waiting for its previous one holds no concurrency slot."""
    import time

    from kvserve.bench import runner
    from kvserve.bench.workload import trace_requests

    trace = tmp_path / "turns.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in [
        {"request_id": "a0", "arrival_time": 0, "prompt_len": 4, "output_len": 2,
         "session_id": "a"},
        {"request_id": "a1", "arrival_time": 0.01, "prompt_len": 8, "output_len": 2,
         "session_id": "a"},
        {"request_id": "b0", "arrival_time": 0.02, "prompt_len": 4, "output_len": 2,
         "session_id": "b"}]))
    spans: dict[int, list[float]] = {}
    bodies: list[dict] = []

    async def send(client, target, request, disconnect_after, timeout):
        bodies.append(target.body(request))
        spans[request.index] = [time.perf_counter()]
        await asyncio.sleep(0.3)
        spans[request.index].append(time.perf_counter())
        return RequestResult(request.index, ok=True)

    async def no_metrics(client, base_url):
        return None
    monkeypatch.setattr(runner, "send", send)
    monkeypatch.setattr(runner, "scrape_metrics", no_metrics)
    requests = trace_requests(trace, 0)
    assert [r.session for r in requests] == [("", "a"), ("", "a"), ("", "b")]
    asyncio.run(runner.run(requests, Target("http://bench.test", "m", sessions=True),
                           max_concurrency=2))
    assert spans[1][0] >= spans[0][1]  # a's second turn after its first ended
    assert spans[2][0] < spans[0][1]  # b's first ran beside a's (a1 waited without a slot)
    assert [body["session"] for body in bodies] == [{"id": "a"}, {"id": "b"}, {"id": "a"}]
    # a tenant's session is sent as its (the review: two tenants' "a" were one session)
    from kvserve.bench.workload import BenchRequest
    turn = BenchRequest(0, [1, 2], 2, 4, session=("t1", "a"))
    body = Target("http://bench.test", "m", sessions=True).body(turn)
    assert (body["session"], body["user"]) == ({"id": "a"}, "t1")
