"""From a validated body to engine requests: prompts as token ids (tokenised off the event
loop by the caller), the length checks against max_model_len, and SamplingParams."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from kvserve.core import RequestError, SamplingParams
from kvserve.engine.text import Tokenizer, bad_words_token_ids, choice_token_ids
from kvserve.server.errors import APIError, bad_request
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    json_schema_given,
)
from kvserve.server.reasoning_parsers import END as THINK_END
from kvserve.server.reasoning_parsers import START as THINK_START
from kvserve.server.reasoning_parsers import ThinkParser
from kvserve.server.state import ServerState
from kvserve.server.tool_parsers import strict_json

logger = logging.getLogger("kvserve.server")


def encode_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
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
        ids = state.tokenizer.encode(item, req.add_special_tokens) if isinstance(item, str) \
            else list(item)
        where = "'prompt'" if len(prompts) == 1 else f"prompt {index}"
        if not ids:
            raise bad_request(f"{where} is empty", param="prompt")
        check_token_ids(ids, vocab_size, where, "prompt")
        encoded.append(ids)
    return encoded


def truncated(state: ServerState, req: Any, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt cut to that many tokens (-1: as many
    as leave one to generate), its last ones, as vLLM's tokenizer of a generative model cuts,
    or with ``truncation_side: "right"`` its first ones; more than the context is a 400. A
    prompt not cut is the same list, as its echo tells."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return prompts
    limit = state.max_model_len
    if keep > limit:
        raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than "
                          f"max_model_len = {limit}; ask for a smaller truncation",
                          param="truncate_prompt_tokens")
    if keep == 0:
        raise bad_request("truncate_prompt_tokens=0 leaves no prompt; ask for at least 1 "
                          "token (or -1: as many as the context takes)",
                          param="truncate_prompt_tokens")
    keep = limit - 1 if keep < 0 else keep
    if req.truncation_side == "right":
        return [prompt[:keep] if len(prompt) > keep else prompt for prompt in prompts]
    # a text prompt's leading special tokens (a BOS) stay, as vLLM's tokenizer truncates
    # one by default (an explicit side, or token ids, are sliced as they are)
    sent = getattr(req, "prompt", None)  # a completion's (a chat's template writes its own)
    texts = isinstance(sent, str) or (isinstance(sent, list) and
                                      all(isinstance(p, str) for p in sent))
    added = state.tokenizer.encode("", True) if req.truncation_side is None and texts and \
        getattr(req, "add_special_tokens", False) else []
    return [_last_tokens(prompt, keep, added) for prompt in prompts]


def _last_tokens(prompt: list[int], keep: int, added: list[int]) -> list[int]:
    """``prompt``'s last ``keep`` tokens, its leading ``added`` ones (a BOS) counted among
    them and kept where it starts with them; ``prompt`` itself where it is short enough."""
    if len(prompt) <= keep:
        return prompt
    if added and len(added) < keep and prompt[:len(added)] == added:
        return added + prompt[len(prompt) - keep + len(added):]
    return prompt[-keep:]


def encode_chat(state: ServerState, req: ChatCompletionRequest) -> list[list[int]]:
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    return [chat_ids(state, req.messages, req.add_generation_prompt,
                     req.chat_template_kwargs, req.continue_final_message, tools)]


# What the template is rendered with already: chat_template_kwargs may not set them.
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "continue_final_message", "bos_token",
                 "eos_token", "unk_token", "pad_token")


def chat_ids(state: ServerState, chat: list[ChatMessage],
             add_generation_prompt: bool = True,
             template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """``chat`` through the model's chat template, as the chat endpoint sends it; ``tools``
    (OpenAI's, as sent) to the template as its ``tools``, as vLLM and transformers pass
    them (a template without tools renders none)."""
    messages = []
    for index, message in enumerate(chat):
        content = message.content
        if content is None and message.role != "assistant":  # an assistant's may be empty
            # (OpenAI: when it holds tool calls)
            raise bad_request(f"messages[{index}] ({message.role}) has no 'content'",
                              param=f"messages.{index}.content")
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        # OpenAI's developer message is the system prompt under another name (its newer
        # models' word): a template that knows no such role rendered it as a turn.
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_arguments_as_object(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    taken = [name for name in _TEMPLATE_OWN if name in (template_kwargs or ())]
    if taken:
        raise bad_request(f"'chat_template_kwargs' may not set {taken[0]!r}: the server "
                          "renders the template with it", param="chat_template_kwargs")
    # the request's tools, unless chat_template_kwargs sets its own (vLLM's)
    variables = {**({"tools": tools} if tools else {}), **(template_kwargs or {})}
    try:
        return state.tokenizer.encode_chat(messages, add_generation_prompt,
                                           continue_final_message, **variables)
    except MemoryError:
        raise
    except Exception as error:  # the template's failure on this request (a TypeError, an
        # undefined attribute, the sandbox's refusal, a deep tool-call argument): the
        # request's fault, as vLLM answers it (QA: a 500 unless chat_template_kwargs was set)
        what = "" if isinstance(error, ValueError) else f"{type(error).__name__}: "
        if not isinstance(error, (ValueError, RecursionError)):  # a template's TypeError,
            # or kvserve's bug: logged (not a deep argument's thousand frames, per request)
            logger.info("the chat template failed on a request", exc_info=True)
        with_kwargs = " with 'chat_template_kwargs'" if template_kwargs else ""
        raise bad_request(f"cannot apply the chat template{with_kwargs}: {what}{error}",
                          "chat_template_kwargs" if template_kwargs else "messages") from None


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    """A replayed tool call with its arguments as an object, not the JSON text OpenAI's API
    carries: templates write them with ``tojson``, and the model then reads its own call in
    the shape it was taught (QA: the text was written as a quoted string), as vLLM does."""
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if arguments is None or arguments == "":  # none given: {}, as vLLM's (QA: tojson of
        return {**call, "function": {**function, "arguments": {}}}  # Undefined, a 400)
    if not isinstance(arguments, str):
        return call
    try:
        parsed = strict_json(arguments)
    except ValueError:  # not JSON, or nested past what can be read (QA: a 500)
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def _tokens(count: int) -> str:
    return "1 token" if count == 1 else f"{count} tokens"


def check_token_ids(ids: Any, vocab_size: int, where: str, param: str) -> None:
    """A 400 naming the first id of ``ids`` outside the vocabulary [0, vocab_size)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{where} has token id {bad}, outside the vocabulary "
                          f"[0, {vocab_size})", param=param)


def check_stop_token_ids(state: ServerState, req: Any) -> None:
    """A stop token the model cannot sample would never stop anything, nor a bias on it do
    anything: 400, as a prompt token outside the vocabulary is; likewise an allowed token."""
    vocab_size = state.tokenizer.vocab_size
    check_token_ids(req.stop_token_ids or (), vocab_size, "'stop_token_ids'", "stop_token_ids")
    check_token_ids(logit_bias(req), vocab_size, "'logit_bias'", "logit_bias")
    check_token_ids(req.allowed_token_ids or (), vocab_size, "'allowed_token_ids'",
                    "allowed_token_ids")


def check_logprobs(state: ServerState, req: Any, chat: bool) -> None:
    """A 400 naming the field that asks for more logprobs than --max-logprobs allows; -1
    (vLLM's: the whole vocabulary) is set to the vocabulary's size in ``req``, so that what
    reads the field later reads a count."""
    limit = state.max_logprobs
    fields = ("top_logprobs", "prompt_logprobs") if chat else ("logprobs", "prompt_logprobs")
    for name in fields:
        asked = getattr(req, name)
        whole = ""
        if asked == -1:
            asked = state.tokenizer.vocab_size
            whole = f" (-1: the whole vocabulary, {asked})"
        if asked is not None and asked > limit:
            raise bad_request(f"'{name}' is {getattr(req, name)}{whole}, more than this server "
                              f"gives: at most {limit} (--max-logprobs)", param=name)
        if whole:
            setattr(req, name, asked)


def logit_bias(req: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) with integer keys, each bias
    clamped to [-100, 100] as vLLM does; a 400 for a key that is not a token id."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"'logit_bias' keys are token ids (strings of digits), got "
                              f"{key[:40]!r}", param="logit_bias")
        if len(key.lstrip("0")) > 18:  # int() of thousands of digits is slow, then refused
            # (leading zeros are no digits of it: QA, "00000000000000000001" is token 1)
            raise bad_request(f"'logit_bias' has token id {key[:40]}..., outside the "
                              "vocabulary", param="logit_bias")
        bias[int(key)] = min(100.0, max(-100.0, value))
    return bias


def context_exceeded(message: str, param: str) -> APIError:
    """A 400 that clients recognise as a context overflow: the message holds vLLM's and
    OpenAI's "This model's maximum context length is N tokens" (agent frameworks trim their
    history on that sentence, or on the code), the code is OpenAI's."""
    return APIError(400, message, param=param, code="context_length_exceeded")


def max_tokens_for(state: ServerState, req: Any, chat: bool, prompts: list[list[int]],
                   strict: bool = False) -> int:
    """The request's max_tokens, checked against the context: a prompt that leaves no room
    to generate, or a max_tokens past the whole context, is a 400
    (``context_length_exceeded``); one that only overruns what a prompt leaves is served
    cut short to it (``finish_reason: "length"``), as vLLM's get_max_tokens does, prompt by
    prompt (:func:`room_for`). ``strict``: that too is the 400 (the Responses API's
    truncation, which drops history until the answer fits whole)."""
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    which = "" if len(prompts) == 1 else \
        f" (prompt {[len(p) for p in prompts].index(longest)} of the list)"
    if longest >= limit:
        field = "messages" if chat else "prompt"
        raise context_exceeded(f"This model's maximum context length is {limit} tokens "
                               f"(max_model_len). However, your request has "
                               f"{_tokens(longest)} of input{which}, which leaves no room to "
                               f"generate; shorten the {field}", field)
    asked = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    if asked == 0:  # echo without generation: one token generated, none returned
        if not req.echo:
            raise bad_request("max_tokens 0 asks for no token: only with 'echo': true (the "
                              "prompt scored, nothing generated)", param="max_tokens")
        asked = 1
    cap = state.max_tokens_cap
    if asked is None:  # chat: the generation config's default, else the room; a completion:
        # OpenAI's 16, the default vLLM's completions request has of its own
        default = state.sampling_defaults.get("max_tokens") if chat else 16
        room = limit - longest if default is None else min(default, limit - longest)
        return room if cap is None else min(room, cap)
    if longest + asked > limit and (strict or asked > limit):
        name = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
        raise context_exceeded(f"'{name}' is too large: {asked}. This model's maximum context "
                               f"length is {limit} tokens (max_model_len) and your request "
                               f"has {_tokens(longest)} of input{which} ({asked} > {limit} - "
                               f"{longest}); ask for at most {_tokens(limit - longest)}", name)
    return asked if cap is None else min(asked, cap)


def room_for(state: ServerState, params: SamplingParams, prompt: list[int]) -> SamplingParams:
    """``params`` with max_tokens cut to what ``prompt`` leaves of the context, as vLLM cuts
    each prompt's (QA: a chat client's fixed max_tokens on a long history was a 400 here,
    served cut short by vLLM)."""
    room = state.max_model_len - len(prompt)
    if params.min_tokens > room:  # vLLM's: above the max_tokens the context leaves
        raise bad_request(f"min_tokens {params.min_tokens} is more than the prompt leaves of "
                          f"this model's context ({_tokens(len(prompt))} of "
                          f"{state.max_model_len}, max_model_len): ask for at most "
                          f"{_tokens(room)}", param="min_tokens")
    if params.max_tokens is None or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=room)


def _token_constraints(req: Any, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The body's constraints on the tokens, as SamplingParams fields: logit_bias,
    allowed_token_ids, bad_words and the structured outputs (choices, JSON mode, a JSON
    schema), with the token ids of words and choices where the tokenizer is here."""
    structured = req.structured_outputs
    choices = req.guided_choice or (structured.choice if structured is not None else None) or ()
    words = req.bad_words or ()
    schema = json_schema_given(req)
    return {
        "logit_bias": tuple(logit_bias(req).items()),
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": tuple(words),
        "bad_words_token_ids": bad_words_token_ids(tokenizer, words) if tokenizer else (),
        "choices": tuple(choices),
        "choice_token_ids": choice_token_ids(tokenizer, choices) if tokenizer else (),
        "json_object": bool(structured is not None and structured.json_object) or (
            req.response_format is not None and req.response_format.type == "json_object"),
        "json_schema": None if schema is None else schema[1],
    }


def _structured_fields(req: Any) -> dict[str, str]:
    """The body's field each of the engine's structured-output fields came from, for its
    refusals (QA: "choices must be ... got ('',)" for guided_choice, "JSON output ends at
    EOS" for a forced tool call)."""
    structured = req.structured_outputs
    schema = json_schema_given(req)
    schema_field = "json_schema" if schema is None else schema[0]
    return {
        "choices": "guided_choice" if req.guided_choice else "structured_outputs.choice",
        "json_object": "structured_outputs.json_object"
        if structured is not None and structured.json_object else "response_format",
        # a forced call's (or calls') schema: the tool_choice that asked for it
        "json_schema": "tool_choice" if schema_field.startswith("tools.") else schema_field,
    }


def _in_body_terms(message: str, req: Any) -> tuple[str, str | None]:
    """An engine refusal's message in the body's field names, and the field it is about
    (the first word of the message; a structured output by the field it came in)."""
    fields = _structured_fields(req)
    schema_or_mode = fields["json_schema"] if fields["json_schema"] != "json_schema" \
        else fields["json_object"]
    for prefix, field, said in (
            ("choices end", fields["choices"], "the choices '{}' gives end"),
            ("JSON output ends", schema_or_mode, "the JSON output '{}' asks for ends")):
        if message.startswith(prefix):  # "... at EOS: min_tokens must be 0"
            return said.format(field) + message[len(prefix):], field
    words = message.split(" ")
    for index, word in enumerate(words):  # the names, at the start or after "not"/"and"
        if word in fields and (index == 0 or words[index - 1] in ("not", "and")):
            words[index] = f"'{fields[word]}'"
    name = message.split(" ", 1)[0]
    field = fields.get(name, name)
    return " ".join(words), field if name in fields or name in type(req).model_fields \
        else None


def _thinking_first(reasoning: ThinkParser | None) -> dict[str, Any]:
    """The SamplingParams fields that hold a thinking answer's structured output (if it
    has one) from the end of its thinking on."""
    if reasoning is None:
        return {}
    return {"think_markers": (THINK_START, THINK_END), "think_open": reasoning.opened}


# The fields a model's generation config may give a default (--generation-config)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(req: Any, chat: bool, max_tokens: int, priority: int,
                    tenant: str = "", tokenizer: Tokenizer | None = None,
                    defaults: Mapping[str, Any] | None = None,
                    reasoning: ThinkParser | None = None) -> SamplingParams:
    """The engine's params for a checked body; ``tokenizer`` turns bad words and choices
    into their token ids (here: an engine process has no tokenizer);
    ``defaults`` (--generation-config's) fill the DEFAULTED fields the body left unset;
    ``reasoning``: the answer thinks first, its structured output held from the end of its
    thinking on."""
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "max_queue_delay", "cache_salt",
        "prompt_logprobs") if getattr(req, name) is not None}
    for name in DEFAULTED:
        if name not in given and defaults and name in defaults:
            given[name] = defaults[name]
    if not chat and req.echo and logprobs is not None:  # the echoed prompt's logprobs too
        if req.session is not None:
            raise bad_request("'echo' with 'logprobs' needs the prompt's logprobs, which a "
                              "session turn cannot give (its held tokens are not computed "
                              "again, rule G8)", param="echo")
        given["prompt_logprobs"] = max(logprobs, req.prompt_logprobs or 0)
    if req.session is not None:
        given["session_id"], given["session_ttl"] = req.session.id, req.session.ttl
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, n=req.n,
                              ignore_eos=req.ignore_eos, stop=stop,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens,
                              stop_token_ids=tuple(req.stop_token_ids or ()),
                              priority=priority, logprobs=logprobs, tenant=tenant,
                              **_token_constraints(req, tokenizer),
                              **_thinking_first(reasoning), **given)
    except RequestError as error:  # its message starts with the field it is about
        raise bad_request(*_in_body_terms(str(error), req)) from None
