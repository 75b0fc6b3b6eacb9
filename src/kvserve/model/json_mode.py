"""JSON mode (OpenAI's ``response_format: {"type": "json_object"}``, vLLM's
``structured_outputs: {"json_object": true}``): the tokens a request may sample next so that
its output stays the beginning of one JSON object, and ends (EOS) when the object closes.

A byte-level pushdown recognizer of JSON (RFC 8259) reads the output so far; the next tokens
allowed are those whose bytes it accepts from there. Testing every token of the vocabulary
at every step would cost a Python loop of 50k tokens, so a :class:`JsonVocabulary` groups
the tokens once: by their first byte that is not whitespace (only the groups of bytes the
recognizer accepts next are tried), and, inside a string, tokens without a quote, a
backslash or a control byte are accepted whatever the state, unchecked. The allowed tokens
of a state are remembered (a state is small and hashable), so a stretch of one kind (a long
string, a run of keys at one depth) is computed once.

Whitespace between tokens is allowed, at most ``MAX_WHITESPACE`` bytes in a row, so that a
small model cannot fill its answer with blank lines. Strings are checked as JSON strings
(escapes included), not as UTF-8: a token holding part of a character is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_WHITESPACE = 8
_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# Modes of the recognizer (where it is in the grammar).
TOP = "top"                # before the object: whitespace or "{"
OBJECT_FIRST = "obj1"      # after "{": a key or "}"
OBJECT_KEY = "key"         # after "," in an object: a key
COLON = "colon"            # after a key
VALUE = "value"            # after ":" or "," in an array
ARRAY_FIRST = "arr1"       # after "[": a value or "]"
AFTER_VALUE = "after"      # after a value: ",", or the container's closer
STRING = "str"             # in a string; ``extra`` True for a key
ESCAPE = "esc"             # after a backslash in a string
UNICODE = "uni"            # in \\uXXXX; ``extra`` (is_key, hex digits left)
NUMBER = "num"             # in a number; ``extra`` its part (see _number)
LITERAL = "lit"            # in true/false/null; ``extra`` the bytes left
DONE = "done"              # the object closed: only EOS


@dataclass(frozen=True)
class JsonState:
    mode: str
    stack: str = ""  # "o" and "a", outermost first
    extra: object = None
    whitespace: int = 0  # whitespace bytes in a row just read


START = JsonState(TOP)


def feed(state: JsonState | None, byte: int) -> JsonState | None:
    """The state after ``byte``, or None if no JSON object begins with what was read."""
    if state is None:
        return None
    mode = state.mode
    if mode == STRING:
        if byte == 0x22:  # the closing quote
            return JsonState(COLON if state.extra else AFTER_VALUE, state.stack)
        if byte == 0x5C:
            return JsonState(ESCAPE, state.stack, state.extra)
        return None if byte < 0x20 else state
    if mode == ESCAPE:
        if byte not in _ESCAPES:
            return None
        if byte == ord("u"):
            return JsonState(UNICODE, state.stack, (state.extra, 4))
        return JsonState(STRING, state.stack, state.extra)
    if mode == UNICODE:
        if byte not in _HEX:
            return None
        is_key, left = state.extra  # type: ignore[misc]
        return JsonState(STRING, state.stack, is_key) if left == 1 else \
            JsonState(UNICODE, state.stack, (is_key, left - 1))
    if mode == NUMBER:
        return _number(state, byte)
    if mode == LITERAL:
        left: bytes = state.extra  # type: ignore[assignment]
        if byte != left[0]:
            return None
        return JsonState(LITERAL, state.stack, left[1:]) if len(left) > 1 else \
            JsonState(AFTER_VALUE, state.stack)
    if mode == DONE:
        return None
    if byte in _WHITESPACE:
        if state.whitespace >= MAX_WHITESPACE:
            return None
        return JsonState(mode, state.stack, state.extra, state.whitespace + 1)
    return _structural(state, byte)


def _structural(state: JsonState, byte: int) -> JsonState | None:
    mode, stack = state.mode, state.stack
    if mode == TOP:
        return JsonState(OBJECT_FIRST, "o") if byte == ord("{") else None
    if mode in (OBJECT_FIRST, OBJECT_KEY):
        if byte == 0x22:
            return JsonState(STRING, stack, True)
        return _close(stack) if mode == OBJECT_FIRST and byte == ord("}") else None
    if mode == COLON:
        return JsonState(VALUE, stack) if byte == ord(":") else None
    if mode == ARRAY_FIRST and byte == ord("]"):
        return _close(stack)
    if mode in (VALUE, ARRAY_FIRST):
        return _value(stack, byte)
    if mode == AFTER_VALUE:
        top = stack[-1]
        if byte == ord(","):
            return JsonState(OBJECT_KEY if top == "o" else VALUE, stack)
        if byte == (ord("}") if top == "o" else ord("]")):
            return _close(stack)
    return None


def _value(stack: str, byte: int) -> JsonState | None:
    if byte == 0x22:
        return JsonState(STRING, stack, False)
    if byte == ord("{"):
        return JsonState(OBJECT_FIRST, stack + "o")
    if byte == ord("["):
        return JsonState(ARRAY_FIRST, stack + "a")
    if byte == ord("-"):
        return JsonState(NUMBER, stack, "minus")
    if byte in _DIGITS:
        return JsonState(NUMBER, stack, "zero" if byte == ord("0") else "int")
    if byte in _LITERALS:
        return JsonState(LITERAL, stack, _LITERALS[byte])
    return None


def _close(stack: str) -> JsonState:
    rest = stack[:-1]
    return JsonState(AFTER_VALUE, rest) if rest else JsonState(DONE)


# A number's parts: minus (after "-"), zero (a leading 0), int, point (after "."), frac,
# exp (after e/E), sign (after its + or -), expdigits. Complete in zero, int, frac and
# expdigits, where a byte that cannot go on ends the number and is read after it.
_NUMBER_NEXT = {
    "minus": {"digit": "int", "zero": "zero"},
    "zero": {"point": "point", "exp": "exp"},
    "int": {"digit": "int", "zero": "int", "point": "point", "exp": "exp"},
    "point": {"digit": "frac", "zero": "frac"},
    "frac": {"digit": "frac", "zero": "frac", "exp": "exp"},
    "exp": {"digit": "expdigits", "zero": "expdigits", "sign": "sign"},
    "sign": {"digit": "expdigits", "zero": "expdigits"},
    "expdigits": {"digit": "expdigits", "zero": "expdigits"},
}
_COMPLETE = frozenset({"zero", "int", "frac", "expdigits"})


def _number(state: JsonState, byte: int) -> JsonState | None:
    part: str = state.extra  # type: ignore[assignment]
    kind = ("zero" if byte == ord("0") else "digit" if byte in _DIGITS else
            "point" if byte == ord(".") else "exp" if byte in b"eE" else
            "sign" if byte in b"+-" else None)
    following = _NUMBER_NEXT[part].get(kind) if kind is not None else None
    if following is not None:
        return JsonState(NUMBER, state.stack, following)
    if part not in _COMPLETE:
        return None
    return feed(JsonState(AFTER_VALUE, state.stack), byte)  # the number ended before it


def read(data: bytes, state: JsonState | None = START) -> JsonState | None:
    for byte in data:
        state = feed(state, byte)
        if state is None:
            return None
    return state


class JsonVocabulary:
    """A vocabulary's tokens as bytes, grouped to find a JSON state's next tokens quickly.
    Tokens without bytes (special tokens, as decoded) are never allowed."""

    def __init__(self, token_bytes: Sequence[bytes], cache_size: int = 4096) -> None:
        self.token_bytes = list(token_bytes)
        by_first: dict[int | None, list[int]] = {}
        in_string: list[int] = []  # no quote, backslash or control byte: any string takes it
        string_special: list[int] = []
        for token_id, data in enumerate(self.token_bytes):
            if not data:
                continue
            significant = data.lstrip(b" \t\n\r")
            by_first.setdefault(significant[0] if significant else None, []).append(token_id)
            if any(b == 0x22 or b == 0x5C or b < 0x20 for b in data):
                string_special.append(token_id)
            else:
                in_string.append(token_id)
        self._by_first = by_first
        self._in_string = in_string
        self._string_special = string_special
        self._cache: dict[JsonState, list[int]] = {}
        self._cache_size = cache_size

    def allowed(self, state: JsonState) -> list[int]:
        """The tokens whose bytes keep the output the beginning of a JSON object (none in
        DONE: the caller allows EOS there)."""
        cached = self._cache.get(state)
        if cached is not None:
            return cached
        if state.mode == STRING:
            plain, candidates = self._in_string, self._string_special
        else:
            plain = []
            after_space = feed(state, 0x20)
            starts = [byte for byte in range(256) if feed(state, byte) is not None or (
                after_space is not None and feed(after_space, byte) is not None)]
            candidates = [t for byte in starts if byte not in _WHITESPACE
                          for t in self._by_first.get(byte, ())]
            if after_space is not None:
                candidates += self._by_first.get(None, [])
        token_bytes = self.token_bytes
        allowed = sorted(plain + [t for t in candidates
                                  if read(token_bytes[t], state) is not None])
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[state] = allowed
        return allowed
