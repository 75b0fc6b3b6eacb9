"""JSON mode (model/json_mode.py): the recognizer takes exactly the beginnings of one JSON
object, and a vocabulary's allowed tokens are exactly those it takes next."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvserve.core import SamplingParams
from kvserve.model.json_mode import DONE, MAX_WHITESPACE, START, JsonVocabulary, read
from kvserve.model.sampler import Sampler, SamplingRow

OBJECTS = [b"{}", b'{"a": 1}', b' {"a": [1, 2.5, -3e+2, 0.5E-1, true, false, null]}',
           b'{"k":"v\\n\\"\\u00e9","n":0,"o":{"p":[[],{}]}}', b'{"\xc3\xa9": "\xe2\x82\xac"}']
NOT_OBJECTS = [b"[]", b'"a"', b'{"a" 1}', b'{"a": 01}', b'{"a": tru}', b"{,}", b'{"a":1,}',
               b'{"a": "\x01"}', b'{"a": [1 2]}', b"{}}", b'{"a": -}', b'{"a": 1.}',
               b'{"a": 1e}', b'{a: 1}', b'{"a": "\\x"}', b'{"a": "\\u12g4"}', b"{} ",
               b"{" + b" " * (MAX_WHITESPACE + 1) + b"}"]


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
    assert START.mode == "top" and read(b"   {").mode == "obj1"
