"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline (docs/responses-api.md).

    body -> ResponsesRequest (checked, errors name the Responses API's fields)
    -> the conversation: the previous response's (previous_response_id, from the store)
       + instructions + input items, as chat messages
    -> a chat request (text.format -> response_format, flat tools -> chat tools)
       (those three: server/responses_request.py)
    -> generation.start: the same checks, queue, scheduler and engine as /v1/chat/completions
    -> the answer as a Response object (output items: a thinking model's reasoning, a
       message, function calls), or as the Responses API's typed stream events

Responses are kept (``store``) only where the operator turned the store on
(--enable-responses-store or vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1), in memory, each
tenant's most recent ``capacity`` (server/response_store.py), each readable only with its
tenant's keys. Without the store, ``store: true`` (OpenAI's default) is served and not
kept, as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.core.stop import ended_in_queue
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.engine import CompletionChunk
from kvserve.server.errors import APIError, bad_request
from kvserve.server.generation import ChatGeneration, queue_end, start
from kvserve.server.prompts import encode_chat, max_tokens_for
from kvserve.server.reasoning_parsers import END, START
from kvserve.server.response_store import ResponseStore, Stored
from kvserve.server.responses import Choice, kvserve_ext
from kvserve.server.responses_request import (
    NamedFunction,
    ResponsesRequest,
    chat_request,
    check_tool_outputs,
    in_responses_words,
    input_messages,
    parse_responses_request,
    wants_logprobs,
)
from kvserve.server.state import ServerState

logger = logging.getLogger(__name__)


# -- the answer -----------------------------------------------------------------------------


class EventLog:
    """A background response's stream events as they are made (``stream`` with
    ``background``): the request that made it and any GET ?stream=true follow it from a
    sequence number on, each to its end; a reader that goes away stops nothing."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ended = False
        self._changed = asyncio.Event()

    def add(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The events after sequence number ``after``, those to come included."""
        at = after + 1
        while True:
            changed = self._changed  # set by any event added while those before go out
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await changed.wait()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_PARTIAL = "\ufffd"  # what a token ending inside a character's UTF-8 bytes decodes to
_TOO_LARGE = ("the response is larger than this server's store keeps for a tenant ({} bytes "
              "as JSON, --responses-store-memory)")


class ResponsesGeneration(ChatGeneration):
    """A chat generation answered in the Responses API's shapes: ``api`` is the request as
    sent, ``conversation`` its messages (history and input, without instructions), kept in
    ``store`` with the answer's, for ``owner``'s key."""

    def __init__(self, *args: Any, api: ResponsesRequest,
                 conversation: list[dict[str, Any]], store: ResponseStore,
                 owner: str | None) -> None:
        super().__init__(*args)
        self.api = api
        self.conversation = conversation
        self.store = store
        self.owner = owner
        self.response_id = _new_id("resp")
        self.item_id = _new_id("msg")
        self.reasoning_id = "rs_" + self.item_id.removeprefix("msg_")
        self.sequence = 0  # the next stream event's sequence_number
        self.cancelled = False  # a background response the client cancelled
        # a text stream's items opened so far (reasoning, message, call0, call1...): their
        # index; the indices of those closed already
        self._live: dict[str, int] = {}
        self._shut: set[int] = set()
        self._spaces = ""  # a message's leading whitespace, sent once text follows it
        self._held: list[Any] = []  # the logprobs of tokens whose text has not gone out
        self._thinking = self._thinks("")  # whether the answer is (yet) thinking
        self.log: EventLog | None = None  # background with stream: its events, kept

    @property
    def choice(self) -> Choice:
        return next(iter(self.choices.values()))  # one sequence: this API has no n

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        response = self._response(self._status(), self._output(), self._response_usage())
        choice = self.choice
        if response["status"] == "cancelled":
            response["error"] = None
        elif ended_in_queue(choice.finish_reason, choice.stop_reason):
            # a background response's queue deadline or a more urgent arrival: the poller
            # reads what the request would have been answered (QA: an operator's abort)
            error = queue_end(self.state, choice.stop_reason)
            response["error"] = {"code": str(error.code), "message": error.message}
        elif response["status"] == "failed":
            response["error"] = {"code": "aborted", "message": "the request was aborted "
                                 "before it finished (an operator's abort, or the server's "
                                 "shutdown timeout)"}
        response["store"] = self._keep(response)  # false where it was not kept (QA: true,
        # and a 404 for it)
        return response

    # the Response object

    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        api, params = self.api, self.params
        assert params is not None  # start() sets it before any answer is built
        text_format = api.text.format if api.text is not None else None
        tool_choice = api.tool_choice or "auto"  # OpenAI's default, tools or none (the
        # structured-output pass: "none" without tools)
        out: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "background": api.background, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            # the settings it is served with, the server's defaults filled in, as vLLM's
            # (QA: 1.0 and null echoed where the model's generation config gave others)
            "instructions": api.instructions,
            "max_output_tokens": params.max_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": api.parallel_tool_calls is not False,
            "previous_response_id": api.previous_response_id,
            "reasoning": {"effort": api.reasoning.effort if api.reasoning else None,
                          "summary": api.reasoning.summary if api.reasoning else None},
            "service_tier": "default", "store": self.store.enabled and api.store,
            "temperature": params.temperature,
            "text": {"format": ({"type": "text"} if text_format is None else
                                text_format.model_dump(by_alias=True, exclude_none=True)),
                     "verbosity": api.text.verbosity if api.text is not None
                     and api.text.verbosity is not None else "medium"},
            "tool_choice": (tool_choice.model_dump() if isinstance(tool_choice, NamedFunction)
                            else tool_choice),
            "tools": [tool.model_dump(by_alias=True) for tool in api.tools or ()],
            "top_logprobs": api.top_logprobs or 0,
            "top_p": params.top_p,
            "truncation": api.truncation or "disabled", "usage": usage, "user": api.user,
            "prompt_cache_key": api.prompt_cache_key,
            "safety_identifier": api.safety_identifier, "metadata": api.metadata or {}}
        if status != "in_progress":
            out["kvserve"] = kvserve_ext(self.choice.request_id, self.choice.metrics)
        return out

    def _status(self) -> str:
        reason = self.choice.finish_reason
        if self.cancelled:
            return "cancelled"
        return {"length": "incomplete", "abort": "failed"}.get(reason or "", "completed")

    # background mode

    def run_in_background(self, running: dict[str, Any]) -> Response:
        """Answer at once with the response ``queued``, kept in the store, and generate it
        in a task of the server's (in ``running`` until it ends, for cancel and the
        shutdown's drain); the store then holds the whole answer. A 400 where even the
        queued response is more than the store keeps (QA: a 404 at once, the request
        running on)."""
        opening = self._response("queued", [], None)
        if not self._keep(opening):
            self.close()
            raise bad_request(_TOO_LARGE.format(self.store.max_bytes) + ": send it without "
                              "'background'", param="background")
        if self.api.stream:  # its events kept, and this request follows them
            self.log = EventLog()
            self._sse("response.created", response=opening)
            self._sse("response.queued", response=opening)
        task = asyncio.create_task(self._in_background(running))
        running[self.response_id] = (self, task)
        headers = {"X-Request-Id": self.given_id}
        if self.log is not None:
            return StreamingResponse(self.log.follow(-1), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        return JSONResponse(opening, headers=headers)

    async def _in_background(self, running: dict[str, Any]) -> None:
        try:
            if self.log is None:
                await self._collect()
                self.body(list(self.choices.values()))  # kept in the store
            else:
                await self._log_events()
        except EngineDeadError as error:
            self._failed()
            self._failed_event("engine_dead", str(error))  # kept, and logged if streamed
        except Exception as error:  # a bug: the response says failed, the log says why
            logger.exception("background response %s failed", self.response_id)
            self._failed_event("server_error", f"internal error: {type(error).__name__}")
        finally:
            self.close()
            if self.log is not None:
                self._keep_events()
            running.pop(self.response_id, None)
            if self.log is not None:
                self.log.end()

    async def _log_events(self) -> None:
        """A streamed background response's events, made into its log (by _sse) as a
        stream's are; the response kept at its end, as _events keeps it."""
        assert self.log is not None
        first = await anext(self.stream, None)
        if first is None:  # nothing came: it ended at once (an abort)
            self.body(list(self.choices.values()))
            return
        async for _ in self._events(first, opened=True):  # a fault: _in_background's
            pass

    def _keep_events(self) -> None:
        """The log kept with the response, for GET ?stream=true once it ended (without it
        where the two are more than the store keeps: the response comes first)."""
        assert self.log is not None
        try:
            stored = self.store.get(self.response_id, self.owner)
        except APIError:  # deleted meanwhile
            return
        if not self.store.put(self.response_id,
                              dataclasses.replace(stored, events=list(self.log.events))):
            self.store.put(self.response_id, stored)

    def _apply(self, chunk: CompletionChunk) -> Choice:
        """A chunk read; a background response's first says it is ``in_progress`` (it
        went from queued to its end, QA)."""
        if self.api.background and not self.choice.token_ids and chunk.new_token_ids and \
                not chunk.finished:
            self._keep(self._response("in_progress", [], None))
        return super()._apply(chunk)

    def cancel(self) -> None:
        """End a background response here: its engine request is aborted (its task reads
        the abort and ends)."""
        self.cancelled = True
        self.stream.abort()

    def _response_usage(self) -> dict[str, Any]:
        """The Responses API's usage object (input/output tokens and their details)."""
        choice = self.choice
        cached = choice.metrics.num_cached_tokens if choice.metrics is not None else 0
        output = choice.num_output_tokens
        return {"input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": self.num_prompt_tokens + output}

    def _reasoning_tokens(self) -> int:
        """The output tokens up to the one that closes the thinking (all of them, where it
        never closes): the fewest whose text holds </think>, found by halving."""
        choice = self.choice
        if self.answer.split(choice.text)[0] is None:
            return 0
        ids, low, high = choice.token_ids, 1, len(choice.token_ids)
        decode = self.state.tokenizer.decode
        if END not in decode(ids):
            return len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if END in decode(ids[:middle]) else (middle + 1, high)
        return low

    def _output(self) -> list[dict[str, Any]]:
        """The output items: the reasoning (a reasoning parser's), then the message, or the
        calls (after any text before them)."""
        choice = self.choice
        status = "completed" if choice.finish_reason == "stop" else "incomplete"
        reasoning, content = self.answer.split(choice.text)
        thought = "completed" if self.answer.thought(choice.text) else status
        items = [self._reasoning_item(reasoning, thought)] \
            if reasoning is not None and self.answer.shows_reasoning else []
        if content is None and reasoning is not None:
            return items  # all thinking: no message, as vLLM's
        content = content or ""
        if self.tools is not None:
            message = self.tools.message(choice.request_id, content)
            calls = message.get("tool_calls")
            if calls:  # auto: the content before the calls, if any, first
                said = [self._message_item(message["content"], status,
                                           self._message_logprobs(message["content"]))] \
                    if message.get("content") else []
                return items + said + [
                    self._call_item(call["id"], call["function"]["name"],
                                    call["function"]["arguments"], index, status)
                    for index, call in enumerate(calls)]
        return [*items, self._message_item(content, status, self._message_logprobs(content))]

    def _reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [],
                "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}

    def _message_item(self, text: str | None, status: str,
                      logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status,
                "role": "assistant",
                "content": [] if text is None else [_part(text, logprobs or [])]}

    def _message_logprobs(self, text: str) -> list[dict[str, Any]]:
        """The logprobs of the message's tokens (none unless asked for): those after the
        thinking, as far as the message's text goes (a call's tokens may follow)."""
        choice = self.choice
        if not wants_logprobs(self.api) or not choice.logprobs:
            return []
        start = self._reasoning_tokens()
        ids = choice.token_ids[start:len(choice.logprobs)]
        # the fewest whose text holds the message's: a call's tokens after it are left out,
        # and a stop token, which writes nothing (QA: the EOS was in .done, in no delta;
        # OpenAI lists none)
        decode, wanted = self.state.tokenizer.decode, len(text)
        partial = "" if text.endswith(_PARTIAL) else _PARTIAL  # a character's bytes begun,
        # not ended, decode as U+FFFD: no character of the message yet (QA: the last
        # token of a closing "✓" was left out)

        def short(k: int) -> bool:
            return len(decode(ids[:k]).rstrip(partial)) < wanted
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if short(middle) else (low, middle)
        return self._logprobs(choice.logprobs[start:start + low])["content"]

    def _call_item(self, call_id: str, name: str, arguments: str, index: int,
                   status: str) -> dict[str, Any]:
        return {"id": self._call_item_id(index), "type": "function_call", "status": status,
                "call_id": call_id, "name": name, "arguments": arguments}

    def _call_item_id(self, index: int) -> str:
        return "fc_" + self.item_id.removeprefix("msg_") + (f"_{index}" if index else "")

    def _keep(self, response: dict[str, Any]) -> bool:
        """Keep the response and its conversation (this answer's messages appended); False
        where the store could not (off, store false, or larger than it keeps)."""
        if not response["store"]:
            return False
        answer: list[dict[str, Any]] = []
        for item in response["output"]:
            if item["type"] == "reasoning":  # left out of the history, as chat's templates do
                continue
            if item["type"] == "message":
                answer.append({"role": "assistant", "content": item["content"][0]["text"]})
                continue
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if answer:  # the text before the calls, or a call before: one turn
                answer[-1].setdefault("tool_calls", []).append(call)
            else:
                answer.append({"role": "assistant", "content": None, "tool_calls": [call]})
        kept = self.store.put(self.response_id,
                              Stored(self.owner, response, self.conversation + answer,
                                     _as_items(self.api.input)))
        if not kept and self.api.background:  # what its poller reads instead (QA: it was
            # queued for ever): its status and usage, without the long parts
            too_large = {**self._response("failed", [], response["usage"]),
                         "instructions": None, "tools": [], "metadata": {},
                         "error": {"code": "response_too_large", "message": _TOO_LARGE.format(
                             self.store.max_bytes)}}
            too_large.pop("kvserve", None)
            self.store.put(self.response_id, Stored(self.owner, too_large, None, None))
        return kept

    # the stream: the Responses API's typed events

    def _sse(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        event = f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
        if self.log is not None:
            self.log.add(event)
        return event

    async def _events(self, first: CompletionChunk, opened: bool = False
                      ) -> AsyncIterator[str]:
        """The stream's events (``opened``: its response.created went out already, as a
        background response's does when it is queued)."""
        opening = self._response("in_progress", [], None)
        if not opened:
            yield self._sse("response.created", response=opening)
        yield self._sse("response.in_progress", response=opening)
        tools = self.tools
        # a named function's arguments delta by delta; "required" among several tools: the
        # calls whole at the end; otherwise the text as it comes (reasoning, then content)
        named = tools is not None and tools.name is not None
        text = tools is None or tools.parser is not None
        if named and self.answer.reasoning is not None:
            named = text = False  # thinks, then calls: the items go out whole, in order
        if named:
            yield self._opened(self._first_call())
        chunk: CompletionChunk | None = first
        try:
            while chunk is not None:
                if ended_in_queue(chunk.finish_reason, chunk.stop_reason):
                    error = queue_end(self.state, chunk.stop_reason)
                    yield self._failed_event(str(error.code), error.message)
                    self.close()
                    return
                choice = self._apply(chunk)
                if named and chunk.new_text:
                    yield self._sse("response.function_call_arguments.delta",
                                    item_id=self._call_item_id(0), output_index=0,
                                    delta=chunk.new_text)
                elif text:
                    yield self._text_pieces(choice, chunk)
                chunk = await anext(self.stream, None)
        except EngineDeadError as error:
            self._failed()
            yield self._failed_event("engine_dead", str(error))
            return
        response = self.body(list(self.choices.values()))
        calls = 0
        for index, item in enumerate(response["output"]):
            key = item["type"]
            if key == "function_call":
                key, calls = f"call{calls}", calls + 1
            live = (named and index == 0) or self._live.get(key) == index
            if not live:  # whole: its text in one delta, as OpenAI's
                yield self._opened({**item, "status": "in_progress"}, index)
                yield self._whole_delta(item, index)
            if index not in self._shut:
                yield self._closed(item, index)
        # (a cancelled background response's: OpenAI's stream has no cancelled event)
        final = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed", "cancelled": "response.failed"}[
                     response["status"]]
        yield self._sse(final, response=response)

    def _text_pieces(self, choice: Choice, chunk: CompletionChunk) -> str:
        """A text stream's events for one chunk: its reasoning, its content and its calls
        (auto, a tool-call parser's), each item opened as its first text comes and the one
        before it closed."""
        piece = self.answer.delta(choice.request_id, chunk.new_text, choice.text,
                                  chunk.finished) or {}
        events = ""
        reasoning, content = piece.get("reasoning") or "", piece.get("content") or ""
        if wants_logprobs(self.api):  # a chunk's tokens go with the text they make
            thinking = self._thinking  # before this chunk
            self._thinking = self._thinks(choice.text)
            self._held += list(zip(chunk.new_token_ids, chunk.logprobs or [], strict=False))
            if (reasoning or piece.get("tool_calls") or thinking) and not content:
                # thinking's (</think>'s too, which writes neither: QA, it went out with
                # the first text), or a call's: no message's
                self._held = []
        if reasoning:
            if "reasoning" not in self._live:
                events += self._open_live("reasoning",
                                          self._reasoning_item(None, "in_progress"))
            events += self._sse("response.reasoning_text.delta", item_id=self.reasoning_id,
                                output_index=self._live["reasoning"], content_index=0,
                                delta=reasoning)
        if content and "message" not in self._live and not (self._spaces + content).strip():
            self._spaces += content  # only whitespace yet: no message item for it
            content = ""
        if content:
            if "message" not in self._live:
                events += self._open_live("message", self._message_item(None, "in_progress"))
                content, self._spaces = self._spaces + content, ""
            held, self._held = self._held, []
            events += self._sse("response.output_text.delta", item_id=self.item_id,
                                output_index=self._live["message"], content_index=0,
                                delta=content,
                                logprobs=self._logprobs(held)["content"] if held else [])
        for call in piece.get("tool_calls") or ():
            key, function = f"call{call['index']}", call["function"]
            if key not in self._live:
                events += self._open_live(key, self._call_item(
                    call["id"], function["name"], "", call["index"], "in_progress"))
            if function.get("arguments"):
                events += self._sse("response.function_call_arguments.delta",
                                    item_id=self._call_item_id(call["index"]),
                                    output_index=self._live[key],
                                    delta=function["arguments"])
        return events

    def _thinks(self, text: str) -> bool:
        """Whether an answer that has written ``text`` is thinking: a reasoning parser's,
        begun inside its thinking (or opened it), not yet closed."""
        parser = self.answer.reasoning
        if parser is None:
            return False
        opened = parser.opened or text.lstrip().startswith(START) or \
            START.startswith(text.lstrip())  # "" or "<thi": may be opening it
        return opened and not parser.thought(text)

    def _open_live(self, key: str, item: dict[str, Any]) -> str:
        """Open a streamed item, closing the one before it (the thinking is over as the
        content begins; the content as a call begins)."""
        events = ""
        if self._live:
            last, index = max(self._live.items(), key=lambda entry: entry[1])
            if index not in self._shut:
                events += self._closed(self._live_item(last), index)
                self._shut.add(index)
        self._live[key] = len(self._live)
        return events + self._opened(item, self._live[key])

    def _live_item(self, key: str) -> dict[str, Any]:
        """A streamed item as it is when the next one begins."""
        reasoning, content = self.answer.split(self.choice.text)
        if key == "reasoning":
            return self._reasoning_item(reasoning or "", "completed")
        assert self.tools is not None  # only calls come after a message or a call
        message = self.tools.message(self.choice.request_id, content or "")
        if key == "message":
            said = message["content"] or ""
            return self._message_item(said, "completed", self._message_logprobs(said))
        index = int(key.removeprefix("call"))
        call = message["tool_calls"][index]
        return self._call_item(call["id"], call["function"]["name"],
                               call["function"]["arguments"], index, "completed")

    def _first_call(self) -> dict[str, Any]:
        """A named function's call item, opened as its arguments begin."""
        assert self.tools is not None and self.tools.name is not None
        return self._call_item(self.tools.call_id(self.choice.request_id, 0), self.tools.name,
                               "", 0, "in_progress")

    def _opened(self, item: dict[str, Any], index: int = 0) -> str:
        """An output item's opening events (a message's opens its one text part)."""
        if item["type"] in ("message", "reasoning"):
            item = {**item, "content": []}
        events = self._sse("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            events += self._sse("response.content_part.added", item_id=item["id"],
                                output_index=index, content_index=0, part=_part(""))
        return events

    def _whole_delta(self, item: dict[str, Any], index: int) -> str:
        """An item that went out whole: its text, or its arguments, as one delta."""
        if item["type"] in ("message", "reasoning"):
            text = item["content"][0]["text"] if item["content"] else ""
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra: dict[str, Any] = {"logprobs": item["content"][0]["logprobs"]} \
                if item["type"] == "message" and item["content"] else {}
            return self._sse(f"response.{kind}.delta", item_id=item["id"],
                             output_index=index, content_index=0, delta=text,
                             **extra) if text else ""
        return self._sse("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=index, delta=item["arguments"])

    def _closed(self, item: dict[str, Any], index: int) -> str:
        """An output item's closing events."""
        if item["type"] == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            return (self._sse("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text)
                    + self._sse("response.output_item.done", output_index=index, item=item))
        if item["type"] == "message":
            text = item["content"][0]["text"] if item["content"] else ""
            logprobs = item["content"][0]["logprobs"] if item["content"] else []
            return (self._sse("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text,
                              logprobs=logprobs)
                    + self._sse("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=_part(text))
                    + self._sse("response.output_item.done", output_index=index, item=item))
        return (self._sse("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, name=item["name"], arguments=item["arguments"])
                + self._sse("response.output_item.done", output_index=index, item=item))

    def _fault_event(self, error: Exception) -> str:
        return self._failed_event("server_error", f"internal error: {type(error).__name__}")

    def _failed_event(self, code: str, message: str) -> str:
        """The event that ends a stream that failed; a background response's failure
        kept, for its poller to read."""
        response = self._response("failed", [], None)
        response["error"] = {"code": code, "message": message}
        if self.api.background:
            self._keep(response)
        return self._sse("response.failed", response=response)


def _as_items(given: Any) -> list[dict[str, Any]]:
    """A request's input as items, as OpenAI lists them (GET .../input_items): each with an
    id, a message's text as a list of parts."""
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    out = []
    for item in items:
        if item.get("type", "message") != "message":
            # (its id after it: an "id": null given kept null, and after= could not page, QA)
            out.append({**item, "id": item.get("id") or _new_id("item")})
            continue
        content = item.get("content")
        if isinstance(content, str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            content = [{"type": kind, "text": content}]
        out.append({**item, "id": item.get("id") or _new_id("msg"), "type": "message",
                    "content": content})
    return out


def _referenced(given: Any, store: ResponseStore, owner: str | None) -> Any:
    """The input with each ``item_reference`` (``{"type": "item_reference", "id": ID}``, or
    ``{"id": ID}`` alone, its type optional as OpenAI's) replaced by the stored item it
    names (an earlier response's input or output item, the tenant's own), as OpenAI reads
    it (QA: a 400, where SDKs send earlier turns' items so when they are stored); a 404
    naming an id not kept."""
    if not isinstance(given, list):
        return given
    references = {index: item for index, item in enumerate(given) if _is_reference(item)}
    if not references:
        return given
    if not store.enabled:
        raise bad_request("'item_reference' names a stored item: it needs the response "
                          "store (--enable-responses-store); send the item itself instead",
                          param="input")
    for index, item in references.items():
        if set(item) - {"type", "id"} or not isinstance(item.get("id"), str):
            raise bad_request(f"input.{index}: an item_reference is {{\"type\": "
                              "\"item_reference\", \"id\": ID}", param=f"input.{index}")
    found = store.items({item["id"] for item in references.values()}, owner)
    for index, item in references.items():
        if item["id"] not in found:
            raise APIError(404, f"item {item['id'][:100]!r} not found (input.{index}: the "
                                "items of the responses kept are found)",
                           param=f"input.{index}.id", code="item_not_found")
    return [found[item["id"]] if index in references else item
            for index, item in enumerate(given)]


def _is_reference(item: Any) -> bool:
    return isinstance(item, dict) and (item.get("type") == "item_reference" or
                                       ("type" not in item and set(item) == {"id"}))


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


# -- the endpoints --------------------------------------------------------------------------


def _owner(state: ServerState, request: Request) -> str | None:
    """Whose stored responses a request may read: its key's tenant (None: keys are off)."""
    key = state.keys.authenticate(request.headers.getlist("authorization"))
    return key.tenant if state.keys.enabled else None


async def create(state: ServerState, request: Request) -> Response:
    arrival_time = time.monotonic()
    key = state.keys.authenticate(request.headers.getlist("authorization"))
    owner = key.tenant if state.keys.enabled else None
    api = parse_responses_request(await state.read_json(request))
    api.input = _referenced(api.input, state.responses, owner)
    history = state.responses.history(api.previous_response_id, owner)
    messages = input_messages(api.input)
    check_tool_outputs(history + messages)
    if not messages and not history:  # QA: chat's "messages ... at least 1 item (got [])"
        raise bad_request("'input' holds nothing to answer: reasoning items are left out of "
                          "the prompt; send a message", param="input")
    if api.background and not (state.responses.enabled and api.store):
        raise bad_request("'background' keeps the response for GET /v1/responses/{id} to "
                          "read: it needs the response store (--enable-responses-store, or "
                          "VLLM_ENABLE_RESPONSES_API_STORE=1) and 'store': true",
                          param="background")
    kind = partial(ResponsesGeneration, api=api, conversation=history + messages,
                   store=state.responses, owner=owner)
    try:
        generation = await _start(state, request, key, api, history + messages,
                                  arrival_time, kind)
    except APIError as error:  # the length checks name chat's fields
        raise in_responses_words(error) from None
    if api.background:
        return generation.run_in_background(state.background)
    if api.stream:
        return await generation.stream_response(request)
    return await generation.full_response(request)


async def _start(state: ServerState, request: Request, key: Any, api: ResponsesRequest,
                 conversation: list[dict[str, Any]], arrival_time: float,
                 kind: Callable[..., ResponsesGeneration]) -> ResponsesGeneration:
    """The request queued; with ``truncation: "auto"`` (OpenAI's), a conversation longer
    than the context loses its oldest items, as few as make it fit (found by bisection;
    a tool's output never stays without its call; the last item always stays)."""
    auto_tools = state.tool_parser is not None

    def chat(dropped: int) -> Any:
        return chat_request(api, [], _from(conversation, dropped), auto_tools)

    async def overflow(dropped: int) -> APIError | None:  # nothing is queued
        """The context's 400 where the answer would not fit whole (strict: the chat
        endpoints serve such a request cut short, as vLLM does), else None."""
        req = chat(dropped)
        prompts = await asyncio.to_thread(encode_chat, state, req)
        try:
            max_tokens_for(state, req, True, prompts, strict=True)
        except APIError as error:
            if error.code != "context_length_exceeded":
                raise
            return error
        return None

    cut: int | None = 0
    if api.truncation == "auto" and len(conversation) >= 2:
        whole = await overflow(0)
        if whole is not None:
            low, high, cut = 1, len(conversation) - 1, None  # the fewest dropped that fit
            while low <= high:
                middle = (low + high) // 2
                if await overflow(middle) is None:
                    cut, high = middle, middle - 1
                else:
                    low = middle + 1
            if cut is None:
                raise whole
    generation = await start(state, request, key, chat(cut), True, arrival_time, kind,
                             strict_context=True, outlives_client=bool(api.background))
    assert isinstance(generation, ResponsesGeneration)  # what ``kind`` makes
    return generation


def _from(conversation: list[dict[str, Any]], dropped: int) -> list[dict[str, Any]]:
    """The conversation without its first ``dropped`` messages, and without tool outputs
    left at its start (their calls gone)."""
    kept = conversation[dropped:]
    while len(kept) > 1 and kept[0].get("role") == "tool":
        kept = kept[1:]
    return kept


async def cancel(state: ServerState, request: Request, response_id: str) -> Response:
    """OpenAI's cancel of a background response: one under way ends, ``cancelled`` (its
    engine requests aborted, their blocks freed); one that ended is returned as it is."""
    owner = _owner(state, request)
    stored = state.responses.get(response_id, owner)
    if not stored.response.get("background"):
        raise bad_request(f"response {response_id[:100]!r} was not created in the "
                          "background: only a background response can be cancelled",
                          param="response_id")
    running = state.background.get(response_id)
    if running is not None:
        generation, task = running
        generation.cancel()
        await asyncio.shield(task)
    return JSONResponse(state.responses.get(response_id, owner).response)


def retrieve(state: ServerState, request: Request, response_id: str) -> Response:
    """The stored response; with ``stream=true``, a streamed background response's events
    after ``starting_after`` (a sequence number), following it to its end if it is under
    way, as OpenAI's."""
    stored = state.responses.get(response_id, _owner(state, request))
    query = request.query_params
    streamed = query.get("stream", "false")
    if streamed not in ("true", "false"):
        raise bad_request("'stream' must be true or false", param="stream")
    if streamed == "false":
        return JSONResponse(stored.response)
    after_text = query.get("starting_after", "-1")
    if not (after_text == "-1" or (after_text.isascii() and after_text.isdigit()
                                   and len(after_text) < 10)):
        raise bad_request("'starting_after' must be an event's sequence number (an integer "
                          "from 0)", param="starting_after")
    running = state.background.get(response_id)
    log = running[0].log if running is not None else None
    if log is not None:
        events: AsyncIterator[str] = log.follow(int(after_text))
    elif stored.events is not None:
        if int(after_text) >= len(stored.events):  # QA: an empty stream, no end told
            raise bad_request(f"'starting_after' {after_text}: the stream ended at event "
                              f"{len(stored.events) - 1}", param="starting_after")
        events = _replayed(stored.events[int(after_text) + 1:])
    else:
        raise bad_request(f"response {response_id[:100]!r} has no events to stream: only a "
                          "response created with 'background' and 'stream' keeps them; GET "
                          "it without 'stream'", param="stream")
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _replayed(events: list[str]) -> AsyncIterator[str]:
    for event in events:
        yield event


def input_items(state: ServerState, request: Request, response_id: str) -> Response:
    """OpenAI's list of a stored response's input items: ``order`` asc or desc (the
    default, as OpenAI's), ``limit`` 1-100 (20), ``after`` an item's id."""
    stored = state.responses.get(response_id, _owner(state, request))
    if stored.input_items is None:  # QA: an empty list, as if it had had no input
        raise bad_request(f"response {response_id[:100]!r} was larger than this server's "
                          "store keeps, so its input items were not kept",
                          param="response_id")
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be asc or desc", param="order")
    limit_text = query.get("limit", "20")
    if not (limit_text.isascii() and limit_text.isdigit()) or not 1 <= int(limit_text) <= 100:
        raise bad_request("'limit' must be an integer from 1 to 100", param="limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"'after': no input item {after!r} in this response",
                              param="after")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit_text)]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > len(page)})


async def delete(state: ServerState, request: Request, response_id: str) -> Response:
    owner = _owner(state, request)
    state.responses.get(response_id, owner)  # a 404 first, for another tenant's too
    running = state.background.get(response_id)
    if running is not None:  # under way: it ends here, then is forgotten
        running[0].cancel()
        await asyncio.shield(running[1])
    state.responses.delete(response_id, owner)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
