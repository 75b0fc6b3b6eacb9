"""A request body, from bytes to checked JSON: bounded before it is parsed, valid Unicode
after, so that no body can reach a 500.

    size (413, checked while reading; server/state.py)
    -> nesting depth and number literal lengths, on the raw bytes with strings blanked out
       (Python's parser recurses once per level and turns every integer literal into an int,
       so a 100,000-deep array or a 5,000-digit integer would fail inside it)
    -> UTF-8 (RFC 8259's; json.loads would take UTF-16 and -32, misread by the checks above)
    -> json.loads (NaN and Infinity are not JSON and are refused)
    -> every string, key or value, is valid Unicode: JSON's \\uD800 escapes can produce lone
       UTF-16 surrogates (and so can their UTF-8-style bytes), which no tokenizer or UTF-8
       encoder accepts

Each refusal is a 400 naming the problem (and the field, for bad text).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.server.errors import bad_request

MAX_JSON_DEPTH = 64  # an OpenAI body nests at most ~6 levels (messages -> parts -> text)
MAX_NUMBER_CHARS = 64  # 2**64 has 20 digits; repr() of a float at most 24 characters

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NUMBER_RUN = re.compile(rb"[-+0-9.eE]{%d,}" % (MAX_NUMBER_CHARS + 1))
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets
_OPENERS = frozenset(b"[{")
# In an ASCII body a lone surrogate can only come from a \uD800-\uDFFF escape; check_text
# looks at every string of the others too.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying what is wrong with it."""
    skeleton = _STRING.sub(b'""', raw)
    check_depth(skeleton)
    if _NUMBER_RUN.search(skeleton):
        raise bad_request(f"the request body has a number literal longer than "
                          f"{MAX_NUMBER_CHARS} characters")
    try:
        # UTF-8 only, as JSON between systems is (RFC 8259): json.loads takes UTF-16 and -32
        # bytes too, which the checks above, made for UTF-8, misread (QA: 500s past them)
        text = raw.decode("utf-8-sig")  # a BOM before it is dropped (RFC 8259 allows it)
    except UnicodeDecodeError as error:
        raise bad_request(f"the request body is not UTF-8: {error}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not raw.isascii() or _SURROGATE_ESCAPE.search(raw):
        check_text(body)
    return body


def check_depth(skeleton: bytes) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH (strings already blanked out)."""
    brackets = skeleton.translate(None, _BRACKETS)
    if len(brackets) <= MAX_JSON_DEPTH:
        return
    depth = 0
    for byte in brackets:
        depth += 1 if byte in _OPENERS else -1
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests JSON arrays/objects more than "
                              f"{MAX_JSON_DEPTH} levels deep")


def check_text(value: Any, path: str = "") -> None:
    """Refuse any string (key or value) that is not valid Unicode, naming its field."""
    if isinstance(value, str):
        if not _is_unicode(value):
            raise bad_request(f"field '{path or '(body)'}' is not valid Unicode text (it holds "
                              "an unpaired UTF-16 surrogate)", param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if not _is_unicode(key):
                raise bad_request(f"a key in '{path or '(body)'}' is not valid Unicode text "
                                  "(it holds an unpaired UTF-16 surrogate)",
                                  param=path or None)
            check_text(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, f"{path}.{index}" if path else str(index))


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise bad_request(f"the request body is not valid JSON: {name} is not a JSON number")
