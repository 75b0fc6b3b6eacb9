"""The text seam: what the engine, ``LLM`` and the server ask of a tokenizer.

The engine turns prompts into token ids and output ids back into text through these
protocols only; :class:`kvserve.model.tokenizer.Tokenizer` implements them, and so can a test
fake or another tokenizer library behind a thin adapter. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvserve.core import SamplingParams
    from kvserve.engine.engine import CompletionChunk


@runtime_checkable
class Detokenizer(Protocol):
    """One request's output ids to text, a step at a time. Emitted text is never retracted:
    a character split over tokens is held until its last byte arrives."""

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        ...

    def flush(self) -> str:
        """The text still held back, at the end of the request."""
        ...


@runtime_checkable
class StopChecker(Protocol):
    """Stop strings over streamed text: text that could start a stop string is held until it
    completes one or cannot any more."""

    def check(self, text_so_far: str, new_text: str) -> tuple[str, str | None]:
        """The part of ``new_text`` safe to emit, and the stop string matched (or None)."""
        ...

    def flush(self) -> str:
        """The held tail, once the request has finished without a stop string."""
        ...

    def skip(self, new_text: str) -> str:
        """Take ``new_text`` unsearched (the first min_tokens tokens'), and return what may
        be shown: all but a tail that could begin a stop string, so one that begins in it
        and ends later cuts the output at its start."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model, its chat template, and the per-request streamers."""

    eos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: the tokenizer's own (a BOS where it adds one), as a
        text prompt gets them; a chat template's text writes its own."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """The chat template applied to ``messages``, as text; ``kwargs``: more variables
        for the template (vLLM's ``chat_template_kwargs``, ``tools``)."""
        ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    **template_kwargs: Any) -> list[int]:
        """:meth:`apply_chat_template`'s text as ids."""
        ...

    def id_to_token(self, token_id: int) -> str | None:
        """The token's own string in the vocabulary (None for an id it lacks)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ...

    def detokenizer(self, prompt_token_ids: Sequence[int],
                    skip_special_tokens: bool = True) -> Detokenizer:
        """A fresh incremental detokenizer for one request with this prompt (special
        tokens' text left out unless ``skip_special_tokens`` is False)."""
        ...

    def stop_checker(self, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> StopChecker:
        """A fresh stop-string matcher for one request (the matched string kept in the text
        with ``include_stop_str_in_output``)."""
        ...


def ended_by_token(chunk: CompletionChunk) -> bool:
    """Whether ``chunk`` ends its request on its last token: the EOS or a stop token id (the
    scheduler's stop; a stop string is found later, in the text)."""
    return chunk.finished and chunk.finish_reason == "stop" and \
        not isinstance(chunk.stop_reason, str) and bool(chunk.new_token_ids)


class TextStream:
    """One request's output text as it streams: incremental detokenization, then stop
    strings. The engine runs one per request on its thread; an engine process leaves this to
    the server's process (:mod:`kvserve.engine.engine_process`), so both apply one rule."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] | None, min_tokens: int = 0,
                 include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.detokenizer = tokenizer.detokenizer(prompt_token_ids, skip_special_tokens)
        self.stop_checker = tokenizer.stop_checker(stop, include_stop_str_in_output) \
            if stop else None
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> TextStream | None:
        """The stream a request's settings ask for; None with ``detokenize=False``."""
        if not params.detokenize:
            return None
        return cls(tokenizer, prompt_token_ids, params.stop, params.min_tokens,
                   params.include_stop_str_in_output, params.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int], finished: bool,
             ended_by_token: bool = False) -> tuple[str, str | None]:
        """The text ``new_token_ids`` add that may be shown, and the stop string they
        completed (None if none). The text ends before a stop string; text held back because
        it could start one is let out once the request has ``finished`` without one. The
        text of the first ``min_tokens`` tokens is not searched, as vLLM's: a stop string
        there ended a request that asked for at least that many tokens. With
        ``ended_by_token`` (the last id is the EOS or a stop token id that ended the request)
        that token's text is not shown unless ``include_stop_str_in_output``, as vLLM's (a
        stop token id ``\\n`` was left in)."""
        if ended_by_token and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        new_text = self.detokenizer.step(new_token_ids)
        self.num_tokens += len(new_token_ids)
        stop = None
        if self.stop_checker is not None and self.num_tokens <= self.min_tokens:
            new_text = self.stop_checker.skip(new_text)
        elif self.stop_checker is not None:
            new_text, stop = self.stop_checker.check(self.text, new_text)
        if self.stop_checker is not None and stop is None and finished:
            new_text += self.stop_checker.flush()
        self.text += new_text
        return new_text, stop


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it encodes at the start of a text
    and, where that differs, as it encodes after a space (its form in the middle of one:
    " routed" is one token where "routed" is two; banned too even then)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip()))
        if not bare:
            continue  # a blank word: SamplingParams names it
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        sequences.append(bare)
        if spaced and spaced != bare:
            sequences.append(spaced)
    return tuple(sequences)


def choice_token_ids(tokenizer: Tokenizer, choices: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each choice's token ids, as the text encodes alone (the output is steered to that
    spelling of it)."""
    return tuple(tuple(tokenizer.encode(choice)) for choice in choices)
