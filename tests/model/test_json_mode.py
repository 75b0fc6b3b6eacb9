"""JSON mode (model/json_mode.py): the recognizer takes exactly the beginnings of one JSON
object, and a vocabulary's allowed tokens are exactly those it takes next."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from kvserve.core import RequestError, SamplingParams
from kvserve.model.json_mode import (
    ANY_OBJECT,
    DONE,
    MAX_WHITESPACE,
    START,
    JsonVocabulary,
    Schema,
    SchemaError,
    check_schema,
    read,
)
from kvserve.model.sampler import Sampler, SamplingRow, Thinking, thinking

OBJECTS = [b"{}", b'{"a": 1}', b'{"a": [1, 2.5, -3e+2, 0.5E-1, true, false, null]}',
           b'{"k":"v\\n\\"\\u00e9","n":0,"o":{"p":[[],{}]}}', b'{"\xc3\xa9": "\xe2\x82\xac"}']
NOT_OBJECTS = [b"[]", b'"a"', b'{"a" 1}', b'{"a": 01}', b'{"a": tru}', b"{,}", b'{"a":1,}',
               b'{"a": "\x01"}', b'{"a": [1 2]}', b"{}}", b'{"a": -}', b'{"a": 1.}',
               b'{"a": 1e}', b'{a: 1}', b'{"a": "\\x"}', b'{"a": "\\u12g4"}', b"{} ",
               b"{" + b" " * (MAX_WHITESPACE + 1) + b"}",
               b" {}", b"\n{}"]  # the answer starts with its brace (QA: "\n{" in arguments)


@pytest.mark.parametrize("text", OBJECTS)
def test_a_json_object_is_read_to_its_end_and_every_prefix_is_a_beginning(text):
    json.loads(text)  # the cases are JSON
    assert read(text).mode == DONE
    assert all(read(text[:end]) is not None for end in range(len(text)))


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_what_is_not_one_json_object_is_never_done(text):
    state = read(text)
    assert state is None or state.mode != DONE


def test_the_allowed_tokens_are_exactly_those_the_recognizer_takes():
    """Against the plain definition (every token tried) on a random vocabulary of JSON
    pieces and prose, at states along real objects."""
    pieces = [b"{", b"}", b"[", b"]", b'"', b'":', b'",', b'"}', b" ", b"\n", b"  ", b"1",
              b"0", b"-", b".", b"e", b"+", b"true", b"tr", b"ue", b"null", b"a", b"key",
              b" the", b" {", b'\\', b'\\n', b"u", b"00e9", b":", b",", b", ", b'{"', b"}}",
              b"\x00", b"\xc3", b"", b"1.5", b"]}", b' "']
    rng = random.Random(0)
    vocabulary = JsonVocabulary(pieces + [bytes(rng.choice(b'ab{}[]":, 01e.-\\')
                                                for _ in range(rng.randint(1, 4)))
                                          for _ in range(300)])
    for text in OBJECTS:
        for end in range(len(text)):
            state = read(text[:end])
            if state.mode == DONE:
                continue
            expected = [t for t, data in enumerate(vocabulary.token_bytes)
                        if data and read(data, state) is not None]
            assert vocabulary.allowed(state) == expected, text[:end]


def test_the_sampler_keeps_a_json_row_in_json_and_ends_it_at_eos():
    pieces = [b"<eos>", b"{", b"}", b'"a"', b":", b" 1", b"hello", b" world", b"]"]
    token_bytes = [b"", *pieces[1:]]  # EOS decodes to nothing: never JSON
    sampler = Sampler(token_bytes=lambda: token_bytes)
    params = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0)
    prose = torch.tensor([[5.0, 0.0, 0.0, 1.0, 0.0, 0.0, 9.0, 8.0, 7.0]])  # wants "hello"

    def pick(output: list[int]) -> int:
        return sampler(prose, [SamplingRow(params, [99, *output], 1)]).token_ids[0]

    assert pick([]) == 1  # "{"
    assert pick([1]) == 3  # '"a"' over "}"
    assert pick([1, 3]) == 4
    assert pick([1, 3, 4]) == 3  # a string value
    assert pick([1, 3, 4, 3]) == 2  # "}"
    assert pick([1, 3, 4, 3, 2]) == 0  # closed: EOS
    free = SamplingRow(SamplingParams(temperature=0.0), [99], 1)
    assert sampler(prose, [free]).token_ids == [6]  # a row without JSON mode is untouched
    with pytest.raises(ValueError, match="JSON mode needs the vocabulary"):
        Sampler()(prose, [SamplingRow(params, [99], 1)])


def test_start_is_before_the_object():
    assert START.mode == "top" and read(b"{").mode == "obj1" and read(b" {") is None


def test_an_object_that_lists_no_properties_is_empty_and_one_that_lists_none_is_free():
    """LangChain's tool without arguments sends {"properties": {}, "type": "object"}: only
    {} (QA: the model filled it with keys); without "properties", any keys."""
    closed = Schema({"type": "object", "properties": {}})
    assert read(b"{}", schema=closed).mode == DONE and read(b'{"a', schema=closed) is None
    free = Schema({"type": "object"})
    assert read(b'{"a": 1}', schema=free).mode == DONE


PET = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
       "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                      "tags": {"type": "array", "items": {"type": "string"}},
                      "kind": {"enum": ["cat", "dog", 1, 12, None]},
                      "owner": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]},
                      "ok": {"type": "boolean"}, "w": {"type": ["number", "null"]}},
       "$defs": {"P": {"type": "object", "properties": {"n": {"type": "string"}},
                       "required": ["n"]}}}


@pytest.mark.parametrize("text", [
    b'{"name":"Bob","age":3}', b'{"name": "x", "age": -12, "tags": ["a", "b"]}',
    b'{"name":"a","age":0,"kind":"dog"}', b'{"name":"a","age":0,"kind":12}',
    b'{"name":"a","age":0,"kind":null,"ok":false}', b'{"name":"a","age":0,"owner":{"n":"z"}}',
    b'{"name":"a","age":0,"owner":null,"w":1.5e3}', b'{"name":"a","age":0,"w":null}',
])
def test_an_object_of_the_schema_is_read_to_its_end(text):
    schema = Schema(PET)
    assert read(text, schema=schema).mode == DONE


@pytest.mark.parametrize(("schema", "good", "bad"), [
    # QA: an object's keyword without a type held nothing; it makes the value an object
    ({"type": "object", "properties": {"a": {"additionalProperties": False}},
      "required": ["a"]}, b'{"a":{}}', b'{"a":1}'),
    ({"type": "object", "properties": {"a": {"additionalProperties": {"type": "integer"}}},
      "required": ["a"]}, b'{"a":{"k":1}}', b'{"a":{"k":"v"}}'),
    # both enum and const: the values both hold
    ({"type": "object", "properties": {"a": {"enum": [1, 2], "const": 2}}, "required": ["a"]},
     b'{"a":2}', b'{"a":1}'),
    # {}: any value, of which an answer (a call's arguments) is an object (QA: refused)
    ({}, b'{"k":[1]}', b'[1]'),
])
def test_a_schema_holds_what_it_says(schema, good, bad):
    compiled = Schema(schema)
    assert read(good, schema=compiled).mode == DONE
    state = read(bad, schema=compiled)
    assert state is None or state.mode != DONE


@pytest.mark.parametrize("text", [
    b'{"name":"Bob"}',  # age is required
    b'{"name":"Bob","age":3.5}', b'{"name":"Bob","age":3e2}',  # an integer
    b'{"name":"Bob","age":3,"x":1}',  # no other keys
    b'{"name":"a","name":"b","age":1}',  # each key once
    b'{"age":1,"name":"a"}', b'{"name":"a","age":0,"kind":"dog","tags":[]}',  # in order
    b'{"name":1,"age":1}', b'{"name":"a","age":0,"kind":"cow"}',
    b'{"name":"a","age":0,"kind":123}', b'{"name":"a","age":0,"owner":{}}',
    b'{"name":"a","age":0,"tags":[1]}', b'{"name":"a","age":0,"ok":"yes"}',
])
def test_what_breaks_the_schema_is_never_done(text):
    state = read(text, schema=Schema(PET))
    assert state is None or state.mode != DONE


@pytest.mark.parametrize(("schema", "needle"), [
    ({"type": "string"}, "root must be an object"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}},
     "schema.properties.a: 'pattern' is not supported"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "object"},
                                                      {"type": "object"}]}}},
     "objects in a union must be told apart by their first property"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"},
                                                      {"enum": ["x"]}]}}},
     "alternatives must be of different JSON types"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 2,
                                             "maxItems": 1}}}, "minItems and maxItems"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     "additionalProperties must be false"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}},
     "is not a local definition"),
    ({"type": "object", "required": ["b"], "properties": {"a": {}}},
     "required must list names of properties"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                             "minLength": 2}}},
     "schema.properties.a: 'minLength' cannot be given beside 'anyOf', which decides the "
     "value here: move it into each alternative"),  # beside a union
    # QA: "'type' is not supported (honoured: type, ...)"; "give type" where it was given
    ({"type": "object", "properties": {"a": {"type": "string", "$ref": "#/$defs/A"}},
      "$defs": {"A": {"type": "string"}}},
     "'type' cannot be given beside '\\$ref', which decides the value here: move it into "
     "the schema it names"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": ["abc", "d"],
                                             "maxLength": 1}}},
     "'maxLength' cannot be given beside 'enum', which decides the value here: drop it"),
    # QA: const dropped silently where both were given
    ({"type": "object", "properties": {"a": {"enum": [1, 2], "const": 3}}},
     "const 3 is not among the enum's values"),
    # QA: object keywords without a type held nothing (any value)
    ({"type": "object", "properties": {"a": {"required": ["x"]}}},
     "required must list names of properties"),
    ({"type": "object", "properties": {"a": {"enum": ["x"], "pattern": "y"}}},
     "schema.properties.a: 'pattern' is not supported"),
    # QA: a TypeError (a 500) each
    ({"type": "object", "required": [["a"]], "properties": {"a": {}}},
     "required must list names of properties"),
    ({"type": "object", "properties": {"a": {"$ref": []}}}, r"\$ref must be a text"),
    ({"type": "object", "properties": {"a": {"$ref": {}}}}, r"\$ref must be a text"),
    # QA: any value, silently
    ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/A"}}}, "refers only to itself"),
    # QA (fuzz): a cycle through another $ref; a list of no type names read "non-empty";
    # false shown as Python's False
    ({"$defs": {"N": {"$ref": "#/$defs/M"}, "M": {"$ref": "#/$defs/N"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/N"}}}, "through other \\$refs back to itself"),
    ({"type": "object", "properties": {"a": {"type": [5]}}},
     r"schema.properties.a.type: a list of types must be a non-empty list of type names, "
     r"got \[5\]"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": False}}},
     "schema.properties.a.items: expected an object, got false"),
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/A"}}}, "needs the definition's type"),
    # QA: the bounds were dropped
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"},
                                                      {"type": "number", "minimum": 1}]}}},
     "only where the number's bounds hold the integer's"),
])
def test_what_a_schema_asks_beyond_the_subset_is_refused_by_name(schema, needle):
    with pytest.raises(SchemaError, match=needle):
        Schema(schema)


def test_the_allowed_tokens_follow_the_schema():
    """Keys in the schema's order (as OpenAI's strict mode and vLLM write them), an
    optional one skipped or not; a closing brace only once the required keys are in; an
    integer takes no point."""
    schema = Schema({"type": "object", "properties": {"a": {"type": "integer"},
                                                      "b": {"type": "string"}},
                     "required": ["a"], "additionalProperties": False})
    pieces = [b"{", b'"a"', b'"b"', b'"c"', b":", b"1", b".", b"}", b",", b'"x"', b'"']
    vocabulary = JsonVocabulary(pieces)

    def allowed(text: bytes) -> set[bytes]:
        return {pieces[t] for t in vocabulary.allowed(read(text, schema=schema), schema)}

    assert allowed(b"{") == {b'"a"', b'"'}  # no "}": a is required, and comes first
    assert allowed(b'{"a":1') == {b"1", b"}", b","}  # no ".": an integer
    assert allowed(b'{"a":1,') == {b'"b"', b'"'}  # a was given
    assert allowed(b'{"a":1,"b":"x"') == {b"}"}  # no key left: no ","


def test_the_allowed_tokens_under_a_schema_are_exactly_those_it_takes():
    schema = Schema(PET)
    rng = random.Random(1)
    alphabet = b'abnmegtkiow{}[]":, 01e.-\\'
    pieces = [b'"name"', b'"age"', b'"kind"', b'"dog"', b"null", b"12", b'"n"', b'":"']
    vocabulary = JsonVocabulary(pieces + [bytes(rng.choice(alphabet)
                                                for _ in range(rng.randint(1, 5)))
                                          for _ in range(400)])
    text = b'{"name": "Bo", "age": 3, "tags": ["a"], "kind": 12, "owner": {"n": "z"}}'
    for end in range(len(text)):
        state = read(text[:end], schema=schema)
        expected = [t for t, data in enumerate(vocabulary.token_bytes)
                    if data and read(data, state, schema) is not None]
        assert vocabulary.allowed(state, schema) == expected, text[:end]


def test_unions_a_value_settles_are_merged():
    """Union[int, float] is a number; a union with an any is any (QA: both refused)."""
    schema = Schema({"type": "object", "properties": {
        "x": {"anyOf": [{"type": "integer"}, {"type": "number"}]},
        "y": {"type": ["integer", "number"]}, "z": {"anyOf": [{}, {"type": "string"}]}}})
    assert read(b'{"x":1.5,"y":2,"z":[true]}', schema=schema).mode == DONE


def test_a_json_states_mask_is_built_once():
    """Building a mask from a list of 49k ids took 4.7 of a JSON step's 5.7 ms: the mask of
    a list the vocabulary keeps is kept too, and a list it does not keep is not."""
    sampler = Sampler(token_bytes=lambda: [b"{", b"}"])
    kept = [1, 3]
    first = sampler.mask(kept, 8, torch.device("cpu"), remember=True)
    assert first.tolist() == [False, True, False, True] + [False] * 4
    assert sampler.mask(kept, 8, torch.device("cpu"), remember=True) is first
    assert sampler.mask([1, 3], 8, torch.device("cpu"), remember=True) is not first
    assert sampler.mask(kept, 8, torch.device("cpu")) is not first


def test_a_rows_state_goes_on_from_the_step_before():
    """Reading the whole output again at each step made a JSON request O(n^2) (17% of its
    time per token): the state after all but the last token is kept and fed that token;
    the answer is the whole reading's, also with the step before unknown."""
    pieces = [b"{", b'"a"', b":", b" [", b"1", b",", b"2", b"]", b"}"]
    sampler = Sampler(token_bytes=lambda: pieces)
    output = [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for end in range(len(output) + 1):
        expected = read(b"".join(pieces[t] for t in output[:end]))
        assert sampler.json_state(None, ANY_OBJECT, output[:end]) == expected
    assert (None, b"", tuple(output[:4])) in sampler._states
    fresh = Sampler(token_bytes=lambda: pieces)  # no step before: read whole
    assert fresh.json_state(None, ANY_OBJECT, output).mode == DONE


CAT_OR_DOG = {"type": "object", "required": ["pet", "n"], "properties": {
    "pet": {"anyOf": [
        {"type": "object", "required": ["kind", "meows"], "properties": {
            "kind": {"const": "cat"}, "meows": {"type": "boolean"}}},
        {"type": "object", "required": ["kind", "barks"], "properties": {
            "kind": {"enum": ["dog", "wolf"]}, "barks": {"type": "integer"}}},
        {"type": "null"}]},
    "n": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}}


@pytest.mark.parametrize(("text", "done"), [
    (b'{"pet":{"kind":"cat","meows":true},"n":[1]}', True),
    (b'{"pet":{"kind":"wolf","barks":3},"n":[1,2]}', True),
    (b'{"pet":null,"n":[0]}', True),
    (b'{"pet":{"kind":"cat","barks":3},"n":[1]}', False),  # a cat does not bark
    (b'{"pet":{"kind":"dog","meows":true},"n":[1]}', False),
    (b'{"pet":{"meows":true,"kind":"cat"},"n":[1]}', False),  # the tag comes first
    (b'{"pet":null,"n":[]}', False),  # minItems 1
    (b'{"pet":null,"n":[1,2,3]}', False),  # maxItems 2
])
def test_a_tagged_union_of_objects_and_counted_arrays(text, done):
    """Objects of a union told apart by their first property (pydantic's discriminated
    union; a required call among several tools), and arrays' minItems / maxItems."""
    state = read(text, schema=Schema(CAT_OR_DOG))
    assert (state is not None and state.mode == DONE) == done


def _one(node: dict) -> Schema:
    return Schema({"type": "object", "properties": {"v": node}, "required": ["v"],
                   "additionalProperties": False})


def _done(schema: Schema, value: bytes) -> bool:
    state = read(b'{"v":' + value + b"}", schema=schema)
    return state is not None and state.mode == DONE


BOUNDS = [{"minimum": -5, "maximum": 120}, {"exclusiveMinimum": 0, "exclusiveMaximum": 10},
          {"minimum": 0.5, "exclusiveMaximum": 2.25}, {"maximum": -2.5},
          {"minimum": 7}, {"exclusiveMinimum": -1.5}, {"minimum": 0, "exclusiveMinimum": True},
          {"minimum": 100, "maximum": 100}]


def _within(value: float, bounds: dict) -> bool:
    low, high = bounds.get("minimum"), bounds.get("maximum")
    low_x, high_x = bounds.get("exclusiveMinimum"), bounds.get("exclusiveMaximum")
    if low_x is True:
        low_x, low = low, None
    return ((low is None or value >= low) and (high is None or value <= high)
            and (low_x is None or value > low_x) and (high_x is None or value < high_x))


@pytest.mark.parametrize("bounds", BOUNDS)
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_number_is_held_to_its_bounds(kind, bounds):
    """minimum, maximum and their exclusive forms (pydantic's ge, le, gt, lt; draft 4's
    boolean flags): a value is done exactly when it lies within them."""
    schema = _one({"type": kind, **bounds})
    rng = random.Random(7)
    texts = [str(n) for n in range(-150, 160)] + ["-0", "0.5", "2.25", "2.2499", "-2.5",
                                                   "-2.51", "7.0", "100.00", "-1.4999"]
    texts += [f"{rng.uniform(-200, 200):.{rng.randint(1, 4)}f}" for _ in range(300)]
    for text in texts:
        if kind == "integer" and "." in text:
            continue
        assert _done(schema, text.encode()) == _within(float(text), bounds), text
    assert not _done(schema, b"1e1")  # a bounded number is written without an exponent


@pytest.mark.parametrize("bounds", BOUNDS)
@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_bounded_number_never_reaches_a_dead_end(kind, bounds):
    """Every beginning the recognizer takes can still be finished (a constrained row that
    took one would have no token left): breadth first over digits, sign and point."""
    schema = _one({"type": kind, **bounds})
    alphabet = b"-0123456789.}"
    frontier = [read(b'{"v":', schema=schema)]
    seen = set(frontier)
    for _ in range(4):  # every beginning of up to four bytes
        following = []
        for state in frontier:
            for byte in alphabet:
                after = read(bytes([byte]), state, schema)
                if after is not None and after not in seen:
                    seen.add(after)
                    following.append(after)
        frontier = following
    for state in seen:
        assert _finishes(state, schema, alphabet), state


def _finishes(state, schema: Schema, alphabet: bytes, depth: int = 12) -> bool:
    """Some bytes of ``alphabet`` (at most ``depth``) take ``state`` to the object's end:
    depth first, the closing brace tried first."""
    if state.mode == DONE:
        return True
    if depth == 0:
        return False
    return any(_finishes(after, schema, alphabet, depth - 1)
               for byte in sorted(alphabet, key=lambda b: b != ord("}"))
               if (after := read(bytes([byte]), state, schema)) is not None)


def test_a_string_is_held_to_its_length_in_characters():
    schema = _one({"type": "string", "minLength": 2, "maxLength": 4})
    for text in ['""', '"a"', '"ab"', '"abcd"', '"abcde"', '"é"', '"éé"', '"éééé"', '"ééééé"',
                 '"\\n\\n"', '"\\u00e9x"', '"a\\"b\\\\"']:
        length = len(json.loads(text))
        assert _done(schema, text.encode()) == (2 <= length <= 4), text
    # a counted string is UTF-8: bytes that are no character cannot pad or stretch it
    for raw in [b'"ab\x80\x80\x80"', b'"\xc3\xa9\xa9"', b'"a\xc3"', b'"a\xe0\x80\x80"',
                b'"a\xff"', b'"a\xed\xa0\x80"']:
        assert not _done(schema, raw), raw
    assert _done(schema, '"a😀"'.encode())


def test_the_allowed_tokens_of_a_string_held_to_a_length_are_exactly_those_it_takes():
    schema = _one({"type": "string", "maxLength": 3, "minLength": 1})
    rng = random.Random(3)
    alphabet = ["a", "b", "é", "€", '"', "\\", "n", "u", "0", "}"]
    pieces = [b'"'] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))).encode()
        for _ in range(500)] + ["é".encode()[:1], "é".encode()[1:], "€".encode()[:2],
                                "€".encode()[1:], "€".encode()[2:] + b"a", b"\xff"]
    vocabulary = JsonVocabulary(pieces)
    for prefix in [b'{"v":"', b'{"v":"a', b'{"v":"ab', b'{"v":"ab\xc3', b'{"v":"abc',
                   b'{"v":"\\', b'{"v":"\\u00', b'{"v":"\xe2', b'{"v":"\xe2\x82']:
        state = read(prefix, schema=schema)
        assert state is not None, prefix
        expected = [t for t, data in enumerate(vocabulary.token_bytes)
                    if read(data, state, schema) is not None]
        assert vocabulary.allowed(state, schema) == expected, prefix


@pytest.mark.parametrize(("node", "needle"), [
    ({"type": "integer", "minimum": 3, "maximum": 2}, "no integer lies within"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
     "no integer lies within"),
    ({"type": "number", "minimum": "1"}, "must be numbers"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength and maxLength"),
    ({"type": "number", "multipleOf": 2}, "'multipleOf' is not supported"),
    ({"maximum": 2}, "'maximum' holds a value of type number or integer: give \"type\""),
    ({"type": "integer", "minimum": 10 ** 20}, "at most 20 digits before its point"),  # QA
    ({"type": "number", "minimum": 1e25}, "at most 20 digits"),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-19}, "17 after it"),
])
def test_bounds_that_cannot_hold_are_refused_by_name(node, needle):
    with pytest.raises(SchemaError, match=needle):
        _one(node)


def test_a_type_list_gives_each_type_its_own_keywords():
    """Optional[conint(ge=1)] as {"type": ["integer", "null"], "minimum": 1}."""
    schema = _one({"type": ["integer", "null"], "minimum": 1})
    assert _done(schema, b"null") and _done(schema, b"3") and not _done(schema, b"0")


@pytest.mark.parametrize("node", [{"type": "number"}, {"type": "integer"}, {},
                                  {"type": "number", "minimum": -5}])
def test_a_number_has_at_most_the_digits_a_double_or_int64_holds(node):
    """QA: a small model at temperature 0 wrote fraction digits until max_tokens."""
    schema = _one(node)
    number = "" if node.get("type") == "integer" else ".5"
    assert _done(schema, b"1" * 1 + b"2" * 19) and not _done(schema, b"1" * 21)
    if number:
        assert _done(schema, b"0." + b"3" * 17) and not _done(schema, b"0." + b"3" * 18)
    if "minimum" not in node and number:
        assert _done(schema, b"1e308") and not _done(schema, b"1e3080")
    if number:
        state = read(b'{"v":0.' + b"3" * 17, schema=schema)
        assert state is not None and _finishes(state, schema, b"0123456789.e}")  # not stuck


def test_a_keyword_of_another_type_holds_nothing_there():
    """JSON Schema's rule (and vLLM's): "required" beside an array, "minItems" or
    "maximum" beside a string constrain nothing (QA: refused, naming a keyword the message
    listed as honoured)."""
    schema = _one({"type": "array", "items": {"type": "string"}, "required": []})
    assert _done(schema, b'["a"]')
    schema = _one({"type": "string", "minItems": 1, "maximum": 2})
    assert _done(schema, b'"abc"')


@pytest.mark.parametrize("bounds", [{"exclusiveMinimum": 0, "maximum": 1e-16},
                                    {"minimum": 99999999999999999999},
                                    {"minimum": -1e-17, "maximum": 1e-17}])
def test_bounds_at_the_digit_caps_leave_no_dead_end(bounds):
    """The caps (20 digits before the point, 17 after) are part of what can still end
    within the bounds: a prefix with no room left is refused at its last digit."""
    schema = _one({"type": "number", **bounds})
    frontier = [read(b'{"v":', schema=schema)]
    for _ in range(24):  # the first byte of each branch, depth first: follow one path far
        state = frontier[-1]
        nexts = [after for byte in b"0123456789.-" if
                 (after := read(bytes([byte]), state, schema)) is not None]
        if not nexts:
            break
        frontier.append(nexts[0] if len(frontier) % 2 else nexts[-1])
    for state in frontier:
        assert _finishes(state, schema, b"0123456789.}", depth=24), state


def test_a_long_counted_strings_states_share_their_tokens():
    """Past minLength and further from maxLength than any token reaches, every count allows
    the same tokens: worked out once (a state's first step costs ~8 ms, each count was one);
    near either end the count is told apart."""
    schema = _one({"type": "string", "minLength": 3, "maxLength": 60})
    rng = random.Random(5)
    pieces = [b'"', b'a"', b"ab", b"abc" * 3, b'\\n', "é".encode()] + [
        bytes(rng.choice(b'ab"\\n}') for _ in range(rng.randint(1, 6))) for _ in range(200)]
    vocabulary = JsonVocabulary(pieces)
    for count in range(0, 61):
        state = read(b'{"v":"' + b"x" * count, schema=schema)
        expected = [t for t, data in enumerate(pieces) if read(data, state, schema) is not None]
        assert vocabulary.allowed(state, schema) == expected, count
    shared = {key for key in vocabulary.cache if key[1].extra[1] == 3}
    assert len(vocabulary.cache) < 61 - 10 and shared  # the middle counts are one entry


def test_the_allowed_lists_kept_are_bounded_in_slots_least_recently_used_first():
    """The soak pass: one schema of 40 strings held to a maxLength kept 3,280 lists of
    nearly the whole vocabulary, 1.2 GB, for the life of the process (a count bound per
    schema). The lists kept are bounded in slots over every schema; a list dropped is
    worked out again, the same."""
    from kvserve.model.json_mode import ENTRY_SLOTS

    schema = _one({"type": "string", "maxLength": 40})
    pieces = [b'"', b"a", b"ab", b"abc", b"abcd", b'a"', b"\\n"] + [b"x" * n for n in range(5, 30)]
    bound = 4 * (len(pieces) + ENTRY_SLOTS)
    vocabulary = JsonVocabulary(pieces, cache_slots=bound)
    states = [read(b'{"v":"' + b"x" * count, schema=schema) for count in range(41)]
    expected = {count: [t for t, data in enumerate(pieces)
                        if read(data, state, schema) is not None]
                for count, state in enumerate(states)}
    for _ in range(2):
        for count, state in enumerate(states):
            assert vocabulary.allowed(state, schema) == expected[count], count
            slots = sum(len(kept) + ENTRY_SLOTS for kept in vocabulary.cache.values())
            assert slots <= bound
    last = vocabulary.allowed(states[40], schema)
    assert vocabulary.allowed(states[40], schema) is last  # kept while recently used
    other = _one({"type": "string", "maxLength": 40})  # another schema's lists count too
    for count in range(30, 41):
        vocabulary.allowed(read(b'{"v":"' + b"x" * count, schema=other), other)
    assert sum(len(kept) + ENTRY_SLOTS for kept in vocabulary.cache.values()) <= bound


THINKING = [b"", b"{", b"}", b"<think>", b"<th", b"ink>", b"hmm", b"</think>", b"\n",
            b"</", b"think>\n"]  # token 0 the EOS


def _thinking_pick(params: SamplingParams, output: list[int], wants: int,
                   sampler: Sampler | None = None) -> int:
    """The token a greedy row picks after ``output`` when the model wants ``wants`` most
    (then "{", then the rest alike)."""
    logits = torch.zeros(1, len(THINKING))
    logits[0, wants], logits[0, 1] = 9.0, 5.0
    sampler = sampler or Sampler(token_bytes=lambda: THINKING)
    return sampler(logits, [SamplingRow(params, [99, *output], 1)]).token_ids[0]


def test_a_thinking_answer_is_held_to_json_from_the_end_of_its_thinking_on():
    """vLLM's reasoning-aware structured outputs (docs/structured-outputs.md, "Thinking
    first"): nothing holds while the model thinks; from the token after the closing marker
    (one token or several, more text in its last) the JSON holds, to EOS."""
    params = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0,
                            think_markers=("<think>", "</think>"), think_open=True)
    assert _thinking_pick(params, [], wants=6) == 6  # free while it thinks
    assert _thinking_pick(params, [6, 6], wants=6) == 6
    assert _thinking_pick(params, [6, 7], wants=6) == 1  # thought: "{" first
    assert _thinking_pick(params, [6, 9, 10], wants=6) == 1  # "</" "think>\n"
    assert _thinking_pick(params, [6, 7, 1], wants=6) == 2  # "}"
    assert _thinking_pick(params, [6, 7, 1, 2], wants=6) == 0  # closed: EOS
    ending = dataclasses.replace(params, stop_token_ids=(8,))  # the model's other end ids
    assert _thinking_pick(ending, [6], wants=8) != 8  # are stop ids: none while it thinks
    assert _thinking_pick(params, [6], wants=0) != 0  # no EOS while it thinks (QA: a "stop"
    # answer with no JSON); it must close its thinking and write its form
    assert [thinking(params, output, THINKING).start for output in (
        [], [6], [3, 6, 7], [6, 9, 10, 1])] == [None, None, 3, 3]
    unthinking = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0)
    assert _thinking_pick(unthinking, [], wants=6) == 1  # without markers: held at once


def test_an_answer_that_may_think_chooses_at_its_first_tokens():
    """Thinking not opened by the prompt (Qwen3's template): the first tokens may open the
    thinking or begin the JSON; once the marker began it goes on; an answer that began
    otherwise is held from its first token."""
    params = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0,
                            think_markers=("<think>", "</think>"))
    sampler = Sampler(token_bytes=lambda: THINKING)
    assert _thinking_pick(params, [], wants=3, sampler=sampler) == 3  # "<think>"
    assert _thinking_pick(params, [], wants=4, sampler=sampler) == 4  # "<th"
    assert _thinking_pick(params, [], wants=6, sampler=sampler) == 1  # or the JSON
    assert _thinking_pick(params, [4], wants=1, sampler=sampler) == 5  # "<th" + "ink>"
    assert _thinking_pick(params, [3], wants=6, sampler=sampler) == 6  # thinking: free
    assert _thinking_pick(params, [4, 5, 6, 7], wants=6, sampler=sampler) == 1
    assert _thinking_pick(params, [1], wants=3, sampler=sampler) == 2  # did not think
    assert thinking(params, [], THINKING) == Thinking(0, b"")
    assert thinking(params, [8, 4], THINKING) == Thinking(0, b"\n<th")
    assert thinking(params, [1], THINKING) == Thinking(0)


def test_a_thinking_answer_is_held_to_its_choices_after_its_thinking():
    params = SamplingParams(temperature=0.0, eos_token_id=0, choice_token_ids=[(2,)],
                            think_markers=("<think>", "</think>"), think_open=True)
    assert _thinking_pick(params, [6], wants=6) == 6
    assert _thinking_pick(params, [6, 7], wants=6) == 2
    assert _thinking_pick(params, [6, 7, 2], wants=6) == 0


@pytest.mark.parametrize("markers", [("<think>",), ("", "</think>"), "<think>", (1, 2)])
def test_think_markers_are_two_texts(markers):
    with pytest.raises(RequestError, match="think_markers must be two non-empty texts"):
        SamplingParams(json_object=True, eos_token_id=0, think_markers=markers)


def test_an_enums_texts_are_found_by_their_run_whatever_their_number():
    """The texts still possible are one run of the sorted texts (bisection: an enum of
    150,000 values was read text by text, seconds a token, QA): a text that is the
    beginning of another, numbers that go on, and the same answers in any order given."""
    values = [12, 1, "ab", "a", "abc", 120, None, "b"] + [f"v{i}" for i in range(3000)]
    for order in (values, list(reversed(values))):
        schema = Schema({"type": "object", "properties": {"x": {"enum": order}},
                         "required": ["x"]})
        for value in (1, 12, 120, "a", "ab", "abc", None, "b", "v0", "v2999"):
            text = b'{"x":' + json.dumps(value).encode() + b"}"
            assert read(text, schema=schema).mode == DONE, text
        for text in (b'{"x":2}', b'{"x":"abcd"}', b'{"x":"v3000"}', b'{"x":121}',
                     b'{"x":"v"}', b'{"x":nul}'):
            assert read(text, schema=schema) is None or \
                read(text, schema=schema).mode != DONE, text
    pieces = [b'{"x":', b"1", b"2", b"0", b"}", b'"a', b"b", b'"', b"c", b'"v29', b"99"]
    vocabulary = JsonVocabulary(pieces)
    state = read(b'{"x":"a', schema=schema)
    expected = [t for t, data in enumerate(pieces) if read(data, state, schema) is not None]
    assert vocabulary.allowed(state, schema) == expected == [6, 7]


def test_a_recursive_definition_in_a_union_holds_its_own_shape():
    """pydantic's tree (a child that is a Node or null): the reference's place stood for
    any value while the union around it was built, so any child was taken (QA)."""
    tree = {"$defs": {"Node": {"type": "object", "required": ["v", "child"], "properties": {
        "v": {"type": "integer"},
        "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/Node"}
    schema = Schema(tree)
    for text in (b'{"v":1,"child":null}', b'{"v":1,"child":{"v":2,"child":null}}'):
        assert read(text, schema=schema).mode == DONE
    for text in (b'{"v":1,"child":"hello"}', b'{"v":1,"child":[1,2]}'):
        assert read(text, schema=schema) is None


def test_an_integer_or_number_keeps_the_bounds_they_share():
    schema = Schema({"type": "object", "required": ["x"], "properties": {
        "x": {"type": ["integer", "number"], "minimum": 5, "maximum": 6}}})
    assert read(b'{"x":5.5}', schema=schema).mode == DONE
    assert read(b'{"x":6}', schema=schema).mode == DONE
    assert read(b'{"x":1000}', schema=schema) is None  # QA: taken
    exclusive = Schema({"type": "object", "required": ["x"], "properties": {
        "x": {"type": ["integer", "number"], "exclusiveMinimum": 5}}})
    assert read(b'{"x":5}', schema=exclusive) is None
    assert read(b'{"x":5.5}', schema=exclusive).mode == DONE
    wider = Schema({"type": "object", "required": ["x"], "properties": {
        "x": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "number"}]}}})
    assert read(b'{"x":-2.5}', schema=wider).mode == DONE  # the numbers hold the integers


@pytest.mark.parametrize("number", ["1e400", "-1e400", "Infinity", "NaN"])
def test_a_schema_of_numbers_no_json_holds_is_refused(number):
    """QA: an enum of 1e400 (read as infinity) let the model write Infinity."""
    with pytest.raises(SchemaError, match="no JSON number"):
        check_schema('{"type": "object", "properties": {"a": {"enum": [' + number + "]}}}")


def test_an_enum_beside_a_type_keeps_the_values_of_that_type():
    """QA: {"enum": [1, "a"], "type": "string"} took 1."""
    schema = Schema({"type": "object", "required": ["x"], "properties": {
        "x": {"enum": [1, "a", 2.0], "type": ["string", "integer"]}}})
    assert read(b'{"x":"a"}', schema=schema).mode == DONE
    assert read(b'{"x":1}', schema=schema).mode == DONE
    with pytest.raises(SchemaError, match="no value of the enum is of its type"):
        Schema({"type": "object", "properties": {"x": {"enum": [1], "type": "string"}}})


CLOSING = [*THINKING, b"</think", b">{", b'>"', b">\n", b'</think>{"a']  # 11 .. 15


def test_bytes_after_the_closing_marker_in_its_token_begin_the_form():
    """QA: the form held from the token after the one that closed the thinking, so what
    that token wrote after the marker was never checked ('>"' put '"' before the JSON).
    Now those bytes begin the form, and while it thinks a token that would close it with
    bytes the form cannot begin with is never drawn."""
    params = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0,
                            think_markers=("<think>", "</think>"), think_open=True)

    def pick(output: list[int], wants: int) -> int:
        logits = torch.zeros(1, len(CLOSING))
        logits[0, wants] = 9.0
        sampler = Sampler(token_bytes=lambda: CLOSING)
        return sampler(logits, [SamplingRow(params, [99, *output], 1)]).token_ids[0]

    assert pick([6, 11], wants=13) != 13  # '>"': banned
    assert pick([6, 11], wants=12) == 12  # '>{': closes and begins the object
    assert pick([6, 11, 12], wants=6) == 2  # then "}" (the "{" was read)
    assert pick([6, 11], wants=14) == 14  # ">\n": a blank after it is fine
    assert pick([6], wants=15) == 15  # '</think>{"a': the marker and the JSON's beginning
    choices = SamplingParams(temperature=0.0, eos_token_id=0, choice_token_ids=[(2,)],
                             think_markers=("<think>", "</think>"), think_open=True)
    sampler = Sampler(token_bytes=lambda: CLOSING)
    assert 12 in sampler.closing_bans(choices, b"</think") and \
        14 not in sampler.closing_bans(choices, b"</think")


def test_a_thinking_rows_state_goes_on_from_the_step_before():
    """QA: every step read the whole output's bytes again (O(n^2) over a long thinking);
    now only the last token is read, and the answer is the whole reading's."""
    params = SamplingParams(json_object=True, eos_token_id=0,
                            think_markers=("<think>", "</think>"))
    output = [3, 6, 6, 9, 6, 9, 10, 1]  # <think> hmm hmm </ hmm </ think>\\n {
    sampler = Sampler(token_bytes=lambda: CLOSING)
    for end in range(len(output) + 1):
        assert sampler.thinking_of(params, output[:end]) == thinking(params, output[:end],
                                                                     CLOSING), end
    assert thinking(params, output, CLOSING) == Thinking(7, leftover=b"")


def test_blanks_may_come_between_the_thinking_and_its_form():
    """A model writes "</think>\\n\\n" before its answer: the blanks are allowed (a few),
    then the form holds as from its first byte (QA: "{" was forced at once)."""
    params = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0,
                            think_markers=("<think>", "</think>"), think_open=True)
    assert _thinking_pick(params, [6, 7], wants=8) == 8  # "\n" after "</think>"
    assert _thinking_pick(params, [6, 7, 8], wants=6) == 1  # then "{"
    # inside the object: only JSON's tokens ("}" or a blank), not the "<think>" it wants
    assert _thinking_pick(params, [6, 7, 8, 1], wants=3) in (2, 8)
    assert _thinking_pick(params, [6, 7, 8, 8, 8, 8], wants=8) == 1  # enough blanks
    plain = SamplingParams(temperature=0.0, json_object=True, eos_token_id=0)
    assert _thinking_pick(plain, [], wants=8) == 1  # without thinking: the object at once
