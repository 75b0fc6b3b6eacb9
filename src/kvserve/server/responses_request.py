"""The Responses API's request (``POST /v1/responses``, docs/responses-api.md): its body
checked, with errors that name the Responses API's fields, and translated for the chat
pipeline:

    body -> ResponsesRequest (checked, errors name the Responses API's fields)
    -> the conversation: the previous response's (previous_response_id, from the store)
       + instructions + input items, as chat messages
    -> a chat request (text.format -> response_format, flat tools -> chat tools)

server/responses_api.py runs it (generation.start) and makes its answer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import (
    Body,
    ChatCompletionRequest,
    parse_body,
    validate_body,
    validate_part,
)

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

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
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
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # kept until needed
    text: TextOptions | None = None
    tools: list[Any] | None = Field(default=None, max_length=1024)  # _function_tools
    tool_choice: Any = None  # "none", "auto", "required" or a named function (_tool_choice)
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None
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
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: "" is refused
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
                         "namespace", "async"}, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn's text,
                # or its calls before: one assistant turn, as the chat answer was (QA)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _only(item, {"type", "call_id", "output", "id", "status", "name", "caller",
                         "namespace"}, where)
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
    previous responses'), and each call has its output, as OpenAI requires (QA: an output
    of no call was taken, and a call with no output)."""
    called: set[str] = set()
    unanswered: dict[str, None] = {}  # in call order
    for message in conversation:
        for call in message.get("tool_calls") or ():
            called.add(call["id"])
            unanswered[call["id"]] = None
        if message["role"] == "tool":
            if message["tool_call_id"] not in called:
                raise bad_request(f"'input': the function_call_output of call_id "
                                  f"{message['tool_call_id'][:100]!r} answers no "
                                  "function_call before it (in the input or the previous "
                                  "responses)", param="input")
            unanswered.pop(message["tool_call_id"], None)
    if unanswered:
        call_id = next(iter(unanswered))
        raise bad_request(f"'input': no function_call_output for the function_call of call_id "
                          f"{call_id[:100]!r} (in the input or the previous responses): send "
                          "one for each call", param="input")


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
        raise in_responses_words(error) from None


def in_responses_words(error: APIError) -> APIError:
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
    if head == "messages":  # QA: "... no room to generate; shorten the messages"
        message = message.replace("the messages", "the input")
    return APIError(error.status, message, param=param, code=error.code,
                    headers=error.headers)
