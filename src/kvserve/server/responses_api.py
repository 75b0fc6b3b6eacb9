"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline (docs/responses-api.md).

    body -> ResponsesRequest (checked, errors name the Responses API's fields)
    -> the conversation: the previous response's (previous_response_id, from the store)
       + instructions + input items, as chat messages
    -> a chat request (text.format -> response_format, flat tools -> chat tools)
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
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.engine import CompletionChunk
from kvserve.server.errors import APIError, bad_request
from kvserve.server.generation import QUEUE_ENDS, Generation, queue_end, start
from kvserve.server.prompts import encode_chat, max_tokens_for
from kvserve.server.protocol import (
    Body,
    ChatCompletionRequest,
    parse_body,
    validate_body,
    validate_part,
)
from kvserve.server.reasoning_parsers import END, START
from kvserve.server.response_store import ResponseStore, Stored
from kvserve.server.responses import Choice, kvserve_ext
from kvserve.server.state import ServerState

logger = logging.getLogger(__name__)

MAX_INPUT_ITEMS = 4096
LOGPROBS = "message.output_text.logprobs"  # the one 'include' value: the message's logprobs
MAX_METADATA_KEYS = 16  # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512


class TextFormat(Body):
    """``text.format``: plain text, JSON mode or a JSON schema (flat, unlike chat's
    response_format.json_schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint; this model has none


class FunctionTool(Body):
    """A Responses API function tool (flat: name and parameters beside the type)."""

    type: str
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class Reasoning(Body):
    """Accepted and echoed; it sets nothing: a thinking model thinks as its template and
    --reasoning-parser say, and no summary is written."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: Any  # a string, or a list of items (input_messages checks them)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    text: TextOptions | None = None
    tools: list[Any] | None = Field(default=None, max_length=1024)  # _function_tools
    tool_choice: Any = None  # "none", "auto", "required" or a named function (_tool_choice)
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default"] | None = None
    include: list[str] | None = Field(default=None, max_length=64)
    background: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's and kvserve's extras, as on the chat endpoint
    priority: int | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    max_queue_delay: float | None = None
    # OpenAI's, not implemented: accepted null only
    max_tool_calls: Any = None
    conversation: Any = None
    prompt: Any = None
    stream_options: Any = None


# Request fields copied to the chat request under the same name
_PASSED = ("model", "temperature", "top_p", "stream", "user", "safety_identifier",
           "prompt_cache_key", "parallel_tool_calls", "priority", "seed", "top_k", "min_p",
           "stop", "repetition_penalty", "ignore_eos", "min_tokens", "request_id",
           "cache_salt", "max_queue_delay")
# A chat request's field -> the Responses API's, in the errors the chat checks raise
_RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format",
            "messages": "input"}


def parse_responses_request(body: Any) -> ResponsesRequest:
    request = validate_body(ResponsesRequest, body)
    for name in ("max_tool_calls", "conversation", "prompt", "stream_options"):
        if getattr(request, name) is not None:
            raise bad_request(f"field '{name}' is not supported by this server; remove it",
                              param=name)
    unknown = [value for value in request.include or () if value != LOGPROBS]
    if unknown:
        raise bad_request(f"'include' value {unknown[0]!r} is not supported by this server "
                          f"(it includes {LOGPROBS!r} only)", param="include")
    if request.metadata is not None:
        _check_metadata(request.metadata)
    if request.tools is not None:
        request.tools = _function_tools(request.tools)
    if request.tool_choice is not None:
        request.tool_choice = _tool_choice(request.tool_choice)
    return request


def _function_tools(tools: list[Any]) -> list[FunctionTool]:
    """The tools, each a function tool (another type is named in the 400: web search, file
    search and MCP tools are OpenAI's to run)."""
    checked = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind is None:  # QA: "tool type None is not supported"
            raise bad_request(f"tools.{index}: a tool needs its 'type' (\"function\")",
                              param=f"tools.{index}.type")
        if kind != "function":
            raise bad_request(f"tools.{index}: tool type {kind!r} is not supported by this "
                              "server (function tools are)", param=f"tools.{index}.type")
        checked.append(validate_part(FunctionTool, tool, f"tools.{index}"))
    return checked


def _tool_choice(choice: Any) -> str | NamedFunction:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            set(choice) == {"type", "name"} and isinstance(choice["name"], str) and \
            choice["name"]:
        return NamedFunction(type="function", name=choice["name"])
    kind = choice.get("type") if isinstance(choice, dict) else None
    hint = f" (tool type {kind!r} is not supported)" if kind not in (None, "function") else ""
    raise bad_request('\'tool_choice\' must be "none", "auto", "required" or {"type": '
                      f'"function", "name": ...}}{hint}', param="tool_choice")


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"'metadata' has {len(metadata)} keys; at most "
                          f"{MAX_METADATA_KEYS} are allowed", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(f"'metadata' key {key[:64]!r}: keys are at most 64 characters "
                              "and values at most 512", param="metadata")


# -- the conversation -----------------------------------------------------------------------


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The input items as chat messages (each item checked, errors naming ``input.N``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items",
                          param="input")
    if len(items) > MAX_INPUT_ITEMS:
        raise bad_request(f"'input' has {len(items)} items; at most {MAX_INPUT_ITEMS} are "
                          "allowed", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an item (an object such as {{\"role\": "
                              "\"user\", \"content\": ...}})", param=where)
        _common_fields(item, where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where),
                                 "arguments": _text(item, "arguments", where)}}
            _only(item, {"type", "call_id", "name", "arguments", "id", "status", "caller",
                         "namespace"}, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text,
                # or its calls before: one assistant turn, as the chat answer was (QA)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _only(item, {"type", "call_id", "output", "id", "status"}, where)
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                             "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # another model's reasoning, replayed: this model's template has none
        else:
            raise bad_request(f"{where}: item type {kind!r} is not supported by this server "
                              "(it takes message, function_call, function_call_output and "
                              "reasoning items)", param=f"{where}.type")
    return messages


def _common_fields(item: dict[str, Any], where: str) -> None:
    """An item's id and status, as OpenAI writes them, where given (QA: an object as the id,
    "banana" as the status were taken)."""
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise bad_request(f"{where}.id must be a string", param=f"{where}.id")
    if item.get("status") not in (None, "in_progress", "completed", "incomplete"):
        raise bad_request(f"{where}.status must be in_progress, completed or incomplete",
                          param=f"{where}.status")


def check_tool_outputs(conversation: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a call made before it (in the input or the
    previous responses'), as OpenAI requires (QA: an output of no call was taken)."""
    called: set[str] = set()
    for message in conversation:
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise bad_request(f"'input': the function_call_output of call_id "
                              f"{message['tool_call_id'][:100]!r} answers no function_call "
                              "before it (in the input or the previous responses)",
                              param="input")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _only(item, {"type", "role", "content", "id", "status", "phase"}, where)
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role must be user, assistant, system or developer; got "
                          f"{role!r}", param=f"{where}.role")
    return {"role": role, "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (as chat joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts",
                          param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.{index}: {kind} is not supported: this server's "
                              "model reads text only", param=f"{where}.{index}.type")
        else:
            raise bad_request(f"{where}.{index} must be an input_text or output_text part "
                              "with its 'text'", param=f"{where}.{index}")
    return "\n".join(texts)


def _text(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (name != "arguments" and not value):
        kind = "a string" if name == "arguments" else "a non-empty string"  # "" is no args
        raise bad_request(f"{where}.{name} must be {kind}", param=f"{where}.{name}")
    return value


def _only(item: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise bad_request(f"{where}: unknown field {unknown[0]!r}",
                          param=f"{where}.{unknown[0]}")


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the message carries its tokens' logprobs: OpenAI's include value, or
    top_logprobs asked for (which would mean nothing without it)."""
    return LOGPROBS in (req.include or ()) or bool(req.top_logprobs)


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]],
                 messages: list[dict[str, Any]], auto_tools: bool = False
                 ) -> ChatCompletionRequest:
    """The chat request that answers ``req``: its instructions, the previous responses'
    conversation (``history``, without their instructions, as OpenAI's
    previous_response_id) and its input (``messages``); ``auto_tools`` as parse_body's."""
    body: dict[str, Any] = {name: getattr(req, name) for name in _PASSED
                            if getattr(req, name) is not None}
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body["messages"] = system + history + messages
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type != "json_schema" and \
            text_format.schema_ is not None:  # QA: taken, and the schema ignored
        raise bad_request(f"text.format of type {text_format.type} takes no 'schema' (a "
                          "schema is type json_schema's)", param="text.format.schema")
    if text_format is not None and text_format.type == "json_schema":
        if text_format.name is None or text_format.schema_ is None:
            raise bad_request("text.format of type json_schema needs its 'name' and "
                              "'schema'", param="text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name, "schema": text_format.schema_,
            "strict": text_format.strict, "description": text_format.description}}
    elif text_format is not None:
        body["response_format"] = {"type": text_format.type}
    for index, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(f"tools.{index}: tool type {tool.type!r} is not supported by "
                              "this server (function tools are)", param=f"tools.{index}.type")
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)} for tool in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    elif req.tools:
        body["tool_choice"] = "auto"  # OpenAI's default with tools (refused: no parser)
    if wants_logprobs(req):  # chat's, the message's tokens then picked out of them
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    try:
        return parse_body(ChatCompletionRequest, body, auto_tools)
    except APIError as error:
        raise _renamed(error) from None


def _renamed(error: APIError) -> APIError:
    """A chat check's error in the Responses API's words."""
    if error.param is None:
        return error
    head, dot, rest = error.param.partition(".")
    if head == "messages":  # the conversation (history, instructions and input) as a whole
        dot = rest = ""
    elif head == "tools":  # tools.1.function.parameters: flat here, tools.1.parameters
        rest = rest.replace(".function.", ".", 1)
    param = _RENAMED.get(head, head) + dot + rest
    message = error.message.replace(f"'{head}", f"'{_RENAMED.get(head, head)}") \
        if head in _RENAMED else error.message
    for chat_name, name in _RENAMED.items():  # a bound named in it ("[0, max_tokens=2]")
        message = message.replace(f"{chat_name}=", f"{name}=")
    if head == "response_format":
        message = message.replace("response_format.json_schema", "text.format")
    if head == "tools":
        message = message.replace(".function.parameters", ".parameters", 1)
    return APIError(error.status, message, param=param, code=error.code,
                    headers=error.headers)


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


_TOO_LARGE = ("the response is larger than this server's store keeps for a tenant ({} bytes "
              "as JSON, --responses-store-memory)")


class ResponsesGeneration(Generation):
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
        response = self._response(self._status(), self._output(), self._usage())
        if response["status"] == "cancelled":
            response["error"] = None
        elif response["status"] == "failed":
            response["error"] = {"code": "aborted", "message": "the request was aborted "
                                 "before it finished (an operator's abort, or the server's "
                                 "shutdown timeout)"}
        self._keep(response)
        return response

    # the Response object

    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        api = self.api
        text_format = api.text.format if api.text is not None else None
        tool_choice = api.tool_choice or ("auto" if api.tools else "none")
        out: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": self.created,
            "status": status, "background": api.background, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": api.instructions, "max_output_tokens": api.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": api.parallel_tool_calls is not False,
            "previous_response_id": api.previous_response_id,
            "reasoning": {"effort": api.reasoning.effort if api.reasoning else None,
                          "summary": None},
            "service_tier": "default", "store": self.store.enabled and api.store,
            "temperature": 1.0 if api.temperature is None else api.temperature,
            "text": {"format": ({"type": "text"} if text_format is None else
                                text_format.model_dump(by_alias=True, exclude_none=True)),
                     "verbosity": "medium"},
            "tool_choice": (tool_choice.model_dump() if isinstance(tool_choice, NamedFunction)
                            else tool_choice),
            "tools": [tool.model_dump(by_alias=True) for tool in api.tools or ()],
            "top_logprobs": api.top_logprobs or 0, "top_p": 1.0 if api.top_p is None else api.top_p,
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

    def _usage(self) -> dict[str, Any]:
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
        assert self.answer is not None
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
        assert self.answer is not None
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
        low, high = 0, len(ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if len(decode(ids[:middle])) < wanted \
                else (low, middle)
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
            self.store.put(self.response_id, Stored(self.owner, too_large, [], []))
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
        if named and self.answer is not None and self.answer.reasoning is not None:
            named = text = False  # thinks, then calls: the items go out whole, in order
        if named:
            yield self._opened(self._first_call())
        chunk: CompletionChunk | None = first
        try:
            while chunk is not None:
                if chunk.stop_reason in QUEUE_ENDS:
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
        assert self.answer is not None
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
        parser = self.answer.reasoning if self.answer is not None else None
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
        assert self.answer is not None
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
        raise _renamed(error) from None
    if api.background:
        return generation.run_in_background(state.background)
    if api.stream:
        return await generation.stream_response(request)
    return await generation.full_response(request)


async def _start(state: ServerState, request: Request, key: Any, api: ResponsesRequest,
                 conversation: list[dict[str, Any]], arrival_time: float,
                 kind: Any) -> Generation:
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
    return await start(state, request, key, chat(cut), True, arrival_time, kind,
                       strict_context=True)


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
