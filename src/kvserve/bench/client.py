"""Send one benchmark request to an OpenAI-compatible server and time it.

Times are taken when each streamed event arrives: TTFT is send -> first event with text,
each inter-token latency is the gap between consecutive events with text (an event may
carry several tokens on a server that batches them: the gap is then per event, as vLLM's
tool takes it), E2E is send -> end of stream. Without streaming the first token arrives
with the whole answer: TTFT is E2E.
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
        return body


async def send(client: httpx.AsyncClient, target: Target, request: BenchRequest,
               disconnect_after: int | None = None) -> RequestResult:
    """``disconnect_after``: close the stream after that many text events (a client that
    goes away mid-stream); the request's ``cancel_after`` closes it after that many seconds
    (a trace's client timeout). Either counts the request disconnected."""
    result = RequestResult(request.index, num_prompt_tokens=request.num_prompt_tokens)
    if request.cancel_after is not None and request.cancel_after <= 0:
        result.disconnected = True  # the client left before it was sent
        return result
    start = time.perf_counter()
    try:
        async with asyncio.timeout(request.cancel_after):
            await _exchange(client, target, request, result, start, disconnect_after)
    except TimeoutError:
        result.disconnected = True
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
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
            await _read_events(response, result, start, disconnect_after)
        else:
            _read_body(json.loads(await response.aread()), result)


async def _read_events(response: httpx.Response, result: RequestResult, start: float,
                       disconnect_after: int | None) -> None:
    last = None
    num_events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if "error" in data:
            result.error = f"stream error: {data['error'].get('message')}"
            return
        _note_usage(data, result)
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
    if result.num_output_tokens == 0:
        result.num_output_tokens = num_events


def _text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _note_usage(data: dict[str, Any], result: RequestResult) -> None:
    usage = data.get("usage")
    if usage:
        result.num_output_tokens = usage.get("completion_tokens", 0)
        result.num_prompt_tokens = usage.get("prompt_tokens", result.num_prompt_tokens)
    ext = data.get("kvserve")
    if isinstance(ext, dict) and "num_preemptions" in ext:
        result.num_preemptions = ext["num_preemptions"]


def _read_body(data: dict[str, Any], result: RequestResult) -> None:
    _note_usage(data, result)
    result.generated_text = "".join(
        choice.get("text") or (choice.get("message") or {}).get("content") or ""
        for choice in data.get("choices") or [])


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
