"""The text seam: what the engine, ``LLM`` and the server ask of a tokenizer.

The engine turns prompts into token ids and output ids back into text through these
protocols only; :class:`kvserve.model.tokenizer.Tokenizer` implements them, and so can a test
fake or another tokenizer library behind a thin adapter. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


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


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model, its chat template, and the per-request streamers."""

    eos_token_id: int | None

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        ...

    def encode(self, text: str) -> list[int]:
        ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template applied to ``messages``, with the generation prompt, as ids."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        ...

    def detokenizer(self, prompt_token_ids: Sequence[int]) -> Detokenizer:
        """A fresh incremental detokenizer for one request with this prompt."""
        ...

    def stop_checker(self, stop: Sequence[str]) -> StopChecker:
        """A fresh stop-string matcher for one request."""
        ...
