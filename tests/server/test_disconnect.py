"""A client that goes away aborts its request wherever it is (queued, prefilling, decoding;
streaming or not), and the KV pool is whole again."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from .helpers import LiveServer, slow_engine, wait_for


@pytest.fixture(scope="module")
def live():
    # one seat, small prefill chunks, 10 ms steps: a request stays in each state long enough
    engine = slow_engine(0.01, max_num_seqs=1, max_num_batched_tokens=32, max_model_len=1024)
    with LiveServer(engine) as server:
        yield server


def raw_post(server: LiveServer, body: dict) -> socket.socket:
    """Send a request on a bare socket and return it unread, so the test decides when the
    client goes away."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(payload)).encode() +
                 b"\r\n\r\n" + payload)
    return sock


def aborted(server: LiveServer) -> int:
    return server.state.engine.stats.num_finished.get("abort", 0)


def running_output(server: LiveServer) -> list:
    return [r for r in list(server.scheduler.running) if r.output_token_ids]


LONG = {"prompt": [11] * 20, "max_tokens": 900, "ignore_eos": True}


def test_streaming_client_leaves_while_decoding(live):
    before = aborted(live)
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: aborted(live) == before + 1, what="the abort")
    wait_for(live.idle, what="a whole pool")
    # metrics forget it too, and count it
    wait_for(lambda: not live.state.metrics._live, what="metrics to drop the request")
    text = httpx.get(live.url + "/metrics").text
    assert ('vllm:request_success_total{engine="0",finished_reason="abort",'
            'model_name="tiny"}') in text


def test_plain_client_leaves_while_decoding(live):
    before = aborted(live)
    sock = raw_post(live, LONG)
    wait_for(lambda: running_output(live), what="decoding")
    sock.close()
    wait_for(lambda: aborted(live) == before + 1, what="the abort")
    wait_for(live.idle, what="a whole pool")


def test_plain_client_leaves_while_prefilling(live):
    before = aborted(live)
    sock = raw_post(live, {**LONG, "prompt": [12] * 800, "max_tokens": 10})
    wait_for(lambda: live.scheduler.running, what="prefill to start")
    assert not running_output(live)  # 800 tokens in chunks of 32: still prefilling
    sock.close()
    wait_for(lambda: aborted(live) == before + 1, what="the abort")
    wait_for(live.idle, what="a whole pool")


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaves_while_queued(live, stream):
    before = aborted(live)
    blocker = raw_post(live, LONG)
    wait_for(lambda: running_output(live), what="the blocker to run")
    queued = raw_post(live, {**LONG, "max_tokens": 5, "stream": stream})
    wait_for(lambda: live.state.engine.stats.num_waiting == 1, what="queued")
    queued.close()
    wait_for(lambda: aborted(live) == before + 1, what="the queued abort")
    assert live.state.engine.stats.num_running == 1  # the blocker is untouched
    blocker.close()
    wait_for(lambda: aborted(live) == before + 2, what="the blocker's abort")
    wait_for(live.idle, what="a whole pool")


def test_operator_abort_ends_a_stream(live):
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "stream": True},
                      headers={"X-Request-Id": "op-1"}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        reply = httpx.post(live.url + "/v1/abort", json={"request_id": "cmpl-op-1"})
        assert reply.json()["aborted"] == ["cmpl-op-1"]
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "abort"
    # what the scheduler did with it reaches the client (only the request id did)
    assert last["kvserve"]["queue_time"] is not None and "num_preemptions" in last["kvserve"]
    wait_for(live.idle, what="a whole pool")


def test_an_operator_abort_is_reported_once(live):
    """/v1/abort names a request under "aborted" only on the call that aborted it: asked
    again while the abort is on its way (slow steps keep the stream open), or twice in one
    call, it is under "not_found", since nothing is left to abort."""
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "stream": True},
                      headers={"X-Request-Id": "op-2"}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        live.engine.executor.delay = 3.0  # the abort waits for the step under way
        began = live.engine.executor.began
        try:  # a step that slept 0.01 s could end first, and the abort with it (under load)
            wait_for(lambda: live.engine.executor.began > began, what="a slow step")
            first = httpx.post(live.url + "/v1/abort",
                               json={"request_id": ["cmpl-op-2", "cmpl-op-2", "cmpl-none"]})
            again = httpx.post(live.url + "/v1/abort", json={"request_id": "cmpl-op-2"})
            assert "op-2" in live.state.groups, "the stream ended before the retry"
        finally:
            live.engine.executor.delay = 0.01
        events = [line for line in lines if line.startswith("data: ")]
    assert first.json() == {"aborted": ["cmpl-op-2"], "not_found": ["cmpl-op-2", "cmpl-none"]}
    assert again.json() == {"aborted": [], "not_found": ["cmpl-op-2"]}
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    wait_for(live.idle, what="a whole pool")
    # a field it does not know is refused, as every endpoint's (QA: taken)
    odd = httpx.post(live.url + "/v1/abort", json={"request_id": "cmpl-x", "force": True})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "force"


@pytest.mark.parametrize("name", ["op-q", "cmpl-op-q", "op-q-1"])
def test_an_operator_abort_reaches_a_request_the_engine_is_still_taking(live, name):
    """QA (churn pass): from the hold of its ids until the engine took it (the end of the
    step under way, seconds under load) /v1/abort answered not_found, and the request ran
    to its end. Now the abort is kept and done once the engine has it; a choice's id ends
    that choice alone."""
    blocker = raw_post(live, LONG)
    wait_for(lambda: running_output(live), what="the blocker to run")
    live.engine.executor.delay = 3.0  # the add waits for the step under way
    began = live.engine.executor.began
    try:
        wait_for(lambda: live.engine.executor.began > began, what="a slow step")
        body = json.dumps({"prompt": [13] * 5, "max_tokens": 3, "ignore_eos": True, "n": 2})
        sock = socket.create_connection(("127.0.0.1", live.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: op-q\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" +
                     body.encode())
        wait_for(lambda: "op-q" in live.state.queuing, what="the add under way")
        reply = httpx.post(live.url + "/v1/abort", json={"request_id": [name, name]})
        assert reply.json() == {"aborted": [name], "not_found": [name]}
    finally:
        live.engine.executor.delay = 0.01
    blocker.close()
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    choices = json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"]
    reasons = sorted(choice["finish_reason"] for choice in choices)
    assert reasons == (["abort", "length"] if name == "op-q-1" else ["abort", "abort"])
    assert not live.state.queuing
    wait_for(live.idle, what="a whole pool")


@pytest.mark.parametrize("name", ["cmpl-own", "cmpl-cmpl-own"])
def test_an_id_the_client_chose_with_a_prefix_aborts_by_either_name(live, name):
    """X-Request-Id `cmpl-own` makes the response id `cmpl-cmpl-own`: /v1/abort finds the
    request by the id as sent and by the response id."""
    with httpx.stream("POST", live.url + "/v1/completions", json={**LONG, "stream": True},
                      headers={"X-Request-Id": "cmpl-own"}, timeout=30) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines)[6:])["id"] == "cmpl-cmpl-own"
        reply = httpx.post(live.url + "/v1/abort", json={"request_id": name})
        assert reply.json() == {"aborted": [name], "not_found": []}
        events = [line for line in lines if line.startswith("data: ")]
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    wait_for(live.idle, what="a whole pool")


def test_a_choice_id_aborts_that_choice_and_the_others_run_on(live):
    """With n > 1 the choices run as `<id>-0`, `<id>-1`, ...: the ids the dashboard and the
    engine's logs show. /v1/abort with one of them (or with its response-id form) ends that
    choice with an abort and leaves the others running; it answered not_found."""
    with httpx.stream("POST", live.url + "/v1/completions",
                      json={**LONG, "stream": True, "n": 2},
                      headers={"X-Request-Id": "op-3"}, timeout=30) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines)[6:])["choices"][0]["index"] == 0  # 0 runs, 1 waits
        reply = httpx.post(live.url + "/v1/abort", json={"request_id": "cmpl-op-3-1"})
        assert reply.json() == {"aborted": ["cmpl-op-3-1"], "not_found": []}
        chunks = []
        for line in lines:  # choice 1 ends; choice 0 keeps producing
            chunks.append(json.loads(line[6:])["choices"][0])
            if chunks[-1]["index"] == 0 and any(c["index"] == 1 for c in chunks):
                break
        assert [c["finish_reason"] for c in chunks if c["index"] == 1] == ["abort"]
        again = httpx.post(live.url + "/v1/abort", json={"request_id": ["op-3-1", "op-3"]})
        assert again.json() == {"aborted": ["op-3"], "not_found": ["op-3-1"]}
        rest = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert [c["finish_reason"] for r in rest for c in r["choices"] if c["finish_reason"]] \
        == ["abort"]
    wait_for(live.idle, what="a whole pool")


@pytest.mark.parametrize(("path", "body", "last"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 30, "ignore_eos": True,
                         "stream": True}, "[DONE]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 30, "stream": True},
     "response.failed"),
])
def test_a_fault_while_streaming_ends_the_stream_with_an_error(live, monkeypatch, path,
                                                               body, last):
    """QA: an exception in a stream's events cut the connection: no error, no end (a
    strict client saw a protocol error); now an error event ends it, the request is
    freed, and the traceback is in the log."""
    from kvserve.server.generation import Generation
    from kvserve.server.responses_api import ResponsesGeneration

    calls = []

    def faulty(self, *args):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("a bug")
        return original(self, *args)

    target = ResponsesGeneration if path == "/v1/responses" else Generation
    name = "_text_pieces" if path == "/v1/responses" else "_event"
    original = getattr(target, name)
    monkeypatch.setattr(target, name, faulty)
    with httpx.stream("POST", live.url + path, json=body, timeout=60) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert last in lines[-1] or last in lines[-2], lines[-2:]
    assert any("internal error: RuntimeError" in line for line in lines[-2:])
    wait_for(live.idle, what="the failed stream's request freed")
