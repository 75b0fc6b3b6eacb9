"""Turn one step's logits into tokens: allowed tokens, bad words, logit bias, penalties,
temperature, top-k, top-p, min-p, seeds, logprobs.

Order per row, as vLLM's: outside allowed_token_ids, off every choice's path or out of
JSON (JSON mode, kvserve/model/json_mode.py), and bad words' next tokens, never drawn ->
logit_bias added -> repetition, frequency and presence penalties -> below min_tokens, EOS
and the stop token ids held back (never drawn) -> temperature (0: greedy) -> min-p ->
top-k -> top-p (of what min-p and top-k left) -> draw.
A seeded request draws from a generator seeded by (seed, output position), so the *draw*
does not depend on batching or preemption: given the same logits, it picks the same token.
By default the logits themselves are not batch-invariant (docs/tenants.md, "What varies
with batching"): the projections' reductions run in an order that depends on the batch's
shape, so a greedy or seeded request can give
different text alone, in a batch, or after a prefix-cache hit, in bfloat16 far more often
than in float32. With ``--batch-invariant`` the model's kernels reduce in a fixed order and
this sampler handles each row on its own (``batch_invariant=True``), so a greedy or seeded
request's tokens do not depend on the rest of the batch; an unseeded one still draws from
the sampler's shared generator, in batch order.
Logprobs are those of the model's own distribution (raw logits), like vLLM's default.
It runs where the logits are (a GPU's too, ``--device cuda``); seeded draws take their
uniforms from CPU generators, so a seed gives the same draw on any device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.core import SamplingParams
from kvserve.core.outputs import LogprobEntry
from kvserve.model import paged_kernel
from kvserve.model.detokenizer import held_length
from kvserve.model.json_mode import (
    ANY_OBJECT,
    DONE,
    START,
    JsonState,
    JsonVocabulary,
    Schema,
    check_schema,
    read,
)

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_FOLD = 0x9E3779B9  # odd: folds a seed's high 32 bits into its low ones


def token_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at ``position``. torch's CPU generator
    reads only the low 32 bits of its seed, so the request's seed (any in [-2**63, 2**64); a
    negative one is its two's complement, as torch takes it: -1 is 2**64 - 1) has its high
    bits folded into them first: seeds apart by a multiple of 2**32 gave one stream (QA: 0
    and 2**63 drew the same text); a seed in [0, 2**32) keeps its own."""
    value = seed % (1 << 64)
    folded = (value + (value >> 32) * _SEED_FOLD) & 0xFFFFFFFF
    return (folded * _SEED_MIX + position) % (1 << 63)


# A temperature below this samples greedily, as vLLM's (its _SAMPLING_EPS): dividing by one
# overflows float32 (1e-38 became 0, and the division inf), which made the softmax NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingRow:
    """One sampled position: the request's parameters and its whole sequence so far."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_greedy(self) -> bool:
        """Temperature alone decides, as vLLM's sampling type: ``top_k=1`` samples among
        the tokens tied at the top, where the greedy path takes the first of them."""
        return self.params.temperature < GREEDY_BELOW

    @property
    def held_stops(self) -> list[int]:
        """The tokens this row may not draw yet: below min_tokens, its EOS ids and stop
        token ids, as vLLM's min-tokens logits processor holds them (drawn, an EOS was kept
        as text and the model ran on past its own end); the EOS ids even with ignore_eos, as
        vLLM's all_stop_token_ids has them (QA: greedy drew one there, where vLLM takes the
        next)."""
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            return []
        eos = [] if params.eos_token_id is None else [params.eos_token_id]
        return [*eos, *params.extra_eos_token_ids, *params.stop_token_ids]

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or \
            p.presence_penalty != 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether this row's logits change before sampling (other than held stops)."""
        p = self.params
        return self.has_penalties or bool(p.logit_bias) or p.allowed_token_ids is not None \
            or bool(p.bad_words_token_ids) or bool(p.choice_token_ids) or p.json_object \
            or p.json_schema is not None

    def choice_tokens(self, start: int = 0) -> list[int]:
        """With choices: the tokens that keep the output (from position ``start`` on: a
        thinking answer's after its thinking) a prefix of one of them, and EOS once it
        spells one whole (EOS alone should it have left them all)."""
        output = tuple(self.output_token_ids[start:])
        count = len(output)
        params = self.params
        tokens = {ids[count] for ids in params.choice_token_ids
                  if len(ids) > count and ids[:count] == output}
        if not tokens or output in params.choice_token_ids:
            assert params.eos_token_id is not None  # the engine refuses choices without one
            tokens.add(params.eos_token_id)
        return sorted(tokens)

    @property
    def bad_tokens(self) -> list[int]:
        """vLLM's bad_words: each word's last token, where the output ends in the rest of
        the word (a one-token word: always)."""
        output = self.output_token_ids
        banned = []
        for ids in self.params.bad_words_token_ids:
            prefix = len(ids) - 1
            if prefix == 0 or (len(output) >= prefix
                               and tuple(output[len(output) - prefix:]) == ids[:-1]):
                banned.append(ids[-1])
        return banned


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row: sampled token and the top n


class Sampler:
    def __init__(self, seed: int = 0, batch_invariant: bool = False,
                 token_bytes: Callable[[], Sequence[bytes]] | None = None) -> None:
        """``token_bytes``: the vocabulary's tokens as bytes, asked for at the first request
        in JSON mode (none: such a request is refused)."""
        self.generator = torch.Generator().manual_seed(seed)
        self.batch_invariant = batch_invariant
        self._token_bytes = token_bytes
        self._bytes: list[bytes] | None = None
        self._json: JsonVocabulary | None = None
        # the tokens that keep an output the beginning of its opening think marker, by
        # (marker, the output's bytes so far)
        self._openings: dict[tuple[bytes, bytes], list[int]] = {}
        # a JSON state's allowed tokens as a mask, by the id of the list the vocabulary keeps
        # for that state (held here, so the id stays its own): building one from a list of
        # 49k ids took 4.7 of a JSON step's 5.7 ms
        self._masks: dict[int, tuple[list[int], torch.Tensor]] = {}
        # a JSON row's recognizer state, by (its schema's text, its output so far)
        self._states: dict[tuple[str | None, bytes, tuple[int, ...]], JsonState | None] = {}
        # a thinking row's Thinking, by (its markers, opened, its output so far)
        self._thoughts: dict[tuple[Any, bool, tuple[int, ...]], Thinking] = {}
        # the tokens that would close a row's thinking with bytes its form cannot begin
        # with, by (the closing marker, the output's end that begins it, the form)
        self._closings: dict[tuple[Any, ...], list[int]] = {}
        self._blanks: frozenset[int] | None = None

    def vocabulary_bytes(self) -> list[bytes]:
        """Each token's bytes (JSON mode and thinking first need them)."""
        if self._bytes is None:
            if self._token_bytes is None:
                raise ValueError("JSON mode needs the vocabulary's bytes: this sampler has "
                                 "no tokenizer")
            self._bytes = list(self._token_bytes())
        return self._bytes

    def json_vocabulary(self) -> JsonVocabulary:
        if self._json is None:
            self._json = JsonVocabulary(self.vocabulary_bytes())
        return self._json

    def blank_tokens(self) -> frozenset[int]:
        """The tokens that write only blanks (spaces, tabs, newlines)."""
        if self._blanks is None:
            self._blanks = frozenset(token_id for token_id, piece in
                                     enumerate(self.vocabulary_bytes())
                                     if piece and not piece.strip(b" \t\n\r"))
        return self._blanks

    def thinking_of(self, params: SamplingParams, output: Sequence[int]) -> Thinking:
        """:func:`thinking`, from the step before where it is known: a settled row's stays,
        a thinking row's looks for its closing marker in its tail and its last token only
        (the whole output's bytes each step made a long thinking O(n^2); QA)."""
        assert params.think_markers is not None
        thoughts = self._thoughts
        key = (params.think_markers, params.think_open, tuple(output))
        known = thoughts.get(key)
        if known is not None:
            return known
        before = thoughts.get((key[0], key[1], key[2][:-1])) if output else None
        token_bytes = self.vocabulary_bytes()
        if before is not None and before.opening is None and before.start is not None:
            where = before  # settled: the form holds from where it did
        elif before is not None and before.opening is None:  # thinking: only its last
            closes = params.think_markers[1].encode()  # token can close it
            last = output[-1]
            window = before.tail + (token_bytes[last] if last < len(token_bytes) else b"")
            at = window.find(closes)
            where = Thinking(None, tail=_tail(window, closes)) if at < 0 else \
                Thinking(len(output), leftover=window[at + len(closes):].lstrip())
        else:
            where = thinking(params, output, token_bytes)
        if len(thoughts) >= 4096:
            thoughts.clear()
        thoughts[key] = where
        return where

    def closing_bans(self, params: SamplingParams, tail: bytes) -> list[int]:
        """While a row thinks, the tokens that would write the rest of its closing marker
        (after ``tail``, its thinking's end) and then bytes its form cannot begin with:
        they are never drawn (QA: a token writing '>"' closed the thinking and put '"'
        before the JSON)."""
        assert params.think_markers is not None
        closes = params.think_markers[1].encode()
        form = (params.json_schema, params.json_object, bool(params.choice_token_ids))
        key = (closes, tail, form)
        bans = self._closings.get(key)
        if bans is None:
            schema = self.json_schema(params.json_schema) \
                if params.json_object or params.json_schema is not None else None
            bans = []
            for token_id, piece in enumerate(self.vocabulary_bytes()):
                joined = tail + piece
                at = joined.find(closes) if piece else -1
                if at < 0:
                    continue
                leftover = joined[at + len(closes):].lstrip()
                if leftover and (schema is None or read(leftover, START, schema) is None):
                    bans.append(token_id)
            if len(self._closings) >= 64:
                self._closings.clear()
            self._closings[key] = bans
        return bans

    def opening_tokens(self, marker: bytes, written: bytes) -> list[int]:
        """The tokens after ``written`` (an output so far, nothing but blanks and the
        beginning of ``marker``) that go on writing the marker."""
        key = (marker, written)
        tokens = self._openings.get(key)
        if tokens is None:
            tokens = [token_id for token_id, piece in enumerate(self.vocabulary_bytes())
                      if piece and _goes_on(marker, (written + piece).lstrip())]
            if len(self._openings) >= 64:
                self._openings.clear()
            self._openings[key] = tokens
        return tokens

    def mask(self, token_ids: Sequence[int], vocab: int, device: torch.device,
             remember: bool = False) -> torch.Tensor:
        """True at ``token_ids`` (those below ``vocab``); ``remember``: the list is one the
        JSON vocabulary keeps, so its mask is kept too."""
        if remember:
            kept = self._masks.get(id(token_ids))
            if kept is not None and kept[0] is token_ids and kept[1].shape[0] == vocab \
                    and kept[1].device == device:
                return kept[1]
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[[t for t in token_ids if t < vocab]] = True
        if remember:
            if len(self._masks) >= 256:  # 48 KiB each at a 49k vocabulary
                self._masks.clear()
            self._masks[id(token_ids)] = (token_ids, mask)  # type: ignore[assignment]
        return mask

    def json_state(self, text: str | None, schema: Schema, output: Sequence[int],
                   prefix: bytes = b"") -> JsonState | None:
        """The recognizer's state after ``prefix`` (the bytes a thinking answer wrote after
        its closing marker, in that marker's token) and ``output``: from the state after
        all but its last token, kept from the step before, when there is one (reading the
        whole output again each step cost a request O(n^2) and 17% of its time per
        token)."""
        token_bytes = self.json_vocabulary().token_bytes
        states = self._states
        key = (text, prefix, tuple(output))
        first = read(prefix, START, schema) if prefix else START
        before = states.get((text, prefix, key[2][:-1])) if output else first
        if before is not None or not output:
            state = read(token_bytes[output[-1]] if output[-1] < len(token_bytes) else b"",
                         before, schema) if output else first
        else:
            state = read(b"".join(token_bytes[t] for t in output if t < len(token_bytes)),
                         first, schema)
        if len(states) >= 4096:
            states.clear()
        states[key] = state
        return state

    @staticmethod
    def json_schema(text: str | None) -> Schema:
        """JSON mode's any object (None), or the schema of this text (compiled once)."""
        return ANY_OBJECT if text is None else check_schema(text)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if self.batch_invariant and len(rows) > 1:  # each row alone: [1, vocab] ops only
            outputs = [self._rows(logits[i:i + 1], rows[i:i + 1]) for i in range(len(rows))]
            wanted = any(out.logprobs is not None for out in outputs)
            return SamplerOutput([out.token_ids[0] for out in outputs], [
                out.logprobs[0] if out.logprobs is not None else {} for out in outputs
            ] if wanted else None)
        return self._rows(logits, rows)

    @staticmethod
    def plain_greedy(rows: Sequence[SamplingRow]) -> bool:
        """Whether this sampler takes every row's first maximum of the logits as they are:
        every row greedy, none shaped or holding stops, none asking for logprobs (so a model's
        ``greedy_tokens`` may stand in for the logits and this call; runner.py)."""
        return all(row.is_greedy and not row.shapes_logits and not row.held_stops
                   and row.params.logprobs is None for row in rows)

    def _rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        raw = logits
        shaped = [index for index, row in enumerate(rows) if row.shapes_logits]
        held = [(index, stops) for index, row in enumerate(rows) if (stops := row.held_stops)]
        if shaped or held:
            logits = logits.clone()
            vocab = logits.shape[-1]
            for index in shaped:
                _shape(logits[index], rows[index], vocab, self)
            for index, token_ids in held:
                logits[index, [t for t in token_ids if t < vocab]] = float("-inf")
            _end_where_nothing_is_left(logits, rows)
            logits = _finite(logits)  # a penalty near 0 (or huge) overflows float32
        if all(row.is_greedy for row in rows):
            token_ids = greedy_tokens(logits).tolist()
        else:
            token_ids = self._sample(logits, rows)
        return SamplerOutput(token_ids, _logprobs(raw, rows, token_ids))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        greedy = greedy_tokens(logits)
        # a greedy row's draw is not used: 1.0 spares it a division by a near-zero temperature
        temperatures = torch.tensor([1.0 if row.is_greedy else row.params.temperature
                                     for row in rows], device=logits.device)
        probs = torch.softmax(_finite(logits / temperatures[:, None]), dim=-1)
        probs = _top_k_top_p_min_p(probs, rows)
        # Inverse CDF: one uniform per row, looked up in the row's cumulative distribution,
        # scaled by the row's total so rounding in the float32 sum cannot push it past the
        # end. A token of probability 0 has an empty interval and is never drawn. One
        # uniform per row instead of an exponential per vocabulary entry (an exponential
        # race): about 5x less, 1.0-1.4 -> 0.2-0.3 ms per row at a 49k vocabulary
        # (benchmarks/sampler.py).
        # (A float64 sum would be exact to the last tail token but costs ten times more.)
        cdf = probs.cumsum(dim=-1)
        uniforms = torch.empty(len(rows), 1)
        for index, row in enumerate(rows):
            seed = row.params.seed
            generator = self.generator if seed is None else torch.Generator().manual_seed(
                token_seed(seed, row.num_output_tokens))
            uniforms[index].uniform_(generator=generator)
        total = cdf[:, -1:].contiguous()
        drawn = torch.searchsorted(cdf, uniforms.to(cdf.device) * total, right=True)
        last = torch.searchsorted(cdf, total)  # the last token with any probability
        drawn = torch.minimum(drawn, last).squeeze(1)  # should rounding reach the total
        drawn.clamp_(max=logits.shape[-1] - 1)  # never a token past the vocabulary
        is_greedy = torch.tensor([row.is_greedy for row in rows], device=logits.device)
        return torch.where(is_greedy, greedy, drawn).tolist()


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with NaN and -inf as the dtype's lowest value and +inf as its highest, so
    the softmax of a row is a distribution (inf - inf made it NaN, and a NaN row drew the
    token past the vocabulary, which failed the next step for every request)."""
    info = torch.finfo(logits.dtype)
    return torch.nan_to_num(logits, nan=info.min, posinf=info.max, neginf=info.min)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of [S, vocab] logits: the C++ ``argmax_rows`` (rows in
    parallel; the same first-maximum answer) for contiguous float32 ones where the extension
    is built, else torch's."""
    if (logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()
            and logits.shape[0] > 0 and logits.shape[1] > 0
            and paged_kernel.runs(logits)):
        return paged_kernel.layer_ops().argmax_rows(logits)
    return logits.argmax(dim=-1)


def _end_where_nothing_is_left(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """A row whose constraints together leave no token (allowed_token_ids all among its
    bad words, say) draws its EOS, which ends it, rather than any token of the vocabulary
    (its logits all -inf: the softmax would be uniform, greedy token 0; QA)."""
    dead = torch.isneginf(logits).all(dim=-1).tolist()
    for index, row in enumerate(rows):
        eos = row.params.eos_token_id
        if dead[index] and eos is not None and eos < logits.shape[-1]:
            logits[index, eos] = 0.0


def _json_tokens(row: SamplingRow, sampler: Sampler, start: int = 0,
                 prefix: bytes = b"") -> list[int]:
    """JSON output: the tokens that keep the output (from position ``start`` on, after
    ``prefix``) the beginning of one JSON object (of its schema); EOS alone once it closed
    (or, should nothing fit, to end it)."""
    vocabulary = sampler.json_vocabulary()
    schema = sampler.json_schema(row.params.json_schema)
    state = sampler.json_state(row.params.json_schema, schema, row.output_token_ids[start:],
                               prefix)
    allowed = vocabulary.allowed(state, schema) \
        if state is not None and state.mode != DONE else []
    if not allowed:
        assert row.params.eos_token_id is not None  # the engine refuses JSON mode without
        allowed = [row.params.eos_token_id]
    return allowed


@dataclass(frozen=True)
class Thinking:
    """Where a thinking answer's constraints stand (SamplingParams.think_markers):
    ``start`` the output position they hold from (None while it thinks); ``opening`` its
    bytes so far while it may still open its thinking (None once that is settled);
    ``leftover`` what the token that wrote the closing marker wrote after it (the form's
    first bytes, blanks stripped); ``tail``, while it thinks, the end of its thinking that
    may begin the closing marker."""

    start: int | None
    opening: bytes | None = None
    leftover: bytes = b""
    tail: bytes = b""


def thinking(params: SamplingParams, output: Sequence[int],
             token_bytes: Sequence[bytes]) -> Thinking:
    """A reasoning model's structured output holds from the end of its thinking on (vLLM's
    reasoning-aware structured outputs): while the output may still open its thinking, its
    constraints and the opening marker are both allowed; once it opened, nothing holds
    until the closing marker (but a token that would close it with bytes the form cannot
    begin with: :meth:`Sampler.closing_bans`); then the constraints hold, from the bytes
    after the marker in the token that wrote it."""
    if params.think_markers is None:
        return Thinking(0)
    opens, closes = (marker.encode() for marker in params.think_markers)
    pieces = [token_bytes[t] if t < len(token_bytes) else b"" for t in output]
    written = b"".join(pieces)
    after = 0  # where the closing marker is looked for
    if not params.think_open:
        body = written.lstrip()
        if len(body) < len(opens) and opens.startswith(body):
            return Thinking(0, written)  # "<thi" or nothing: which way it goes is open
        if not body.startswith(opens):
            return Thinking(0)  # it did not think: held from its first token
        after = len(written) - len(body) + len(opens)
    at = written.find(closes, after)
    if at < 0:  # still thinking
        return Thinking(None, tail=_tail(written[after:], closes))
    closed, end = at + len(closes), 0
    for position, piece in enumerate(pieces):  # the token that wrote the marker's end
        end += len(piece)
        if end >= closed:
            return Thinking(position + 1, leftover=written[closed:end].lstrip())
    raise AssertionError("the closing marker lies within the output")


# The most blank tokens a thinking answer may write between its thinking and its form.
MAX_BLANK_TOKENS = 4


def _tail(written: bytes, marker: bytes) -> bytes:
    """The longest end of ``written`` that ``marker`` begins with (not all of it)."""
    length = held_length(written, marker)
    return written[len(written) - length:]


def _structured_tokens(row: SamplingRow, sampler: Sampler
                       ) -> tuple[list[int] | None, bool, list[int]]:
    """The tokens a row's choices or JSON allow now, where it has either (None where it
    has neither, or while it thinks first), whether the list is one the JSON vocabulary
    keeps (its mask kept too), and the tokens it may not draw (while it thinks, those that
    would end its thinking with what its form cannot begin with)."""
    params = row.params
    json_output = params.json_object or params.json_schema is not None
    if not (params.choice_token_ids or json_output):
        return None, False, []
    where = sampler.thinking_of(params, row.output_token_ids) \
        if params.think_markers is not None else Thinking(0)
    if where.start is None:  # thinking: it may not end before it writes its form (QA:
        # EOS while thinking made a "stop" answer with no JSON, or a call with no arguments)
        bans = sampler.closing_bans(params, where.tail)
        ends = [] if params.ignore_eos or params.eos_token_id is None else \
            [params.eos_token_id]  # and its stop ids: the model's other end-of-sequence
        return None, False, [*bans, *ends, *params.stop_token_ids]  # ids among them (review)
    start, blank = where.start, False
    if where.start and not where.leftover:  # after a thinking, blanks may come first (a
        # model's "</think>\n\n", QA: the form was forced at once, off its trained path)
        blanks, output = sampler.blank_tokens(), row.output_token_ids
        while start < len(output) and output[start] in blanks:
            start += 1
        blank = start == len(output) and start - where.start < MAX_BLANK_TOKENS
    if params.choice_token_ids:
        tokens = row.choice_tokens(start)
    else:
        tokens = _json_tokens(row, sampler, start, where.leftover)
    if blank:
        return sorted(sampler.blank_tokens().union(tokens)), False, []
    if where.opening is None:
        return tokens, json_output, []
    assert params.think_markers is not None
    opening = sampler.opening_tokens(params.think_markers[0].encode(), where.opening)
    if where.opening.strip():  # the marker begun: it goes on
        return opening, False, []
    return sorted(set(tokens).union(opening)), False, []


def _goes_on(marker: bytes, text: bytes) -> bool:
    """Whether ``text`` (not empty) is the marker's beginning, or the marker and more."""
    return bool(text) and (marker.startswith(text) or text.startswith(marker))


def _shape(logits: torch.Tensor, row: SamplingRow, vocab: int, sampler: Sampler) -> None:
    """allowed_token_ids and choices, bad_words, logit_bias and the penalties, in vLLM's
    order, on one row."""
    params = row.params
    structured, remember, closing = _structured_tokens(row, sampler)
    for token_ids, kept in ((params.allowed_token_ids, False), (structured, remember)):
        if token_ids is not None:
            allowed = sampler.mask(token_ids, vocab, logits.device, kept)
            logits.masked_fill_(~allowed, float("-inf"))
    banned = [t for t in [*row.bad_tokens, *closing] if t < vocab]
    if banned:
        logits[banned] = float("-inf")
    if params.logit_bias:
        token_ids = [t for t, _ in params.logit_bias if t < vocab]
        biases = [b for t, b in params.logit_bias if t < vocab]
        logits[token_ids] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    if row.has_penalties:
        _apply_penalties(logits, row)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    params = row.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if row.num_output_tokens and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long,
                                             device=logits.device),
                                minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _top_k_top_p_min_p(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM V1's order: min_p (of the whole distribution), then top_k (every token tied
    with the k-th kept), then top_p of what those left, renormalised (QA: top_p measured the
    whole distribution and min_p ran last, which kept tokens vLLM never draws)."""
    vocab, device = probs.shape[-1], probs.device
    # a top_k at or past the vocabulary is off, as in vLLM (QA: 2**63 overflowed int64)
    top_k = torch.tensor([min(row.params.top_k, vocab) if row.params.top_k > 0 else vocab
                          for row in rows],
                         device=device)
    top_p = torch.tensor([row.params.top_p for row in rows], device=device)
    min_p = torch.tensor([row.params.min_p for row in rows], device=device)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        kth = sorted_probs.gather(-1, top_k[:, None] - 1)
        kept = sorted_probs * (sorted_probs >= kth)
        before = kept.cumsum(dim=-1) - kept  # the kept mass strictly above each token
        within = (before < top_p[:, None] * kept.sum(dim=-1, keepdim=True)) | \
            (top_p >= 1.0)[:, None]  # off: rounding in the sum drops no tail token
        keep = (kept > 0) & within
        keep[:, 0] = True
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return probs


def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow],
              token_ids: list[int]) -> list[LogprobEntry] | None:
    wanted = [row.params.logprobs for row in rows]
    if all(n is None for n in wanted):
        return None
    return logprob_entries(torch.log_softmax(logits, dim=-1), token_ids, wanted)


def logprob_entries(logprobs: torch.Tensor, token_ids: Sequence[int],
                    wanted: Sequence[int | None]) -> list[LogprobEntry]:
    """Per row of ``logprobs``, a LogprobEntry: token id -> logprob for ``token_ids[row]``
    (the sampled or the prompt's token) first, then the top ``wanted[row]``, and that
    token's rank; an empty one where ``wanted[row]`` is None."""
    result: list[LogprobEntry] = []
    asked = [index for index, n in enumerate(wanted) if n is not None]
    if not asked:
        return [LogprobEntry() for _ in wanted]
    rows = logprobs[asked] if len(asked) < len(wanted) else logprobs
    own = rows.gather(1, torch.tensor([token_ids[i] for i in asked],
                                      device=logprobs.device)[:, None])
    # vLLM's count (a tie before the token), the rows at once: one sync, not one per row
    ranks = dict(zip(asked, (rows >= own).sum(dim=1).tolist(), strict=True))
    own_values = dict(zip(asked, own.flatten().tolist(), strict=True))
    for index, n in enumerate(wanted):
        entry = LogprobEntry()
        if n is not None:
            entry[token_ids[index]] = own_values[index]
            entry.rank = ranks[index]
            if n > 0:  # the engine's max_logprobs bounds n; the vocabulary does too
                values, ids = logprobs[index].topk(min(n, logprobs.shape[-1]))
                for value, token_id in zip(values.tolist(), ids.tolist(), strict=True):
                    entry.setdefault(token_id, value)
        result.append(entry)
    return result
