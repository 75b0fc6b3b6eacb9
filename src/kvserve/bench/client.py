"""Send one benchmark request to an OpenAI-compatible server and time it.

Times are taken when each streamed event arrives: TTFT is send -> first event with text,
each inter-token latency is the gap between consecutive events with text (an event may
carry several tokens on a server that batches them: the gap is then per event, as vLLM's
tool takes it), E2E is send -> end of stream. Without streaming the first token arrives
with the whole answer: TTFT is E2E, and no TPOT is measured.

A request completes when its answer is whole: a stream ended by ``[DONE]``, or a JSON body.
An answer that breaks the protocol (a stream that ends without ``[DONE]``, a 200 that is no
event stream, an event that is no JSON object, an error event) fails the request with the
reason. Output tokens are the answer's ``usage``; a server that sends none has its streamed
events counted instead (``usage_missing`` says so; the summary warns).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.bench.workload import BenchRequest


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    disconnected: bool = False
    num_preemptions: int | None = None
    generated_text: str = ""  # what the server sent back (--save-detailed)
    streamed: bool = True  # False: the whole answer at once (no TPOT to measure)
    usage_missing: bool = False  # no usage came: output tokens are the text events counted


class BadAnswer(Exception):
    """An answer that breaks the OpenAI protocol: its request failed, for this reason."""


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    sessions: bool = False  # send a trace turn's session id (kvserve's "session" field)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.max_tokens,
                                "temperature": self.temperature, "stream": self.stream}
        if self.endpoint.endswith("/chat/completions"):
            text = request.prompt if isinstance(request.prompt, str) else \
                " ".join(map(str, request.prompt))
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = request.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if request.priority is not None:
            body["priority"] = request.priority
        if self.sessions and request.session is not None:
            tenant, session_id = request.session
            body["session"] = {"id": session_id}
            if tenant:  # a session is its tenant's: without keys the server reads "user"
                body["user"] = tenant  # (the review: two tenants' "conv0" were one, a 409)
        return body


async def send(client: httpx.AsyncClient, target: Target, request: BenchRequest,
               disconnect_after: int | None = None,
               timeout: float | None = None) -> RequestResult:
    """``disconnect_after``: close the stream after that many text events (a client that
    goes away mid-stream); the request's ``cancel_after`` closes it after that many seconds
    (a trace's client timeout). Either counts the request disconnected. ``timeout``: the
    seconds the whole answer may take, or the request fails."""
    result = RequestResult(request.index, num_prompt_tokens=request.num_prompt_tokens,
                           streamed=target.stream)
    cancel = request.cancel_after
    if cancel is not None and cancel <= 0:
        result.disconnected = True  # the client left before it was sent
        return result
    cancels = cancel is not None and (timeout is None or cancel <= timeout)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(cancel if cancels else timeout):
            await _exchange(client, target, request, result, start, disconnect_after)
    except TimeoutError:
        if cancels:
            result.disconnected = True
        else:  # QA: a server sending a token now and then held the run for ever
            result.error = f"no whole answer within the timeout ({timeout:g} s)"
    except httpx.HTTPError as error:
        detail = str(error) or ("timed out" if isinstance(error, httpx.TimeoutException)
                                else "no detail")  # QA: "ReadTimeout: " and nothing
        result.error = f"{type(error).__name__}: {detail}"
    except BadAnswer as error:
        result.error = str(error)
    if result.error is not None:
        return result
    result.e2e = time.perf_counter() - start
    if not target.stream:
        result.ttft = result.e2e
    result.ok = result.error is None and not result.disconnected
    return result


async def _exchange(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                    result: RequestResult, start: float,
                    disconnect_after: int | None) -> None:
    async with client.stream("POST", target.base_url + target.endpoint,
                             json=target.body(request), headers=target.headers) as response:
        result.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {_message(text)}"
            return
        if target.stream:
            kind = response.headers.get("content-type")  # none: the lines tell
            if kind is not None and not kind.startswith("text/event-stream"):
                raise BadAnswer(f"HTTP 200 but {kind}, not an event stream")  # QA: a
                # proxy's login page, a whole JSON answer, counted completed
            await _read_events(response, result, start, disconnect_after)
        else:
            _read_body(await response.aread(), result)


async def _read_events(response: httpx.Response, result: RequestResult, start: float,
                       disconnect_after: int | None) -> None:
    last = None
    num_events = 0
    usage_seen = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            if not usage_seen:  # QA: 0 output tok/s from a server that sends no usage
                result.num_output_tokens, result.usage_missing = num_events, True
            return
        data = _event(payload)
        usage_seen = _note_usage(data, result) or usage_seen
        text = "".join(_text(choice) for choice in data.get("choices") or [])
        if not text:
            continue
        result.generated_text += text
        now = time.perf_counter()
        num_events += 1
        if last is None:
            result.ttft = now - start
        else:
            result.itls.append(now - last)
        last = now
        if disconnect_after is not None and num_events >= disconnect_after:
            result.disconnected = True
            return
    raise BadAnswer(f"the stream ended before [DONE] ({num_events} text events)")


def _json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """``text``'s JSON object; BadAnswer saying ``what`` it is not, otherwise."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise BadAnswer(f"{what}: {text[:80]!r}")
    return data


def _event(payload: str) -> dict[str, Any]:
    """One event's JSON object; BadAnswer for anything else, and for an error event."""
    data = _json_object(payload, "a stream event is not a JSON object")
    if "error" in data:
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise BadAnswer(f"stream error: {message}")
    return data


def _text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _note_usage(data: dict[str, Any], result: RequestResult) -> bool:
    """Take the event's usage and kvserve figures; whether it carried usage."""
    ext = data.get("kvserve")
    if isinstance(ext, dict) and "num_preemptions" in ext:
        result.num_preemptions = ext["num_preemptions"]
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return False
    tokens = usage.get("completion_tokens")
    if isinstance(tokens, int):
        result.num_output_tokens = tokens
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        result.num_prompt_tokens = prompt
    return isinstance(tokens, int)


def _read_body(body: bytes, result: RequestResult) -> None:
    data = _json_object(body, "HTTP 200 but not a JSON answer")
    if not _note_usage(data, result):
        result.usage_missing = True  # nothing to count the tokens by: 0
    result.generated_text = "".join(
        choice.get("text") or (choice.get("message") or {}).get("content") or ""
        for choice in data.get("choices") or [])


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
