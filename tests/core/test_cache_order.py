"""Cache-aware waiting orders and aging (C4-C7): small prefix trees worked out by hand."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.cache_order import CacheAwareQueue, dfs_weight_order
from kvserve.core.config import AGING_POLICIES, SCHEDULING_POLICIES, SchedulerConfig
from kvserve.core.errors import ConfigError, RequestError
from kvserve.core.queues import AgingPriorityQueue, make_waiting_queue
from tests.conftest import FakeExecutor, make_request, make_scheduler, step


class FakeCache:
    """cached_prefix_hashes from a table: request id -> its matched path of node names."""

    def __init__(self, paths: dict[str, list[str]]) -> None:
        self.paths = paths
        self.num_queries = 0

    def cached_prefix_hashes(self, request):
        self.num_queries += 1
        return [name.encode() for name in self.paths.get(request.request_id, [])]


def ids(queue):
    return [r.request_id for r in queue]


# Seven requests (arrival order r1..r7) and their matched prefixes, as paths in the tree
#
#   root ── A ── A1            r1 ends at A, r6 at A1
#     ├──── B ── B1 ── B1x     r2 ends at B1, r5 at B1x
#     │     └─── B2            r4 ends at B2
#     ├──── C ── C1 ── C2 ── C3   r7 ends at C3 (the longest match, alone on its branch)
#     └ r3 matches nothing
#
# weights (waiting requests whose match passes through): B 3, B1 2, A 2, C 1, the rest 1.
TREE = {"r1": ["A"], "r2": ["B", "B1"], "r3": [], "r4": ["B", "B2"],
        "r5": ["B", "B1", "B1x"], "r6": ["A", "A1"], "r7": ["C", "C1", "C2", "C3"]}


def filled(policy, paths=TREE, max_queue=128, aging_s=None, arrivals=None):
    queue = CacheAwareQueue(policy, max_queue, aging_s)
    for name in paths:
        queue.push(make_request(name, 4, arrival_time=(arrivals or {}).get(name, 0.0)))
    return queue


def test_lpm_most_cached_blocks_first_ties_in_arrival_order():  # C4
    queue = filled("lpm")
    queue.start_pass(FakeCache(TREE), now=0.0)
    # matches: r7 4, r5 3, r2 r4 r6 2, r1 1, r3 0
    assert ids(queue) == ["r7", "r5", "r2", "r4", "r6", "r1", "r3"]
    assert [queue.pop().request_id for _ in range(3)] == ["r7", "r5", "r2"]
    assert queue.num_tokens == 16


def test_dfs_weight_walks_the_heaviest_branch_deepest_first():  # C5
    queue = filled("dfs-weight")
    queue.start_pass(FakeCache(TREE), now=0.0)
    # root's children by weight: B (3), A (2), C (1); B's: B1 (2), B2 (1); a node's own
    # requests after its children's; r3 (root) last.
    assert ids(queue) == ["r5", "r2", "r4", "r6", "r1", "r7", "r3"]


def test_dfs_weight_equal_weights_keep_first_reached_order():  # C5
    paths = {"x": ["X"], "y": ["Y"], "x2": ["X"], "y2": ["Y"]}
    order = dfs_weight_order([make_request(n, 4) for n in paths],
                             [[p.encode() for p in path] for path in paths.values()])
    assert [r.request_id for r in order] == ["x", "x2", "y", "y2"]


def test_between_passes_and_for_new_arrivals_the_order_is_kept():  # C4, C2
    queue = filled("lpm")
    queue.start_pass(FakeCache(TREE), now=0.0)
    queue.push(make_request("late", 4))
    queue.push_front(make_request("victim", 4))
    assert ids(queue)[:2] == ["victim", "r7"] and ids(queue)[-1] == "late"
    queue.remove(queue.peek())
    assert queue.pop().request_id == "r7"


def test_a_queue_over_the_bound_is_served_fcfs():  # C6
    cache = FakeCache(TREE)
    queue = filled("lpm", max_queue=6)
    queue.start_pass(cache, now=0.0)
    assert ids(queue) == ["r1", "r2", "r3", "r4", "r5", "r6", "r7"]
    assert (cache.num_queries, queue.num_fcfs_passes, queue.num_sorted_passes) == (0, 1, 0)
    queue.remove(next(r for r in queue if r.request_id == "r3"))  # 6 left: at the bound
    queue.start_pass(cache, now=0.0)
    assert ids(queue) == ["r7", "r5", "r2", "r4", "r6", "r1"]
    assert (cache.num_queries, queue.num_fcfs_passes, queue.num_sorted_passes) == (6, 1, 1)


def test_lpm_aging_promotes_ahead_of_cache_hits_after_t():  # C7
    paths = {"a": [], "b": ["B", "B1"], "c": []}
    queue = filled("lpm", paths, aging_s=10.0, arrivals={"a": 0.0, "b": 5.0, "c": 1.0})
    cache = FakeCache(paths)
    queue.start_pass(cache, now=9.99)
    assert ids(queue) == ["b", "a", "c"] and queue.promoted == []
    queue.start_pass(cache, now=10.0)
    assert ids(queue) == ["a", "b", "c"] and ids(queue.promoted) == ["a"]
    queue.start_pass(cache, now=11.0)
    assert ids(queue) == ["a", "c", "b"]


def test_priority_aging_drops_the_value_by_one_per_t():  # C7
    queue = AgingPriorityQueue(aging_s=2.0)
    queue.push(make_request("x", 4, priority=5, arrival_time=0.0))
    queue.push(make_request("y", 4, priority=3, arrival_time=3.0))
    queue.start_pass(None, now=3.99)  # x: 5 - 1 = 4, y: 3
    assert ids(queue) == ["y", "x"]
    queue.start_pass(None, now=4.0)  # x: 5 - 2 = 3 = y's 3: the earlier arrival first
    assert ids(queue) == ["x", "y"]
    assert queue.effective_priority(queue.peek(), 10.0) == 0


def test_config_checks_the_new_fields():  # A4
    with pytest.raises(ConfigError, match="lpm_max_queue"):
        SchedulerConfig(scheduling_policy="lpm", lpm_max_queue=-1)
    with pytest.raises(ConfigError, match="schedule_aging_s=0"):
        SchedulerConfig(scheduling_policy="lpm", schedule_aging_s=0)
    with pytest.raises(ConfigError, match="not fcfs"):
        SchedulerConfig(schedule_aging_s=5.0)
    for policy in AGING_POLICIES:  # and only the orders whose queues age (contributor pass:
        SchedulerConfig(scheduling_policy=policy, schedule_aging_s=5.0)  # a new one ignored it)
    assert set(SCHEDULING_POLICIES) - set(AGING_POLICIES) == {"fcfs"}
    with pytest.raises(ConfigError, match="enable_priority_preemption"):
        SchedulerConfig(scheduling_policy="priority", schedule_aging_s=5.0,
                        enable_priority_preemption=True)
    with pytest.raises(ConfigError, match="scheduling_policy='nope'"):
        SchedulerConfig(scheduling_policy="nope")


def test_vtc_buckets_keep_the_cache_aware_order():  # C4, T1
    config = SchedulerConfig(scheduling_policy="lpm", tenant_fairness="vtc")
    queue = make_waiting_queue("lpm", config)
    for name in ("r1", "r2", "r5"):
        queue.push(make_request(name, 4, tenant="t"))
    queue.start_pass(FakeCache(TREE), now=0.0)
    assert ids(queue) == ["r5", "r2", "r1"]


# -- on the scheduler, with the real prefix cache --------------------------------------------

def warm_then_queue(policy, executor):
    """A 12-token prompt runs to its end (3 blocks of 4 stay cached, free); then "cold" (no
    match) arrives before "hot" (that prompt plus 4 tokens: 3 blocks match)."""
    scheduler = make_scheduler(num_blocks=32, block_size=4, scheduling_policy=policy,
                               max_num_seqs=1, max_num_batched_tokens=64)
    prompt = list(range(100, 112))
    scheduler.add_request(make_request("warm", prompt_token_ids=prompt, max_tokens=1))
    step(scheduler, executor)
    assert not scheduler.requests
    scheduler.add_request(make_request("cold", 16))
    scheduler.add_request(make_request("hot", prompt_token_ids=[*prompt, 7, 8, 9, 10]))
    return scheduler


@pytest.mark.parametrize(("policy", "first", "hit_tokens"),
                         [("fcfs", "cold", 0), ("lpm", "hot", 12), ("dfs-weight", "hot", 12)])
def test_the_cache_aware_order_admits_the_hit_first(policy, first, hit_tokens):  # C4, C5, G6
    executor = FakeExecutor()
    scheduler = warm_then_queue(policy, executor)
    queries, hits = scheduler.kv.prefix_cache_queries, scheduler.kv.prefix_cache_hits
    free_before = scheduler.kv.num_free_blocks
    out, _ = step(scheduler, executor)
    assert [new.request_id for new in out.scheduled_new_reqs] == [first]
    admitted = scheduler.requests[first]
    assert admitted.num_cached_tokens == hit_tokens
    # The sort's lookups are read-only: only the admission is counted (G6).
    assert scheduler.kv.prefix_cache_queries - queries == 16
    assert scheduler.kv.prefix_cache_hits - hits == hit_tokens
    assert scheduler.kv.num_free_blocks == free_before - 4


# -- the aging bound (C7) ----------------------------------------------------------------------

P_MIN, P_MAX, AGING_S = 0, 3, 2.0
events = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(P_MIN, P_MAX),
                            st.integers(0, 3)), min_size=1, max_size=60)


def aging_delay(policy, priority):
    """How long after its arrival a later arrival can still be served before a request:
    under lpm T, under priority (priority - P_MIN + 1) x T (docs/scheduler.md, C7)."""
    return AGING_S if policy != "priority" else (priority - P_MIN + 1) * AGING_S


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["priority", "lpm", "dfs-weight"]), script=events,
       max_queue=st.integers(0, 8))
def test_with_aging_every_request_is_admitted_within_its_bound(policy, script, max_queue):
    """Whatever the arrivals, a request is popped after at most (requests waiting when it
    arrived) + (requests arriving less than its aging delay after it) others (C7)."""
    queue = make_waiting_queue(policy, SchedulerConfig(
        scheduling_policy=policy, schedule_aging_s=AGING_S, lpm_max_queue=max_queue))
    paths: dict[str, list[str]] = {}
    cache = FakeCache(paths)
    now, arrived, popped = 0.0, [], []
    waiting_at_arrival: dict[str, int] = {}
    popped_before: dict[str, int] = {}
    for gap, is_arrival, priority, depth in script:
        now += gap
        if is_arrival:
            name = f"r{len(arrived)}"
            paths[name] = ["shared", "deeper", "deepest"][:depth]
            waiting_at_arrival[name] = len(queue)
            popped_before[name] = len(popped)
            request = make_request(name, 4, priority=priority, arrival_time=now)
            queue.push(request)
            arrived.append(request)
        elif queue:
            queue.start_pass(cache, now)
            popped.append(queue.pop())
    while queue:  # drain: the clock keeps moving
        now += 1
        queue.start_pass(cache, now)
        popped.append(queue.pop())
    position = {r.request_id: i for i, r in enumerate(popped)}
    for index, request in enumerate(arrived):
        name = request.request_id
        delay = aging_delay(policy, request.sampling_params.priority)
        close_behind = [r for r in arrived[index + 1:]
                        if r.arrival_time < request.arrival_time + delay]
        admissions_in_between = position[name] - popped_before[name]
        assert admissions_in_between <= waiting_at_arrival[name] + len(close_behind), name


# -- requests not ready yet (L2) ---------------------------------------------------------------

def test_not_ready_requests_are_skipped_and_restored_in_order():  # L2, D4
    executor = FakeExecutor()
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2,
                               max_num_batched_tokens=64, record_events=True)
    for name in ("a", "b", "c", "d", "e"):
        scheduler.add_request(make_request(name, 8))
    scheduler.set_not_ready("a", "kv_transfer")
    scheduler.set_not_ready("c", "input")
    out, _ = step(scheduler, executor)
    assert [new.request_id for new in out.scheduled_new_reqs] == ["b", "d"]
    assert ids(scheduler.waiting) == ["a", "c", "e"]  # the skipped back first, in order
    assert scheduler.waiting.num_tokens == 24
    blocked = [(e.request_id, e.reason) for e in scheduler.take_events() if e.kind == "blocked"]
    assert blocked == [("a", "not_ready: kv_transfer"), ("c", "not_ready: input"),
                       ("e", "max_num_seqs")]
    assert scheduler.stats().num_blocked_steps == {"not_ready": 1, "max_num_seqs": 1}
    scheduler.set_not_ready("a", None)
    scheduler.abort("b")
    out, _ = step(scheduler, executor)
    assert [new.request_id for new in out.scheduled_new_reqs] == ["a"]
    assert ids(scheduler.waiting) == ["c", "e"]


def test_a_ready_head_that_does_not_fit_still_blocks_the_queue():  # L2, D4 head-of-line
    executor = FakeExecutor()
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("big", 24, max_tokens=50, ignore_eos=True))
    step(scheduler, executor)  # big holds 6 blocks, 7 after its next token
    scheduler.add_request(make_request("wait", 4))
    scheduler.add_request(make_request("huge", 12))  # needs 3 blocks, 1 is free
    scheduler.add_request(make_request("small", 3))  # would fit in that 1
    scheduler.set_not_ready("wait", "kv_transfer")
    out, _ = step(scheduler, executor)
    assert out.scheduled_new_reqs == [] and ids(scheduler.waiting) == ["wait", "huge", "small"]
    assert scheduler.kv.num_free_blocks == 1


def test_skipping_does_not_charge_a_fair_share_tenant():  # L2, T3
    scheduler = make_scheduler(tenant_fairness="vtc", max_num_batched_tokens=64)
    scheduler.add_request(make_request("x", 8, tenant="t1"))
    scheduler.set_not_ready("x", "input")
    step(scheduler, FakeExecutor())
    assert scheduler.waiting.counters.get("t1", 0.0) == 0.0 and ids(scheduler.waiting) == ["x"]


def test_only_a_waiting_request_can_be_marked_not_ready():  # L2
    scheduler = make_scheduler()
    with pytest.raises(RequestError, match="'nope' is not waiting"):
        scheduler.set_not_ready("nope", "input")


def test_aging_promotion_on_the_scheduler_is_logged_once():  # C7, C4
    executor = FakeExecutor()
    scheduler = make_scheduler(num_blocks=32, block_size=4, scheduling_policy="lpm",
                               schedule_aging_s=5.0, max_num_seqs=1,
                               max_num_batched_tokens=64, record_events=True)
    prompt = list(range(100, 112))
    scheduler.add_request(make_request("warm", prompt_token_ids=prompt, max_tokens=1))
    step(scheduler, executor, now=0.0)
    scheduler.add_request(make_request("cold", 16, arrival_time=0.5, max_tokens=1))
    for name, tail, arrival in (("hot1", [1, 2, 3, 4], 0.5), ("hot2", [5, 6, 7, 8], 2.0)):
        scheduler.add_request(make_request(name, prompt_token_ids=[*prompt, *tail],
                                           arrival_time=arrival, max_tokens=1))
    scheduler.take_events()
    admitted = [step(scheduler, executor, now=t)[0].scheduled_new_reqs[0].request_id
                for t in (1.0, 6.0, 7.0)]
    assert admitted == ["hot1", "cold", "hot2"]  # cold waited 5.5 s >= 5 at t=6, hot2 4 s
    promoted = [(e.time, e.request_id, e.reason) for e in scheduler.take_events()
                if e.kind == "promoted"]
    assert promoted == [(6.0, "cold", "aging")]


@pytest.mark.parametrize("options", [{"scheduling_policy": "priority"},
                                     {"scheduling_policy": "lpm"},
                                     {"scheduling_policy": "lpm", "tenant_fairness": "vtc"}])
def test_an_aged_request_waiting_not_ready_is_reported_promoted_once(options):  # C7, L2
    """Set aside and put back on each pass while not ready, it stays in the same wait:
    aging names it once (it was reported on every pass)."""
    executor = FakeExecutor()
    scheduler = make_scheduler(num_blocks=32, block_size=4, schedule_aging_s=1.0,
                               max_num_batched_tokens=64, record_events=True, **options)
    scheduler.add_request(make_request("x", 8, arrival_time=0.0, max_tokens=1))
    scheduler.add_request(make_request("y", 8, arrival_time=0.0, max_tokens=1))
    scheduler.set_not_ready("x", "input")
    for now in (0.5, 2.0, 3.0, 4.0):
        step(scheduler, executor, now=now)
        scheduler.add_request(make_request(f"z{now}", 8, arrival_time=now, max_tokens=1))
    promoted = [e.request_id for e in scheduler.take_events() if e.kind == "promoted"]
    assert promoted.count("x") == 1


def test_priority_aging_reports_each_request_once():  # C7
    queue = AgingPriorityQueue(aging_s=2.0)
    queue.push(make_request("x", 4, priority=5, arrival_time=0.0))
    queue.push(make_request("y", 4, priority=3, arrival_time=3.0))
    assert queue.start_pass(None, now=1.0) == []
    assert ids(queue.start_pass(None, now=2.0)) == ["x"]
    assert queue.start_pass(None, now=4.0) == []
    assert ids(queue.start_pass(None, now=5.0)) == ["y"]


def test_priority_aging_reports_a_request_that_reuses_a_gone_ones_id():  # C7
    """The review: the queue knew its unreported requests by id, so one whose id a removed
    request had used was never reported lifted."""
    queue = AgingPriorityQueue(aging_s=2.0)
    gone = make_request("x", 4, priority=5, arrival_time=0.0)
    queue.push(make_request("keep", 4, priority=5, arrival_time=0.5))  # the queue stays busy
    queue.push(gone)
    queue.remove(gone)  # aborted before it aged
    queue.push(make_request("x", 4, priority=5, arrival_time=1.0))
    assert ids(queue.start_pass(None, now=3.5)) == ["keep", "x"]


def test_priority_aging_keeps_the_order_of_a_full_sort_each_pass():  # C7
    """The queue keeps each priority value in arrival order and compares the heads at the
    pass's time (QA: it sorted the whole queue every step); random pushes, preemptions
    back, removals, pops and passes give the order and the lifted reports of a full sort."""
    rng = random.Random(7)
    queue = AgingPriorityQueue(aging_s=2.0)
    model: list = []
    promoted: set[str] = set()
    now = 0.0
    assert queue.start_pass(None, now) == []  # the queue's clock: its passes'

    def key(request):
        return (queue.effective_priority(request, now), request.arrival_time,
                request.request_id)

    for index in range(2000):
        action = rng.random()
        if action < 0.4 or not model:
            request = make_request(f"r{index}", 2, priority=rng.randint(0, 4),
                                   arrival_time=now - rng.random() * 3)
            queue.push(request)
            model.append(request)
        elif action < 0.55:
            request = model.pop(rng.randrange(len(model)))
            queue.remove(request)
            promoted.discard(request.request_id)
        elif action < 0.75:
            model.sort(key=key)
            request = queue.pop()
            assert request is model.pop(0)
            promoted.discard(request.request_id)
            if rng.random() < 0.3:  # preempted: back with its arrival time
                queue.push_front(request)
                model.append(request)
        else:
            now += rng.random()
            model.sort(key=key)
            expected = [r for r in model if r.arrival_time <= now - 2.0
                        and r.request_id not in promoted]
            promoted.update(r.request_id for r in expected)
            assert ids(queue.start_pass(None, now)) == ids(expected)
            assert list(queue) == model
    assert len(queue) == len(model)


def test_a_request_pushed_back_each_step_keeps_one_pending_report():  # C7
    """QA: a not-ready request set aside and pushed back each step added an entry to the
    aging reports' heap each time, which compaction could not drop (it still waits)."""
    queue = AgingPriorityQueue(aging_s=2.0)
    request = make_request("blocked", 4, priority=1, arrival_time=0.0)
    for _ in range(1000):
        queue.push(request)
        queue.remove(request)
    queue.push(request)
    assert len(queue._unreported) == 1
    assert ids(queue.start_pass(None, now=2.0)) == ["blocked"]  # reported once, as before
