"""Spec K1, K2: victim and admission strategies selected by config."""

import pytest

from kvserve.core import check_empty
from kvserve.core.config import SchedulerConfig
from kvserve.core.policies import (
    AdaptiveReserve,
    LeastComputedFirst,
    LeastGeneratedFirst,
    LeastUrgentFirst,
    NewestFirst,
    make_victim_policy,
)
from tests.conftest import make_request, make_scheduler, run_to_completion


def running_set():
    a = make_request("a", 40, priority=2, arrival_time=0.0)
    b = make_request("b", 10, priority=2, arrival_time=1.0)
    c = make_request("c", 30, priority=0, arrival_time=2.0)
    d = make_request("d", 50, priority=1, arrival_time=3.0)
    a.output_token_ids += [1, 2, 3]
    b.output_token_ids += [1]
    c.output_token_ids += [1]
    d.output_token_ids += [1, 2]
    for request, computed in zip((a, b, c, d), (43, 11, 31, 12), strict=True):
        request.num_computed_tokens = computed
    return [a, b, c, d]


@pytest.mark.parametrize(("policy", "victim"), [
    (NewestFirst(), "d"),  # vLLM fcfs: the last admitted
    (LeastUrgentFirst(), "b"),  # vLLM priority: largest (priority, arrival)
    (LeastGeneratedFirst(), "c"),  # SGLang: fewest outputs (b, c: 1), then longest prompt
    (LeastComputedFirst(), "b"),  # fewest computed tokens
])
def test_victim_policies(policy, victim):  # K1
    running = running_set()
    assert running[policy.select(running)].request_id == victim


def test_victim_policy_is_chosen_by_config():  # K1
    assert isinstance(make_victim_policy(SchedulerConfig()), NewestFirst)
    assert isinstance(make_victim_policy(SchedulerConfig(scheduling_policy="priority")),
                      LeastUrgentFirst)
    assert isinstance(make_victim_policy(SchedulerConfig(victim_policy="sglang")),
                      LeastGeneratedFirst)
    assert isinstance(make_victim_policy(SchedulerConfig(victim_policy="least-computed")),
                      LeastComputedFirst)


def pressure_workload():
    return [make_request(i, 20 + 5 * i, max_tokens=40, ignore_eos=True) for i in range(8)]


@pytest.mark.parametrize("victim_policy", ["vllm", "sglang", "least-computed"])
def test_every_victim_policy_finishes_the_same_tokens(victim_policy):  # K1 + F4
    baseline = run_to_completion(make_scheduler(num_blocks=400, block_size=4),
                                 pressure_workload())
    scheduler = make_scheduler(num_blocks=30, block_size=4, victim_policy=victim_policy)
    final = run_to_completion(scheduler, pressure_workload())
    assert scheduler.num_preemptions > 0
    assert {k: v.new_token_ids for k, v in final.items()} == \
        {k: v.new_token_ids for k, v in baseline.items()}
    check_empty(scheduler)


def test_reserve_admission_never_preempts():  # K2 "reserve"
    optimistic = make_scheduler(num_blocks=30, block_size=4)
    run_to_completion(optimistic, pressure_workload())
    reserve = make_scheduler(num_blocks=30, block_size=4, admission_policy="reserve")
    final = run_to_completion(reserve, pressure_workload())
    assert optimistic.num_preemptions > 0
    assert reserve.num_preemptions == 0 and len(final) == 8
    check_empty(reserve)


def test_reserve_admission_keeps_future_blocks_free():  # K2 "reserve"
    scheduler = make_scheduler(num_blocks=10, block_size=4, admission_policy="reserve")
    scheduler.add_request(make_request("a", 8, max_tokens=17))  # 8 + 17 - 1 = 24 -> 6 blocks
    scheduler.add_request(make_request("b", 8, max_tokens=9))  # 8 + 9 - 1 = 16 -> 4 blocks
    scheduler.add_request(make_request("c", 4, max_tokens=1))  # 4 -> 1 block
    scheduler.schedule(0.0)
    # a may grow to 6 blocks and b to 4: all 10 are spoken for, so c waits although 6 are
    # free today
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert scheduler.kv.num_free_blocks == 6


def test_adaptive_ratio_decays_and_jumps_after_preemption():  # K2 "adaptive"
    config = SchedulerConfig(admission_policy="adaptive", adaptive_init_ratio=0.5,
                             adaptive_min_ratio=0.1, adaptive_decay_steps=4,
                             adaptive_retract_decode_steps=2)
    scheduler = make_scheduler(num_blocks=10, **{k: getattr(config, k) for k in (
        "admission_policy", "adaptive_init_ratio", "adaptive_min_ratio",
        "adaptive_decay_steps", "adaptive_retract_decode_steps")})
    policy = scheduler._admission
    assert isinstance(policy, AdaptiveReserve)
    for expected in (0.4, 0.3, 0.2, 0.1, 0.1):
        policy.end_step(0, [])
        assert policy.ratio == pytest.approx(expected)
    running = [make_request("a", 4, max_tokens=10), make_request("b", 4, max_tokens=30)]
    running[0].output_token_ids += [1] * 6
    policy.end_step(1, running)
    # (6 decoded + 2 steps x 2 requests) / (10 + 30 max tokens) = 10 / 40
    assert policy.ratio == pytest.approx(0.25)


def test_adaptive_admission_preempts_less_than_optimistic():  # K2 "adaptive"
    def workload():
        return [make_request(i, 10 + 3 * i, max_tokens=60, ignore_eos=True)
                for i in range(10)]
    optimistic = make_scheduler(num_blocks=40, block_size=4)
    adaptive = make_scheduler(num_blocks=40, block_size=4, admission_policy="adaptive")
    run_to_completion(optimistic, workload())
    final = run_to_completion(adaptive, workload())
    assert len(final) == 10
    assert adaptive.num_preemptions < optimistic.num_preemptions
    check_empty(adaptive)


@pytest.mark.parametrize("admission_policy", ["reserve", "adaptive"])
def test_reservation_beyond_the_pool_still_admits_a_lone_request(admission_policy):  # K2, J2
    scheduler = make_scheduler(num_blocks=4, block_size=4, admission_policy=admission_policy)
    final = run_to_completion(scheduler, [make_request("a", 8, max_tokens=1000,
                                                       ignore_eos=True)])
    assert (final["a"].finish_reason, len(final["a"].new_token_ids)) == ("length", 9)
