"""Spec K1, K2: victim and admission strategies selected by config."""

from collections.abc import Iterator, Sequence

import pytest

from kvserve.core import (
    CacheConfig,
    ConfigError,
    Request,
    Scheduler,
    VictimPolicy,
    WaitingQueue,
    check_empty,
)
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


def test_a_listed_name_no_factory_builds_is_refused_not_served_by_another(monkeypatch):
    """Contributor pass: a name added to kvserve.core.config's list without its branch in
    the factory ran the factory's last policy (the opposite victim, say), silently."""
    from kvserve.core import config, policies, queues

    for name in config.VICTIM_POLICIES:  # every listed name builds
        make_victim_policy(SchedulerConfig(victim_policy=name))
    for name in config.SCHEDULING_POLICIES:
        queues.make_plain_queue(name)
    monkeypatch.setattr(config, "VICTIM_POLICIES", (*config.VICTIM_POLICIES, "newest-k"))
    monkeypatch.setattr(config, "ADMISSION_POLICIES", (*config.ADMISSION_POLICIES, "greedy"))
    with pytest.raises(ConfigError, match="victim_policy='newest-k' has no class"):
        make_victim_policy(SchedulerConfig(victim_policy="newest-k"))
    with pytest.raises(ConfigError, match="admission_policy='greedy' has no class"):
        policies.make_admission_policy(SchedulerConfig(admission_policy="greedy"), None)
    with pytest.raises(ValueError, match="'sjf' has no queue class"):
        queues.make_plain_queue("sjf")


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
    # and says so: not "kv_cache" with 6 blocks free (operator pass)
    assert scheduler.num_blocked_steps == {"admission_reserve": 1}


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


def test_adaptive_ratio_starts_over_when_a_request_finds_the_engine_idle():  # K2 "adaptive"
    """As SGLang's new_token_ratio, reset when its scheduler has nothing to run: a ratio an
    old burst left would otherwise set how much a new one reserves (and K4's 400 rules count
    an idle engine's reserve at the initial ratio)."""
    scheduler = make_scheduler(num_blocks=10, admission_policy="adaptive",
                               adaptive_init_ratio=0.5, adaptive_min_ratio=0.1,
                               adaptive_decay_steps=4)
    policy = scheduler._admission
    policy.end_step(0, [])
    scheduler.add_request(make_request("a", 4, max_tokens=10))  # idle: starts over
    assert policy.ratio == pytest.approx(0.5)
    policy.end_step(0, [])
    scheduler.add_request(make_request("b", 4, max_tokens=10))  # a waits: not idle
    assert policy.ratio == pytest.approx(0.4)


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


@pytest.mark.parametrize("policy", [LeastGeneratedFirst(), LeastComputedFirst()])
def test_a_tie_goes_to_the_latest_admitted(policy):  # K1
    """SGLang's retract_decode sorts stably and pops the last, so among equals the newest
    goes; taking the first preempted the head of the line when requests were alike (QA)."""
    running = [make_request(name, 16, max_tokens=8) for name in "abc"]
    for request in running:
        request.num_computed_tokens = 16
    assert policy.select(running) == 2
    running[2].num_computed_tokens = 17  # c computed one more: of the rest, b
    running[2].output_token_ids.append(5)
    assert policy.select(running) == 1


# -- Your own policy (docs/scheduler.md, "Your own policy") ------------------------------------


class ShortestPromptFirst(WaitingQueue):
    """A waiting order of one's own: the shortest prompt first, ties by arrival."""

    def __init__(self) -> None:
        super().__init__()
        self._requests: list[Request] = []

    def push(self, request: Request) -> None:
        self._requests.append(request)
        self._requests.sort(key=lambda r: (r.num_prompt_tokens, r.arrival_time))
        self._added(request)

    push_front = push  # a preempted request takes its place by length again

    def pop(self) -> Request:
        request = self._requests.pop(0)
        self._removed(request)
        return request

    def peek(self) -> Request:
        return self._requests[0]

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        self._removed(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))


class EarliestFirst(VictimPolicy):
    """A victim choice of one's own: the earliest admitted."""

    def select(self, running: Sequence[Request]) -> int:
        return 0


def admitted_order(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    run_to_completion(scheduler, requests)
    return [event.request_id for event in scheduler.take_events() if event.kind == "admitted"]


def test_a_waiting_order_of_ones_own_is_handed_to_the_scheduler():
    requests = [make_request("a", 30, max_tokens=2), make_request("b", 10, max_tokens=2),
                make_request("c", 20, max_tokens=2)]
    config = SchedulerConfig(max_num_seqs=1, max_model_len=256)
    cache = CacheConfig(num_blocks=64, block_size=16)
    mine = Scheduler(config, cache, record_events=True, waiting_queue=ShortestPromptFirst())
    assert admitted_order(mine, requests) == ["b", "c", "a"]
    check_empty(mine)
    fcfs = Scheduler(config, cache, record_events=True)
    assert admitted_order(fcfs, [make_request(r.request_id, r.num_prompt_tokens, max_tokens=2)
                                 for r in requests]) == ["a", "b", "c"]


def test_a_victim_choice_of_ones_own_is_handed_to_the_scheduler():
    def victims(policy: VictimPolicy | None) -> list[str]:
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=256),
                              CacheConfig(num_blocks=30, block_size=4), record_events=True,
                              victim_policy=policy)
        run_to_completion(scheduler, pressure_workload())
        check_empty(scheduler)
        return [e.request_id for e in scheduler.take_events() if e.kind == "preempted"]

    newest_first, earliest_first = victims(None), victims(EarliestFirst())
    assert newest_first and earliest_first and newest_first != earliest_first
    assert earliest_first[0] == "0" != newest_first[0]  # the earliest admitted, not the newest


@pytest.mark.parametrize("answer", [None, -1, 99, 1.0, True])
def test_a_victim_choice_that_is_no_index_into_running_is_named(answer):
    """QA (core fuzz): None livelocked the run (nobody preempted), -1 took the last request
    and counted its tokens off the budget twice, 99 or 1.0 were a bare IndexError or
    TypeError naming no policy. And the policy was handed the scheduler's own list."""
    from kvserve.core.errors import InvariantError

    class Odd(VictimPolicy):
        def select(self, running: Sequence[Request]) -> int:
            assert isinstance(running, tuple)  # a copy: sorting it reorders nothing
            return answer  # type: ignore[return-value]

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=256),
                          CacheConfig(num_blocks=30, block_size=4), victim_policy=Odd())
    with pytest.raises(InvariantError, match=r"Odd.select\(\) must return an index into "
                                             rf"running \(0 to \d+\), got {answer!r}"):
        run_to_completion(scheduler, pressure_workload())


def test_auto_preemption_prices_without_the_two_prices_are_refused():  # S4 A4
    """QA (core fuzz): any object was taken, and failed at the first preemption, inside
    schedule(), with the victim out of every queue."""
    with pytest.raises(ConfigError, match="preemption_prices must have recompute_seconds"
                                          r".* object lacks recompute_seconds and swap_seconds"):
        Scheduler(SchedulerConfig(preemption_mode="auto"),
                  CacheConfig(num_blocks=8, num_host_blocks=8), preemption_prices=object())


def test_a_queue_with_requests_in_it_is_refused():
    queue = ShortestPromptFirst()
    queue.push(make_request("a", 4))
    with pytest.raises(ConfigError, match="waiting_queue must be empty"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=8), waiting_queue=queue)


def test_the_simulator_makes_ones_own_policies_for_each_run():
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.trace import TraceRequest

    trace = [TraceRequest(name, 0.0, 2, prompt_len=length)
             for name, length in (("a", 30), ("b", 10), ("c", 20))]
    sim = Simulator(SchedulerConfig(max_num_seqs=1, max_model_len=256),
                    CacheConfig(num_blocks=64, block_size=16), UnitCostModel(),
                    record_events=True, waiting_queue=ShortestPromptFirst,
                    victim_policy=EarliestFirst)
    for _ in range(2):  # a fresh queue each run
        result = sim.run(trace)
        assert [e.request_id for e in result.events if e.kind == "admitted"] == ["b", "c", "a"]


def test_a_class_for_an_object_or_an_object_for_a_maker_is_named():
    """QA: a class given to the scheduler failed on len() or at the first preemption; an
    instance given to the simulator (an empty queue, so falsy) was ignored for FCFS."""
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    config, cache = SchedulerConfig(), CacheConfig(num_blocks=8)
    with pytest.raises(ConfigError, match=r"waiting_queue must be a WaitingQueue object .*"
                                          r"got the class ShortestPromptFirst"):
        Scheduler(config, cache, waiting_queue=ShortestPromptFirst)
    with pytest.raises(ConfigError, match=r"victim_policy must be a VictimPolicy object .*got "
                                          r"the class EarliestFirst"):
        Scheduler(config, cache, victim_policy=EarliestFirst)
    with pytest.raises(ConfigError, match=r"waiting_queue takes a maker of a WaitingQueue, "
                                          r"called once per run.*got ShortestPromptFirst"):
        Simulator(config, cache, UnitCostModel(), waiting_queue=ShortestPromptFirst())
    with pytest.raises(ConfigError, match="victim_policy takes a maker"):
        Simulator(config, cache, UnitCostModel(), victim_policy=EarliestFirst())


def test_the_documented_example_runs_as_written(capsys):
    """docs/scheduler.md, "Your own policy": its example named things it never defined
    (QA: NameError); it runs whole now, and prints what its comment says."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "scheduler.md").read_text()
    section = text[text.index("### Your own policy"):]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("```")]
    exec(compile(code, "docs/scheduler.md", "exec"), {})
    assert capsys.readouterr().out == "['b', 'a']\n"
