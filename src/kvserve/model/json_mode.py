"""Structured output by JSON: JSON mode (OpenAI's ``response_format: {"type": "json_object"}``,
vLLM's ``structured_outputs: {"json_object": true}``) and a JSON schema (OpenAI's
``{"type": "json_schema", ...}``, vLLM's ``structured_outputs: {"json": ...}``): the tokens a
request may sample next so that its output stays the beginning of one JSON object (of the
schema), and ends (EOS) when the object closes.

A byte-level pushdown recognizer of JSON (RFC 8259) reads the output so far; the next tokens
allowed are those whose bytes it accepts from there. With a schema, each value is read
against its schema node: an object takes only its properties' names as keys, each once,
and closes once its required ones are there; a string (of its minLength to maxLength
characters), number or integer (within its minimum and maximum), boolean or null only that;
an enum or const only those values (as ``json.dumps`` writes them); an array its items;
anyOf alternatives of different JSON types. :func:`check_schema` (through
``Schema._compile``) says which keywords are honoured and refuses the others by name (a
constraint accepted must hold).

Testing every token of the vocabulary at every step would cost a Python loop of 50k tokens,
so a :class:`JsonVocabulary` groups the tokens once: by their first byte that is not
whitespace (only the groups of bytes the recognizer accepts next are tried), and, inside a
free string, tokens without a quote, a backslash or a control byte are accepted whatever
the state, unchecked. The allowed tokens of a state are remembered (a state is small and
hashable), so a stretch of one kind (a long string, a run of keys at one depth) is computed
once.

Whitespace between tokens is allowed, at most ``MAX_WHITESPACE`` bytes in a row, so that a
small model cannot fill its answer with blank lines; none before the object (an answer, a
tool call's arguments, starts with its brace, as OpenAI's do). Strings are checked as JSON strings
(escapes included), not as UTF-8: a token holding part of a character is allowed.
"""

from __future__ import annotations

import functools
import json
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MAX_WHITESPACE = 8
_WHITESPACE = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')

# Modes of the recognizer (where it is in the grammar).
TOP = "top"                # before the object: "{" (no whitespace: the answer starts there)
OBJECT_FIRST = "obj1"      # after "{": a key or "}"
OBJECT_KEY = "key"         # after "," in an object: a key
COLON = "colon"            # after a key
VALUE = "value"            # a value of schema node ``extra``
ARRAY_FIRST = "arr1"       # after "[": a value or "]"
AFTER_VALUE = "after"      # after a value: ",", or the container's closer
STRING = "str"             # in a free string; ``extra`` True for a key
ESCAPE = "esc"             # after a backslash in a string
UNICODE = "uni"            # in \\uXXXX; ``extra`` (is_key, hex digits left)
NUMBER = "num"             # in a number; ``extra`` (its part, integer only)
CHOICE = "lit"             # in one of some texts (a key, an enum, true...); ``extra`` below
DONE = "done"              # the object closed: only EOS


class SchemaError(ValueError):
    """A JSON schema this recognizer cannot hold an output to; names the keyword."""


# -- schemas -----------------------------------------------------------------------------

class Texts(tuple[bytes, ...]):
    """Texts a value or key is one of, sorted, so those that go on from what was read are
    one run of them (found by bisection: an enum of 150,000 values was read text by text,
    seconds a token, QA); hashed once (a state that holds them is a cache key)."""

    _hash: int

    @classmethod
    def of(cls, texts: Iterable[bytes]) -> Texts:
        return cls(sorted(set(texts)))

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


_NO_TEXTS = Texts()


@dataclass(frozen=True)
class Node:
    """A compiled schema node. ``kind``: any, object, array, string, number, integer,
    texts (the value is one of ``texts``: enum, const, boolean, null), union (of values
    told apart by their first character) or tagged (objects told apart by their first
    property's value)."""

    kind: str
    properties: tuple[tuple[str, int], ...] = ()  # object: name -> node index
    required: frozenset[str] = frozenset()
    additional: int | None = None  # object: the node of other keys' values; None: none
    items: int | None = None  # array
    min_items: int = 0  # array
    max_items: int | None = None  # array
    texts: Texts = _NO_TEXTS
    alternatives: tuple[int, ...] = ()  # union
    # tagged: the objects of a union told apart by their first property (``properties``:
    # its name, with all their values), each value's object
    by_text: tuple[tuple[bytes, int], ...] = ()
    min_length: int = 0  # string: characters (code points; an escape is one)
    max_length: int | None = None  # string
    # number, integer: the bounds, (value, inclusive), None where unbounded (integer: whole
    # numbers, inclusive)
    low: tuple[Fraction, bool] | None = None
    high: tuple[Fraction, bool] | None = None
    # pending (a definition's place while it is compiled): the type it says, if it does
    stands_for: str | None = None

    @property
    def bounded(self) -> bool:
        """A string whose length, or a number whose value, is held to bounds."""
        return bool(self.min_length) or self.max_length is not None or \
            self.low is not None or self.high is not None


# Keywords that only describe (honoured by ignoring them).
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "strict", "name", "deprecated", "readOnly",
                          "writeOnly"})


class Schema:
    """A JSON schema compiled into nodes: ``root`` the object the output is, and the free
    value, object and array that "any" stands for. No schema: JSON mode's any object.
    SchemaError names what is not honoured."""

    def __init__(self, schema: Any = None) -> None:
        self.nodes: list[Node] = [Node("any")]
        self.any = 0
        self.any_object = self._add(Node("object", additional=self.any))
        self.any_array = self._add(Node("array", items=self.any))
        self.names: dict[tuple[int, int], Texts] = {}  # the keys an object may write next
        self._defs: dict[str, Any] = {}
        self._refs: dict[str, int] = {}
        self._nesting = 0  # schemas being compiled, one inside another ($refs followed)
        if schema is None:
            self.root = self.any_object
            return
        if not isinstance(schema, dict):
            raise SchemaError("a JSON schema must be an object")
        for keyword in ("definitions", "$defs"):
            defs = schema.get(keyword, {})
            if not isinstance(defs, dict):
                raise SchemaError(f"schema: {keyword} must be an object")
            self._defs.update(defs)
        self.root = self._compile(schema, "")
        if self.root == self.any:  # {}: any value, of which an answer is an object (QA:
            self.root = self.any_object  # a tool's "parameters": {} was refused)
        if self.nodes[self.root].kind != "object":
            raise SchemaError("the schema's root must be an object (\"type\": \"object\")")

    def _add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema: Any, where: str) -> int:
        """``schema``'s node; SchemaError past MAX_SCHEMA_DEPTH schemas one inside another,
        counting those a $ref leads to (the structured-output pass: a chain of $refs in
        $defs passed the body's depth check, and compiling it was a RecursionError, a 500)."""
        self._nesting += 1
        try:
            if self._nesting > MAX_NESTED_SCHEMAS:
                raise SchemaError(f"the JSON schema nests more than {MAX_NESTED_SCHEMAS} "
                                  "schemas one inside another, counting those its $refs "
                                  "lead to")
            return self._compile_one(schema, where)
        finally:
            self._nesting -= 1

    def _compile_one(self, schema: Any, where: str) -> int:
        if schema is True or schema == {}:
            return self.any
        if not isinstance(schema, dict):
            raise SchemaError(f"schema{where}: expected an object, got {_shown(schema)}")
        if "$ref" in schema:
            self._refuse_beside(schema, {"$ref", "definitions", "$defs"}, where, "$ref")
            return self._ref(schema["$ref"], where)
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:  # pydantic's discriminator names the tag the union holds
                self._refuse_beside(schema, {keyword, "discriminator", "definitions", "$defs"},
                                    where, keyword)
                return self._union(schema[keyword], f"{where}.{keyword}")
        if "enum" in schema or "const" in schema:
            self._refuse_beside(schema, {"enum", "const", "type"}, where,
                                "enum" if "enum" in schema else "const")
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"schema{where}: enum must be a non-empty list")
            if "enum" in schema and "const" in schema:  # both hold (QA: const was dropped)
                const = _text(schema["const"])
                values = [v for v in values if _text(v) == const]
                if not values:
                    raise SchemaError(f"schema{where}: const {_shown(schema['const'])} is "
                                      "not among the enum's values: no value holds both")
            if "type" in schema:  # both hold: the values of that type (QA: 1 taken as string)
                kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
                values = [v for v in values if any(_is_of(v, kind) for kind in kinds)]
                if not values:
                    raise SchemaError(f"schema{where}: no value of the enum is of its type "
                                      f"{_shown(schema['type'])}")
            return self._add(Node("texts", texts=Texts.of(_text(v) for v in values)))
        kind = schema.get("type")
        if isinstance(kind, list):  # each type with its own keywords (minimum: numbers')
            if not kind or not all(isinstance(k, str) for k in kind):  # QA: [5] was "empty"
                raise SchemaError(f"schema{where}.type: a list of types must be a non-empty "
                                  f"list of type names, got {_shown(kind)}")
            return self._union([{key: value for key, value in schema.items()
                                 if key not in _TYPED or key in _KEYWORDS.get(k, ())}
                                | {"type": k}
                                for k in kind if isinstance(k, str)], f"{where}.type")
        # A keyword of another type than this one's holds nothing here (JSON Schema's
        # rule, vLLM's too: "required" beside an array); without a type, only an object's
        self._refuse_beside(schema, {"type", "definitions", "$defs", *(
            _TYPED if isinstance(kind, str) else _KEYWORDS["object"])}, where)
        if kind == "object" or (kind is None and any(k in schema for k in _KEYWORDS["object"])):
            return self._object(schema, where)  # QA: {"required": [...]} alone held nothing
        if kind == "array":
            items = self._compile(schema.get("items", True), f"{where}.items")
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if not _is_count(low) or not (high is None or (_is_count(high) and high >= low)):
                raise SchemaError(f"schema{where}: minItems and maxItems must be counts, "
                                  "the first no more than the second")
            return self._add(Node("array", items=items, min_items=low, max_items=high))
        if kind == "boolean":
            return self._add(Node("texts", texts=Texts.of((b"true", b"false"))))
        if kind == "null":
            return self._add(Node("texts", texts=Texts.of((b"null",))))
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if not _is_count(low) or not (high is None or (_is_count(high) and high >= low)):
                raise SchemaError(f"schema{where}: minLength and maxLength must be counts, "
                                  "the first no more than the second")
            return self._add(Node(kind, min_length=low, max_length=high))
        if kind in ("number", "integer"):
            return self._add(_numbers(kind, schema, where))
        if kind is None:
            return self.any
        raise SchemaError(f"schema{where}: unknown type {kind!r}")

    @staticmethod
    def _refuse_beside(schema: dict[str, Any], known: set[str], where: str,
                       beside: str | None = None) -> None:
        """SchemaError naming the first keyword of ``schema`` neither ``known`` nor a
        description (a constraint accepted must hold); ``beside``: the keyword that decides
        the value here (enum, const, a union, $ref), which takes no other."""
        unknown = sorted(set(schema) - known - _ANNOTATIONS)
        if unknown and beside is not None and (unknown[0] in _TYPED or unknown[0] == "type"):
            # QA: "'type' is not supported (honoured: type, ...)", "give type" beside one
            instead = "move it into the schema it names" if beside == "$ref" else \
                "drop it" if beside in ("enum", "const") else "move it into each alternative"
            raise SchemaError(f"schema{where}: '{unknown[0]}' cannot be given beside "
                              f"'{beside}', which decides the value here: {instead}")
        if unknown and unknown[0] in _TYPED:  # honoured, with the type it belongs to
            types = " or ".join(k for k, words in _KEYWORDS.items() if unknown[0] in words)
            raise SchemaError(f"schema{where}: '{unknown[0]}' holds a value of type {types}: "
                              f"give \"type\" beside it")
        if unknown:
            raise SchemaError(f"schema{where}: '{unknown[0]}' is not supported (honoured: "
                              "type, properties, required, additionalProperties, items, "
                              "minItems, maxItems, minLength, maxLength, minimum, maximum, "
                              "exclusiveMinimum, exclusiveMaximum, enum, const, anyOf, "
                              "oneOf, $ref); drop the constraint (a pydantic Field's "
                              "pattern, multiple_of...) or, for a date or time, take a str")

    def _object(self, schema: dict[str, Any], where: str) -> int:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise SchemaError(f"schema{where}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required) \
                or not set(required) <= set(properties):
            raise SchemaError(f"schema{where}: required must list names of properties")
        compiled = tuple((name, self._compile(sub, f"{where}.properties.{name}"))
                         for name, sub in properties.items())
        # OpenAI's strict schemas say additionalProperties false; left out, an object that
        # lists properties takes only them here too, an empty list included (LangChain's
        # tool without arguments: {}), and one that lists none takes any keys
        extra = schema.get("additionalProperties", "properties" not in schema)
        if properties and extra is not False:
            raise SchemaError(f"schema{where}: an object with properties takes only them "
                              "here: additionalProperties must be false or left out")
        additional = None if extra is False else self._compile(
            True if extra is True else extra, f"{where}.additionalProperties")
        return self._add(Node("object", properties=compiled, required=frozenset(required),
                              additional=additional))

    def _union(self, options: Any, where: str) -> int:
        if not isinstance(options, list) or not options:
            raise SchemaError(f"schema{where}: must be a non-empty list")
        alternatives = tuple(self._compile(option, f"{where}.{i}")
                             for i, option in enumerate(options))
        nodes = [self.nodes[a] for a in alternatives]
        if any(node.kind == "pending" and node.stands_for is None for node in nodes):
            raise SchemaError(f"schema{where}: a union that holds a definition within that "
                              "definition needs the definition's type (\"type\": ...)")
        kinds = {node.stands_for or node.kind for node in nodes}
        if "any" in kinds:
            return self.any
        if kinds == {"number", "integer"}:  # Union[int, float]: the integers are numbers,
            # where the numbers' bounds hold every integer's (the same keywords, or a type
            # list: an integer's are its whole numbers within them); QA: bounds were dropped
            numbers = [node for node in nodes if node.kind == "number"]
            widest = next((node for node in numbers if all(
                _within(other, node) for other in nodes)), None)
            if widest is None:
                raise SchemaError(f"schema{where}: an integer and a number in a union are "
                                  "held here only where the number's bounds hold the "
                                  "integer's")
            return alternatives[nodes.index(widest)]
        objects = tuple(a for a in alternatives if self.nodes[a].kind == "object")
        if len(objects) > 1:
            tagged = self._tagged(objects)
            if tagged is None:
                raise SchemaError(f"schema{where}: objects in a union must be told apart by "
                                  "their first property: one name in each, required, a "
                                  "const or enum of values no other has (pydantic's "
                                  "discriminated union)")
            alternatives = (*(a for a in alternatives if a not in objects), tagged)
            if len(alternatives) == 1:
                return tagged
        starts = [_first_bytes(self.nodes[a], self.nodes) for a in alternatives]
        if sum(len(s) for s in starts) != len(set().union(*starts)):
            raise SchemaError(f"schema{where}: alternatives must be of different JSON types "
                              "(told apart by their first character)")
        return self._add(Node("union", alternatives=alternatives))

    def _tagged(self, objects: tuple[int, ...]) -> int | None:
        """A tagged union of these objects, or None if their first properties do not tell
        them apart."""
        nodes = [self.nodes[o] for o in objects]
        if not all(node.properties for node in nodes):
            return None
        name = nodes[0].properties[0][0]
        by_text: list[tuple[bytes, int]] = []
        for index, node in zip(objects, nodes, strict=True):
            first, value = node.properties[0]
            tag = self.nodes[value]
            if first != name or first not in node.required or tag.kind != "texts":
                return None
            by_text += [(text, index) for text in tag.texts]
        texts = [text for text, _ in by_text]
        if len(set(texts)) != len(texts):
            return None
        values = self._add(Node("texts", texts=Texts.of(texts)))
        return self._add(Node("tagged", properties=((name, values),),
                              required=frozenset({name}), by_text=tuple(by_text)))

    def _ref(self, ref: Any, where: str) -> int:
        if not isinstance(ref, str):
            raise SchemaError(f"schema{where}: $ref must be a text, got {_shown(ref)}")
        if ref in self._refs:
            return self._refs[ref]
        prefix = next((p for p in ("#/$defs/", "#/definitions/") if ref.startswith(p)), None)
        if prefix is None or ref[len(prefix):] not in self._defs:
            raise SchemaError(f"schema{where}: $ref {ref!r} is not a local definition")
        definition = self._defs[ref[len(prefix):]]
        # its place, for a definition that refers to itself: "pending" with the type its
        # definition says, what a union around the reference needs to know of it
        index = self._add(Node("pending", stands_for=_says_type(definition)))
        self._refs[ref] = index
        compiled = self.nodes[self._compile(definition, f"{where}.$ref")]
        if compiled.kind == "pending":
            raise SchemaError(f"schema{where}: $ref {ref!r} refers only to itself, or "
                              "through other $refs back to itself, with no type between")
        self.nodes[index] = compiled
        return index


# The keywords each type honours besides type (an object's are also the default's).
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_KEYWORDS: dict[str, tuple[str, ...]] = {
    "object": ("properties", "required", "additionalProperties"),
    "array": ("items", "minItems", "maxItems"),
    "string": ("minLength", "maxLength"),
    "number": _BOUNDS, "integer": _BOUNDS}
_TYPED = frozenset(keyword for keywords in _KEYWORDS.values() for keyword in keywords)


def _numbers(kind: str, schema: dict[str, Any], where: str) -> Node:
    """A number or integer node with its bounds: minimum and maximum, and
    exclusiveMinimum and exclusiveMaximum as numbers (JSON Schema 6 on, pydantic's gt and
    lt) or as draft 4's booleans beside them."""
    bounds: dict[str, tuple[Fraction, bool] | None] = {}
    for side, keyword, exclusive in (("low", "minimum", "exclusiveMinimum"),
                                     ("high", "maximum", "exclusiveMaximum")):
        value, strict = schema.get(keyword), schema.get(exclusive)
        if isinstance(strict, bool):  # draft 4: the flag of minimum / maximum
            strict, flag = None, strict
        else:
            flag = False
        found = [(v, inclusive) for v, inclusive in ((value, not flag), (strict, False))
                 if v is not None]
        for v, _ in found:
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise SchemaError(f"schema{where}: {keyword} and {exclusive} must be numbers")
        # both given: the tighter holds
        pick = max if side == "low" else min
        bound = pick(((Fraction(str(v)), inclusive) for v, inclusive in found),
                     key=lambda b: (b[0], (not b[1]) == (side == "low")), default=None)
        if bound is not None and kind == "integer":  # the whole numbers within, inclusive
            value_, inclusive = bound
            whole = math.ceil(value_) if side == "low" else math.floor(value_)
            if not inclusive and whole == value_:
                whole += 1 if side == "low" else -1
            bound = (Fraction(whole), True)
        bounds[side] = bound
    low, high = bounds["low"], bounds["high"]
    if low is not None and high is not None and not _meets(low[0], high[0], True, True,
                                                           low, high):
        raise SchemaError(f"schema{where}: no {kind} lies within its minimum and maximum")
    node = Node(kind, low=low, high=high)
    if not any(_number_viable(start, node) for start in (b"-", *(bytes([d]) for d in
                                                                  b"0123456789"))):
        raise SchemaError(f"schema{where}: no {kind} written with at most "
                          f"{_MAX_DIGITS['int']} digits before its point and "
                          f"{_MAX_DIGITS['frac']} after it lies within its bounds")
    return node


_Bound = tuple[Fraction, bool] | None  # (value, inclusive), None: unbounded


def _clipped(a: Fraction, b: Fraction, a_in: bool, b_in: bool, low: _Bound,
             high: _Bound) -> tuple[Fraction, Fraction, bool, bool]:
    """The interval from ``a`` to ``b`` (each end included where ``a_in``, ``b_in``) cut to
    ``low`` and ``high``."""
    if low is not None and (low[0] > a or (low[0] == a and not low[1])):
        a, a_in = low[0], low[1]
    if high is not None and (high[0] < b or (high[0] == b and not high[1])):
        b, b_in = high[0], high[1]
    return a, b, a_in, b_in


def _meets(a: Fraction, b: Fraction, a_in: bool, b_in: bool, low: _Bound,
           high: _Bound) -> bool:
    """Whether the interval from ``a`` to ``b`` holds a number within ``low`` and
    ``high``."""
    a, b, a_in, b_in = _clipped(a, b, a_in, b_in, low, high)
    return a < b or (a == b and a_in and b_in)


def _number_viable(text: bytes, node: Node) -> bool:
    """Whether the number begun as ``text`` (a sign, digits, a point and digits: no
    exponent where a number is bounded) can still end within ``node``'s bounds, written
    with at most _MAX_DIGITS digits in each part (QA: a bound past them left the answer
    cut mid-number)."""
    negative = text.startswith(b"-")
    body = text[1:] if negative else text
    low, high = node.low, node.high
    if negative:  # v = -u: hold u to the bounds mirrored
        low, high = ((-high[0], high[1]) if high else None), ((-low[0], low[1]) if low else None)
    integer = node.kind == "integer"
    step = Fraction(1) if integer else Fraction(1, 10 ** _MAX_DIGITS["frac"])
    top = (Fraction(10 ** _MAX_DIGITS["int"]), False)  # u has at most 20 integer digits
    high = top if high is None or high[0] > top[0] else high

    def holds(a: Fraction, b: Fraction, b_in: bool) -> bool:
        """Some u of the grid (the integers, or multiples of 10^-17) in [a, b] (b
        excluded unless ``b_in``) within the bounds."""
        return _on_grid(a, b, True, b_in, low, high, step)

    if not body:  # "-": any u >= 0
        return holds(Fraction(0), top[0], False)
    whole, point, fraction = body.partition(b".")
    value = Fraction(body.decode()) if point and fraction else Fraction(int(whole))
    if point:  # u in [D.F, D.F + 10^-len(F)), or D.F itself once no digit may follow
        if len(fraction) >= _MAX_DIGITS["frac"]:
            return holds(value, value, True)
        return holds(value, value + Fraction(1, 10 ** len(fraction)), False)
    if whole == b"0":
        return holds(Fraction(0), Fraction(0 if integer else 1), integer)
    for more in range(_MAX_DIGITS["int"] - len(whole) + 1):  # u in [D 10^k, (D + 1) 10^k)
        scale = 10 ** more
        if value * scale > high[0]:
            return False
        if holds(value * scale, (value + 1) * scale, False):
            return True
    return False


def _on_grid(a: Fraction, b: Fraction, a_in: bool, b_in: bool, low: _Bound, high: _Bound,
             step: Fraction) -> bool:
    """Whether a multiple of ``step`` lies in the interval from ``a`` to ``b`` (each end
    included where ``a_in``, ``b_in``) and within ``low`` and ``high``."""
    a, b, a_in, b_in = _clipped(a, b, a_in, b_in, low, high)
    first, last = math.ceil(a / step), math.floor(b / step)
    if not a_in and first * step == a:
        first += 1
    if not b_in and last * step == b:
        last -= 1
    return first <= last


def _number_within(text: bytes, node: Node) -> bool:
    """Whether the complete number ``text`` is within ``node``'s bounds."""
    value = Fraction(text.decode())
    return _meets(value, value, True, True, node.low, node.high)


def _is_of(value: Any, kind: Any) -> bool:
    """Whether a JSON value is of the JSON Schema type ``kind``."""
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    return {"string": str, "boolean": bool, "null": type(None), "object": dict,
            "array": list}.get(kind) is type(value) if kind != "number" else (
        isinstance(value, (int, float)) and not isinstance(value, bool))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _within(inner: Node, outer: Node) -> bool:
    """Whether every value ``inner``'s bounds take, ``outer``'s take too."""
    def inside(a: tuple[Fraction, bool] | None, b: tuple[Fraction, bool] | None,
               lower: bool) -> bool:
        if b is None:
            return True
        if a is None:
            return False
        if a[0] != b[0]:
            return a[0] > b[0] if lower else a[0] < b[0]
        return b[1] or not a[1]

    return inside(inner.low, outer.low, True) and inside(inner.high, outer.high, False)


def _says_type(schema: Any) -> str | None:
    """The JSON type a schema says its values have, where it says one plainly."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str) and kind in _STARTS:
        return kind
    return "object" if kind is None and "properties" in schema else None


_STARTS = {"object": set(b"{"), "array": set(b"["), "string": set(b'"'),
           "number": set(b"-0123456789"), "integer": set(b"-0123456789"),
           "boolean": set(b"tf"), "null": set(b"n")}


def _first_bytes(node: Node, nodes: list[Node]) -> set[int]:
    """The first characters a value of ``node`` can start with."""
    kind = node.stands_for or node.kind
    if kind == "texts":
        return {text[0] for text in node.texts}
    if kind == "union":
        return set().union(*(_first_bytes(nodes[a], nodes) for a in node.alternatives))
    if kind == "tagged":
        return set(b"{")
    return _STARTS.get(kind, set(b'{["-0123456789tfn'))


ANY_OBJECT = Schema()  # JSON mode's


@functools.lru_cache(maxsize=64)
def check_schema(text: str) -> Schema:
    """A schema given as JSON text, compiled once per process (the server checks a body's
    schema, the engine its request's, the sampler holds its rows to it: one Schema, which
    also keeps its states' tokens); SchemaError (a ValueError) naming what is wrong or not
    honoured."""
    try:
        schema = json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
    except SchemaError:
        raise
    except ValueError:
        raise SchemaError("the JSON schema is not JSON") from None
    except RecursionError:  # QA: a schema sent as a string skips the body's depth check
        raise SchemaError(_TOO_DEEP) from None
    if _depth(schema) > MAX_SCHEMA_DEPTH:  # compiling it would recurse as deep (QA: a 500)
        raise SchemaError(_TOO_DEEP)
    if schema is None:  # Schema(None) is JSON mode's any object (QA: "null" took it)
        raise SchemaError("a JSON schema must be an object, got null")
    return Schema(schema)


def _shown(value: Any) -> str:
    """A schema's value as JSON writes it (false, not False), cut to 100 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


MAX_SCHEMA_DEPTH = 64  # as a request body's (server/body.py)
# Schemas compiled one inside another, $refs followed: a body within MAX_SCHEMA_DEPTH nests
# fewer (two JSON levels or more each); each takes a few Python frames
MAX_NESTED_SCHEMAS = 2 * MAX_SCHEMA_DEPTH
_TOO_DEEP = f"the JSON schema nests arrays/objects more than {MAX_SCHEMA_DEPTH} levels deep"


def _depth(value: Any) -> int:
    """How deep ``value`` nests arrays and objects (counted without recursing)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_SCHEMA_DEPTH:
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _not_a_number(text)
    return value


def _not_a_number(name: str) -> Any:
    """NaN and Infinity (1e400 is read as one) are no JSON numbers: an enum of one let the
    model write Infinity (QA)."""
    raise SchemaError(f"the JSON schema holds {name}, which is no JSON number (a number past "
                      "a double's range is read as one)")


# -- the recognizer ----------------------------------------------------------------------

@dataclass(frozen=True)
class JsonState:
    mode: str
    # open containers, outermost first: ("o", node, the index of the next property a key
    # may name, the key being read or None) or ("a", node, the values begun)
    stack: tuple[tuple[Any, ...], ...] = ()
    extra: Any = None
    whitespace: int = 0  # whitespace bytes in a row just read


START = JsonState(TOP)


def feed(state: JsonState | None, byte: int, schema: Schema = ANY_OBJECT) -> JsonState | None:
    """The state after ``byte``, or None if no JSON object (of ``schema``) begins with what
    was read."""
    if state is None:
        return None
    mode = state.mode
    if mode == STRING:
        return _string(state, byte, schema)
    if mode == ESCAPE:
        if byte not in _ESCAPES:
            return None
        if byte == ord("u"):
            return JsonState(UNICODE, state.stack, (state.extra, 4))
        return JsonState(STRING, state.stack, _counted(state.extra))
    if mode == UNICODE:
        if byte not in _HEX:
            return None
        inner, left = state.extra
        return JsonState(STRING, state.stack, _counted(inner)) if left == 1 else \
            JsonState(UNICODE, state.stack, (inner, left - 1))
    if mode == NUMBER:
        return _number(state, byte, schema)
    if mode == CHOICE:
        return _choice(state, byte, schema)
    if mode in (DONE, TOP) and byte in _WHITESPACE:
        return None  # the answer is the object: nothing before it, nothing after it
    if mode == DONE:
        return None
    if byte in _WHITESPACE:
        if state.whitespace >= MAX_WHITESPACE:
            return None
        return JsonState(mode, state.stack, state.extra, state.whitespace + 1)
    return _structural(state, byte, schema)


def _string(state: JsonState, byte: int, schema: Schema) -> JsonState | None:
    """In a string: ``extra`` True for a key, False for a free value, or, for a value held
    to a length, (its node, the characters read, the UTF-8 bytes its last character still
    needs as (how many, the range of the next one), or None)."""
    extra = state.extra
    if extra is True or extra is False:
        if byte == 0x22:  # the closing quote
            return JsonState(COLON, state.stack) if extra else _after_value(state.stack)
        if byte < 0x20:
            return None
        return JsonState(ESCAPE, state.stack, extra) if byte == 0x5C else state
    index, count, pending = extra
    if pending is not None:  # inside a character: only its next byte
        left, low, high = pending
        if not low <= byte <= high:
            return None
        return JsonState(STRING, state.stack,
                         (index, count, (left - 1, 0x80, 0xBF) if left > 1 else None))
    node = schema.nodes[index]
    if byte == 0x22:
        return _after_value(state.stack) if count >= node.min_length else None
    if byte < 0x20 or (node.max_length is not None and count >= node.max_length):
        return None  # a character more would be too many
    if byte == 0x5C:  # counted once the escape is read
        return JsonState(ESCAPE, state.stack, extra)
    if byte < 0x80:
        return JsonState(STRING, state.stack, (index, count + 1, None))
    following = _UTF8_LEADS.get(byte)
    if following is None:
        return None  # not the first byte of a character (counted strings are UTF-8)
    return JsonState(STRING, state.stack, (index, count + 1, following))


# A UTF-8 character's first byte -> the bytes it needs after it: how many, and the range of
# the next one (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF)
_UTF8_LEADS: dict[int, tuple[int, int, int]] = {
    **{lead: (1, 0x80, 0xBF) for lead in range(0xC2, 0xE0)},
    0xE0: (2, 0xA0, 0xBF), **{lead: (2, 0x80, 0xBF) for lead in range(0xE1, 0xED)},
    0xED: (2, 0x80, 0x9F), 0xEE: (2, 0x80, 0xBF), 0xEF: (2, 0x80, 0xBF),
    0xF0: (3, 0x90, 0xBF), 0xF1: (3, 0x80, 0xBF), 0xF2: (3, 0x80, 0xBF),
    0xF3: (3, 0x80, 0xBF), 0xF4: (3, 0x80, 0x8F)}


def _counted(extra: Any) -> Any:
    """A string's ``extra`` after an escape: one character more where they are counted (a
    surrogate pair's two escapes count two)."""
    return extra if isinstance(extra, bool) else (extra[0], extra[1] + 1, None)


def _structural(state: JsonState, byte: int, schema: Schema) -> JsonState | None:
    mode, stack = state.mode, state.stack
    if mode == TOP:
        return _open_object((), schema.root) if byte == ord("{") else None
    if mode in (OBJECT_FIRST, OBJECT_KEY):
        if mode == OBJECT_FIRST and byte == ord("}"):
            return _close(stack, schema)
        return _key(stack, byte, schema)
    if mode == COLON:
        if byte != ord(":"):
            return None
        _, node, _, key = stack[-1]
        return JsonState(VALUE, stack, _property_node(schema.nodes[node], key))
    if mode == ARRAY_FIRST:
        if byte == ord("]"):
            return _close(stack, schema)
        _, index, _ = stack[-1]
        node = schema.nodes[index]
        if node.max_items == 0:
            return None
        return _value((*stack[:-1], ("a", index, 1)), node.items, byte, schema)
    if mode == VALUE:
        return _value(stack, state.extra, byte, schema)
    if mode == AFTER_VALUE:
        frame = stack[-1]
        if frame[0] == "a":
            _, index, count = frame
            node = schema.nodes[index]
            if byte == ord(","):
                if node.max_items is not None and count >= node.max_items:
                    return None
                return JsonState(VALUE, (*stack[:-1], ("a", index, count + 1)), node.items)
            return _close(stack, schema) if byte == ord("]") else None
        if byte == ord(","):
            return JsonState(OBJECT_KEY, stack) if _keys_left(frame, schema) else None
        return _close(stack, schema) if byte == ord("}") else None
    return None


def _value(stack: tuple[Any, ...], index: int, byte: int, schema: Schema) -> JsonState | None:
    """The first byte of a value of schema node ``index``."""
    node = schema.nodes[index]
    kind = node.kind
    if kind == "union":
        for alternative in node.alternatives:
            state = _value(stack, alternative, byte, schema)
            if state is not None:
                return state
        return None
    if kind == "texts":
        return _choice(_in_texts(stack, node.texts, "value"), byte, schema)
    if byte == 0x22 and kind in ("any", "string"):
        return JsonState(STRING, stack, (index, 0, None) if node.bounded else False)
    if byte == ord("{") and kind in ("any", "object", "tagged"):
        return _open_object(stack, schema.any_object if kind == "any" else index)
    if byte == ord("[") and kind in ("any", "array"):
        return JsonState(ARRAY_FIRST, (*stack, ("a", index if kind == "array"
                                                else schema.any_array, 0)))
    if kind in ("any", "number", "integer") and (byte == ord("-") or byte in _DIGITS):
        part = "minus" if byte == ord("-") else "zero" if byte == ord("0") else "int"
        run = 0 if part == "minus" else 1
        if not node.bounded:
            return JsonState(NUMBER, stack, (part, kind == "integer", run))
        text = bytes([byte])
        return JsonState(NUMBER, stack, (part, kind == "integer", run, index, text)) \
            if _number_viable(text, node) else None
    if kind == "any" and byte in b"tfn":
        return _choice(_in_texts(stack, _LITERALS, "value"), byte, schema)
    return None


def _open_object(stack: tuple[Any, ...], index: int) -> JsonState:
    return JsonState(OBJECT_FIRST, (*stack, ("o", index, 0, None)))


def _property_node(node: Node, key: str) -> int:
    """The schema node of ``key``'s value (a key was only taken where it has one)."""
    for name, index in node.properties:
        if name == key:
            return index
    assert node.additional is not None
    return node.additional


def _keys_left(frame: tuple[Any, ...], schema: Schema) -> bool:
    node = schema.nodes[frame[1]]
    return node.additional is not None or frame[2] < len(node.properties)


def _next_names(node: Node, position: int) -> list[str]:
    """The properties a key may name after ``position`` ones are behind: in the schema's
    order (as OpenAI's strict mode and vLLM write them), skipping optional ones, up to the
    first required one."""
    names = []
    for name, _ in node.properties[position:]:
        names.append(name)
        if name in node.required:
            break
    return names


def _key(stack: tuple[Any, ...], byte: int, schema: Schema) -> JsonState | None:
    """The first byte of a key: a free string where other keys are allowed, else one of
    the names not yet given."""
    if byte != 0x22:
        return None
    _, index, position, _ = stack[-1]
    node = schema.nodes[index]
    if node.additional is not None:
        return JsonState(STRING, stack, True)
    names = schema.names.get((index, position))
    if names is None:
        names = schema.names[index, position] = Texts.of(
            _text(name) for name in _next_names(node, position))
    return _choice(_in_texts(stack, names, "key"), byte, schema)


_LITERALS = Texts.of((b"true", b"false", b"null"))


def _in_texts(stack: tuple[Any, ...], texts: Texts, what: str) -> JsonState:
    return JsonState(CHOICE, stack, (texts, 0, len(texts), 0, what))


def _choice(state: JsonState, byte: int, schema: Schema) -> JsonState | None:
    """In one of some texts (``extra``: the sorted texts, the run of them still possible,
    ``[low, high)``, which share the bytes read so far, how many, and what they are: a
    "key" or a "value")."""
    texts, low, high, read_so_far, what = state.extra

    def at(text: bytes) -> int:  # ascending over the run; a text read whole sorts first
        return text[read_so_far] if len(text) > read_so_far else -1

    first = bisect_left(texts, byte, low, high, key=at)
    last = bisect_right(texts, byte, first, high, key=at)
    if first == last:  # a value just finished ends here, and this byte comes after it
        if what == "value" and len(texts[low]) == read_so_far:
            return feed(_after_choice(state.stack, texts[low], what, schema), byte, schema)
        return None
    read_so_far += 1
    if last - first == 1 and len(texts[first]) == read_so_far:
        return _after_choice(state.stack, texts[first], what, schema)
    return JsonState(CHOICE, state.stack, (texts, first, last, read_so_far, what))


def _after_choice(stack: tuple[Any, ...], text: bytes, what: str,
                  schema: Schema) -> JsonState:
    if what == "value":
        return _after_value(_tag(stack, text, schema))
    name = json.loads(text)
    kind, index, _, _ = stack[-1]
    position = 1 + [p for p, _ in schema.nodes[index].properties].index(name)
    return JsonState(COLON, (*stack[:-1], (kind, index, position, name)))


def _tag(stack: tuple[Any, ...], text: bytes, schema: Schema) -> tuple[Any, ...]:
    """The stack after a value ``text``: where it was a tagged union's first property, the
    object it names goes on in its place (its first property read)."""
    frame = stack[-1] if stack else None
    if frame is None or frame[0] != "o" or schema.nodes[frame[1]].kind != "tagged":
        return stack
    chosen = dict(schema.nodes[frame[1]].by_text)[text]
    return (*stack[:-1], ("o", chosen, 1, frame[3]))


def _after_value(stack: tuple[Any, ...]) -> JsonState:
    return JsonState(AFTER_VALUE, stack)


def _close(stack: tuple[Any, ...], schema: Schema) -> JsonState | None:
    frame = stack[-1]
    if frame[0] == "a" and frame[2] < schema.nodes[frame[1]].min_items:
        return None  # too few items
    if frame[0] == "o" and any(name in schema.nodes[frame[1]].required
                               for name, _ in schema.nodes[frame[1]].properties[frame[2]:]):
        return None  # a required key is missing
    rest = stack[:-1]
    return _after_value(rest) if rest else JsonState(DONE)


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
# The most digits in a row in each part: past what a double holds (17 significant digits,
# exponents to 308) and a 64-bit integer (20 digits), a number only grows, and a small
# model at temperature 0 could write digits until max_tokens (QA).
_MAX_DIGITS = {"int": 20, "frac": 17, "expdigits": 3}


def _number(state: JsonState, byte: int, schema: Schema) -> JsonState | None:
    """In a number: ``extra`` (its part, integer only, the digits in a row in this part),
    and for a bounded one its node and the text read (no exponent: the bounds are checked on
    the digits)."""
    part, integer, run, *bounded = state.extra
    kind = ("zero" if byte == ord("0") else "digit" if byte in _DIGITS else
            "point" if byte == ord(".") else "exp" if byte in b"eE" else
            "sign" if byte in b"+-" else None)
    if (integer and kind in ("point", "exp")) or (bounded and kind == "exp"):
        kind = None
    following = _NUMBER_NEXT[part].get(kind) if kind is not None else None
    if following is not None:
        digits = (run + 1 if following == part else 1) if kind in ("digit", "zero") else 0
        if digits > _MAX_DIGITS.get(following, digits):
            return None  # the number ends, or goes on to its next part, instead
        if not bounded:
            return JsonState(NUMBER, state.stack, (following, integer, digits))
        index, text = bounded
        text += bytes([byte])
        if not _number_viable(text, schema.nodes[index]):
            return None
        return JsonState(NUMBER, state.stack, (following, integer, digits, index, text))
    if part not in _COMPLETE:
        return None
    if bounded and not _number_within(bounded[1], schema.nodes[bounded[0]]):
        return None
    return feed(_after_value(state.stack), byte, schema)  # the number ended before it


def read(data: bytes, state: JsonState | None = START,
         schema: Schema = ANY_OBJECT) -> JsonState | None:
    for byte in data:
        state = feed(state, byte, schema)
        if state is None:
            return None
    return state


# What JsonVocabulary.allowed keeps, in list slots (8 bytes each: the token ids' int objects
# are the vocabulary's own), an entry's key and dict slot counted as ENTRY_SLOTS more; the
# least recently used go first. The soak pass: kept per schema by count (4,096 lists each,
# 64 schemas), one schema of 40 strings held to a maxLength filled 3,280 lists of ~49k ids
# near their ends, 1.2 GB, for the life of the process.
ALLOWED_CACHE_SLOTS = 1 << 22  # 32 MiB of slots: ~85 lists of a whole 49k vocabulary
ENTRY_SLOTS = 64


class JsonVocabulary:
    """A vocabulary's tokens as bytes, grouped to find a JSON state's next tokens quickly.
    Tokens without bytes (special tokens, as decoded) are never allowed."""

    def __init__(self, token_bytes: Sequence[bytes],
                 cache_slots: int = ALLOWED_CACHE_SLOTS) -> None:
        self.token_bytes = list(token_bytes)
        # allowed()'s lists by (schema, state), least recently used first, and their slots
        self.cache: OrderedDict[tuple[Schema, JsonState], list[int]] = OrderedDict()
        self.cache_slots = cache_slots
        self._slots = 0
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
        # the plain string tokens of whole UTF-8 characters by their number, so a string
        # held to a length takes those that fit at once; the others (part of a character)
        # are checked byte by byte there
        chars = {}
        partial = []
        for token_id in in_string:
            try:
                chars[token_id] = len(self.token_bytes[token_id].decode())
            except UnicodeDecodeError:
                partial.append(token_id)
        self._longest = max((len(data) for data in self.token_bytes), default=0)
        self._by_chars = sorted(chars, key=chars.__getitem__)
        self._chars = [chars[t] for t in self._by_chars]
        self._counted_special = string_special + partial

    def _canonical(self, state: JsonState, schema: Schema) -> JsonState:
        """A state that allows the same tokens: in a counted string past its minLength and
        further from its maxLength than any token reaches, the count no token can tell
        apart (the minLength's), so a long string's states share one list, worked out once
        (each count was one, ~8 ms each)."""
        if state.mode != STRING or not isinstance(state.extra, tuple):
            return state
        index, count, pending = state.extra
        node = schema.nodes[index]
        if count <= node.min_length or (node.max_length is not None
                                        and node.max_length - count <= self._longest):
            return state
        return JsonState(STRING, state.stack, (index, node.min_length, pending),
                         state.whitespace)

    def allowed(self, state: JsonState, schema: Schema = ANY_OBJECT) -> list[int]:
        """The tokens whose bytes keep the output the beginning of a JSON object of
        ``schema`` (none in DONE: the caller allows EOS there); remembered, within
        ``cache_slots`` (ALLOWED_CACHE_SLOTS)."""
        state = self._canonical(state, schema)
        key = (schema, state)
        cached = self.cache.get(key)
        if cached is not None:
            self.cache.move_to_end(key)
            return cached
        if state.mode == STRING and isinstance(state.extra, tuple):  # held to a length
            index, read_so_far, pending = state.extra
            maximum = schema.nodes[index].max_length
            room = len(self._by_chars) if maximum is None else \
                bisect_right(self._chars, maximum - read_so_far)
            plain = [] if pending is not None else self._by_chars[:room]
            candidates = self._counted_special if pending is None else [
                t for byte in range(pending[1], pending[2] + 1)
                for t in self._by_first.get(byte, ())]
        elif state.mode == STRING:
            plain, candidates = self._in_string, self._string_special
        else:
            plain = []
            after_space = feed(state, 0x20, schema)
            starts = [byte for byte in range(256) if feed(state, byte, schema) is not None or (
                after_space is not None and feed(after_space, byte, schema) is not None)]
            candidates = [t for byte in starts if byte not in _WHITESPACE
                          for t in self._by_first.get(byte, ())]
            if after_space is not None:
                candidates += self._by_first.get(None, [])
        token_bytes = self.token_bytes
        allowed = sorted(plain + [t for t in candidates
                                  if read(token_bytes[t], state, schema) is not None])
        self.cache[key] = allowed
        self._slots += len(allowed) + ENTRY_SLOTS
        while self._slots > self.cache_slots and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self._slots -= len(dropped) + ENTRY_SLOTS
        return allowed
