"""``json.dumps(value, indent=n, allow_nan=False)``, byte for byte, at the C encoder's speed.

On Python 3.11 an indented dump runs the pure-Python encoder, one generator step per
value: a 10,000-request report (170,000 values in its rows, more in its time series) took
longer to write than the trace took to read. Here every container whose items hold no
non-empty container (a report row, a time series) is written by the C encoder, with the
item separator carrying the newline and indentation that the indented dump puts there;
only the few containers above them are joined in Python. Anything else (empty containers,
scalars, keys that are not strings) goes through ``json.dumps`` itself, whose newlines are
then shifted to its depth (a JSON string holds no raw newline, so only layout moves).
tests/sim/test_indented_json.py compares the two on reports and on random values.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

_CONTAINERS = (dict, list, tuple)


_SCALAR = json.JSONEncoder(allow_nan=False)
_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def _flat(items: Any) -> bool:
    """No item is a non-empty container (the type test first: it runs in C)."""
    if _SCALAR_TYPES.issuperset(map(type, items)):
        return True
    return not any(isinstance(item, _CONTAINERS) and item for item in items
                   if type(item) not in _SCALAR_TYPES)


def dumps(value: Any, indent: int = 1) -> str:
    """What ``json.dumps(value, indent=indent, allow_nan=False)`` returns (indent >= 1)."""
    if indent < 1:
        raise ValueError(f"indent must be at least 1, got {indent}")
    return _Writer(indent).write(value, 0)


class _Writer:
    def __init__(self, indent: int) -> None:
        self.indent = indent
        self._flat: dict[int, json.JSONEncoder] = {}  # depth -> encoder of a flat container

    def write(self, value: Any, depth: int) -> str:
        if not isinstance(value, _CONTAINERS):
            return _SCALAR.encode(value)  # one line, as json.dumps writes it
        if value:
            inner = "\n" + " " * (self.indent * (depth + 1))
            items = value.values() if isinstance(value, dict) else value
            if _flat(items):
                body = self._flat_encoder(depth, inner).encode(value)
                return body[0] + inner + body[1:-1] + inner[:-self.indent] + body[-1]
            if not isinstance(value, dict):
                parts = [self.write(item, depth + 1) for item in value]
                return "[" + inner + ("," + inner).join(parts) + inner[:-self.indent] + "]"
            if all(type(key) is str for key in value):
                parts = [encode_basestring_ascii(key) + ": " + self.write(item, depth + 1)
                         for key, item in value.items()]
                return "{" + inner + ("," + inner).join(parts) + inner[:-self.indent] + "}"
        text = json.dumps(value, indent=self.indent, allow_nan=False)
        return text.replace("\n", "\n" + " " * (self.indent * depth)) if depth else text

    def _flat_encoder(self, depth: int, inner: str) -> json.JSONEncoder:
        encoder = self._flat.get(depth)
        if encoder is None:
            encoder = self._flat[depth] = json.JSONEncoder(separators=("," + inner, ": "),
                                                           allow_nan=False)
        return encoder
