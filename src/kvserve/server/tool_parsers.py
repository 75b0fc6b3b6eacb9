"""Tool-call parsers for ``"tool_choice": "auto"`` (vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``, docs/structured-outputs.md): the model writes its calls in its own
format, the parser finds them in the answer's text and the answer goes out as OpenAI's
``tool_calls``; text that holds no call (or no call that parses) is the answer's content.

Each parser also says how much of a streamed answer is surely content (``content_end``), so
a stream sends its text as it comes and holds back only what may begin a call, and what of
its calls the text has written so far (``calls_so_far``): a call goes out once its name is
whole, then its arguments as the model writes them (their text as written, which the whole
answer's ``arguments`` holds as the same JSON value; pythonic's calls go out whole at the
end, as their arguments are Python, not JSON).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after
  optional content (Hermes 2 and 3, Qwen 2.5 and others' templates).
- ``llama3_json``: the answer is the call, ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several separated by ``;``, after an optional ``<|python_tag|>`` (Llama
  3.1, 3.2 and 3.3's JSON tool calling).
- ``mistral``: ``[TOOL_CALLS]`` after optional content, then the calls as a JSON list
  ``[{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Mixtral, Nemo) or, in the
  newer tokenizers' form, each ``name[ARGS]{...}`` after its own ``[TOOL_CALLS]`` (Mistral
  Small 3.2, Magistral, Devstral).
- ``pythonic``: the answer is a Python list of calls with keyword arguments of literal
  values, ``[get_weather(city="Oslo"), now()]``, optionally between ``<|python_start|>``
  and ``<|python_end|>`` (Llama 3.2's and Llama 4's pythonic tool calling, ToolACE); read
  with Python's parser as data, never run.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.model.detokenizer import held_length

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass(frozen=True)
class ParsedCalls:
    """An answer's text read by a parser: its content (None where there is none), its
    calls, each ``(name, arguments as JSON text)``, and where in the text the content
    ends."""

    content: str | None
    calls: tuple[tuple[str, str], ...]
    content_end: int = 0


@dataclass(frozen=True)
class CallSoFar:
    """A call as much of it as a streamed answer has written: its name once whole (None
    before), its arguments' text written so far, and whether they are complete."""

    name: str | None
    arguments: str
    done: bool


class Scanned:
    """What the scan of one streamed answer learned, kept from chunk to chunk (ToolCalls
    keeps one per choice) so that each chunk scans only what is new. Without it a call's
    arguments of n pieces were scanned whole each chunk, n^2 / 2 pieces over the stream;
    a long string was read from its opening quote each chunk (QA: 4 s of the event loop for
    20 kB), and each chunk walked every finished call and every field of an unfinished
    object again (QA: seconds for 100 calls, or a JSON answer of 300 keys).

    By where each starts: a JSON value's progress (where it ends, None while it goes on;
    where, at which depth and inside which string, by its opening quote, to go on), a
    finished call object's call and end, and an unfinished object's whole fields so far
    and where the next one begins. Valid while each chunk's text extends the last one's
    (:meth:`follow`, once a chunk); any other text starts over."""

    def __init__(self) -> None:
        self.text = ""
        self.values: dict[int, tuple[int | None, int, int, int | None]] = {}
        self.calls: dict[int, tuple[CallSoFar, int]] = {}
        self.fields: dict[int, tuple[dict[str, tuple[int, int | None]], int]] = {}

    def follow(self, text: str) -> None:
        """This chunk's text: what was learned stands if it extends the last one."""
        if not text.startswith(self.text):
            self.values.clear()
            self.calls.clear()
            self.fields.clear()
        self.text = text


class ToolParser(Protocol):
    keeps_special_tokens: bool

    def parse(self, text: str) -> ParsedCalls: ...

    def content_end(self, text: str) -> int: ...

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]: ...


class HermesParser:
    start, end = "<tool_call>", "</tool_call>"
    # vLLM's: the markers may be special tokens, whose text must be kept
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedCalls:
        """Each ``<tool_call>`` block's JSON read whole, so a ``</tool_call>`` inside one of
        its strings is text (QA: the answer was text whole, a call streamed); a block may
        be left unclosed at the end."""
        at = text.find(self.start)
        if at < 0:
            return ParsedCalls(text, (), len(text))
        calls = []
        block = at
        while block >= 0:
            body = _blank_end(text, block + len(self.start))
            try:
                value, end = raw_json(text, body, call=True)
            except ValueError:  # a call that does not parse: the text is the answer
                return ParsedCalls(text, (), len(text))
            call = _call_of(value)
            after = _blank_end(text, end)
            if call is None or not (text.startswith(self.end, after) or after == len(text)):
                return ParsedCalls(text, (), len(text))
            calls.append(call)
            block = text.find(self.start, after)
        content = text[:at]  # as written (vLLM's), a stream's the same
        return ParsedCalls(content if content.strip() else None, tuple(calls), at)

    def content_end(self, text: str) -> int:
        return _marker_content_end(text, self.start)

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]:
        if scanned is not None:
            scanned.follow(text)
        calls: list[CallSoFar] = []
        at = text.find(self.start)
        while at >= 0:
            at = _blank_end(text, at + len(self.start))
            if not text.startswith("{", at):
                break
            call, end = _object_call(text, at, scanned)
            calls.append(call)
            if end is None:
                break
            at = text.find(self.start, end)
        return calls


class Llama3JsonParser:
    tag = "<|python_tag|>"
    keeps_special_tokens = True  # the tag is a special token

    def parse(self, text: str) -> ParsedCalls:
        body = text.strip()
        body = body.removeprefix(self.tag).lstrip()
        if not body.startswith("{"):
            return ParsedCalls(text, (), len(text))
        calls: list[tuple[str, str]] = []
        at = 0
        while at < len(body):
            try:
                value, at = raw_json(body, at, call=True)
            except ValueError:
                value = None
            call = _call_of(value) if value is not None else None
            if call is None:
                if calls:  # the calls read so far stand, as the stream sent them
                    break
                return ParsedCalls(text, (), len(text))
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif not rest.startswith("{"):  # text after the calls: not the answer, as the
                break  # stream and vLLM's parser leave it
            at = len(body) - len(rest)
        return ParsedCalls(None, tuple(calls))

    def content_end(self, text: str) -> int:
        return _whole_answer_end(text, "{", self.tag)

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]:
        if scanned is not None:
            scanned.follow(text)
        calls: list[CallSoFar] = []
        at = _blank_end(text, 0)
        if text.startswith(self.tag, at):
            at = _blank_end(text, at + len(self.tag))
        while text.startswith("{", at):
            call, end = _object_call(text, at, scanned)
            calls.append(call)
            if end is None:
                break
            at = _blank_end(text, end)
            if text.startswith(";", at):  # a next call after ";" or on its own (vLLM's)
                at = _blank_end(text, at + 1)
        return calls


class MistralParser:
    marker, args = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True  # the markers are special tokens

    @staticmethod
    def new_call_id() -> str:
        """A call's id as Mistral's chat templates take it back: 9 letters and digits (they
        raise on any other; vLLM's MistralToolCall makes the same)."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def parse(self, text: str) -> ParsedCalls:
        at = text.find(self.marker)
        if at < 0:
            return ParsedCalls(text, (), len(text))
        calls = self._calls(text[at:])
        if not calls:
            return ParsedCalls(text, (), len(text))
        content = text[:at]
        return ParsedCalls(content if content.strip() else None, tuple(calls), at)

    def _calls(self, text: str) -> list[tuple[str, str]]:
        """The calls of ``text`` (which starts with the marker): after each marker, a JSON
        list (or object) of calls, or ``name[ARGS]{...}``, the JSON read whole (a marker
        written inside a string is text: QA), nothing but blanks between them; what follows
        the calls read so far and is none (text, a call cut short) is left, as the stream
        leaves it."""
        calls: list[tuple[str, str]] = []
        rest = text
        while rest:
            if not rest.startswith(self.marker):  # text after the calls: not the answer, as
                return calls  # the stream and vLLM's parser leave it
            rest = rest[len(self.marker):].lstrip()
            try:
                if rest.startswith(("[", "{")):  # the list form
                    value, end = raw_json(rest, 0, call=True)
                    items = value if isinstance(value, list) else [value]
                else:  # the newer form: name[ARGS]{...}, or name{...}
                    named = self._named(rest, 0)
                    if named is None:
                        return calls
                    name, start = named
                    rest = rest[start:]
                    arguments, end = raw_json(rest, 0)
                    items = [{"name": name, "arguments": arguments}]
            except ValueError:
                return calls
            for item in items:
                call = _call_of(item)
                if call is None:
                    return calls
                calls.append(call)
            rest = rest[end:].lstrip()
        return calls

    def content_end(self, text: str) -> int:
        return _marker_content_end(text, self.marker)

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]:
        if scanned is not None:
            scanned.follow(text)
        calls: list[CallSoFar] = []
        at = text.find(self.marker)
        while at >= 0:
            at = _blank_end(text, at + len(self.marker))
            if text.startswith(("[", "{"), at):  # the list form
                items_end = self._list_so_far(text, at, calls, scanned)
                if items_end is None:
                    return calls
                at = items_end
            else:  # name[ARGS]{...}, or name{...}
                named = self._named(text, at)
                if named is None or not text.startswith("{", named[1]):
                    return calls
                name, start = named
                end = _value_end(text, start, scanned)
                calls.append(CallSoFar(name, text[start:end], end is not None))
                if end is None:
                    return calls
                at = end
            at = text.find(self.marker, at)
        return calls

    def _named(self, text: str, at: int) -> tuple[str, int] | None:
        """The newer form's name at ``at`` and where its arguments begin: ``name[ARGS]{...}``,
        or ``name{...}``, where the brace parts the name from its arguments (vLLM's
        fallback; QA: text here); None while neither is written, or for a name that is no
        function's."""
        args, brace = text.find(self.args, at), text.find("{", at)
        if args >= 0 and (brace < 0 or args < brace):
            name, start = text[at:args], _blank_end(text, args + len(self.args))
        elif brace >= 0:
            name, start = text[at:brace], brace
        else:
            return None
        if self.marker in name or not _NAME.fullmatch(name.strip()):
            return None
        return name.strip(), start

    @staticmethod
    def _list_so_far(text: str, at: int, calls: list[CallSoFar],
                     scanned: Scanned | None) -> int | None:
        """The calls of the list (or lone object) at ``at``, added to ``calls``; where the
        list ends, None while it goes on."""
        if text[at] == "{":
            call, end = _object_call(text, at, scanned)
            calls.append(call)
            return end
        at = _blank_end(text, at + 1)
        while text.startswith("{", at):
            call, end = _object_call(text, at, scanned)
            calls.append(call)
            if end is None:
                return None
            at = _blank_end(text, end)
            if not text.startswith(",", at):
                break
            at = _blank_end(text, at + 1)
        return at + 1 if text.startswith("]", at) else None


class PythonicParser:
    start, end = "<|python_start|>", "<|python_end|>"
    keeps_special_tokens = True  # Llama 4's tags are special tokens

    def parse(self, text: str) -> ParsedCalls:
        body = text.strip().removeprefix(self.start).removesuffix(self.end).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ParsedCalls(text, (), len(text))
        calls = _python_calls(body)
        if not calls:
            return ParsedCalls(text, (), len(text))
        return ParsedCalls(None, tuple(calls))

    def content_end(self, text: str) -> int:
        return _whole_answer_end(text, "[", self.start)

    def calls_so_far(self, text: str, scanned: Scanned | None = None) -> list[CallSoFar]:
        return []  # Python's arguments, not JSON: the calls go out whole at the end


def _python_calls(body: str) -> list[tuple[str, str]]:
    """``[f(a=1), g()]`` as calls, read by Python's parser as data (literals only: a name,
    an expression or a positional argument is no call; nothing is evaluated)."""
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    if not isinstance(tree.body, ast.List):
        return []
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args \
                or any(keyword.arg is None for keyword in node.keywords):
            return []
        names = [keyword.arg for keyword in node.keywords]
        if len(set(names)) != len(names):  # f(a=1, a=2): Python refuses it too (QA)
            return []
        try:
            arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
            calls.append((node.func.id, to_json(arguments)))
        except ValueError:
            return []
    return calls


def _literal(node: ast.expr) -> Any:
    """A literal's value (to_json then refuses what JSON has not: a set, bytes, a complex
    number; writes True, False and None as JSON's, a tuple as a list). A dict's keys must
    be strings: {None: 1, 1: 2, True: 3} lost a value as Python merged 1 and True (QA)."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise ValueError("not a literal") from None
    if not _string_keys(value):
        raise ValueError("a dict with keys that are not strings")
    return value


def _string_keys(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if isinstance(value, dict):
        return all(isinstance(key, str) and _string_keys(item, depth + 1)
                   for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return all(_string_keys(item, depth + 1) for item in value)
    return True


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "mistral":
        return MistralParser()
    if name == "pythonic":
        return PythonicParser()
    raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")


# A function's name as OpenAI's API takes one (letters, digits, _ and -; dots, for the
# namespaced names some templates write), so prose or a lone surrogate is never a call; a
# request's tools for "auto" are held to it (protocol.py).
CALL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_NAME = CALL_NAME


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is no JSON number a client reads back")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _Object(dict):
    """A JSON object as json reads it (a key written twice: its last, as a client reads a
    call's streamed arguments), with ``call_fields``: a call's own fields as a stream reads
    them, the first of one written twice (QA: {"name": "f", "name": "g"} called g in the
    whole answer, f in the stream), in the order written. Only the call's object reads
    ``call_fields``: inside its arguments such keys are plain keys."""

    call_fields: dict[str, Any]


def _object_of(pairs: list[tuple[str, Any]]) -> _Object:
    value = _Object(pairs)
    value.call_fields = {}
    for key, item in pairs:
        if key in _CALL_FIELDS:
            value.call_fields.setdefault(key, item)
    return value


_CALL_FIELDS = frozenset({"name", "arguments", "parameters"})
_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)
_CALL_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant,
                                 object_pairs_hook=_object_of)


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


def raw_json(text: str, at: int, call: bool = False) -> tuple[Any, int]:
    """The strict JSON value at ``at`` in ``text`` and where it ends (ValueError as
    :func:`strict_json`); ``call``: a call's object, its fields read as a stream reads
    them."""
    try:
        return (_CALL_DECODER if call else _DECODER).raw_decode(text, at)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def to_json(value: Any) -> str:
    """``value`` as JSON text (ValueError where it nests too deeply to write, holds what JSON
    has not, or a lone surrogate, which no UTF-8 answer can carry: QA, a 500)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (TypeError, UnicodeEncodeError) as error:  # a set, bytes; "\ud800"
        raise ValueError(str(error)) from None
    return text


def _call_of(value: Any) -> tuple[str, str] | None:
    """``{"name": ..., "arguments" or "parameters": {...}}`` as (name, arguments' JSON)."""
    if not isinstance(value, dict):
        return None
    fields = value.call_fields if isinstance(value, _Object) else value
    name = fields.get("name")
    if not isinstance(name, str) or \
            not _NAME.fullmatch(name):  # QA: "", a lone surrogate (a 500), prose
        return None
    # the first of the two written, as a stream reads it (QA: one with both streamed the
    # one, then the other's text after it)
    given = next((key for key in fields if key in ("arguments", "parameters")), None)
    arguments = {} if given is None else fields[given]
    if isinstance(arguments, str):  # JSON text, as some models write it: an object's only
        try:
            arguments = strict_json(arguments)
        except ValueError:
            return None  # not arguments a client could read: the answer is the text (QA)
    if not isinstance(arguments, dict):
        return None
    try:
        return name, to_json(arguments)
    except ValueError:
        return None


def _marker_content_end(text: str, marker: str) -> int:
    """Where the content surely ends in an answer whose calls follow ``marker`` (hermes,
    mistral): at the marker, or before what may be its first characters."""
    at = text.find(marker)
    if at >= 0:
        return at
    return len(text) - held_length(text, marker)


def _whole_answer_end(text: str, opener: str, tag: str) -> int:
    """Where the content surely ends in an answer that is calls or none (llama3_json,
    pythonic): all of it once it cannot be calls (it starts with neither ``opener`` nor
    ``tag``), none while it may be."""
    start = text.lstrip()
    if not start or start.startswith(opener) or start.startswith(tag) or tag.startswith(start):
        return 0
    return len(text)


# A streamed call's JSON read as far as it is written: brackets, separators, and runs of
# anything else (numbers, literals); strings by their bodies, which a scan may stop inside.
_PIECE = re.compile(r'[{}\[\]:,]|[^\s{}\[\]:,"]+')
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*')  # up to its closing quote, or as written
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a whole one
_BLANKS = re.compile(r"\s*")


def _blank_end(text: str, at: int) -> int:
    match = _BLANKS.match(text, at)
    assert match is not None
    return match.end()


def _value_end(text: str, at: int, scanned: Scanned | None = None) -> int | None:
    """Where the JSON value that starts at ``at`` ends; None while it may go on (or is no
    value). With ``scanned`` (the stream's, see Scanned), the scan goes on from where the
    last one on a shorter text of the stream stopped."""
    start, depth, quote = at, 0, None  # quote: the string being read's opening quote
    known = scanned.values.get(start) if scanned is not None else None
    if known is not None:
        end, at, depth, quote = known
        if end is not None:
            return end
    while True:
        if quote is None:
            at = _blank_end(text, at)
            if text.startswith('"', at):
                quote, at = at, at + 1
        if quote is not None:  # a string's body, from where it was read to
            at = _STRING_BODY.match(text, at).end()  # type: ignore[union-attr]
            if not text.startswith('"', at):  # unfinished: go on from here
                if scanned is not None:
                    scanned.values[start] = (None, at, depth, quote)
                return None
            at, quote = at + 1, None
            if depth == 0:  # a string is whole at its quote
                return _ended(text, start, at, scanned)
            continue
        piece = _PIECE.match(text, at)
        if piece is None:  # the text's end
            if scanned is not None:
                scanned.values[start] = (None, at, depth, None)
            return None
        at = piece.end()
        token = piece.group()
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth <= 0:
                return _ended(text, start, at, scanned) if depth == 0 else None
        elif depth == 0:
            if token in (":", ","):
                return None
            # a number or literal is whole where something follows
            return _ended(text, start, at, scanned) if at < len(text) else None


def _ended(text: str, start: int, end: int, scanned: Scanned | None) -> int:
    """``end``, kept in ``scanned`` for the value at ``start``."""
    if scanned is not None:
        scanned.values[start] = (end, end, 0, None)
    return end


def _object_call(text: str, at: int,
                 scanned: Scanned | None = None) -> tuple[CallSoFar, int | None]:
    """The call the JSON object at ``at`` writes so far (``{"name": ..., "arguments" or
    "parameters": {...}}``, either first), and where the object ends (None while it goes
    on). The arguments are their text as written; JSON text in a string, decoded, once
    the string is whole. With ``scanned``, a finished object is read once, and an
    unfinished one from its first field not yet whole."""
    opening = at
    if scanned is not None:
        finished = scanned.calls.get(opening)
        if finished is not None:
            return finished
    fields: dict[str, tuple[int, int | None]] = {}
    end: int | None = None
    at = _blank_end(text, at + 1)
    whole = scanned.fields.get(opening) if scanned is not None else None
    if whole is not None:  # a copy: the field under way is added to it below
        fields, at = dict(whole[0]), _blank_end(text, whole[1])
    while at < len(text):
        if text[at] == "}":
            end = at + 1
            break
        key = _STRING.match(text, at)
        if key is None:
            break
        colon = _blank_end(text, key.end())
        if not text.startswith(":", colon):
            break
        start = _blank_end(text, colon + 1)
        if start >= len(text):
            break
        stop = _value_end(text, start, scanned)
        try:  # a key written twice: its first (QA: a second "name" renamed a streamed call)
            fields.setdefault(json.loads(key.group()), (start, stop))
        except ValueError:
            break
        if stop is None:
            break
        at = _blank_end(text, stop)
        if text.startswith(",", at):
            if scanned is not None:  # the fields so far are whole
                scanned.fields[opening] = (dict(fields), at + 1)
            at = _blank_end(text, at + 1)
    call = _object_so_far(text, fields, end)
    if scanned is not None and end is not None:
        scanned.calls[opening] = (call, end)
        scanned.fields.pop(opening, None)
    return call, end


def _object_so_far(text: str, fields: dict[str, tuple[int, int | None]],
                   end: int | None) -> CallSoFar:
    """The call an object's fields read so far write (``end``: where it ended, None while
    it goes on)."""
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, stop = fields["name"]
        value = _loads(text[start:stop])
        name = value if isinstance(value, str) and _NAME.fullmatch(value) else None
    # The name is told only once the arguments can be a call's (an object, or an object's
    # JSON text), so a stream never starts a call the whole answer would leave as text
    # (QA: "arguments": [1, 2] streamed a call with arguments "").
    given = next((fields[key] for key in fields if key in ("arguments", "parameters")), None)
    if given is None:  # none (yet): {} once the object is whole, as the whole answer's
        return CallSoFar(name, "{}", True) if end is not None else CallSoFar(None, "", False)
    start, stop = given
    if text[start] == "{":
        return CallSoFar(name, text[start:len(text) if stop is None else stop],
                         stop is not None)
    value = _loads(text[start:stop]) if stop is not None else None
    if isinstance(value, str) and isinstance(_loads(value), dict):
        return CallSoFar(name, value, True)
    return CallSoFar(None, "", stop is not None)


def _loads(text: str) -> Any:
    try:
        return strict_json(text)
    except ValueError:
        return None
