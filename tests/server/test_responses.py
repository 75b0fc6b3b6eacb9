"""The completions API's logprob offsets (server/responses.py) on text whose characters are
split over byte-level tokens, with the bundled model's tokenizer."""

from __future__ import annotations

import pytest

from kvserve.model.tokenizer import load_tokenizer
from kvserve.server.responses import TextOffsets, completion_logprobs

TEXT = "\n🌟 🌟 ok é"  # each star is 4 UTF-8 bytes over 3 tokens that alone decode to U+FFFD


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_a_split_character_counts_once_where_it_starts(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    entries = [(token_id, {token_id: -0.5}) for token_id in ids]
    offsets = completion_logprobs(tokenizer, entries)["text_offset"]
    # "\n" 0, a star 1, " " 2, a star 3, " ok" 4, " é" 7: not 0..8, one per token
    assert offsets == [0, 1, 1, 1, 2, 3, 3, 4, 7]
    for token_id, start in zip(ids, offsets, strict=True):
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece:
            assert TEXT[start:start + len(piece)] == piece


def test_streamed_chunks_split_inside_a_character_give_the_same_offsets(tokenizer):
    """A stream keeps one TextOffsets per choice, so a chunk that begins inside a character
    (its first bytes went out in the previous chunk's tokens) continues the count."""
    ids = tokenizer.encode(TEXT)
    entries = [(token_id, {token_id: -0.5}) for token_id in ids]
    whole = completion_logprobs(tokenizer, entries)["text_offset"]
    for cut in range(1, len(ids)):
        state = TextOffsets()
        first = completion_logprobs(tokenizer, entries[:cut], state)["text_offset"]
        rest = completion_logprobs(tokenizer, entries[cut:], state)["text_offset"]
        assert first + rest == whole, cut
    state = TextOffsets()
    one_by_one = [completion_logprobs(tokenizer, [e], state)["text_offset"][0] for e in entries]
    assert one_by_one == whole


def test_chat_logprob_bytes_are_each_tokens_own_and_join_to_the_text(tokenizer):
    """OpenAI's ``bytes``: a token's own bytes, so a client can join them into the text. A
    token holding part of a character gave the bytes of U+FFFD instead."""
    from kvserve.server.responses import chat_logprobs

    ids = tokenizer.encode(TEXT)
    content = chat_logprobs(tokenizer, [(t, {t: -0.5, ids[0]: -1.0}) for t in ids], 1)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == TEXT.encode()
    star = [entry for entry in content if entry["token"] == "\ufffd"]
    assert len(star) >= 4 and all(entry["bytes"] != list("\ufffd".encode()) for entry in star)
    assert content[0]["top_logprobs"][0]["bytes"] == list(b"\n")


def test_tokens_holding_part_of_a_character_keep_distinct_names(tokenizer):
    """Each star's three tokens decode alone to U+FFFD: keyed by that text, a top list of
    them collapsed into one entry holding the last one's logprob (QA). They are named by
    their bytes, as OpenAI names them (``bytes:\\xf0\\x9f``), whole tokens by their text."""
    ids = tokenizer.encode(TEXT)
    star = ids[1:4]
    entries = [(star[0], {star[0]: -0.1, star[1]: -2.0, star[2]: -3.0, ids[0]: -4.0})]
    out = completion_logprobs(tokenizer, entries)
    [top] = out["top_logprobs"]
    assert len(top) == 4 and top["\n"] == -4.0
    names = [name for name in top if name != "\n"]
    assert all(name.startswith("bytes:\\x") for name in names)
    assert b"".join(bytes.fromhex(name[6:].replace("\\x", "")) for name in
                    out["tokens"] + names[1:]) == "🌟".encode()
    assert top[out["tokens"][0]] == out["token_logprobs"][0] == -0.1


def test_special_tokens_are_named_and_counted_as_written(tokenizer):
    """QA (detokenization pass): <|im_start|> and <|im_end|> were '' in logprobs (two in one
    top list collided on that key), chat bytes were [], and an echoed prompt's offsets after
    <|im_start|> were 12 characters short; vLLM names and counts them as written."""
    from kvserve.server.responses import chat_logprobs

    text = "<|im_start|>user\nHi<|im_end|>"
    ids = tokenizer.encode(text)
    start, end = ids[0], ids[-1]
    entries = [(t, {t: -0.5, start: -1.0, end: -2.0}) for t in ids]
    logprobs = completion_logprobs(tokenizer, entries)
    assert logprobs["tokens"][0] == "<|im_start|>" and logprobs["tokens"][-1] == "<|im_end|>"
    assert set(logprobs["top_logprobs"][1]) == {"user", "<|im_start|>", "<|im_end|>"}
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert text[offset:offset + len(token)] == token
    content = chat_logprobs(tokenizer, entries, 3)["content"]
    assert content[-1]["token"] == "<|im_end|>" and bytes(content[-1]["bytes"]) == b"<|im_end|>"
    assert [top["token"] for top in content[1]["top_logprobs"]] == [
        "user", "<|im_start|>", "<|im_end|>"]
