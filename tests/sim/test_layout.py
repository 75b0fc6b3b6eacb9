"""BlockLayout: scattered context tokens, followed incrementally from SchedulerOutput, and
the simulator switching it on only for a cost model that prices it."""

from array import array

import pytest

from kvserve.core import (
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from kvserve.sim.cost_models import CalibratedCostModel, needs_block_layout
from kvserve.sim.executor import SimExecutor
from kvserve.sim.layout import BlockLayout
from kvserve.sim.report import build_report, dumps
from kvserve.sim.simulator import Simulator
from kvserve.sim.tokens import EOS_TOKEN_ID, stream_key, stream_token
from kvserve.sim.workloads import WorkloadSpec, generate

_PARAMS = SamplingParams(max_tokens=100)


def new(request_id: str, block_ids: list[int], num_computed: int) -> NewRequestData:
    return NewRequestData(request_id, [1] * (num_computed + 1), num_computed + 1, block_ids,
                          num_computed, False, _PARAMS)


def step(new_reqs=(), cached=(), preempted=(), finished=()) -> SchedulerOutput:
    """A one-token-per-request step; ``cached`` holds (id, new block ids, num computed)."""
    columns = CachedRequestData([c[0] for c in cached], [list(c[1]) for c in cached],
                                [c[2] for c in cached])
    scheduled = {r.request_id: 1 for r in new_reqs} | {c[0]: 1 for c in cached}
    return SchedulerOutput(list(new_reqs), columns, scheduled, len(scheduled),
                           list(preempted), list(finished))


def test_the_docstring_example():
    #   block table [7, 8, 9, 3, 4, 12]: 3 and 12 are scattered (4 follows 3)
    #   context 86 = blocks 0-4 in full + 6 tokens of block 5 -> 16 (block 3) + 6 (block 5)
    layout = BlockLayout(16)
    assert layout.observe(step([new("a", [7, 8, 9, 3, 4, 12], 86)])) == 22


def test_counts_follow_blocks_appended_step_by_step():
    # block_size 4. a starts on [5, 6] with 7 tokens computed; 9 follows 6 with a gap,
    # 10 follows 9. b is consecutive throughout and never counts.
    layout = BlockLayout(4)
    assert layout.observe(step([new("a", [5, 6], 7), new("b", [0, 1], 7)])) == 0
    # a grows into block 9 (scattered): 8 tokens of context still sit in [5, 6]
    assert layout.observe(step(cached=[("a", [9], 8), ("b", [2], 8)])) == 0
    # 9 context tokens: the 9th is the first in block 9 -> 1
    assert layout.observe(step(cached=[("a", [], 9), ("b", [], 9)])) == 1
    assert layout.observe(step(cached=[("a", [], 11), ("b", [], 11)])) == 3
    # a grows into 10, which follows 9: block 9's 4 tokens count, block 10's do not
    assert layout.observe(step(cached=[("a", [10], 12), ("b", [3], 12)])) == 4
    assert layout.observe(step(cached=[("a", [], 14), ("b", [], 14)])) == 4


def test_preempted_and_finished_requests_are_dropped_and_resumed_ones_rebuilt():
    layout = BlockLayout(4)
    layout.observe(step([new("a", [3, 9], 5), new("b", [0, 1], 5)]))
    assert len(layout) == 2
    # a is preempted: its table goes; it resumes on [4, 5] (consecutive) -> no longer counts
    assert layout.observe(step(cached=[("b", [], 6)], preempted=["a"])) == 0
    assert len(layout) == 1
    assert layout.observe(step([new("a", [4, 5], 5)], cached=[("b", [], 7)])) == 0
    assert layout.observe(step(cached=[("a", [], 6)], finished=["b"])) == 0
    assert len(layout) == 1
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockLayout(0)


def _two_decoders(layout: BlockLayout | None) -> list[int]:
    """a and b (6-token prompts) prefill together and decode in lockstep on a fresh pool of
    4-token blocks; returns each step's scattered context tokens."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                          CacheConfig(16, 4, enable_prefix_caching=False))
    executor = SimExecutor(layout)
    for name in ("a", "b"):
        executor.register(name, 6, 50, False, stream_key(0, name))
        scheduler.add_request(Request(name, [stream_token(stream_key(1, name), p)
                                             for p in range(6)],
                                      SamplingParams(max_tokens=50, eos_token_id=EOS_TOKEN_ID)))
    counts = []
    for now in range(9):
        out = scheduler.schedule(float(now))
        scheduler.update(out, executor.execute(out), float(now))
        counts.append(executor.view.scattered_context_tokens)
    return counts


def test_the_executor_reports_the_layout_of_a_real_schedule():
    # A fresh pool deals a [0, 1], b [2, 3]. Decoding in lockstep, both cross into a third
    # block at context 8: a gets 4, b gets 5, each a jump. Then 4 -> 6 and 5 -> 7, jumps too.
    #   step:        0   1   2   3   4   5   6   7   8
    #   context:     0   6   7   8   9  10  11  12  13    (each of a, b)
    #   scattered:   0   0   0   0   1   2   3   4   5    (each)
    assert _two_decoders(BlockLayout(4)) == [0, 0, 0, 0, 2, 4, 6, 8, 10]
    assert _two_decoders(None) == [0] * 9  # off: the view says nothing about layout


# -- the simulator's switch ------------------------------------------------------------------

SIX_TERMS = {"fixed_s": 0.004, "per_token_s": 2e-5, "per_seq_s": 1e-5, "per_sampled_s": 1e-5,
             "per_context_token_s": 3e-8, "per_attention_pair_s": 1e-9}
_CONFIG = (SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
           CacheConfig(150, 16))
# Arrivals and departures churn the pool, so blocks end up scattered.
_TRACE = generate(WorkloadSpec(num_requests=60, rate=8.0, prompt_len="uniform:32,300",
                               output_len="uniform:8,120", seed=11))


class SixTermModel:
    """The calibrated model as it was before the layout term: its formula and its
    description, written out, so 'as before' is pinned independently of the new code."""

    name = "calibrated"

    def __init__(self, coefficients: dict[str, float], needs_layout: bool = False) -> None:
        self.c = coefficients
        self.needs_block_layout = needs_layout

    def step_time(self, scheduler_output, view) -> float:  # type: ignore[no-untyped-def]
        c = self.c
        return (c["fixed_s"] + c["per_token_s"] * view.num_tokens
                + c["per_seq_s"] * view.num_seqs + c["per_sampled_s"] * view.num_sampled
                + c["per_context_token_s"] * view.context_tokens
                + c["per_attention_pair_s"] * view.attention_pairs)

    def describe(self) -> dict:
        return {"name": self.name, "coefficients": dict(self.c), "min_tokens": 0,
                "source": ""}


def _report(cost_model) -> tuple[str, array]:  # type: ignore[no-untyped-def]
    result = Simulator(*_CONFIG, cost_model).run(_TRACE)
    return dumps(build_report({"cost_model": cost_model.describe()}, result)), \
        result.steps.duration


def test_the_switch_follows_the_layout_coefficient():
    assert not needs_block_layout(SixTermModel(SIX_TERMS))
    assert not CalibratedCostModel(dict(SIX_TERMS)).needs_block_layout
    with_term = CalibratedCostModel({**SIX_TERMS, "per_scattered_context_token_s": 1e-7})
    assert needs_block_layout(with_term)
    from kvserve.sim.simulator import SimRun
    assert SimRun(Simulator(*_CONFIG, with_term), _TRACE, None).executor.layout is not None
    assert SimRun(Simulator(*_CONFIG, CalibratedCostModel(dict(SIX_TERMS))), _TRACE,
                None).executor.layout is None


def test_reports_are_byte_identical_to_the_six_term_model_when_the_term_is_unused():
    before, before_durations = _report(SixTermModel(SIX_TERMS))
    # The calibrated model without the term, as loaded from an old file or with the key at 0
    for coefficients in (dict(SIX_TERMS), {**SIX_TERMS, "per_scattered_context_token_s": 0}):
        model = CalibratedCostModel.from_dict({"format": "kvserve-cost-model/1",
                                               "coefficients": coefficients})
        report, durations = _report(model)
        assert durations == before_durations  # every step's price, bit for bit
        assert report == before
    # Tracking the layout (forced on) changes nothing else the simulation does.
    assert _report(SixTermModel(SIX_TERMS, needs_layout=True))[0] == before


class Recording:
    """Wraps a cost model and keeps every view it priced."""

    name = "recording"

    def __init__(self, model: CalibratedCostModel) -> None:
        self.model, self.views = model, []
        self.needs_block_layout = model.needs_block_layout

    def step_time(self, scheduler_output, view) -> float:  # type: ignore[no-untyped-def]
        self.views.append(view)
        return self.model.step_time(scheduler_output, view)

    def describe(self) -> dict:
        return self.model.describe()


def test_the_term_prices_the_scattered_tokens_the_simulation_produced():
    model = CalibratedCostModel({**SIX_TERMS, "per_scattered_context_token_s": 1e-6})
    recording = Recording(model)
    result = Simulator(*_CONFIG, recording).run(_TRACE)
    scattered = [v.scattered_context_tokens for v in recording.views]
    context = [v.context_tokens for v in recording.views]
    # The churn leaves some context scattered, never more than all of it.
    assert sum(scattered) > 0
    assert all(0 <= s <= c for s, c in zip(scattered, context, strict=True))
    six_terms = SixTermModel(SIX_TERMS)
    for view, duration in zip(recording.views, result.steps.duration, strict=True):
        expected = six_terms.step_time(None, view) + 1e-6 * view.scattered_context_tokens
        assert duration == pytest.approx(expected, rel=1e-12)
    assert '"per_scattered_context_token_s": 1e-06' in _report(model)[0]
