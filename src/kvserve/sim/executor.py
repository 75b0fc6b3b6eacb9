"""SimExecutor: the model replaced by deterministic tokens (docs/architecture.md, "The one seam").

Like a real model runner it keeps per-request state from SchedulerOutput alone: new and
resumed requests arrive with their whole current sequence, cached requests with their
computed-token count, finished and preempted ids say what to drop. It samples one token
for every request whose scheduled chunk reaches the end of its sequence and nothing for a
mid-prompt chunk. A request whose model answer is ``output_len`` tokens long samples those
tokens and then EOS, unless ``ignore_eos``; the scheduler's own stop checks do the rest.

Each step it also describes the batch's shape (:class:`BatchView`) for the cost model, and,
when given a :class:`~kvserve.sim.layout.BlockLayout`, where the batch's KV lies in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core import ModelOutput, SchedulerOutput
from kvserve.core.decode_lane import DecodeLane
from kvserve.sim.layout import BlockLayout
from kvserve.sim.tokens import EOS_TOKEN_ID, stream_token, stream_tokens


@dataclass(frozen=True, slots=True)
class BatchView:
    """The shape of one step's batch, summed over its scheduled requests i with c_i tokens
    of KV already computed and n_i tokens computed now.

    attention_pairs = sum n_i * c_i + n_i * (n_i + 1) / 2: (query, key) pairs under the
    causal mask, the quadratic term of prefill; context_tokens = sum c_i: KV read from cache.

    scattered_context_tokens: of those context tokens, the ones in blocks whose id does not
    follow the request's previous block by +1 (:mod:`kvserve.sim.layout`). Tracked only when
    the cost model prices it; otherwise 0.
    """

    num_seqs: int
    num_tokens: int
    num_sampled: int
    num_decode_seqs: int
    context_tokens: int
    attention_pairs: int
    scattered_context_tokens: int = 0


EMPTY_BATCH = BatchView(0, 0, 0, 0, 0, 0)


def batch_view(out: SchedulerOutput, num_sampled: int) -> BatchView:
    """The shape of a step from its SchedulerOutput alone (each request's computed-token
    count before the step travels with it), for a step an engine ran: ``num_sampled`` is
    how many requests the model sampled for. The layout is not counted."""
    computed = {new.request_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.request_ids, cached.num_computed_tokens, strict=True))
    num_decode = context = pairs = 0
    for request_id, num_new in out.num_scheduled_tokens.items():
        before = computed[request_id]
        context += before
        pairs += num_new * before + num_new * (num_new + 1) // 2
        if num_new == 1 and before:
            num_decode += 1
    return BatchView(len(out.num_scheduled_tokens), out.total_num_scheduled_tokens,
                     num_sampled, num_decode, context, pairs)


@dataclass(slots=True)
class _SeqState:
    num_prompt_tokens: int
    answer: list[int]  # the ordinary tokens the model samples, then EOS (unless ignore_eos)
    stream: int
    seq_len: int = 0
    num_computed: int = 0


class SimExecutor:
    def __init__(self, layout: BlockLayout | None = None) -> None:
        # both read, and _state advanced, by the lane's half (sim/fast_forward.py)
        self._answers: dict[str, tuple[int, list[int], int]] = {}
        self._state: dict[str, _SeqState] = {}
        self.layout = layout
        self.view = EMPTY_BATCH
        # The decode lane (kvserve.core.decode_lane): its members are in a step's total but
        # not in num_scheduled_tokens; the lane sums their context.
        self.lane: DecodeLane | None = None

    def register(self, request_id: str, num_prompt_tokens: int, output_len: int,
                 ignore_eos: bool, stream: int, drawn: list[int] | None = None) -> list[int]:
        """What the simulated model will answer to ``request_id`` (before it is added).

        The answer is drawn once, vectorised (``drawn``: already drawn, the stream's
        ``output_len`` ids after the prompt; the list is kept); with ``ignore_eos`` it
        continues the stream past ``output_len`` until the scheduler stops the request.
        Returns the answer: the tokens the request samples first (not to be changed)."""
        answer = stream_tokens(stream, num_prompt_tokens, num_prompt_tokens + output_len) \
            if drawn is None else drawn
        if not ignore_eos:
            answer.append(EOS_TOKEN_ID)
        self._answers[request_id] = (num_prompt_tokens, answer, stream)
        return answer

    def forget(self, request_id: str) -> None:
        self._answers.pop(request_id, None)
        self._state.pop(request_id, None)
        if self.layout is not None:
            self.layout.forget(request_id)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        state = self._state
        for request_id in out.finished_req_ids:
            self.forget(request_id)
        for request_id in out.preempted_req_ids:
            state.pop(request_id, None)
        for new in out.scheduled_new_reqs:
            state[new.request_id] = _SeqState(*self._answers[new.request_id],
                                              seq_len=len(new.token_ids),
                                              num_computed=new.num_computed_tokens)
        sampled: dict[str, list[int]] = {}
        num_decode = context = pairs = 0
        # This loop runs for every running request every step; a decode (one token after a
        # computed prefix) is the usual case, so it gets the short form of the pair count.
        for request_id, num_new in out.num_scheduled_tokens.items():
            seq = state[request_id]
            computed = seq.num_computed
            context += computed
            if num_new == 1:
                pairs += computed + 1
                if computed:
                    num_decode += 1
            else:
                pairs += num_new * computed + num_new * (num_new + 1) // 2
            computed += num_new
            seq.num_computed = computed
            seq_len = seq.seq_len
            if computed == seq_len:
                try:
                    token_id = seq.answer[seq_len - seq.num_prompt_tokens]
                except IndexError:  # ignore_eos: the stream goes on past the drawn answer
                    token_id = stream_token(seq.stream, seq_len)
                sampled[request_id] = [token_id]
                seq.seq_len = seq_len + 1
            elif computed > seq_len:
                raise AssertionError(f"{request_id}: scheduled past the end of its sequence")
        scattered = 0 if self.layout is None else self.layout.observe(out)
        num_seqs, num_sampled = len(out.num_scheduled_tokens), len(sampled)
        lane = self.lane
        if lane is not None and lane.in_step:  # each member decodes one token
            num_lane = len(lane.members)
            num_seqs += num_lane
            num_sampled += num_lane
            num_decode += num_lane
            context += lane.context
            pairs += lane.context + num_lane
        self.view = BatchView(num_seqs, out.total_num_scheduled_tokens, num_sampled,
                              num_decode, context, pairs, scattered)
        return ModelOutput(sampled)
