"""Tool-call parsers for ``"tool_choice": "auto"`` (vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``, docs/structured-outputs.md): the model writes its calls in its own
format, the parser finds them in the answer's text and the answer goes out as OpenAI's
``tool_calls``; text that holds no call (or no call that parses) is the answer's content.

Each parser also says how much of a streamed answer is surely content (``content_end``), so
a stream sends its text as it comes and holds back only what may begin a call; the calls go
out whole, once the answer is complete.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after
  optional content (Hermes 2 and 3, Qwen 2.5 and others' templates).
- ``llama3_json``: the answer is the call, ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``, after an optional ``<|python_tag|>`` (Llama
  3.1, 3.2 and 3.3's JSON tool calling).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ParsedCalls:
    """An answer's text read by a parser: its content (None where there is none), its
    calls, each ``(name, arguments as JSON text)``, and where in the text the content
    ends."""

    content: str | None
    calls: tuple[tuple[str, str], ...]
    content_end: int = 0


class ToolParser(Protocol):
    keeps_special_tokens: bool

    def parse(self, text: str) -> ParsedCalls: ...

    def content_end(self, text: str) -> int: ...


class HermesParser:
    start, end = "<tool_call>", "</tool_call>"
    # vLLM's: the markers may be special tokens, whose text must be kept
    keeps_special_tokens = True
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedCalls:
        at = text.find(self.start)
        if at < 0:
            return ParsedCalls(text, (), len(text))
        calls = []
        for body in self._block.findall(text[at:]):
            call = _call(body)
            if call is None:  # a call that does not parse: the text is the answer
                return ParsedCalls(text, (), len(text))
            calls.append(call)
        content = text[:at]  # as written (vLLM's), a stream's the same
        return ParsedCalls(content if content.strip() else None, tuple(calls), at)

    def content_end(self, text: str) -> int:
        """How much of ``text`` (an answer so far) is content for sure: up to a call's
        start, or up to what may be its first characters."""
        at = text.find(self.start)
        if at >= 0:
            return at
        return len(text) - _partial_suffix(text, self.start)


class Llama3JsonParser:
    tag = "<|python_tag|>"
    keeps_special_tokens = True  # the tag is a special token

    def parse(self, text: str) -> ParsedCalls:
        body = text.strip()
        body = body.removeprefix(self.tag).lstrip()
        if not body.startswith("{"):
            return ParsedCalls(text, (), len(text))
        calls, at = [], 0
        while at < len(body):
            try:
                value, at = raw_json(body, at)
            except ValueError:
                return ParsedCalls(text, (), len(text))
            call = _call_of(value)
            if call is None:
                return ParsedCalls(text, (), len(text))
            calls.append(call)
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                return ParsedCalls(text, (), len(text))
            at = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return ParsedCalls(None, tuple(calls))

    def content_end(self, text: str) -> int:
        """All of it once it cannot be a call (it starts with neither ``{`` nor the tag);
        none while it may be."""
        start = text.lstrip()
        if not start or start.startswith("{") or start.startswith(self.tag) or \
                self.tag.startswith(start):
            return 0
        return len(text)


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")


def _call(body: str) -> tuple[str, str] | None:
    try:
        value = strict_json(body)
    except ValueError:
        return None
    return _call_of(value)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is no JSON number a client reads back")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def strict_json(text: str) -> Any:
    """``text`` as JSON that a strict parser reads back: ValueError where it is not JSON,
    holds NaN, Infinity or a number past a double's range (Python's json takes them; QA:
    a call's arguments went out with NaN), or nests deeper than the interpreter reads (a
    RecursionError was a 500, QA)."""
    body = text.strip(" \t\n\r")
    value, end = raw_json(body, 0)
    if end != len(body):
        raise ValueError("more than one JSON value")
    return value


def raw_json(text: str, at: int) -> tuple[Any, int]:
    """The strict JSON value at ``at`` in ``text`` and where it ends (ValueError as
    :func:`strict_json`)."""
    try:
        return _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def to_json(value: Any) -> str:
    """``value`` as JSON text (ValueError where it nests too deeply to write)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _call_of(value: Any) -> tuple[str, str] | None:
    """``{"name": ..., "arguments" or "parameters": {...}}`` as (name, arguments' JSON)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # JSON text, as some models write it: an object's only
        try:
            arguments = strict_json(arguments)
        except ValueError:
            return None  # not arguments a client could read: the answer is the text (QA)
    if not isinstance(arguments, dict):
        return None
    try:
        return value["name"], to_json(arguments)
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
