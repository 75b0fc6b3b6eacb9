"""The sampler: greedy, temperature, top-k, top-p, min-p, penalties, seeds and logprobs."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from kvserve.core import RequestError, SamplingParams
from kvserve.model import paged_kernel
from kvserve.model.sampler import Sampler, SamplingRow, greedy_tokens, token_seed

PROBS = [0.6, 0.25, 0.1, 0.05]
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def draw(params: SamplingParams, n: int = 4000, seed: int = 0) -> Counter:
    rows = [SamplingRow(params, [9], 1) for _ in range(n)]
    return Counter(Sampler(seed)(LOGITS.repeat(n, 1), rows).token_ids)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 1.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], 1)] * 2
    assert Sampler()(logits, rows).token_ids == [1, 0]


def test_plain_greedy_rows_are_those_the_sampler_only_takes_the_first_maximum_of():
    """Sampler.plain_greedy: the rows a model's greedy_tokens may answer without the float32
    logits (runner.py): greedy, nothing shaping the logits, no held stops, no logprobs."""
    def row(output=(7,), **params):
        return SamplingRow(SamplingParams(**params), [1, *output], 1)

    assert Sampler.plain_greedy([row(temperature=0.0), row(temperature=0.0)])
    assert Sampler.plain_greedy([row(temperature=0.0, min_tokens=2, ignore_eos=True)])
    for other in (row(temperature=0.7), row(top_k=1, temperature=0.7),
                  row(temperature=0.0, logprobs=1),
                  row(temperature=0.0, repetition_penalty=1.2),
                  row(temperature=0.0, logit_bias={3: 1.0}),
                  row(temperature=0.0, min_tokens=3, eos_token_id=2),  # holds its EOS
                  # ignore_eos too, as vLLM's min-tokens processor holds all stop ids
                  row(temperature=0.0, min_tokens=3, eos_token_id=2, ignore_eos=True)):
        assert not Sampler.plain_greedy([row(temperature=0.0), other])


def test_temperature_one_draws_the_model_distribution():
    counts = draw(SamplingParams(temperature=1.0))
    for token, p in enumerate(PROBS):
        assert counts[token] / 4000 == pytest.approx(p, abs=0.03)


def test_low_temperature_sharpens():
    counts = draw(SamplingParams(temperature=0.25))
    assert counts[0] / 4000 > 0.9


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_k=1), {0}),
    (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),  # mass above token 2: 0.85
    (SamplingParams(temperature=1.0, top_p=0.5), {0}),
    (SamplingParams(temperature=1.0, min_p=0.3), {0, 1}),  # 0.3 x 0.6 = 0.18 > 0.1
    # past the vocabulary: off, as in vLLM (QA: 2**63 overflowed the step's int64 tensor)
    (SamplingParams(temperature=1.0, top_k=2**63), {0, 1, 2, 3}),
    (SamplingParams(temperature=1.0, top_k=2**64 + 1, top_p=0.7), {0, 1}),
])
def test_truncation_keeps_exactly_the_allowed_tokens(params, allowed):
    assert set(draw(params, n=2000)) == allowed


def test_top_k_one_draws_among_the_tokens_tied_at_the_top():
    """vLLM samples a top_k=1 request (its sampling type follows temperature alone), and
    top_k keeps every token tied with the k-th: both of a tied maximum come out, where the
    greedy path took the first."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5]]).repeat(400, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=1), [1], 1)] * 400
    assert set(Sampler()(logits, rows).token_ids) == {1, 2}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-38), SamplingParams(temperature=1e-300),
    SamplingParams(temperature=4e-6, seed=3),
    SamplingParams(temperature=1.0, repetition_penalty=1e-300),
    SamplingParams(temperature=1.0, repetition_penalty=1e300),
    SamplingParams(temperature=1e-3, repetition_penalty=1e-30, top_p=0.5, min_p=0.1),
])
def test_extreme_temperatures_and_penalties_draw_a_token_of_the_vocabulary(params):
    """A temperature below 1e-5 samples greedily (as vLLM); a penalty that overflows float32
    leaves a distribution. Either made the softmax NaN, and the draw then returned the
    vocabulary's size: the next step's embedding failed and took the engine down for every
    request (QA: one request with temperature 1e-38)."""
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]] * 3)
    rows = [SamplingRow(params, [0, 2], 1), SamplingRow(params, [1], 1),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [3], 1)]
    token_ids = Sampler(seed=1)(logits, rows).token_ids
    assert all(0 <= token < 4 for token in token_ids), token_ids
    if params.temperature < 1e-5:  # greedy, penalties or not
        assert token_ids[:2] == [0, 0]


def test_below_min_tokens_eos_and_stop_token_ids_are_never_drawn():
    """As vLLM's min-tokens logits processor: until a row has min_tokens outputs, its EOS
    (with ignore_eos too: vLLM's all_stop_token_ids) and stop token ids are held back,
    greedy or sampled; drawn, the EOS was kept as text and the model ran on past its own end
    (QA)."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 5)
    params = SamplingParams(temperature=0.0, min_tokens=3, eos_token_id=0, stop_token_ids=[1])
    rows = [SamplingRow(params, [9, 9, 9], 1),  # 2 outputs: held
            SamplingRow(params, [9, 9, 9, 9], 1),  # 3 outputs: free again
            SamplingRow(SamplingParams(temperature=1.0, seed=5, min_tokens=2, eos_token_id=0,
                                       stop_token_ids=[1, 2]), [9], 1),
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=3, eos_token_id=0,
                                       ignore_eos=True), [9], 1),  # held all the same
            # the model's other EOS ids too (review 49: only the primary one was held)
            SamplingRow(SamplingParams(temperature=0.0, min_tokens=3, eos_token_id=0,
                                       extra_eos_token_ids=(1,), ignore_eos=True), [9], 1)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [2, 0, 3, 1, 2]


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    seen = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0, 2], 1)
    assert Sampler()(logits, [seen]).token_ids == [1]  # 2.0 / 2 = 1.0 < 1.9


def test_frequency_and_presence_penalties_count_output_only():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    prompt_only = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0, 0], 2)
    assert Sampler()(logits, [prompt_only]).token_ids == [0]  # prompt tokens do not count
    repeated = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.3,
                                          presence_penalty=0.0), [5, 0, 0], 1)
    assert Sampler()(logits, [repeated]).token_ids == [1]  # 2.0 - 2 x 0.3 = 1.4 < 1.5
    present = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.6), [5, 0], 1)
    assert Sampler()(logits, [present]).token_ids == [1]  # 2.0 - 0.6 = 1.4


def test_a_seed_fixes_each_position_independently_of_the_batch():
    params = SamplingParams(temperature=1.0, seed=42)
    row = SamplingRow(params, [9, 1, 2], 1)
    alone = Sampler(seed=1)(LOGITS[None, :], [row]).token_ids
    other = SamplingRow(SamplingParams(temperature=1.0), [9], 1)
    batched = Sampler(seed=2)(LOGITS.repeat(2, 1), [other, row]).token_ids[1:]
    assert alone == batched
    positions = [Sampler()(LOGITS[None, :], [SamplingRow(params, [9] + [1] * k, 1)])
                 .token_ids[0] for k in range(40)]
    assert len(set(positions)) > 1  # different output positions draw differently


def test_every_bit_of_a_seed_picks_the_stream():
    """torch's CPU generator reads 32 bits of its seed: seeds apart by 2**32 or 2**63 drew the
    same tokens (QA: 0, 2**63 and -2**63 gave one text). The high bits are folded in; a seed
    below 2**32 keeps the stream it had; a negative seed is its two's complement, as torch
    takes it (-1 is 2**64 - 1, -2**63 is 2**63)."""
    def low32(value: int) -> int:
        return torch.Generator().manual_seed(value).initial_seed() & 0xFFFFFFFF

    def stream(seed: int) -> list[float]:
        return [torch.rand(1, generator=torch.Generator().manual_seed(
            token_seed(seed, k))).item() for k in range(3)]

    seeds = [0, 1, 5, 1 << 32, 5 + (1 << 32), 1 << 63, (1 << 63) + 5, -1, 2, -2, -7]
    assert len({tuple(stream(s)) for s in seeds}) == len(seeds)
    assert stream(-1) == stream((1 << 64) - 1) and stream(-(1 << 63)) == stream(1 << 63)
    old = 0x9E3779B97F4A7C15  # the mix before the fold: seeds below 2**32 are unchanged
    assert all(low32(token_seed(s, k)) == low32((s * old + k) % (1 << 63))
               for s in (0, 7, 123456, (1 << 32) - 1) for k in (0, 9))


def test_logit_bias_moves_greedy_and_sampled_choices_only_of_its_row():
    """vLLM's (OpenAI's) logit_bias: added before sampling, greedy included; the row beside
    it is untouched; logprobs stay the model's own (raw logits, vLLM's default)."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    banned = SamplingRow(SamplingParams(temperature=0.0, logit_bias={0: -100, 2: 1.5},
                                        logprobs=1), [9], 1)
    forced = SamplingRow(SamplingParams(temperature=1.0, seed=3, logit_bias=[(3, 100)]), [9], 1)
    plain = SamplingRow(SamplingParams(temperature=0.0), [9], 1)
    out = Sampler()(logits, [banned, forced, plain])
    assert out.token_ids == [2, 3, 0]  # 3.0 + 1.5 > 4.0; 0.0 + 100 dwarfs the rest
    assert out.logprobs is not None
    assert out.logprobs[0][2] == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    assert counts_only(draw(SamplingParams(temperature=1.0, logit_bias={0: -100}))) <= {1, 2, 3}


def test_allowed_token_ids_are_the_only_ones_drawn():
    assert counts_only(draw(SamplingParams(temperature=1.0, allowed_token_ids=[2, 3]))) == {2, 3}
    greedy = SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[1, 3]), [9], 1)
    assert Sampler()(LOGITS[None], [greedy]).token_ids == [1]
    # with a penalty on the allowed token already seen, the other allowed one wins
    seen = SamplingRow(SamplingParams(temperature=0.0, allowed_token_ids=[1, 3],
                                      repetition_penalty=100.0), [1], 0)
    assert Sampler()(torch.tensor([[5.0, 1.0, 4.0, 0.5]]), [seen]).token_ids == [3]


def test_bad_words_ban_a_words_last_token_where_the_output_ends_in_the_rest():
    """vLLM's bad_words: a one-token word never; a longer word's last token not right after
    the output's last tokens spell the rest of it (the prompt does not count)."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, bad_words=["w", "xy"],
                            bad_words_token_ids=[(3,), (2, 0)])
    def pick(token_ids: list[int], num_prompt: int) -> int:
        return Sampler()(logits, [SamplingRow(params, token_ids, num_prompt)]).token_ids[0]
    assert pick([9, 2], 1) == 1  # the output ends in 2: 0 would finish "xy"
    assert pick([9, 2, 1], 1) == 0
    assert pick([2], 1) == 0  # 2 is the prompt's
    free = SamplingRow(params, [9, 2, 1], 1)
    assert free.bad_tokens == [3]


def test_choices_keep_the_output_on_one_choice_then_end_it():
    """vLLM's structured output by choice: each token keeps the output a prefix of some
    choice; one spelled whole may end (EOS) or go on into a longer one; EOS alone once
    the output left them all."""
    params = SamplingParams(temperature=1.0, seed=2, eos_token_id=0,
                            choice_token_ids=[(1, 2), (1, 2, 3), (3,)])
    def allowed(output: list[int]) -> list[int]:
        return SamplingRow(params, [9, *output], 1).choice_tokens()
    assert allowed([]) == [1, 3]
    assert allowed([1]) == [2]
    assert allowed([1, 2]) == [0, 3]
    assert allowed([3]) == [0]
    assert allowed([2]) == [0]
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0]])  # the model wants 3
    rows = [SamplingRow(params, [9, 1], 1), SamplingRow(params, [9], 1)]
    assert Sampler()(logits.repeat(2, 1), rows).token_ids == [2, 3]


def test_constraints_that_leave_no_token_end_the_row_at_eos():
    """allowed_token_ids all among the bad words: every logit -inf, which drew token 0
    greedily and any token sampled (QA); now the row's EOS, which ends it."""
    params = SamplingParams(allowed_token_ids=[1, 2], bad_words=["a", "b"],
                            bad_words_token_ids=[(1,), (2,)], eos_token_id=3)
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, 9.0]] * 2)
    rows = [SamplingRow(dataclasses.replace(params, temperature=0.0), [9], 1),
            SamplingRow(dataclasses.replace(params, temperature=1.0, seed=7), [9], 1)]
    assert Sampler()(logits, rows).token_ids == [3, 3]


def test_a_structured_output_takes_no_other_token_constraint():
    for constraint in ({"choices": ["a"]}, {"json_object": True}):
        for other in ({"allowed_token_ids": [1]}, {"bad_words": ["x"]}):
            with pytest.raises(RequestError, match="cannot be given with it"):
                SamplingParams(**constraint, **other)


def counts_only(counts: Counter) -> set[int]:
    return set(counts)


@pytest.mark.parametrize(("given", "needle"), [
    ({0: float("inf")}, "logit_bias must map"), ({-1: 1.0}, "logit_bias must map"),
    ({"5": 1.0}, "logit_bias must map"), ([(1, 2, 3)], "logit_bias must map"),
])
def test_logit_bias_is_checked(given, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(logit_bias=given)


@pytest.mark.parametrize(("field", "given"), [
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", [" "]), ("bad_words", [3]),
    ("bad_words_token_ids", [[]]), ("bad_words_token_ids", [[-1]]),
    ("choices", [""]), ("choices", "yes"), ("choice_token_ids", [[]]),
])
def test_bad_words_are_checked(field, given):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: given})


@pytest.mark.parametrize("given", [[], [-1], [1.5], "12"])
def test_allowed_token_ids_are_checked(given):
    with pytest.raises(RequestError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=given)


def test_choices_end_at_eos_so_nothing_may_hold_it_back():
    with pytest.raises(RequestError, match="ignore_eos cannot be true"):
        SamplingParams(choices=["a"], ignore_eos=True)
    with pytest.raises(RequestError, match="min_tokens must be 0"):
        SamplingParams(choices=["a"], min_tokens=2)


def test_token_constraints_are_kept_as_sorted_pairs_and_a_tuple():
    params = SamplingParams(logit_bias={7: 1, 2: -3.5}, allowed_token_ids=[4, 1])
    assert params.logit_bias == ((2, -3.5), (7, 1.0)) and params.allowed_token_ids == (4, 1)
    assert params == SamplingParams(logit_bias=[(2, -3.5), (7, 1)], allowed_token_ids=(4, 1))


def test_logprobs_hold_the_sampled_token_and_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], 1)
    out = Sampler()(logits, [row])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs is not None
    assert set(out.logprobs[0]) == {1, 2}
    assert out.logprobs[0][1] == pytest.approx(float(expected[1]))
    plain = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0), [1], 1)])
    assert plain.logprobs is None


@pytest.mark.skipif(not paged_kernel.handles(torch.float32), reason="needs the C++ extension")
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152 + 7])
def test_the_kernel_argmax_is_torch_argmax_ties_nans_and_infinities_included(vocab):
    """argmax_rows (greedy_tokens' kernel) answers as torch.argmax: the first maximum of a
    row, a NaN counting as the maximum, a row of -inf its first entry."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    last = vocab - 1
    logits[1, last] = 50.0  # the maximum in the tail past the lanes
    logits[2, :] = 3.0  # all tied: index 0
    logits[3, [last, last // 2]] = 60.0  # a tie: the first
    logits[4, last] = float("nan")
    logits[5, [last // 3, last]] = float("nan")
    logits[6, :] = float("-inf")
    logits[7, last // 2] = float("inf")
    expected = logits.argmax(dim=-1)
    got = paged_kernel.layer_ops().argmax_rows(logits)
    assert got.dtype == torch.long and torch.equal(got, expected)
    assert torch.equal(greedy_tokens(logits), expected)
    assert greedy_tokens(logits[:0]).shape == (0,)  # no rows: torch's path
    with pytest.raises(RuntimeError, match="argmax_rows: logits must be contiguous float32"):
        paged_kernel.layer_ops().argmax_rows(logits.double())


@pytest.mark.parametrize(("params", "kept"), [
    ({"top_k": 2, "top_p": 0.5}, [0]),  # top_p of what top_k left: 0.4 / 0.7 > 0.5
    ({"min_p": 0.6, "top_p": 0.5}, [0]),  # min_p first, then top_p of what it left
    ({"min_p": 0.6, "top_k": 3}, [0, 1]),
    ({"top_p": 0.5}, [0, 1]),  # alone, of the whole distribution
    ({"top_k": 3, "top_p": 0.8}, [0, 1, 2]),  # above the third: 0.7 / 0.9 = 0.78 < 0.8
])
def test_top_p_measures_what_min_p_and_top_k_left(params, kept):
    """QA (sampling pass): top_p was measured on the whole distribution and min_p ran last;
    vLLM V1 applies min_p, then top_k, then top_p on the survivors renormalised (keeping 10
    tokens where vLLM kept 6, 15-24% of the mass on tokens vLLM never draws)."""
    from kvserve.model.sampler import _top_k_top_p_min_p

    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    rows = [SamplingRow(SamplingParams(temperature=1.0, **params), [9], 1)]
    assert _top_k_top_p_min_p(probs, rows)[0].nonzero().flatten().tolist() == kept


def test_top_k_keeps_every_token_tied_with_the_kth():
    """QA (sampling pass): top_k cut the tie at the k-th value by sort order (bf16 logits
    tie often: top_k=50 kept 50 where vLLM keeps 51); vLLM keeps every tied token."""
    from kvserve.model.sampler import _top_k_top_p_min_p

    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=2), [9], 1)]
    assert _top_k_top_p_min_p(probs, rows)[0].nonzero().flatten().tolist() == [0, 1, 2, 3]


def test_a_row_without_top_p_keeps_its_whole_tail_beside_a_row_with_one():
    """QA (session 48's review): a top_p=1 row lost its tiniest tokens to the rounding of
    the kept mass whenever another row of the batch used top_k or top_p, so its
    distribution depended on the batch."""
    from kvserve.model.sampler import _top_k_top_p_min_p

    logits = torch.linspace(0.0, -20.0, 5000)
    probs = torch.softmax(torch.stack([logits, logits]), dim=-1)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [9], 1),
            SamplingRow(SamplingParams(temperature=1.0, top_k=2), [9], 1)]
    out = _top_k_top_p_min_p(probs, rows)
    assert torch.equal(out[0], probs[0]) and int((out[1] > 0).sum()) == 2
