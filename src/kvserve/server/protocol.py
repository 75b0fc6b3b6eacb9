"""Request bodies of the OpenAI API as kvserve honours them (pydantic, strict, closed).

docs/architecture.md, rule 5: a field that is accepted works. Unknown fields are refused by
name; OpenAI fields kvserve does not implement are refused by name unless they carry their
neutral value (``best_of: 1``, ``tools: []`` ...), which asks for nothing.
"""

from __future__ import annotations

import json
import unicodedata
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvserve.core.checks import is_one_of
from kvserve.core.request import MAX_CHOICES
from kvserve.model.json_mode import SchemaError, check_schema
from kvserve.server.errors import APIError, bad_request

MAX_STOP_STRINGS = 16

_Int = Annotated[int, Field(strict=True)]


def _is_int_field(annotation: Any) -> bool:
    """``int`` or ``int | None``."""
    return annotation is int or (get_origin(annotation) in (Union, UnionType)
                                 and set(get_args(annotation)) == {int, type(None)})


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """``null`` for an optional field means its default, as OpenAI's API and vLLM take
        ``"n": null`` or ``"stream": null``; a required field's null stays an error."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = [name for name, value in data.items() if value is None and name in fields
                 and not fields[name].is_required() and fields[name].default is not None]
        data = {k: v for k, v in data.items() if k not in nulls} if nulls else data
        return cls._whole_floats_as_ints(data)

    @classmethod
    def _whole_floats_as_ints(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A whole number written as a float (``"max_tokens": 5.0``, as ``budget / 2`` in
        a client's code makes it) is that integer in an integer field, as OpenAI's API and
        vLLM's lax validation take it (QA); 5.5 stays an error, as does "5"."""
        fields = cls.model_fields
        whole = {name: int(value) for name, value in data.items()
                 if isinstance(value, float) and value.is_integer() and name in fields
                 and _is_int_field(fields[name].annotation)}
        return {**data, **whole} if whole else data


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far too
    continuous_usage_stats: bool = False


class FunctionDefinition(Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionName(Body):
    name: str = Field(min_length=1, max_length=256)


class NamedToolChoice(Body):
    """OpenAI's tool_choice naming one function: {"type": "function", "function": {...}}."""

    type: Literal["function"]
    function: FunctionName


class Tool(Body):
    """OpenAI's tool: a function (checked although a served one is ignored: QA)."""

    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # shadows BaseModel's
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: of its constraints only ``choice`` is implemented; the
    others (and its options) are accepted null only."""

    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # "json"
    # would shadow BaseModel.json
    regex: Any = None
    grammar: Any = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_fallback: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None
    whitespace_pattern: Any = None


class SessionRef(Body):
    """kvserve's extension: the multi-turn session a request is a turn of (U1)."""

    # No "/" and not "." or ".." (DELETE /v1/sessions/{id} could not name it: clients
    # normalise such a path), no control characters (C0, DEL or C1) and none that print as
    # nothing (format characters such as a right-to-left override, line and paragraph
    # separators: an id echoed in a message or the event log could disguise itself), and
    # not only blanks.
    id: str = Field(min_length=1, max_length=256)
    ttl: float | None = Field(default=None, gt=0, le=86400)

    @field_validator("id")
    @classmethod
    def _nameable(cls, value: str) -> str:
        if any(c == "/" or unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")
               for c in value):
            raise ValueError("a session id may not contain '/', control characters or "
                             "invisible ones (format characters, line or paragraph "
                             "separators)")
        if not value.strip():
            raise ValueError("a session id may not be only blanks")
        if value in (".", ".."):
            raise ValueError("a session id may not be '.' or '..': a DELETE could not name "
                             "it (clients normalise the path)")
        return value


class _Sampling(Body):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    min_tokens: int = Field(default=0, ge=0, le=1 << 20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: the response carries the prompt's and each choice's token ids (what a session
    # turn should send back, docs/sessions.md)
    return_token_ids: bool = False
    # no cap of its own: prompts x n is bounded by --max-sequences-per-request (QA: a fixed
    # 16 refused vLLM's pass@k evaluations, n=100 and more, whatever the operator allowed)
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)
    priority: int | None = Field(default=None, ge=-(1 << 31), lt=1 << 31)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # kvserve extensions
    # > 0: deadlines are checked as a step begins, after the arrival, so 0 always times out
    max_queue_delay: float | None = Field(default=None, gt=0, le=86400)
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: "" is refused
    session: SessionRef | None = None
    # vLLM's request id in the body (the X-Request-Id header goes first)
    request_id: str | None = None
    # vLLM's: each prompt token's logprob and the top this many (G8: computed, never a
    # prefix-cache hit)
    # (at most --max-logprobs, prompts.check_logprobs; -1: the whole vocabulary, as vLLM's)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=1 << 20)
    # OpenAI's: token id (a string of digits) -> bias added to its logit, clamped to
    # [-100, 100] as vLLM does
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1 << 16)
    # vLLM's: only these token ids may be sampled
    allowed_token_ids: list[_Int] | None = Field(default=None, min_length=1, max_length=1 << 20)
    # vLLM's: words never generated
    bad_words: list[str] | None = Field(default=None, max_length=1024)
    # vLLM's: logprobs name each token "token_id:N" (its text may not be valid UTF-8); null:
    # the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    # OpenAI fields not implemented: accepted only with their neutral value.
    best_of: Any = None
    suffix: Any = None
    # OpenAI's: {"type": "text"} (the default), {"type": "json_object"} (JSON mode) or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    response_format: ResponseFormat | None = None
    # vLLM's own extras not implemented, likewise (a client that sends vLLM's defaults, as
    # LangChain's VLLMOpenAI does, is served; one that asks for more is told which field)
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    # vLLM's: each prompt cut to this many tokens (-1: max_model_len - 1), its last ones
    # unless truncation_side says "right" (its first ones)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=1 << 62)
    truncation_side: Literal["left", "right"] | None = None
    logits_processors: Any = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older structured_outputs.json
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # vLLM's structured output by choice: the output is one of these texts
    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=-1, le=1 << 20)  # --max-logprobs; -1 all
    # OpenAI's: the prompt before each choice's text (and its tokens' logprobs before the
    # answer's, with logprobs); with max_tokens 0, the prompt alone (vLLM's echo without
    # generation: one token is generated and not returned)
    echo: bool = False
    max_tokens: int | None = Field(default=None, ge=0, le=1 << 20)  # 0: with echo only
    # vLLM's: BOS where the model's tokenizer adds one (Llama 3's, Mistral's), true by
    # default as vLLM's (QA: false here dropped a Llama's BOS; the bundled model's
    # tokenizer adds none either way)
    add_special_tokens: bool = True


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # A tool-using history, replayed: an assistant's tool calls and each tool's answer go to
    # the chat template as vLLM sends them (a template without tools renders the content)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = None
    # What an assistant message read back from OpenAI's SDK or vLLM carries: accepted only
    # with their neutral value (_MESSAGE_NEUTRAL), so a saved history is sent again as is.
    refusal: Any = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None
    # a reasoning model's thinking, read back (vLLM's reasoning, once reasoning_content):
    # taken and not rendered, as its templates leave earlier thinking out of the history
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_as_openai_writes_them(cls, calls: list[dict[str, Any]] | None
                                     ) -> list[dict[str, Any]] | None:
        """Each replayed call as OpenAI's API writes one: a function with its name (its
        arguments' JSON text, the object itself as some clients send it, or none); an id and
        the type "function" where given, null standing for none as everywhere in a body
        (QA: {"a": 1} went to the template; LangChain writes "id": null for a call it made
        up)."""
        for index, call in enumerate(calls or ()):
            function = call.get("function")
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                    and function["name"]
                    and isinstance(function.get("arguments"), (str, dict, type(None)))) \
                    or call.get("type") not in (None, "function") \
                    or not isinstance(call.get("id"), (str, type(None))):
                raise ValueError(f"tool call {index} must be {{\"id\": ..., \"type\": "
                                 "\"function\", \"function\": {\"name\": ..., "
                                 "\"arguments\": \"<JSON text>\"}}")
        return calls


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: end the prompt with the assistant's turn opening (default), and more variables
    # for the chat template (a template's own switches)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1, le=1 << 20)  # --max-logprobs; -1 all
    # OpenAI's tools: with tool_choice "none" no call is read from the answer (the template
    # still renders them, as vLLM's default); anything that would need a tool-call parser
    # is refused (_check_tools)
    tools: list[Tool] | None = Field(default=None, max_length=1024)
    # "none" (no call read), a named function or, with one tool, "required" (its call is
    # the answer: its arguments held to the function's parameters, _forced_tool); "auto"
    # would need a tool-call parser
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    store: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # OpenAI's cache-routing hint: the prefix cache finds shared prefixes by their content,
    # so the hint asks for nothing more; and its end-user id, taken as `user` is
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    safety_identifier: str | None = None
    # vLLM's: the answer's content begins with the last message's where that message is the
    # answer's role (an assistant's, continued with continue_final_message)
    echo: bool = False
    # vLLM's chat extras not implemented (neutral values only)
    add_special_tokens: Any = None
    # vLLM's: leave the final (assistant) message open and continue it
    continue_final_message: bool = False
    documents: Any = None
    chat_template: Any = None
    include_reasoning: Any = None
    thinking_token_budget: Any = None


class TokenizeRequest(Body):
    """vLLM's ``/tokenize``: a prompt, or chat messages as the chat endpoint renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # with messages, as the chat endpoint does
    continue_final_message: bool = False  # likewise
    # with a prompt, as the completions endpoint does (true by default, as vLLM's); with
    # messages the template writes them
    add_special_tokens: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=1024)  # with messages: vLLM's
    return_token_strs: bool = False  # vLLM's: each id's token as the vocabulary writes it


class DetokenizeRequest(Body):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[_Int] = Field(max_length=1 << 20)


# The fields kvserve does not implement are those typed Any in the bodies above: null (their
# default) or these values, which ask for nothing, so accepting them honours them.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",),
    "tools": ([],), "parallel_tool_calls": (False, True),
    "functions": ([],), "function_call": ("none",),
    "metadata": ({},), "store": (False,), "modalities": (["text"],),
    # no tiers here: every request is served alike (a tier asked for is served as the
    # default one, as vLLM takes it)
    "service_tier": ("auto", "default", "flex", "priority", "scale"),
    # how long OpenAI keeps a prompt's cache: the prefix cache here keeps blocks until
    # they are needed, whatever is asked
    "prompt_cache_retention": ("in_memory", "24h"),
    # vLLM's defaults
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,), "length_penalty": (1.0,),
    "add_special_tokens": (False,),  # chat's (completions' is honoured)
    # vLLM's: false leaves the reasoning out of the answer (--reasoning-parser's split)
    "include_reasoning": (True, False),
    # nor a reasoning effort to set: the bundled model does not reason (vLLM hands it to the
    # template, which ignores it)
    "reasoning_effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
}


# A message's fields kvserve does not implement (null is their default, also accepted).
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "refusal": (), "function_call": (), "audio": (),
    "annotations": ([],),
}


def _check_neutral(obj: Any, neutral: dict[str, tuple[Any, ...]], prefix: str) -> None:
    """A 400 naming the first field of ``obj`` kvserve does not implement that carries
    something other than its neutral value (null, its default, is always neutral)."""
    for name, values in neutral.items():
        value = getattr(obj, name, None)
        # true is no 1 and 0 no false here (QA: best_of true, use_beam_search 0 taken)
        if value is not None and not is_one_of(value, values):
            hint = _INSTEAD.get(prefix + name)
            raise bad_request(f"field '{prefix}{name}' is not supported by this server; "
                              f"remove it{f' ({hint})' if hint else ''}",
                              param=f"{prefix}{name}")


# What to do instead of a field refused above, where there is something (QA: a bare "not
# supported" for a request's chat template)
_INSTEAD = {
    "chat_template": "the server's template is set where it starts: --chat-template FILE",
}


def validate_body(model: type[Body], body: Any) -> Any:
    """``body`` as ``model`` (its types and bounds only), or a 400 naming the first bad
    field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise bad_request(*_describe(error)) from None


def parse_body(model: type[Body], body: Any, auto_tools: bool = False) -> Any:
    """Validate ``body`` into ``model`` (a completions, chat or tokenize body) with every
    check of the fields it holds, or raise a 400 naming the first bad field. ``auto_tools``:
    the server parses tool calls (--enable-auto-tool-choice), so "auto" is served."""
    request = validate_body(model, body)
    _check_tools(request, auto_tools)  # before tool_choice's neutral values: its message
    # the fields kvserve does not implement are those typed Any (one an endpoint honours,
    # completions' echo or add_special_tokens, has its type there)
    _check_neutral(request, {name: _NEUTRAL.get(name, ())
                             for name, field in model.model_fields.items()
                             if field.annotation is Any}, "")
    response_format = getattr(request, "response_format", None)
    if response_format is not None and (response_format.type == "json_schema") != (
            response_format.json_schema is not None and
            response_format.json_schema.schema_ is not None):
        raise bad_request("'response_format.json_schema' with its 'schema' goes with type "
                          "json_schema, and type json_schema needs them (QA: without a "
                          "schema the answer was free text)", param="response_format")
    json_schema_text(request)  # a 400 naming what is wrong with it, now
    structured = getattr(request, "structured_outputs", None)
    if structured is not None:
        for name, field in StructuredOutputs.model_fields.items():
            if field.annotation is Any and getattr(structured, name) is not None:
                key = field.alias or name
                raise bad_request(f"field 'structured_outputs.{key}' is not supported by this "
                                  "server (of vLLM's structured outputs 'choice', 'json' and "
                                  "'json_object' are); remove it",
                                  param=f"structured_outputs.{key}")
        if structured.choice is None and not structured.json_object and \
                structured.json_schema is None:
            raise bad_request("'structured_outputs' needs 'choice', 'json' or 'json_object': "
                              "true (the constraints this server implements)",
                              param="structured_outputs")
        if getattr(request, "guided_choice", None) is not None:
            raise bad_request("give 'structured_outputs.choice' or 'guided_choice', not both",
                              param="guided_choice")
    for index, message in enumerate(getattr(request, "messages", None) or ()):
        _check_neutral(message, _MESSAGE_NEUTRAL, f"messages.{index}.")
    stop = getattr(request, "stop", None)
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stop)} strings; at most "
                          f"{MAX_STOP_STRINGS} are allowed", param="stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not all(stops):
        raise bad_request("'stop' must hold non-empty strings (an empty one would stop "
                          "before any text)", param="stop")
    return request


def json_schema_text(request: Any) -> str | None:
    """The JSON schema a request holds its answer to (OpenAI's response_format json_schema,
    vLLM's structured_outputs.json or guided_json, a forced tool's parameters), as JSON
    text, checked: a 400 naming the
    field when it is given twice, is not JSON, or asks what kvserve/model/json_mode.py does
    not honour."""
    given = json_schema_given(request)
    return None if given is None else given[1]


def json_schema_given(request: Any) -> tuple[str, str] | None:
    """json_schema_text's schema with the field it came in (``guided_json``,
    ``tools.0.function.parameters``)."""
    response_format = getattr(request, "response_format", None)
    structured = getattr(request, "structured_outputs", None)
    given = [(param, schema) for param, schema in (
        ("response_format", response_format.json_schema.schema_
         if response_format is not None and response_format.json_schema is not None
         else None),
        ("structured_outputs.json", structured.json_schema if structured is not None else None),
        ("guided_json", getattr(request, "guided_json", None)),
        *_tool_parameters(request), *_required_calls_schema(request)) if schema is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one JSON schema, not {given[0][0]} and {given[1][0]}",
                          param=given[1][0])
    param, schema = given[0]
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        check_schema(text)
    except SchemaError as error:
        raise bad_request(f"'{param}': {error}", param=param) from None
    return param, text


def calls_required(request: Any) -> bool:
    """tool_choice "required" among several tools: the answer is one call or more of any
    of them (one, with parallel_tool_calls false), as {"tool_calls": [{"name": ...,
    "parameters": {...}}, ...]}, which the server turns into OpenAI's tool_calls."""
    return getattr(request, "tool_choice", None) == "required" and \
        len(getattr(request, "tools", None) or ()) > 1


def _required_calls_schema(request: Any) -> list[tuple[str, dict[str, Any]]]:
    """The schema of calls_required's answer: a call is an object tagged by its "name"."""
    if not calls_required(request):
        return []
    for index, tool in enumerate(request.tools):  # named where they are, not in the union
        if tool.function.parameters is not None:
            param = f"tools.{index}.function.parameters"
            try:
                check_schema(json.dumps(tool.function.parameters))
            except SchemaError as error:
                raise bad_request(f"'{param}': {error}", param=param) from None
    defs: dict[str, Any] = {}
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
         "properties": {"name": {"const": tool.function.name}, "parameters": _hoisted(
             tool.function.parameters or {"type": "object"}, f"tool{index}.", defs)}}
        for index, tool in enumerate(request.tools)]}}
    if request.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return [("tools", {"type": "object", "required": ["tool_calls"], "$defs": defs,
                       "additionalProperties": False, "properties": {"tool_calls": calls}})]


# Keywords whose values are data, not schemas: a "$ref" in them is not a reference.
_DATA = frozenset({"enum", "const", "default", "examples"})


def _hoisted(schema: Any, prefix: str, defs: dict[str, Any]) -> Any:
    """A tool's parameters within the calls' schema: its definitions ($defs, definitions)
    moved to the root of that schema as ``prefix`` + name, where its references (which
    mean the parameters' own root) then find them (QA: a nested pydantic model's tool
    was refused among several, taken alone)."""
    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for local in ("#/$defs/", "#/definitions/"):
                    if value.startswith(local):
                        value = "#/$defs/" + prefix + value[len(local):]
                out[key] = value
            elif key == "properties" and isinstance(value, dict):  # names, then schemas
                out[key] = {name: moved(sub) for name, sub in value.items()}
            else:
                out[key] = value if key in _DATA else moved(value)
        return out

    if not isinstance(schema, dict):
        return schema
    for keyword in ("$defs", "definitions"):
        if isinstance(schema.get(keyword), dict):
            defs.update({prefix + name: moved(value)
                         for name, value in schema[keyword].items()})
    return moved({key: value for key, value in schema.items()
                  if key not in ("$defs", "definitions")})


def _tool_parameters(request: Any) -> list[tuple[str, dict[str, Any]]]:
    """The forced function's parameters, the schema of its arguments (none given: an
    object of any keys), named by where they are; [] when no function is forced."""
    function = forced_tool(request)
    if function is None:
        return []
    index = [tool.function for tool in request.tools].index(function)
    return [(f"tools.{index}.function.parameters",
             function.parameters if function.parameters is not None else {"type": "object"})]


def auto_tools(request: Any) -> bool:
    """Tools given with tool_choice "auto" (or none given: OpenAI's default with tools)."""
    return bool(getattr(request, "tools", None)) and \
        getattr(request, "tool_choice", None) in (None, "auto")


def _check_tools(request: Any, auto_allowed: bool) -> None:
    """Tools with tool_choice "none" are served, the tools ignored, as vLLM serves them; a
    named function (or "required" with one tool) makes its call the answer (forced_tool),
    "required" among several tools one call or more of them (calls_required); "auto" (the
    default when tools are given, as OpenAI's and vLLM's) needs a tool-call parser: served
    where the server has one (``auto_allowed``), else a 400 saying so."""
    tools = getattr(request, "tools", None)
    choice = getattr(request, "tool_choice", None)
    names = [tool.function.name for tool in tools or ()]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise bad_request(f"tools name the function {twice!r} twice", param="tools")
    if not tools or "tool_choice" not in type(request).model_fields:  # /tokenize's: shown
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return
    if choice == "none":
        return
    if choice is None or choice == "auto":
        if auto_allowed:
            _check_call_names(names)
            return
        raise bad_request('"auto" tool choice needs a tool-call parser, which this server '
                          'was not started with (--enable-auto-tool-choice '
                          '--tool-call-parser NAME); name the function in "tool_choice" (its '
                          'call is the answer), or send "tool_choice": "none" to have the '
                          "tools ignored", param="tool_choice")
    forced_tool(request)  # a name among the tools
    other = next((name for name in ("response_format", "structured_outputs", "guided_json",
                                    "guided_choice")
                  if getattr(request, name, None) is not None and not (
                      name == "response_format" and request.response_format.type == "text")),
                 None)
    if other is not None:
        raise bad_request(f"a tool_choice that asks for a call makes the answer that call: "
                          f"'{other}' cannot be given with it", param=other)


def _check_call_names(names: list[str]) -> None:
    """Under "auto" each name must be one the parser reads a call to (QA: a function named
    "get weather" was served, and the model's call to it came back as its text)."""
    from kvserve.server.tool_parsers import CALL_NAME

    for index, name in enumerate(names):
        if not CALL_NAME.fullmatch(name):
            raise bad_request(f"{name!r}: under tool_choice \"auto\" a function's name is "
                              "1 to 128 letters, digits, _, . or - (as OpenAI's API takes "
                              "one), so that the model's call to it can be read",
                              param=f"tools.{index}.function.name")


def forced_tool(request: Any) -> FunctionDefinition | None:
    """The function whose call is the answer (tool_choice names it, or "required" with one
    tool); a 400 naming what is wrong."""
    tools = getattr(request, "tools", None)
    choice = getattr(request, "tool_choice", None)
    if not tools or choice in (None, "none", "auto"):
        return None
    if choice == "required":
        return tools[0].function if len(tools) == 1 else None  # several: required_calls
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool.function
    raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is "
                      f"not among the tools ({', '.join(t.function.name for t in tools)})",
                      param="tool_choice")


def validate_part(model: type[Body], value: Any, where: str) -> Any:
    """``value`` (part of a body, at ``where``) as ``model``, or a 400 naming the first bad
    field from the body's root (``tools.0.name``)."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise bad_request(*_describe(error, where)) from None


def _describe(error: ValidationError, where: str = "") -> tuple[str, str]:
    errors = error.errors()
    # An unknown key in an object of the right kind is the problem to name, even in one form
    # of a union field (a text part's extra key read as "image parts are not supported");
    # in an object of another kind (an image part) the union's forms are.
    wrong_kind = {tuple(e["loc"][:-1]) for e in errors if e["type"] == "literal_error"}
    first = next((e for e in errors if e["type"] == "extra_forbidden"
                  and tuple(e["loc"][:-1]) not in wrong_kind), None) or _deepest(errors)
    loc = ".".join([where] * bool(where) + [str(part) for part in first["loc"]
                                            if not _is_union_tag(part)])
    if first["type"] == "extra_forbidden":
        return f"unknown field '{loc}': this server does not know it; remove it", loc
    if first["type"] == "missing":
        return f"field '{loc}' is required", loc
    union = next((i for i, part in enumerate(first["loc"]) if _is_union_tag(part)), None)
    if union is not None:  # what the field may be, not why its first form failed
        field = ".".join(str(part) for part in first["loc"][:union])
        forms = _UNION_FORMS.get(field.rsplit(".", 1)[-1])
        if forms is not None:
            return f"field '{field}' must be {forms}", field
    if first["type"] == "model_type":
        message = "input should be a JSON object"
    else:
        message = first["msg"].removeprefix("Value error, ")  # a validator's own words
        message = message[:1].lower() + message[1:]  # type names keep their case
    shown = _as_json(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"field '{loc}': {message} (got {shown})", loc


def _as_json(value: Any) -> str:
    """The value as the client wrote it (true, null, ["a", 1]), not as Python shows it, with
    invisible characters (control, format, line and paragraph separators, lone surrogates)
    escaped so a message shows them (a DEL was printed raw: "got "ab"")."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in _INVISIBLE else c
                   for c in text)


_INVISIBLE = ("Cc", "Cf", "Cs", "Zl", "Zp")


def check_session_id(session_id: str) -> None:
    """A 400 naming the rule a session id in a path breaks (DELETE /v1/sessions/{id}), as
    the request body's ``session.id`` is checked."""
    try:
        SessionRef(id=session_id)
    except ValidationError as error:
        message, _ = _describe(error)
        raise bad_request(message.replace("field 'id'", "session id", 1),
                          param="session_id") from None


# The forms a union-typed field takes, by its name, for the message when none fits.
_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...}); image, '
               "audio and other parts are not supported",
    "stop": "a string or a list of strings",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}',
    "guided_json": "a JSON schema: an object, or its JSON text",
    "json": "a JSON schema: an object, or its JSON text",
}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member it tried (``str``, ``list[int]``,
    ``literal['none','auto']``, a model's class name) in the location."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool")
        or part.startswith(("list[", "dict[", "literal[", "function-"))
        or part in _body_class_names())


def _body_class_names() -> set[str]:
    """The request models' class names (a union of models names the one it tried)."""
    names, todo = set(), [Body]
    while todo:
        for cls in todo.pop().__subclasses__():
            names.add(cls.__name__)
            todo.append(cls)
    return names


def _depth_in_union(error: Any) -> int:
    """How far past the union member it tried an error lies (0 where it is not in one, or
    where the value was not of that member's kind at all)."""
    loc = error["loc"]
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    return 0 if tag is None else len(loc) - tag - 1


def _deepest(errors: list[Any]) -> Any:
    """The error to name: where a union's member took the value in (an object of its kind)
    and failed inside it, that failure (tool_choice's missing function.name, not "should be
    'none', 'auto' or 'required'"); else the first."""
    depth = max(_depth_in_union(error) for error in errors)
    return next(e for e in errors if _depth_in_union(e) == depth) if depth else errors[0]


def model_error(name: str | None, served: str | tuple[str, ...]) -> APIError:
    names = (served,) if isinstance(served, str) else served
    return APIError(404, f"the model '{name}' does not exist; this server serves "
                         f"{', '.join(repr(n) for n in names)}", param="model",
                    code="model_not_found")
