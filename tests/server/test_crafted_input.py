"""Crafted bodies a hostile client sends (issue 19, item 4): each gets an OpenAI-shaped 4xx
naming the problem, nothing is queued, and the server's log stays clean (no traceback)."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import httpx
import pytest

from kvserve.server.body import MAX_JSON_DEPTH, MAX_NUMBER_CHARS

from .helpers import wait_for

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SURROGATE = "\\ud800"  # a JSON escape for a lone UTF-16 surrogate, written raw


def lone(body: str) -> str:
    """``body`` with a lone surrogate escape where ``@`` stands."""
    return body.replace("@", SURROGATE)


def chat_body(content: str) -> str:
    return '{"messages": [{"role": "user", "content": ' + content + '}], "max_tokens": 2}'


REF_CHAIN = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": {
    f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} if i < 799 else {"type": "integer"}
    for i in range(800)}}
DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 450 + '{"type":"integer"}' + \
    '},"required":["a"]}' * 450

CRAFTED = [
    # (path, raw body, status, words the message must hold, param)
    (COMPLETIONS, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400,
     f"more than {MAX_JSON_DEPTH} levels deep", None),
    (COMPLETIONS, '{"prompt": "x", "max_tokens": ' + "7" * 5000 + "}", 400,
     f"number literal longer than {MAX_NUMBER_CHARS} characters", None),
    (COMPLETIONS, '{"prompt": "x", "temperature": -' + "9" * 5000 + ".5}", 400,
     "number literal longer", None),
    (COMPLETIONS, '{"prompt": "x", "temperature": NaN}', 400, "NaN is not a JSON number",
     None),
    (COMPLETIONS, '{"prompt": "x", "top_p": Infinity}', 400, "Infinity is not a JSON number",
     None),
    (COMPLETIONS, lone('{"prompt": "a@b"}'), 400,
     "field 'prompt' is not valid Unicode", "prompt"),
    (COMPLETIONS, lone('{"prompt": ["ok", "@"]}'), 400,
     "field 'prompt.1' is not valid Unicode", "prompt.1"),
    (COMPLETIONS, lone('{"prompt": "x", "model": "m@"}'), 400,
     "field 'model' is not valid Unicode", "model"),
    (COMPLETIONS, '{"prompt": "x", "stop": ["\\udfff"]}', 400,
     "field 'stop.0' is not valid Unicode", "stop.0"),
    (COMPLETIONS, lone('{"prompt": "x", "user": "@"}'), 400,
     "field 'user' is not valid Unicode", "user"),
    (COMPLETIONS, lone('{"prompt": "x", "@": 1}'), 400,
     "a key in '(body)' is not valid Unicode", None),
    (CHAT, chat_body(lone('"hi @"')), 400,
     "field 'messages.0.content' is not valid Unicode", "messages.0.content"),
    (CHAT, chat_body(lone('[{"type": "text", "text": "@"}]')), 400,
     "field 'messages.0.content.0.text' is not valid Unicode", "messages.0.content.0.text"),
    (CHAT, lone('{"messages": [{"role": "user", "content": "x", "name": "@"}]}'),
     400, "field 'messages.0.name' is not valid Unicode", "messages.0.name"),
    ("/v1/abort", lone('{"request_id": "@"}'), 400,
     "field 'request_id' is not valid Unicode", "request_id"),
    ("/v1/abort", lone('{"request_id": ["a", "b@"]}'), 400,
     "field 'request_id.1' is not valid Unicode", "request_id.1"),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "not UTF-8", None),
    (COMPLETIONS, b'{"prompt": "a\xed\xa0\x80"}', 400,  # a surrogate as raw bytes
     "not UTF-8", None),
    # UTF-16 and -32, which json.loads decodes and the checks, made for UTF-8, misread
    # (QA: 500s, the depth check's escape read out of step)
    (COMPLETIONS, ('{"prompt": "x", "max_tokens": ' + "1" * 5000 + "}").encode("utf-16-le"),
     400, "not valid JSON", None),
    (COMPLETIONS, ('{"a": "\\"", "b": ' + "[" * 100_000 + "]" * 100_000 + "}").encode(
        "utf-16"), 400, "the request body", None),  # too deep or not UTF-8: a 400
    (COMPLETIONS, '{"prompt": "\\ud800x"}'.encode("utf-32"), 400, "not UTF-8", None),
    (COMPLETIONS, '{"prompt": "x"', 400, "not valid JSON", None),
    (COMPLETIONS, '{"prompt": "x", "max_tokens": 1e999}', 400, "field 'max_tokens'",
     "max_tokens"),
    # a schema sent as a string skips the body's depth check (QA: a RecursionError, a 500)
    (COMPLETIONS, json.dumps({"prompt": "x", "structured_outputs": {
        "json": "[" * 5000 + "]" * 5000}}), 400, "more than 64 levels deep",
     "structured_outputs.json"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}],
                       "guided_json": '{"a":' * 5000 + "1" + "}" * 5000}), 400,
     "more than 64 levels deep", "guided_json"),
    (COMPLETIONS, json.dumps({"prompt": "x", "guided_json": DEEP_SCHEMA}), 400,
     "more than 64 levels deep", "guided_json"),  # parses, then compiled as deep
    # a chain of $refs, each shallow: its depth is in the $ref graph, not the body (the
    # structured-output pass: a RecursionError, a 500)
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": REF_CHAIN}}}), 400,
     "nests more than 128 schemas one inside another, counting those its $refs lead to",
     "response_format"),
]


@pytest.fixture
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record the server writes, uvicorn's own error log included (it does not
    propagate to the root logger that caplog watches)."""
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="kvserve.server")
    try:
        yield caplog
    finally:
        uvicorn_error.removeHandler(caplog.handler)


def assert_clean(log: pytest.LogCaptureFixture) -> None:
    noisy = [r for r in log.records if r.exc_info or r.levelno >= logging.WARNING
             or "Traceback" in r.getMessage()]
    assert noisy == [], [r.getMessage() for r in noisy]


@pytest.mark.parametrize(("path", "raw", "status", "needle", "param"), CRAFTED)
def test_crafted_body_is_refused_with_json_and_a_clean_log(server, server_log, path, raw,
                                                           status, needle, param):
    content = raw if isinstance(raw, bytes) else raw.encode()
    response = httpx.post(server.url + path, content=content, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
    assert error["param"] == param
    assert server.idle()
    assert_clean(server_log)


def test_a_body_after_a_utf8_bom_is_read(server):
    """RFC 8259 lets a parser skip a BOM, and some Windows tools send one (QA: refused once
    bodies were read as UTF-8 only)."""
    response = httpx.post(server.url + COMPLETIONS, timeout=30,
                          content=b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_a_valid_surrogate_pair_is_text(server):
    """An escaped pair (U+1F600) is ordinary Unicode and is served."""
    response = httpx.post(server.url + COMPLETIONS, timeout=30,
                          content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}',
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("extreme", [{"temperature": 1e-38}, {"temperature": 1e-300},
                                     {"temperature": 1, "repetition_penalty": 1e-300}])
def test_extreme_sampling_values_are_served_and_the_server_lives_on(server, server_log,
                                                                    extreme):
    """Valid values at float32's edge: a temperature below 1e-5 is greedy (as vLLM's), a
    penalty that overflows leaves a distribution. One such request took the engine down
    (the sampler drew the vocabulary's size), and every later request was a 503."""
    for body in ({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **extreme},
                 {"prompt": "Hello", "max_tokens": 2}):
        response = httpx.post(server.url + COMPLETIONS, json=body, timeout=60)
        assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    wait_for(server.idle, what="a whole pool")
    assert_clean(server_log)


def test_clients_leaving_mid_body_log_one_debug_line_each(server, server_log):
    num_clients = 20
    for _ in range(num_clients):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                         b'{"prompt": "half a bo')

    def left() -> list[logging.LogRecord]:
        return [r for r in server_log.records if "left while sending the body" in
                r.getMessage()]

    wait_for(lambda: len(left()) == num_clients, what="a log line per departed client")
    assert {r.levelno for r in left()} == {logging.DEBUG}
    assert {r.getMessage() for r in left()} == {
        "POST /v1/completions: the client left while sending the body"}
    assert_clean(server_log)
    assert server.idle()


@pytest.mark.parametrize("encoding", ["gzip", "br, gzip", "identity, gzip"])
def test_a_compressed_body_is_refused_by_name(server, server_log, encoding):
    """The server does not decompress request bodies (nor does vLLM's): a compressed body
    is a 415 naming the encoding, not a 400 about its bytes; `identity` is no encoding."""
    import gzip

    body = b'{"prompt": "x", "max_tokens": 2}'
    headers = [("Content-Type", "application/json")] + [  # one header per coding
        ("Content-Encoding", coding.strip()) for coding in encoding.split(",")]
    refused = httpx.post(server.url + COMPLETIONS, content=gzip.compress(body), timeout=30,
                         headers=headers)
    assert refused.status_code == 415
    assert refused.json()["error"]["message"] == (
        f"the request body has Content-Encoding '{encoding}'; this server reads only "
        "uncompressed bodies: send it without Content-Encoding")
    served = httpx.post(server.url + COMPLETIONS, content=body, timeout=30,
                        headers={"Content-Type": "application/json",
                                 "Content-Encoding": "identity"})
    assert served.status_code == 200
    assert server.idle()
    assert_clean(server_log)
