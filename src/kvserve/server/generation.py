"""One HTTP generation request, from body to response: /v1/completions and
/v1/chat/completions share everything but the prompt and the output shapes.

    authenticate -> read and validate the body -> model, priority -> tokenise (off the loop)
    -> length checks -> queue every (prompt, sample) as one all-or-nothing group
    -> stream (SSE) or collect, aborting the group if the client goes away

A streamed response sends its headers with the first token, so a request that times out in
the queue still gets a real 503, not a 200 with an error inside.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.core import QueueFullError, RequestError, RequestRejected, SamplingParams
from kvserve.core.scheduler import QUEUE_TIMEOUT
from kvserve.engine.async_engine import EngineDeadError, RequestStream
from kvserve.engine.engine import CompletionChunk
from kvserve.server.auth import resolve_priority
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    model_error,
    parse_body,
)
from kvserve.server.responses import (
    SSE_DONE,
    Choice,
    chat_logprobs,
    completion_logprobs,
    kvserve_ext,
    kvserve_total,
    sse,
    usage,
)
from kvserve.server.state import ServerState

_T = TypeVar("_T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def handle(state: ServerState, request: Request, chat: bool) -> Response:
    arrival_time = time.monotonic()
    key = state.keys.authenticate(request.headers.get("authorization"))
    body = await state.read_json(request)
    req: Any = parse_body(ChatCompletionRequest if chat else CompletionRequest, body)
    if req.model is not None and req.model != state.model_name:
        raise model_error(req.model, state.model_name)
    priority = resolve_priority(req.priority, key, source=state.priority_source,
                                scheduling_policy=state.scheduling_policy)
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true",
                          param="stream_options")
    prompts = await asyncio.to_thread(_encode_chat if chat else _encode_prompts, state, req)
    max_tokens = _max_tokens(state, req, chat, prompts)
    base = _sampling_params(req, chat, max_tokens, priority)
    request_id = state.new_request_id(request.headers.get("x-request-id"))
    choices, items = [], []
    for prompt_index, prompt in enumerate(prompts):
        for sample in range(req.n):
            index = prompt_index * req.n + sample
            sub_id = request_id if len(prompts) * req.n == 1 else f"{request_id}-{index}"
            params = base if base.seed is None or sample == 0 else \
                _replace_seed(base, base.seed + sample)
            choices.append(Choice(index, sub_id, len(prompt)))
            items.append((sub_id, prompt, params))
    stream = await _queue(state, request_id, items, arrival_time)
    generation = _Generation(state, request_id, req, chat, choices, prompts, stream)
    if req.stream:
        return await generation.stream_response(request)
    return await generation.full_response(request)


def _encode_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("'prompt' is empty", param="prompt")
    vocab_size = state.tokenizer.vocab_size
    encoded = []
    for index, item in enumerate(prompts):
        ids = state.tokenizer.encode(item) if isinstance(item, str) else list(item)
        where = "'prompt'" if len(prompts) == 1 else f"prompt {index}"
        if not ids:
            raise bad_request(f"{where} is empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where} has token id {bad}, outside the vocabulary "
                              f"[0, {vocab_size})", param="prompt")
        encoded.append(ids)
    return encoded


def _encode_chat(state: ServerState, req: ChatCompletionRequest) -> list[list[int]]:
    messages = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    try:
        return [state.tokenizer.encode_chat(messages)]
    except ValueError as error:
        raise bad_request(f"cannot apply the chat template: {error}", "messages") from None


def _max_tokens(state: ServerState, req: Any, chat: bool, prompts: list[list[int]]) -> int:
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise bad_request(f"the prompt has {longest} tokens, but this model's maximum "
                          f"context length (max_model_len) is {limit} tokens, which leaves "
                          "no room to generate; shorten the prompt", param="prompt")
    asked = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    if asked is None:
        return limit - longest if chat else min(16, limit - longest)
    if longest + asked > limit:
        name = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
        raise bad_request(f"the prompt has {longest} tokens and {name} is {asked}: "
                          f"{longest + asked} tokens exceed this model's maximum context "
                          f"length (max_model_len) of {limit}; ask for at most "
                          f"{limit - longest} tokens", param=name)
    return asked


def _sampling_params(req: Any, chat: bool, max_tokens: int, priority: int) -> SamplingParams:
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "max_queue_delay", "cache_salt")
        if getattr(req, name) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens,
                              ignore_eos=req.ignore_eos, stop=stop,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              priority=priority, logprobs=logprobs, **given)
    except RequestError as error:
        raise bad_request(str(error)) from None


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


async def _queue(state: ServerState, request_id: str,
                 items: list[tuple[str, list[int], SamplingParams]],
                 arrival_time: float) -> RequestStream:
    for sub_id, prompt, _ in items:
        state.metrics.request_added(sub_id, arrival_time, len(prompt))
    try:
        stream = await state.engine.add_requests(items, arrival_time)
    except BaseException as error:
        for sub_id, _, _ in items:
            state.metrics.request_dropped(sub_id)
        raise _refusal(state, error) from error
    state.groups[request_id] = stream
    return stream


def _refusal(state: ServerState, error: BaseException) -> BaseException:
    if isinstance(error, QueueFullError):
        state.metrics.rejected.labels(state.model_name, "503").inc()
        return APIError(503, f"the server is overloaded: {_strip_id(error)}; retry later",
                        code="queue_full", headers={"Retry-After": state.retry_after()})
    if isinstance(error, (RequestRejected, RequestError, ValueError)):
        state.metrics.rejected.labels(state.model_name, "400").inc()
        return bad_request(_strip_id(error))
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is not running: {error}")
    return error


def _strip_id(error: BaseException) -> str:
    """Core messages start 'request <id>: '; the client knows which request it sent."""
    text = str(error)
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("request ") else text


async def race_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """``await work``, unless the client disconnects first: then cancel it, raise ClientGone.
    The body must already have been read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task},
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    raise ClientGone


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Generation:
    def __init__(self, state: ServerState, request_id: str, req: Any, chat: bool,
                 choices: list[Choice], prompts: list[list[int]],
                 stream: RequestStream) -> None:
        self.state = state
        self.request_id = request_id
        self.req = req
        self.chat = chat
        self.choices = {c.request_id: c for c in choices}
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.stream = stream
        self.created = int(time.time())
        self.response_id = ("chatcmpl-" if chat else "cmpl-") + request_id

    def close(self) -> None:
        self.stream.cancel()
        self.state.groups.pop(self.request_id, None)

    def _apply(self, chunk: CompletionChunk) -> Choice:
        choice = self.choices[chunk.request_id]
        choice.text += chunk.new_text
        choice.num_output_tokens += len(chunk.new_token_ids)
        if chunk.logprobs:
            choice.logprobs += list(zip(chunk.new_token_ids, chunk.logprobs, strict=False))
        if chunk.finished:
            choice.finish_reason = chunk.finish_reason
            choice.stop_reason = chunk.stop_reason
            choice.metrics = chunk.metrics
        return choice

    # -- not streamed ----------------------------------------------------------------------

    async def full_response(self, request: Request) -> Response:
        try:
            await race_disconnect(request, self._collect())
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.close()
        choices = sorted(self.choices.values(), key=lambda c: c.index)
        if any(c.stop_reason == QUEUE_TIMEOUT for c in choices):
            raise _queue_timeout()
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.state.model_name,
            "choices": [self._full_choice(c) for c in choices],
            "usage": usage(choices, self.num_prompt_tokens),
            "kvserve": kvserve_total(self.request_id, choices)}
        return JSONResponse(body)

    async def _collect(self) -> None:
        async for chunk in self.stream:
            self._apply(chunk)

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index}
        if self.chat:
            out["message"] = {"role": "assistant", "content": choice.text}
        else:
            out["text"] = choice.text
        out["logprobs"] = self._logprobs(choice.logprobs) if choice.logprobs else None
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = choice.stop_reason
        out["kvserve"] = kvserve_ext(choice.request_id, choice.metrics)
        return out

    def _logprobs(self, entries: list[tuple[int, dict[int, float]]],
                  offset: int = 0) -> dict[str, Any]:
        tokenizer = self.state.tokenizer
        if self.chat:
            return chat_logprobs(tokenizer, entries, self.req.top_logprobs or 0)
        return completion_logprobs(tokenizer, entries, offset)

    # -- streamed --------------------------------------------------------------------------

    async def stream_response(self, request: Request) -> Response:
        try:
            first = await race_disconnect(request, anext(self.stream))
        except ClientGone:
            self.close()
            return Response(status_code=499)
        except BaseException:
            self.close()
            raise
        if first.stop_reason == QUEUE_TIMEOUT:
            self.close()
            raise _queue_timeout()
        return _ClosingStreamingResponse(self._events(first), self.close,
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Request-Id": self.request_id})

    async def _events(self, first: CompletionChunk) -> AsyncIterator[str]:
        if self.chat:
            for choice in sorted(self.choices.values(), key=lambda c: c.index):
                yield sse(self._chunk(choice, {"role": "assistant", "content": ""}, None))
        yield self._event(first)
        try:
            async for chunk in self.stream:
                if chunk.stop_reason == QUEUE_TIMEOUT:
                    yield sse(_queue_timeout().body())
                    self.close()
                    break
                yield self._event(chunk)
        except EngineDeadError as error:
            yield sse(APIError(503, str(error)).body())
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            choices = list(self.choices.values())
            yield sse({"id": self.response_id, "object": self._chunk_object(),
                       "created": self.created, "model": self.state.model_name,
                       "choices": [], "usage": usage(choices, self.num_prompt_tokens),
                       "kvserve": kvserve_total(self.request_id, choices)})
        yield SSE_DONE

    def _event(self, chunk: CompletionChunk) -> str:
        offset = len(self.choices[chunk.request_id].text)
        choice = self._apply(chunk)
        entries = list(zip(chunk.new_token_ids, chunk.logprobs or [], strict=False))
        logprobs = self._logprobs(entries, offset) if entries else None
        payload = {"content": chunk.new_text} if self.chat else chunk.new_text
        data = self._chunk(choice, payload, logprobs)
        if chunk.finished:
            data["choices"][0]["finish_reason"] = chunk.finish_reason
            data["choices"][0]["stop_reason"] = chunk.stop_reason
            data["kvserve"] = kvserve_ext(choice.request_id, chunk.metrics)
        return sse(data)

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choice: Choice, payload: Any, logprobs: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": choice.index}
        entry["delta" if self.chat else "text"] = payload
        entry["logprobs"] = logprobs
        entry["finish_reason"] = None
        return {"id": self.response_id, "object": self._chunk_object(),
                "created": self.created, "model": self.state.model_name, "choices": [entry]}


def _queue_timeout() -> APIError:
    return APIError(503, "queue timeout: the request waited longer than its queue deadline "
                         "(--max-queue-delay or 'max_queue_delay') without being scheduled; "
                         "retry later", code="queue_timeout", headers={"Retry-After": "1"})


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends (done, disconnect,
    cancellation), so the engine never keeps generating for nobody."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]
