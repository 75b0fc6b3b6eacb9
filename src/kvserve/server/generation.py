"""One HTTP generation request, from body to response: /v1/completions and
/v1/chat/completions share everything but the prompt and the output shapes.

    authenticate -> read and validate the body -> model, priority -> tokenise (off the loop)
    -> length checks -> queue every (prompt, sample) as one all-or-nothing group
    -> stream (SSE) or collect, aborting the group if the client goes away

A streamed response sends its headers with the first token, so a request that times out in
the queue still gets a real 503, not a 200 with an error inside.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.core import QueueFullError, RequestError, RequestRejected, SamplingParams
from kvserve.core.errors import without_request_id
from kvserve.core.limits import check_queueable
from kvserve.core.request import Request as CoreRequest
from kvserve.core.sessions import SessionBusy
from kvserve.core.stop import DISPLACED, ended_in_queue
from kvserve.engine.async_engine import EngineDeadError, RequestStream, StreamRestarted
from kvserve.engine.engine import CompletionChunk
from kvserve.server.auth import OPERATOR_TENANT, ApiKey, resolve_priority, tenant_of
from kvserve.server.chat_answer import ChatAnswer
from kvserve.server.disconnect import (
    ClientGone,
    ClosingStreamingResponse,
    race_disconnect,
    tell_if_gone,
)
from kvserve.server.errors import APIError, bad_request
from kvserve.server.prompts import (
    check_logprobs,
    check_stop_token_ids,
    encode_chat,
    encode_prompts,
    max_tokens_for,
    room_for,
    sampling_params,
    truncated,
)
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    auto_tools,
    parse_body,
)
from kvserve.server.reasoning_parsers import ThinkParser
from kvserve.server.responses import (
    SSE_DONE,
    Choice,
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    echoed_entries,
    kvserve_ext,
    kvserve_total,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from kvserve.server.state import Queuing, ServerState, is_request_id

logger = logging.getLogger(__name__)


def log_request(request_id: str, tenant: str, prompts: list[list[int]],
                params: SamplingParams, sequences: int) -> None:
    """--enable-log-requests: one line as a request is queued (no prompt text: a log is
    read by more people than the prompts' authors)."""
    lengths = ", ".join(str(len(p)) for p in prompts[:8]) + (", ..." if len(prompts) > 8 else "")
    logger.info("request %s queued: tenant %r, prompt tokens %s, sequences %d, "
                "max_tokens %s, temperature %g, top_p %g, top_k %d, seed %s, priority %d",
                request_id, tenant, lengths, sequences, params.max_tokens,
                params.temperature, params.top_p, params.top_k, params.seed, params.priority)


async def handle(state: ServerState, request: Request, chat: bool,
                 body: Any = None) -> Response:
    """``body``: the body already read (/invocations reads it to choose the endpoint)."""
    arrival_time = time.monotonic()
    key = state.keys.authenticate(request.headers.getlist("authorization"))
    if body is None:
        body = await state.read_json(request)
    try:
        req: Any = parse_body(ChatCompletionRequest if chat else CompletionRequest, body,
                              auto_tools=state.tool_parser is not None)
        generation = await start(state, request, key, req, chat, arrival_time)
    except APIError as error:  # a refusal carries the body's id back, as an answer does
        _echo_body_id(error, request, body)  # (the tenants pass: only a header's came back)
        raise
    if req.stream:
        return await generation.stream_response(request)
    return await generation.full_response(request)


def _echo_body_id(error: APIError, request: Request, body: Any) -> None:
    """``error``'s X-Request-Id: the body's ``request_id`` where no header gave one (the
    app's handler echoes a header's) and it is a valid id."""
    given = body.get("request_id") if isinstance(body, dict) else None
    if is_request_id(given) and "x-request-id" not in request.headers:
        error.headers.setdefault("X-Request-Id", given)


async def start(state: ServerState, request: Request, key: ApiKey, req: Any, chat: bool,
                arrival_time: float, kind: Callable[..., ChatGeneration] | None = None,
                strict_context: bool = False, outlives_client: bool = False) -> Generation:
    """A checked request queued: everything between its parsed body and its answer (the
    Responses API's translated chat request comes in here too, ``kind`` its answer's
    shape; ``outlives_client`` for its background responses, which run on when their
    client leaves)."""
    state.check_model(req.model)
    parser = state.tool_parser
    if chat and parser is not None and parser.keeps_special_tokens and auto_tools(req):
        req = req.model_copy(update={"skip_special_tokens": False})  # a call's markers
    priority = resolve_priority(req.priority, key, source=state.priority_source,
                                scheduling_policy=state.scheduling_policy)
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true",
                          param="stream_options")
    state.fan_out.check(req, chat)
    tenant = tenant_of(key, state.keys.enabled, req.user,
                       request.client.host if request.client else None)
    prompts = await asyncio.to_thread(encode_chat if chat else encode_prompts, state, req)
    encoded, prompts = prompts, truncated(state, req, prompts)
    # strict_context: the Responses API keeps OpenAI's 400 for an answer that would
    # overrun the context (its truncation decides); the chat endpoints cut it short, as vLLM
    max_tokens = max_tokens_for(state, req, chat, prompts, strict=strict_context)
    check_stop_token_ids(state, req)
    check_logprobs(state, req, chat)
    num_sequences = len(prompts) * req.n
    if req.session is not None and num_sequences != 1:
        raise bad_request(f"a session turn is one sequence: got {len(prompts)} prompt(s) x "
                          f"n={req.n}; send one prompt with n=1", param="session")
    reasoning = _reasoning(state, prompts) if chat else None
    base = sampling_params(req, chat, max_tokens, priority, tenant, state.tokenizer,
                           state.sampling_defaults, reasoning)
    given_id, request_id = _request_ids(state, request, key, req, num_sequences)
    echoes = _echo_texts(state, req, prompts, encoded) if not chat and req.echo else \
        [""] * len(prompts)
    choices, items = _sequences(state, request_id, prompts, base.samples(), echoes)
    _check_queueable(state, request_id, items)
    if state.shutting_down:  # as vLLM's: once a shutdown began, nothing new is queued
        raise APIError(503, "the server is shutting down; send the request to another "
                            "replica", code="shutting_down")
    if state.log_requests:
        log_request(request_id, tenant, prompts, base, len(items))
    state.hold_ids(request_id, [choice.request_id for choice in choices])
    stream = await _queue(state, request_id, given_id, items, arrival_time, req.n,
                          None if outlives_client else request)
    stream.replayable = not req.stream  # nothing reaches the client before the end
    generation = (kind or ChatGeneration)(state, request_id, given_id, req, choices, prompts,
                                          stream, reasoning) if chat else \
        CompletionGeneration(state, request_id, given_id, req, choices, prompts, stream)
    generation.params = base
    return generation


def _request_ids(state: ServerState, request: Request, key: ApiKey, req: Any,
                 num_sequences: int) -> tuple[str, str]:
    """The request's id as its client gave it (X-Request-Id, else the body's
    ``request_id``, else a new one) and the engine's id for it, held from here: no await
    may come between this and :meth:`ServerState.hold_ids`."""
    given = request.headers.getlist("x-request-id")
    if len(given) > 1:  # as two Authorization headers are refused: which one was meant?
        raise bad_request(f"{len(given)} X-Request-Id headers; send one")
    header = given[0] if given else None
    given_id = state.new_request_id(header) if header is not None or req.request_id is None \
        else state.new_request_id(req.request_id, "'request_id'")
    # (a keys-file tenant's own id always gets a suffix: whether it got one told whether
    # another tenant held that id live, QA)
    private = (header is not None or req.request_id is not None) and state.keys.enabled \
        and key.tenant != OPERATOR_TENANT
    return given_id, state.engine_id(given_id, num_sequences, private)


def _sequences(state: ServerState, request_id: str, prompts: list[list[int]],
               samples: list[SamplingParams], echoes: list[str]
               ) -> tuple[list[Choice], list[tuple[str, list[int], SamplingParams]]]:
    """Each prompt's ``samples`` (sample k seeded seed + k) as the answer's choices and the
    engine's requests, in the choices' order: ``<id>-<index>``, or the id alone for one."""
    choices, items = [], []
    num_sequences = len(prompts) * len(samples)
    for prompt_index, prompt in enumerate(prompts):
        for sample, params in enumerate(samples):
            index = prompt_index * len(samples) + sample
            sub_id = request_id if num_sequences == 1 else f"{request_id}-{index}"
            choices.append(Choice(index, sub_id, prompt, echo=echoes[prompt_index]))
            items.append((sub_id, prompt, room_for(state, params, prompt)))
    return choices, items


def _reasoning(state: ServerState, prompts: list[list[int]]) -> ThinkParser | None:
    """The reasoning parser of a chat answer (--reasoning-parser), as its prompt leaves
    it: None without one, or where the prompt closed the thinking (a template's
    ``enable_thinking`` false)."""
    parser = state.reasoning_parser
    if parser is None:
        return None
    return parser.for_prompt(state.tokenizer.decode(prompts[0][-16:]))


def _chat_echo(req: Any, role: str) -> str:
    """vLLM's chat echo: the last message's text where ``echo`` is asked and that message
    is the answer's role (an assistant's), else nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != role:
        return ""
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


def _echo_texts(state: ServerState, req: Any, prompts: list[list[int]],
                encoded: list[list[int]]) -> list[str]:
    """Each prompt's text for echo: as sent, or its token ids decoded, special tokens as
    written (vLLM's; QA: <|im_start|> was dropped, where /detokenize keeps it); a prompt
    truncate_prompt_tokens cut (``prompts[i]`` is not ``encoded[i]``): what the model got."""
    sent = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
    return [text if isinstance(text, str) and ids is whole
            else state.tokenizer.decode(ids, skip_special_tokens=False)
            for text, ids, whole in zip(sent, prompts, encoded, strict=False)]


def _check_queueable(state: ServerState, request_id: str,
                     items: list[tuple[str, list[int], SamplingParams]]) -> None:
    """A group that could never be queued, even alone, is a 400 (not 503 + Retry-After)."""
    if not state.scheduler_config.bounds_queue:
        return  # nothing to refuse: skip building the group's core requests
    try:
        info = state.engine.info  # each replica's pool (data parallel: the same size)
        check_queueable([CoreRequest(sub_id, prompt, params) for sub_id, prompt, params in items],
                        state.scheduler_config, request_id,
                        (info.num_kv_blocks, info.block_size))
    except RequestRejected as error:
        state.metrics.tenants.refused(items[0][2].tenant, len(items))
        raise _refusal(state, error) from None


async def _queue(state: ServerState, request_id: str, given_id: str,
                 items: list[tuple[str, list[int], SamplingParams]],
                 arrival_time: float, n: int = 1,
                 request: Request | None = None) -> RequestStream:
    tenant = items[0][2].tenant  # one request, one tenant
    counters = state.metrics.tenants.counters(tenant)
    for sub_id, prompt, _ in items:
        state.metrics.request_added(sub_id, arrival_time, len(prompt), counters)
    # before the engine has them: a sequence may finish before add_requests returns (QA:
    # registered after, its group never completed and its n went unobserved)
    state.metrics.request_params([(sub_id, params.max_tokens) for sub_id, _, params in items],
                                 n)
    recorder = state.recorder
    if recorder is not None:
        recorder.submitted(items, arrival_time)
    queuing = state.queuing[request_id] = Queuing(frozenset(sub_id for sub_id, _, _ in items))
    if given_id != request_id:
        state.given.setdefault(given_id, []).append(request_id)
    adding = state.engine.add_requests(items, arrival_time)
    try:
        # a client gone while the engine takes its request has it aborted at once, behind
        # the add in the engine's ordered channel, so both land before its next step (QA:
        # the abort waited for the add's answer, a step later: the request was scheduled
        # for nobody, and under priority preemption evicted a running one)
        stream = await adding if request is None else await tell_if_gone(
            request, adding, lambda: state.engine.abort(*(sub for sub, _, _ in items)))
    except BaseException as error:
        del state.queuing[request_id]
        _forget_given(state, given_id, request_id)
        state.release_ids(request_id, [sub_id for sub_id, _, _ in items])
        for sub_id, _, _ in items:
            state.metrics.request_dropped(sub_id)
        if isinstance(error, QueueFullError | RequestRejected):
            state.metrics.tenants.refused(tenant, len(items))
        if recorder is not None:
            recorder.dropped([sub_id for sub_id, _, _ in items])
        refusal = _refusal(state, error)
        if isinstance(refusal, APIError):  # the id it was given, as an answer's (QA)
            refusal.headers.setdefault("X-Request-Id", given_id)
        raise refusal from error
    state.metrics.tenants.queued(tenant, len(items))
    del state.queuing[request_id]
    state.groups[request_id] = stream
    for choice in queuing.aborts:  # asked while the engine took it
        stream.abort(choice)
    return stream


def _forget_given(state: ServerState, given_id: str, request_id: str) -> None:
    given = state.given.get(given_id)
    if given is not None and request_id in given:
        given.remove(request_id)
        if not given:
            del state.given[given_id]


def _refusal(state: ServerState, error: BaseException) -> BaseException:
    if isinstance(error, QueueFullError):
        state.metrics.rejected.labels(state.model_name, "503").inc()
        if error.limit in state.metrics.admission_rejections:
            state.metrics.admission_rejections[error.limit].inc()
        return APIError(503, f"the server is overloaded: {without_request_id(error)}; retry later",
                        code="queue_full", headers={"Retry-After": state.retry_after()})
    if isinstance(error, SessionBusy):  # the same turn succeeds once the other ends
        state.metrics.rejected.labels(state.model_name, "409").inc()
        return APIError(409, without_request_id(error), param="session", code="session_busy",
                        headers={"Retry-After": "1"})
    if isinstance(error, (RequestRejected, RequestError, ValueError)):
        state.metrics.rejected.labels(state.model_name, "400").inc()
        message = without_request_id(error)
        about_sessions = message.startswith(("session ", "sessions "))  # QA: "sessions are off"
        return bad_request(message, param="session" if about_sessions else None)
    if isinstance(error, EngineDeadError):
        return engine_dead_error(state, error)
    return error


class Generation(abc.ABC):
    """One queued request's answer, whole (:meth:`full_response`) or streamed
    (:meth:`stream_response`): what the completions and chat shapes share. Each shape is a
    subclass (:class:`CompletionGeneration`, :class:`ChatGeneration`; the Responses API's,
    a chat's, in server/responses_api.py) saying what its answer and chunks hold."""

    id_prefix = ""  # the answer's id: this, then the request's given id
    object_name = ""  # the whole answer's "object"
    chunk_object = ""  # a streamed chunk's "object"
    payload_key = ""  # where a choice's text goes in a chunk
    # a completion's choices each carry their prompt's logprobs and token ids (one prompt
    # each); a chat's one prompt carries them on the answer (its role chunk's, streamed)
    per_choice_prompt = True

    def __init__(self, state: ServerState, request_id: str, given_id: str, req: Any,
                 choices: list[Choice], prompts: list[list[int]],
                 stream: RequestStream) -> None:
        self.state = state
        self.request_id = request_id  # the engine's
        self.given_id = given_id  # the client's (or drawn here): the answer's id and header
        self.req = req
        self.choices = {c.request_id: c for c in choices}
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.stream = stream
        self.created = int(time.time())
        self.response_id = self.id_prefix + given_id
        # the name the request asked by (any served name, or the model as given on the
        # command line, state.model_aliases), as vLLM's; the first served name where it
        # named none (QA: the first always)
        self.model = req.model or state.model_name
        self.closed = False
        self.prompt_only = False  # a completion's echo without generation
        self.streamed: set[str] = set()  # choices whose first chunk was read
        self.sent: set[str] = set()  # choices whose first chunk went out
        # each choice's logprob entries and token ids of chunks not sent yet
        self.held: dict[str, tuple[list[Any], list[int]]] = {}
        # what it is served with: the request's settings, the server's defaults under them
        # (set by start(); the Responses API echoes them)
        self.params: SamplingParams | None = None

    def close(self) -> None:
        """End the request here (idempotent: a later call must not release the ids of a new
        request that took them meanwhile)."""
        if self.closed:
            return
        self.closed = True
        self.stream.cancel()
        self.state.groups.pop(self.request_id, None)
        _forget_given(self.state, self.given_id, self.request_id)
        self.state.release_ids(self.request_id, list(self.choices))

    def _failed(self) -> None:
        """The engine died under this request: its unfinished choices end here."""
        unfinished = [c.request_id for c in self.choices.values() if c.finish_reason is None]
        self.state.metrics.requests_failed(unfinished)
        if self.state.recorder is not None:
            self.state.recorder.failed(unfinished)

    def _apply(self, chunk: CompletionChunk) -> Choice:
        choice = self.choices[chunk.request_id]
        if not self.prompt_only:
            choice.text += chunk.new_text
            choice.token_ids += chunk.new_token_ids
            if chunk.logprobs:
                choice.logprobs += list(zip(chunk.new_token_ids, chunk.logprobs,
                                            strict=False))
        if chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = chunk.prompt_logprobs
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
        except EngineDeadError:
            self._failed()
            raise
        finally:
            self.close()
        choices = sorted(self.choices.values(), key=lambda c: c.index)
        ended = next((c.stop_reason for c in choices
                      if ended_in_queue(c.finish_reason, c.stop_reason)), None)
        if ended is not None:
            raise queue_end(self.state, ended)
        return JSONResponse(self.body(choices), headers={"X-Request-Id": self.given_id})

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        """The whole answer's body (``choices`` in order, every one finished)."""
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created, "model": self.model,
            "system_fingerprint": None,  # OpenAI's and vLLM's key (QA: a KeyError here)
            "choices": [self._full_choice(c) for c in choices],
            "usage": self._usage(choices),
            "kvserve": kvserve_total(self.request_id, choices)}
        if not self.per_choice_prompt:  # one prompt: on the response, as vLLM's
            body.update(self._prompt_fields(choices[0], True))
        return body

    def _prompt_fields(self, choice: Choice, opening: bool) -> dict[str, Any]:
        """The prompt's token ids and logprobs where the request asked for them, for a
        whole answer or an ``opening`` chunk (the stream's first of the choice or prompt)."""
        fields: dict[str, Any] = {}
        if opening and self.req.return_token_ids:
            fields["prompt_token_ids"] = choice.prompt_token_ids
        if opening and self.req.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self._prompt_logprobs(choice)
        return fields

    async def _collect(self) -> None:
        while True:
            try:
                async for chunk in self.stream:
                    self._apply(chunk)
                    if ended_in_queue(chunk.finish_reason, chunk.stop_reason):  # a 503:
                        return  # end it now (close() aborts its other sequences)
                return
            except StreamRestarted as restart:  # placed again on another replica: start over
                for request_id in restart.request_ids:
                    choice = self.choices[request_id]
                    choice.text, choice.token_ids, choice.logprobs = "", [], []
                    choice.finish_reason = choice.stop_reason = choice.metrics = None
                    choice.prompt_logprobs = None

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": choice.index, **self._full_content(choice)}
        entries: list[Any] = self._echoed(choice) + choice.logprobs
        out["logprobs"] = self._logprobs(entries) if entries else None
        if self.per_choice_prompt:
            out.update(self._prompt_fields(choice, True))
        out["finish_reason"] = self._finish_reason(choice)
        out["stop_reason"] = choice.stop_reason
        if self.req.return_token_ids:
            out["token_ids"] = choice.token_ids
        out["kvserve"] = kvserve_ext(choice.request_id, choice.metrics)
        return out

    @abc.abstractmethod
    def _full_content(self, choice: Choice) -> dict[str, Any]:
        """A whole choice's text, as its shape holds it."""

    def _echoed(self, choice: Choice) -> list[Any]:
        """An echoed prompt's logprob entries, before the answer's (completions with echo
        and logprobs); none otherwise."""
        return []

    def _prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None]:
        computed = choice.prompt_logprobs or [None] * len(choice.prompt_token_ids)
        return vllm_prompt_logprobs(self.state.tokenizer, choice.prompt_token_ids, computed,
                                    self.req.prompt_logprobs)

    @abc.abstractmethod
    def _logprobs(self, entries: list[Any],
                  offsets: TextOffsets | None = None) -> dict[str, Any]:
        """The logprobs of these (token id, logprob entry) pairs, in the shape's format
        (``offsets``: the choice's text offsets so far, a stream's)."""

    def _tokens_as_ids(self) -> bool:
        """Whether logprobs name tokens as ``token_id:<id>`` (vLLM's flag, or the server's)."""
        asked = self.req.return_tokens_as_token_ids
        return self.state.tokens_as_ids if asked is None else asked

    # -- streamed --------------------------------------------------------------------------

    async def stream_response(self, request: Request) -> Response:
        try:
            first = await race_disconnect(request, anext(self.stream))
        except ClientGone:
            self.close()
            return Response(status_code=499)
        except BaseException as error:
            if isinstance(error, EngineDeadError):
                self._failed()
            self.close()
            raise
        if ended_in_queue(first.finish_reason, first.stop_reason):
            self.close()
            raise queue_end(self.state, first.stop_reason)
        return ClosingStreamingResponse(self._guarded(first), self.close,
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Request-Id": self.given_id})

    async def _guarded(self, first: CompletionChunk) -> AsyncIterator[str]:
        """The stream's events; a fault here ends it with an error event the client reads
        (QA: the connection was cut, no error and no end), and its traceback in the log."""
        try:
            async for event in self._events(first):
                yield event
        except Exception as error:
            logger.exception("request %s: the stream failed", self.request_id)
            yield self._fault_event(error)

    def _fault_event(self, error: Exception) -> str:
        """What ends a stream that failed here: OpenAI's error shape, then [DONE]."""
        return sse(APIError(500, f"internal error: {type(error).__name__}",
                            code="internal_error").body()) + SSE_DONE

    async def _events(self, first: CompletionChunk) -> AsyncIterator[str]:
        for event in self._opening_events():
            yield event
        if event := self._event(first):  # "" where nothing goes out yet (tool calls)
            yield event
        try:
            async for chunk in self.stream:
                if ended_in_queue(chunk.finish_reason, chunk.stop_reason):
                    yield sse(queue_end(self.state, chunk.stop_reason).body())
                    self.close()
                    break
                if event := self._event(chunk):
                    yield event
        except EngineDeadError as error:
            self._failed()
            yield sse(APIError(503, str(error)).body())
        if self._usage_asked()[0]:
            choices = list(self.choices.values())
            yield sse({"id": self.response_id, "object": self.chunk_object,
                       "created": self.created, "model": self.model,
                       "choices": [], "usage": self._usage(choices),
                       "kvserve": kvserve_total(self.request_id, choices)})
        yield SSE_DONE

    def _opening_events(self) -> list[str]:
        """What a stream sends before the first chunk's (a chat's role chunks)."""
        return []

    @abc.abstractmethod
    def _payload(self, choice: Choice, text: str, token_ids: list[int],
                 chunk: CompletionChunk) -> Any:
        """What a chunk of ``text`` (and ``token_ids``) sends for ``choice``; None: nothing
        yet (its tokens and logprobs go with the next chunk sent)."""

    def _event(self, chunk: CompletionChunk) -> str:
        first = chunk.request_id not in self.streamed  # the choice's first chunk
        self.streamed.add(chunk.request_id)
        choice = self._apply(chunk)
        entries: list[Any] = [] if self.prompt_only else \
            list(zip(chunk.new_token_ids, chunk.logprobs or [], strict=False))
        if first:  # an echo's prompt goes out before the answer's first text
            entries = self._echoed(choice) + entries
        token_ids = [] if self.prompt_only else list(chunk.new_token_ids)
        text = "" if self.prompt_only else chunk.new_text
        text = choice.echo + text if first else text
        payload = self._payload(choice, text, token_ids, chunk)
        withheld = payload is None
        held = self.held.get(choice.request_id)
        if withheld:  # nothing goes out yet (a call's text, a chunk of no token): its tokens
            # and logprobs go with the next chunk sent (QA: were lost)
            if held is None:
                held = self.held[choice.request_id] = ([], [])
            held[0].extend(entries)
            held[1].extend(token_ids)
            return ""
        if held is not None:
            entries, token_ids = held[0] + entries, held[1] + token_ids
            del self.held[choice.request_id]
        logprobs = None
        if entries:
            if choice.text_offsets is None:
                choice.text_offsets = TextOffsets()
            logprobs = self._logprobs(entries, choice.text_offsets)
        data = self._chunk(choice, payload, logprobs)
        opening = choice.request_id not in self.sent  # the choice's first chunk sent
        self.sent.add(choice.request_id)
        if self.per_choice_prompt:
            data["choices"][0].update(self._prompt_fields(choice, opening))
        elif opening and self.req.prompt_logprobs is not None:  # the role chunk had the ids
            data["prompt_logprobs"] = self._prompt_logprobs(choice)
        if self.req.return_token_ids:
            data["choices"][0]["token_ids"] = token_ids
        if chunk.finished:
            data["choices"][0]["finish_reason"] = self._finish_reason(choice)
            data["choices"][0]["stop_reason"] = chunk.stop_reason
            data["kvserve"] = kvserve_ext(choice.request_id, chunk.metrics)
        return sse(self._with_usage(data, choice))

    def _usage(self, choices: list[Choice], num_prompt_tokens: int | None = None
               ) -> dict[str, Any]:
        """The usage of ``choices`` (the answer's: its prompts' tokens, else
        ``num_prompt_tokens``); with --enable-prompt-tokens-details, the prompt tokens that
        were prefix-cache hits too (once a prompt, its first sample's), as vLLM's."""
        prompt = self.num_prompt_tokens if num_prompt_tokens is None else num_prompt_tokens
        counted: dict[str, Any] = {**usage(choices, prompt),
                                   "prompt_tokens_details": None}  # vLLM's, null unless on
        if self.state.prompt_tokens_details:
            n = getattr(self.req, "n", 1) or 1
            counted["prompt_tokens_details"] = {"cached_tokens": sum(
                c.metrics.num_cached_tokens for c in choices
                if c.metrics is not None and c.index % n == 0)}
        return counted

    def _with_usage(self, data: dict[str, Any], choice: Choice) -> dict[str, Any]:
        """A chunk with its choice's usage so far (its prompt's tokens and its own output's)
        where vLLM's continuous_usage_stats asks for it, as vLLM counts it (the streaming
        pass: every choice's were added up, 1, 2, 3, ... across n choices)."""
        if self._usage_asked()[1]:
            data["usage"] = self._usage([choice], len(choice.prompt_token_ids))
        return data

    def _usage_asked(self) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage in every chunk), as vLLM reads stream_options:
        --enable-force-include-usage asks for the first, and so lets continuous_usage_stats
        ask for the second (the streaming pass: it was ignored under the flag)."""
        options = self.req.stream_options
        at_end = self.state.force_include_usage or (options is not None and
                                                    bool(options.include_usage))
        return at_end, at_end and options is not None and bool(options.continuous_usage_stats)

    def _finish_reason(self, choice: Choice) -> str | None:
        return choice.finish_reason

    def _chunk(self, choice: Choice, payload: Any, logprobs: Any) -> dict[str, Any]:
        entry = {"index": choice.index, self.payload_key: payload, "logprobs": logprobs,
                 "finish_reason": None}
        return {"id": self.response_id, "object": self.chunk_object,
                "created": self.created, "model": self.model, "choices": [entry]}


class CompletionGeneration(Generation):
    """A /v1/completions answer: each choice a prompt's text, echoed where asked."""

    id_prefix = "cmpl-"
    object_name = chunk_object = "text_completion"
    payload_key = "text"

    def __init__(self, state: ServerState, request_id: str, given_id: str, req: Any,
                 choices: list[Choice], prompts: list[list[int]],
                 stream: RequestStream) -> None:
        super().__init__(state, request_id, given_id, req, choices, prompts, stream)
        # vLLM's echo without generation (max_tokens 0): the one token made is not returned
        self.prompt_only = bool(req.echo and req.max_tokens == 0)

    def _full_content(self, choice: Choice) -> dict[str, Any]:
        return {"text": choice.echo + choice.text}

    def _echoed(self, choice: Choice) -> list[Any]:
        if not self.req.echo or self.req.logprobs is None:
            return []
        return echoed_entries(choice, self.req.logprobs)

    def _logprobs(self, entries: list[Any],
                  offsets: TextOffsets | None = None) -> dict[str, Any]:
        return completion_logprobs(self.state.tokenizer, entries, offsets,
                                   self._tokens_as_ids())

    def _payload(self, choice: Choice, text: str, token_ids: list[int],
                 chunk: CompletionChunk) -> Any:
        # a token whose text is withheld (a stop string's start, half a character) goes
        # out in a chunk of its own with text "", as vLLM 0.32's (checked live): a chunk
        # a token, which clients timing inter-token latency count on
        return text if text or token_ids or chunk.finished else None

    def _chunk(self, choice: Choice, payload: Any, logprobs: Any) -> dict[str, Any]:
        data = super()._chunk(choice, payload, logprobs)
        data["choices"][0]["stop_reason"] = None  # on every chunk, as vLLM's
        return data


class ChatGeneration(Generation):
    """A /v1/chat/completions answer: each choice a message (its reasoning, content and
    tool calls, ``answer``), one prompt for all."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    payload_key = "delta"
    per_choice_prompt = False

    def __init__(self, state: ServerState, request_id: str, given_id: str, req: Any,
                 choices: list[Choice], prompts: list[list[int]], stream: RequestStream,
                 reasoning: ThinkParser | None = None) -> None:
        super().__init__(state, request_id, given_id, req, choices, prompts, stream)
        # ``reasoning``: the reasoning parser as the prompt leaves it (_reasoning)
        self.answer = ChatAnswer(req, state.response_role, state.tool_parser, reasoning)
        self.tools = self.answer.tools
        # vLLM's echo: the last message's text, where it is the answer's role
        self.echoed = _chat_echo(req, state.response_role)

    def _full_content(self, choice: Choice) -> dict[str, Any]:
        message = self.answer.message(choice.request_id, choice.text)
        if self.echoed:
            message["content"] = self.echoed + (message["content"] or "")
        for key in _NULL_MESSAGE_KEYS:  # vLLM's, null here (QA: indexing them failed)
            message.setdefault(key, None)
        return {"message": message}

    def _logprobs(self, entries: list[Any],
                  offsets: TextOffsets | None = None) -> dict[str, Any]:
        return chat_logprobs(self.state.tokenizer, entries, self.req.top_logprobs or 0,
                             self._tokens_as_ids())

    def _opening_events(self) -> list[str]:
        events = []
        for choice in sorted(self.choices.values(), key=lambda c: c.index):
            data = self._chunk(choice, {"role": self.state.response_role, "content": ""},
                               None)
            if self.req.return_token_ids:
                data["prompt_token_ids"] = choice.prompt_token_ids
            events.append(sse(self._with_usage(data, choice)))  # vLLM's role chunk too
            if self.echoed:  # vLLM's: the echoed text in a chunk of its own
                events.append(sse(self._with_usage(
                    self._chunk(choice, {"content": self.echoed}, None), choice)))
        return events

    def _payload(self, choice: Choice, text: str, token_ids: list[int],
                 chunk: CompletionChunk) -> Any:
        # None: a call's text, held until it is whole
        return self.answer.delta(choice.request_id, text, choice.text, chunk.finished)

    def _finish_reason(self, choice: Choice) -> str | None:
        return self.answer.finish_reason(choice.request_id, choice.finish_reason)


# a chat answer's message keys vLLM (and OpenAI) always send, null where nothing fills them
_NULL_MESSAGE_KEYS = ("refusal", "annotations", "audio", "function_call")


def queue_end(state: ServerState, reason: int | str | None) -> APIError:
    """The 503 of a request the waiting queue ended before it was scheduled, counted: it
    waited past its queue deadline (K4), or a more urgent arrival took its place (K5)."""
    if reason == DISPLACED:
        state.metrics.queue_displacements.inc()
        return APIError(503, "the server is overloaded: a more urgent request took this "
                             "one's place in the full waiting queue before it was scheduled; "
                             "retry later", code="queue_full",
                        headers={"Retry-After": state.retry_after()})
    state.metrics.queue_timeouts.inc()
    return APIError(503, "queue timeout: the request waited longer than its queue deadline "
                         "(--max-queue-delay or 'max_queue_delay') without being scheduled; "
                         "retry later", code="queue_timeout", headers={"Retry-After": "1"})


def engine_dead_headers(error: EngineDeadError) -> dict[str, str] | None:
    """Retry-After where replicas are restarting, so a retry will be served."""
    return None if error.retry_after is None else {"Retry-After": str(error.retry_after)}


def engine_dead_error(state: ServerState, error: EngineDeadError) -> APIError:
    """The 503 for a request an engine's death ended: where other replicas still serve,
    the request failed, not the server."""
    what = "the request failed" if state.engine.is_running else "the engine is not running"
    return APIError(503, f"{what}: {error}", headers=engine_dead_headers(error))
