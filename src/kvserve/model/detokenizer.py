"""Streaming text out of generated token ids: incremental detokenisation and stop strings.

Both only ever emit text that will never be retracted: a character whose UTF-8 bytes are
split over tokens is held until its last byte arrives, and a tail that could be the start of a
stop string is held until it either completes the stop string or cannot any more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, AnyStr

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopChecker"]

# Prompt tokens decoded again as context for the first output token, so tokenizers whose
# decoding depends on the previous token (leading-space rules) see some left context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a step at a time.

    Two offsets into the token ids (prompt then output) bound what is decoded each step::

        ids:  ... p0 p1 p2 | o0 o1 | o2 o3
                  ^prefix  ^read     ^new tokens

    ``decode(ids[prefix:read])`` was emitted already; ``decode(ids[prefix:])`` minus that is
    the new text. When it ends in U+FFFD (an incomplete UTF-8 sequence), only the text before
    the U+FFFD run is emitted and the offsets stay, so the bytes are decoded again with the
    next token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids or ())
        self._num_prompt_tokens = len(self._token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = max(self._read_offset - _PROMPT_CONTEXT_TOKENS, 0)
        # Characters emitted past decode(ids[prefix:read]) while the last token is incomplete.
        self._num_partial_chars = 0
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_prompt_tokens:]

    def step(self, new_token_ids: Sequence[int] | int) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        if isinstance(new_token_ids, int):
            new_token_ids = [new_token_ids]
        self._token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held, U+FFFD for incomplete bytes. The engine does not call it:
        an answer that ends inside a character drops those bytes, as vLLM's (no U+FFFD is
        sent); it is here for a caller that wants every byte shown."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._token_ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool) -> str:
        emitted = self._decode(self._prefix_offset, self._read_offset)
        if self._read_offset == self._num_prompt_tokens:  # a character the prompt begins
            emitted = emitted.rstrip(_REPLACEMENT)  # is the answer's when the answer ends
            # it (the streaming pass: it was counted as shown, and lost)
        current = self._decode(self._prefix_offset)
        complete = final or not current.endswith(_REPLACEMENT)
        stable = current if complete else current.rstrip(_REPLACEMENT)
        start = len(emitted) + self._num_partial_chars
        delta = stable[start:]
        if complete:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            self._num_partial_chars = 0
        else:
            self._num_partial_chars += len(delta)
        self.text += delta
        return delta


def held_length(text: AnyStr, marker: AnyStr) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (not all of it):
    what a stream holds back while it may still become the marker (a stop string, a think
    or tool-call marker, in text or bytes)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class StopChecker:
    """Finds stop strings in streamed text and says what is safe to emit.

    ``check(text_so_far, new_text)`` is called once a step with the text the step added. The
    checker keeps its own copy of everything it was given, so ``text_so_far`` (the text before
    this step, whether the detokenizer's or what was emitted) is not needed to find a stop
    string that straddles steps. It returns ``(text_to_emit, matched_stop)``:

    - a stop string found (possibly straddling earlier steps): the text up to it (through it
      with ``include_stop_str_in_output``) and the stop string; the request should finish;
    - otherwise the new text minus any tail that could still begin a stop string, plus earlier
      held text that now cannot; ``flush()`` returns what is still held at the end.

    Concatenating every ``text_to_emit`` (and the final ``flush()``) gives the output text:
    nothing emitted is ever retracted.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._num_emitted = 0
        self._text = ""

    def check(self, text_so_far: str, new_text: str) -> tuple[str, str | None]:
        del text_so_far  # the checker's own buffer is the reference (see the class docstring)
        if self.matched is not None:
            return "", self.matched
        num_old_chars = len(self._text)
        self._text += new_text
        match = self._find_stop(self._text, num_old_chars)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self.include_stop_str_in_output else start
            self.matched = stop
            return self._emit_to(end), stop
        return self._emit_to(len(self._text) - self._held_tail_length(self._text)), None

    def skip(self, new_text: str) -> str:
        """Take ``new_text`` unsearched (the text of a request's first min_tokens tokens),
        and return what may be emitted: all but a tail that could begin a stop string, held
        as :meth:`check` holds it, so a stop string that begins in it and ends in later text
        cuts the output at its start, as vLLM's (QA: its start was emitted already, and
        stayed in an answer that said it stopped there)."""
        self._text += new_text
        return self._emit_to(len(self._text) - self._held_tail_length(self._text))

    def flush(self) -> str:
        """The held-back tail, once no more text will come (the request finished otherwise)."""
        if self.matched is not None:
            return ""
        return self._emit_to(len(self._text))

    def _emit_to(self, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        emitted = self._text[self._num_emitted:end]
        self._num_emitted = end
        return emitted

    def _find_stop(self, text: str, num_old_chars: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the new text, as (start, stop)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = text.find(stop, max(num_old_chars - len(stop) + 1, 0))
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _held_tail_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        return max((held_length(text, stop) for stop in self.stop), default=0)
