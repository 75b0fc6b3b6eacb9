"""A trace's prompts and model answers drawn ahead, many requests per vectorised pass.

Drawing one request's ids costs a dozen numpy calls whatever its length; a 10,000-request
run paid them 10,000 times. :class:`PromptDraws` draws the next ``batch`` plain requests
(a ``prompt_len`` prompt from the request's own stream, no prefix, no hashes: the answer
continues that stream) in arrival order in one pass (:func:`kvserve.sim.tokens.stream_ranges`)
and hands each its slice when it is submitted, with the prompt's int64 bytes for the prefix
cache's hashes. Every other request is drawn alone, as before. The ids are those of
:meth:`TraceRequest.synthesise_with_answer` (tests/sim/test_prompt_draws.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvserve.core.prefix_cache import prompt_block_hashes
from kvserve.sim.tokens import stream_key, stream_ranges, stream_tokens
from kvserve.sim.trace import TraceRequest

BATCH = 64


def _plain(request: TraceRequest) -> bool:
    return (request.prompt_len is not None and request.prompt_token_ids is None
            and request.prompt_hashes is None and request.prefix_id is None)


def servable_answer(request: TraceRequest, max_model_len: int) -> TraceRequest:
    """``request`` with its ``output_len`` cut to what max_model_len lets it generate (J2:
    the rest is never sampled, so never drawn: a trace may ask for 10^10 tokens); itself
    when nothing is cut."""
    room = max(0, max_model_len - request.num_prompt_tokens)
    if request.output_len <= room:
        return request
    return dataclasses.replace(request, output_len=room)


class SessionChains:
    """A recorded conversation's turns as their client sent them: each turn's prompt begins
    with the turn before's prompt and answer.

    A recording keeps a prompt as the hashes of its full blocks, which a replay turns into
    ids block by block; the answer the server gave, which the next turn's prompt holds, is
    not among those ids, and the simulated model answers with its own. So a replayed turn
    did not extend its session's held tokens (U4: it ran as an ordinary request and
    prefilled everything the server had held) nor find the answer's blocks in the prefix
    cache. A turn of a session with hashed prompt (``session_id`` and ``prompt_hashes``)
    is therefore written over the turn before's ids and simulated answer, as long as its
    prompt is at least that long and its leading block hashes are the turn before's prompt's
    (its client sent that conversation on); the rest of it, its new message, stays as drawn.
    A turn that is another version of the conversation (a regenerated answer, an edited
    message) replaced the session on the server (U3), and does in the replay; its leading
    blocks that an earlier turn of the session sent (hashes chain, so an equal hash is an
    equal prefix) take the ids that turn was replayed with, so it hits the prefix cache
    where the server's did.

    A recording made with ``--record-prompts ids`` keeps each turn's ids as sent, the
    server's answer among them, which the simulated model does not give either: its turns
    chain the same way, by the turn before's prompt ids (a prefix of this one's; its answer
    is taken to follow, unchecked, as with hashes) and by its full blocks' hashes, computed
    here (the chaos pass: such a replay diverged at a
    session's second turn and failed)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        # (tenant, session) -> the last turn's ids (prompt, simulated answer) and its
        # prompt as recorded (its block hashes or ids); and the ids each full prompt block
        # was replayed with
        self._held: dict[tuple[str, str], tuple[list[int], tuple[Any, ...]]] = {}
        self._blocks: dict[tuple[str, str], dict[Any, list[int]]] = {}

    def apply(self, request: TraceRequest, prompt: list[int]
              ) -> tuple[list[int], list[int] | None]:
        """``request``'s prompt, chained, and its answer's first ``output_len`` ids as the
        simulated model will give them (None: not a chained turn, nothing changed)."""
        recorded = _as_recorded(request)
        if request.session_id is None or recorded is None:
            return prompt, None
        sent, hashes, size = recorded
        key = (request.tenant, request.session_id)
        blocks = self._blocks.setdefault(key, {})
        held, held_sent = self._held.get(key, ([], ()))
        if key in self._held and len(held) <= len(prompt) and \
                sent[:len(held_sent)] == held_sent:
            prompt = held + prompt[len(held):]
        else:  # a first turn, or another version: the blocks sent before, as sent then
            prompt = list(prompt)
            for index, block_hash in enumerate(hashes):
                ids = blocks.get(block_hash)
                if ids is None:
                    break
                prompt[index * size:(index + 1) * size] = ids
        for index, block_hash in enumerate(hashes):
            blocks[block_hash] = prompt[index * size:(index + 1) * size]
        answer = stream_tokens(request.continuation_key(self.seed), len(prompt),
                               len(prompt) + request.output_len)
        self._held[key] = (prompt + answer, sent)
        return prompt, answer


_IDS_BLOCK_SIZE = 16  # the blocks a turn recorded as ids is matched by (any size would do)


def _as_recorded(request: TraceRequest) -> tuple[tuple[Any, ...], tuple[Any, ...], int] | None:
    """A recorded prompt as :class:`SessionChains` matches it: what a later turn that goes on
    with it begins with (its block hashes, or its ids), its full blocks' hashes and their
    size; None for a prompt not recorded (drawn)."""
    if request.prompt_hashes is not None:
        hashes = tuple(request.prompt_hashes)
        return hashes, hashes, request.hash_block_size
    if request.prompt_token_ids is not None:
        ids = tuple(request.prompt_token_ids)
        return ids, tuple(prompt_block_hashes(ids, _IDS_BLOCK_SIZE)), _IDS_BLOCK_SIZE
    return None


class PromptDraws:
    """Prompts and answers of ``arrivals`` (in arrival order), drawn ``batch`` at a time."""

    def __init__(self, arrivals: Sequence[TraceRequest], seed: int, *,
                 with_bytes: bool, batch: int = BATCH, max_model_len: int | None = None) -> None:
        self.arrivals = arrivals
        self.seed = seed
        # Longer prompts are refused before they are drawn; answers are drawn up to it.
        self.max_model_len = max_model_len
        self.with_bytes = with_bytes  # the prompt's bytes are wanted (prefix caching)
        self.batch = batch
        self._index = {r.request_id: i for i, r in enumerate(arrivals)}
        # request id -> (its ids: prompt then answer, the prompt's length)
        self._drawn: dict[str, tuple[np.ndarray, int]] = {}
        self.chains = SessionChains(seed)

    def take(self, request: TraceRequest) -> tuple[list[int], list[int] | None, bytes | None]:
        """``request``'s prompt ids, its answer's first ``output_len`` ids (None: the
        executor draws them) and its prompt's int64 bytes (None: not at hand)."""
        drawn = self._drawn.pop(request.request_id, None)
        if drawn is None and _plain(request):
            self._draw_from(self._index.get(request.request_id))
            drawn = self._drawn.pop(request.request_id, None)
        if drawn is None:
            prompt, answer = request.synthesise_with_answer(self.seed)
            prompt, chained = self.chains.apply(request, prompt)
            return prompt, answer if chained is None else chained, None
        ids, num_prompt = drawn
        prompt_ids = ids[:num_prompt]
        return (prompt_ids.tolist(), ids[num_prompt:].tolist(),
                prompt_ids.tobytes() if self.with_bytes else None)

    def _draw_from(self, index: int | None) -> None:
        """Draw the plain requests among the ``batch`` arrivals from ``index`` on; those
        drawn before and never taken (refused or cancelled first) are dropped."""
        if index is None or self.arrivals[index].request_id in self._drawn:
            return
        self._drawn.clear()
        limit = self.max_model_len
        chosen = [r if limit is None else servable_answer(r, limit)
                  for r in self.arrivals[index:index + self.batch]
                  if _plain(r) and (limit is None or r.num_prompt_tokens < limit)]
        keys = [stream_key(self.seed, "request:" + r.request_id) for r in chosen]
        ends = [r.prompt_len + r.output_len for r in chosen]  # type: ignore[operator]
        ids = stream_ranges(keys, [0] * len(chosen), ends)
        start = 0
        for request, end in zip(chosen, ends, strict=True):
            self._drawn[request.request_id] = (ids[start:start + end],
                                               request.prompt_len)  # type: ignore[assignment]
            start += end
