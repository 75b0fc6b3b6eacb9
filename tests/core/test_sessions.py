"""Sessions that hold their KV between turns (U1-U8) and the held queue drained first (L1):
exact state worked out by hand on pools of 4-token blocks, and after every path the pool's
accounting (free + referenced by requests + held by sessions, I1, U2, U5)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.core import RequestError, check_empty, check_invariants
from kvserve.core.request import EventType, RequestStatus
from kvserve.core.sessions import SessionError
from tests.conftest import FakeExecutor, make_request, make_scheduler, step, token_for

BS = 4


def sched(num_blocks: int = 20, max_session_kv: float = 0.5, **config: object):
    return make_scheduler(num_blocks, BS, record_events=True, max_session_kv=max_session_kv,
                          **config)


def turn(request_id: str, prompt: list[int], *, session: str = "s", max_tokens: int = 3,
         arrival_time: float = 0.0, **params: object):
    return make_request(request_id, prompt_token_ids=prompt, max_tokens=max_tokens,
                        ignore_eos=True, session_id=session, arrival_time=arrival_time,
                        **params)


def run(scheduler, executor: FakeExecutor, now: float = 0.0, max_steps: int = 200,
        until: str | None = None) -> dict[str, list[int]]:
    """Step from ``now`` (one second a step) until nothing is left, or ``until`` finished;
    returns each finished request's output tokens."""
    outputs: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    for n in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, results = step(scheduler, executor, now + n)
        for result in results:
            tokens.setdefault(result.request_id, []).extend(result.new_token_ids)
            if result.finished:
                outputs[result.request_id] = tokens.pop(result.request_id)
        if until is not None and until in outputs:
            return outputs
    raise AssertionError("requests left")


def prompt_of(request_id: str, length: int) -> list[int]:
    return [token_for(request_id + "/prompt", i) for i in range(length)]


def first_turn(scheduler, executor):
    """Turn 1: a 10-token prompt, 3 output tokens; 12 tokens computed (the last sampled
    token never is), so 3 blocks stay held."""
    prompt = prompt_of("t1", 10)
    scheduler.add_request(turn("t1", prompt))
    run(scheduler, executor)
    return [*prompt, token_for("t1", 10), token_for("t1", 11), token_for("t1", 12)]


def test_a_finished_turn_is_held_and_the_next_prefills_only_its_new_tokens():  # U2 U3 L1
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.num_session_blocks, stats.num_free_blocks) == \
        (1, 3, 17)
    held = scheduler.sessions.held[("", "s")]
    assert held.token_ids == history[:12] and [b.ref_cnt for b in held.blocks] == [1, 1, 1]
    assert [(e.kind, e.num_tokens, e.reason) for e in scheduler.take_events()
            if e.kind is EventType.HELD] == [(EventType.HELD, 12, "session s")]

    held_ids = [b.block_id for b in held.blocks]
    scheduler.add_request(turn("t2", history + prompt_of("t2", 5), arrival_time=10.0))
    assert [r.request_id for r in scheduler.held_waiting] == ["t2"] and not scheduler.waiting
    assert scheduler.requests["t2"].num_computed_tokens == 12
    out, _ = step(scheduler, executor, 10.0)
    assert out.num_scheduled_tokens == {"t2": 6}  # 18 tokens, 12 held
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12  # the held blocks first, then 2 new ones
    assert new.block_ids[:3] == held_ids and len(new.block_ids) == 5
    events = scheduler.take_events()
    assert (events[0].kind, events[0].reason) == (EventType.ARRIVED,
                                                  "held by a session (12 tokens)")
    run(scheduler, executor, 11.0)
    stats = scheduler.stats()
    assert (stats.num_session_hits, stats.num_session_hit_tokens) == (1, 12)
    assert stats.prefix_cache_hits == 12  # counted as a hit too (G6)
    assert (stats.num_sessions_held, stats.num_session_blocks) == (1, 5)  # 18 + 3 - 1 = 20


def test_the_held_queue_is_drained_before_the_ordinary_queue():  # L1
    scheduler = sched(max_num_batched_tokens=8, max_num_seqs=8)
    executor = FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    scheduler.add_request(make_request("r", 8, arrival_time=5.0))
    scheduler.add_request(turn("t2", history + prompt_of("t2", 4), arrival_time=6.0))
    out, _ = step(scheduler, executor, 6.0)
    # t2 arrived later but holds KV: admitted first, 5 new tokens (17 - 12 held: the last
    # answer token was never computed); r takes the 3 left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("t2", 5), ("r", 3)]
    assert [r.request_id for r in scheduler.running] == ["t2", "r"]


def test_under_priority_a_more_urgent_request_goes_before_a_held_turn():  # L5 L1
    """A held turn went first under every policy: a tenant that made every request a
    session turn went ahead of other tenants' urgent work (QA). Under the priority policy
    the more urgent ordinary head goes first; an equally urgent one still waits behind."""
    for urgent_priority, first in ((0, "r"), (10, "t2")):
        scheduler = sched(max_num_batched_tokens=8, max_num_seqs=1,
                          scheduling_policy="priority")
        executor = FakeExecutor(block_size=BS)
        history = first_turn(scheduler, executor)
        scheduler.add_request(turn("t2", history + prompt_of("t2", 4), arrival_time=5.0,
                                   priority=10))
        scheduler.add_request(make_request("r", 8, arrival_time=6.0,
                                           priority=urgent_priority))
        out, _ = step(scheduler, executor, 6.0)
        assert list(out.num_scheduled_tokens) == [first], urgent_priority
        run(scheduler, executor, 7.0)
        check_empty(scheduler)


def test_under_fair_share_a_less_served_tenant_goes_before_a_held_turn():  # T8 L1
    """A held turn went first under fair share whatever its tenant had been served: a
    tenant that made every request a session turn took the seats before a tenant with less
    service. Under VTC the held turn waits while the ordinary queue's next tenant has the
    smaller counter, and its admission is charged as a popped request's is (T3)."""
    for fairness, first in (("vtc", "b2"), (None, "t2")):
        settings = {"tenant_fairness": fairness} if fairness else {}
        scheduler = sched(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=1,
                          **settings)
        executor = FakeExecutor(block_size=BS)
        prompt = prompt_of("t1", 10)
        scheduler.add_request(turn("t1", prompt, tenant="a"))
        scheduler.add_request(make_request("b1", 2, max_tokens=3, ignore_eos=True,
                                           arrival_time=0.5, tenant="b"))
        run(scheduler, executor)  # a's turn, then b1: a has been served far more
        history = [*prompt, token_for("t1", 10), token_for("t1", 11), token_for("t1", 12)]
        scheduler.add_request(turn("t2", history + prompt_of("t2", 4), arrival_time=20.0,
                                   tenant="a"))
        scheduler.add_request(make_request("b2", 2, max_tokens=3, ignore_eos=True,
                                           arrival_time=20.5, tenant="b"))
        counters = dict(getattr(scheduler.waiting, "counters", {}))
        out, _ = step(scheduler, executor, 21.0)
        assert list(out.num_scheduled_tokens) == [first], fairness
        if fairness:
            assert counters["a"] > counters["b"]
            run(scheduler, executor, 22.0, until="b2")
            before = scheduler.waiting.counters["a"]
            step(scheduler, executor, 40.0)  # t2 admitted: its whole prompt, one output
            config = scheduler.config
            assert scheduler.waiting.counters["a"] == before + config.vtc_prompt_token_price \
                * (len(history) + 4) + config.vtc_output_token_price
        run(scheduler, executor, 41.0)
        check_empty(scheduler)


def test_a_held_turn_that_does_not_fit_blocks_the_line_and_is_logged():  # L1 D4
    scheduler, executor = sched(num_blocks=8, max_session_kv=0.5), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)  # 3 blocks held, 5 free
    scheduler.add_request(make_request("big", 18, max_tokens=20, ignore_eos=True))
    step(scheduler, executor, 1.0)  # big needs 5 blocks: fits without releasing
    scheduler.add_request(turn("t2", history + prompt_of("t2", 6), arrival_time=2.0))
    scheduler.add_request(make_request("r", 2, arrival_time=3.0))
    out, _ = step(scheduler, executor, 3.0)
    # t2 needs 2 more blocks (18 tokens) and none is free: it blocks, r waits behind it.
    assert list(out.num_scheduled_tokens) == ["big"]
    blocked = [(e.request_id, e.reason) for e in scheduler.take_events()
               if e.kind is EventType.BLOCKED]
    assert blocked == [("t2", "kv_cache")]
    run(scheduler, executor, 4.0)
    check_empty(scheduler)


def test_a_turn_that_does_not_extend_the_held_tokens_replaces_them():  # U3 G2
    """A regenerated or edited turn (its prompt is not the held tokens plus more) was a 400
    telling the client to DELETE the session first; chat clients send exactly that when a
    user regenerates an answer. It replaces the session now: the held KV is released
    (reason "replaced"), its full blocks stay cached, so the turn hits the prefix it shares,
    and the turn's own KV is held after it."""
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)  # 12 tokens held in 3 full blocks
    again = [*history[:10], 7]  # the conversation before the answer, then another answer
    scheduler.add_request(turn("again", again, arrival_time=5.0))
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.session_releases) == (0, {"replaced": 1})
    assert not scheduler.held_waiting and scheduler.requests["again"].num_computed_tokens == 0
    out, _ = step(scheduler, executor, 5.0)
    assert out.num_scheduled_tokens == {"again": 3}  # 8 tokens hit the released blocks
    run(scheduler, executor, 6.0)
    held = scheduler.sessions.held[("", "s")]
    assert held.token_ids[:11] == again and len(held.token_ids) == 11 + 3 - 1
    for name, prompt, params in (("short", held.token_ids, {}),  # adds nothing
                                 ("salted", [*held.token_ids, 5], {"cache_salt": "x"})):
        scheduler.add_request(turn(name, prompt, arrival_time=20.0, **params))
        assert scheduler.stats().num_sessions_held == 0, name  # replaced again
        run(scheduler, executor, 20.0)
    check_invariants(scheduler)


def test_a_refused_turn_leaves_its_session_held():  # U3 U4
    scheduler, executor = sched(max_model_len=16), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    with pytest.raises(RequestError, match="max_model_len"):  # refused after check_turn
        scheduler.add_request(turn("long", [*history[:5], *range(20)]))
    assert not scheduler.requests and scheduler.stats().num_session_blocks == 3
    assert scheduler.stats().session_releases == {}
    check_invariants(scheduler)


def test_one_turn_at_a_time_and_sessions_off_refuse():  # U4 U1
    scheduler = sched()
    scheduler.add_request(turn("a", prompt_of("a", 5)))
    with pytest.raises(SessionError, match="already has a turn in flight \\(a\\)"):
        scheduler.add_request(turn("b", [*prompt_of("a", 5), 1]))
    off = make_scheduler(20, BS)
    with pytest.raises(RequestError, match=r"sessions are off.*--max-session-kv"):
        off.add_request(turn("a", prompt_of("a", 5)))
    assert not off.requests


def test_sessions_are_tenant_scoped():  # U1
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    scheduler.add_request(turn("a", prompt_of("a", 5), tenant="alice"))
    scheduler.add_request(turn("b", prompt_of("b", 5), tenant="bob"))  # same id "s"
    run(scheduler, executor)
    assert sorted(scheduler.sessions.held) == [("alice", "s"), ("bob", "s")]
    assert scheduler.release_session("s", "carol") == 0
    assert scheduler.release_session("s", "alice") == 1
    assert sorted(scheduler.sessions.held) == [("bob", "s")]
    assert scheduler.release_session("s") == 1  # no tenant: every tenant's (an operator)
    assert not scheduler.sessions.sessions


def test_ttl_releases_into_the_prefix_cache():  # U6 G2
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    prompt = prompt_of("t1", 10)
    scheduler.add_request(turn("t1", prompt, session_ttl=5.0))
    run(scheduler, executor)  # finishes at step time 2.0 (prefill, 2 decodes)
    history = prompt + [token_for("t1", p) for p in (10, 11, 12)]
    assert scheduler.sessions.held[("", "s")].expires_at == 7.0
    scheduler.schedule(6.9)
    assert scheduler.stats().num_sessions_held == 1
    scheduler.take_events()
    scheduler.schedule(7.0)
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.num_free_blocks, stats.session_releases) == \
        (0, 20, {"ttl": 1})
    assert [(e.kind, e.request_id, e.reason) for e in scheduler.take_events()] == \
        [(EventType.RELEASED, "t1", "ttl")]
    # a later turn starts a new session and still hits the 3 cached blocks (12 tokens)
    scheduler.add_request(turn("t2", history + prompt_of("t2", 5), arrival_time=8.0))
    assert scheduler.requests["t2"] in scheduler.waiting
    run(scheduler, executor, 8.0)
    assert scheduler.stats().prefix_cache_hits == 12
    assert scheduler.stats().num_session_hits == 0


def test_a_turn_arriving_after_its_hold_expired_finds_none_without_a_step_between():  # U6
    """QA: the simulator does not step while idle, so a turn 10 s after one with a 1 s ttl
    took the hold the server (which releases between steps) had let go; the replay of a
    recording diverged. The arrival releases it first."""
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn_with_ttl(scheduler, executor, ttl=1.0)  # held until 3.0
    scheduler.take_events()
    scheduler.add_request(turn("t2", history + prompt_of("t2", 5), arrival_time=10.0))
    assert scheduler.requests["t2"] in scheduler.waiting  # not held: an ordinary turn
    released, arrived = scheduler.take_events()
    assert (released.kind, released.request_id, released.reason, released.time) == \
        (EventType.RELEASED, "t1", "ttl", 10.0)  # when it was noticed, not the last step
    assert (arrived.kind, arrived.request_id, arrived.reason) == (EventType.ARRIVED, "t2", "")
    run(scheduler, executor, 10.0)
    stats = scheduler.stats()
    assert (stats.num_session_hits, stats.prefix_cache_hits) == (0, 12)


def first_turn_with_ttl(scheduler, executor, ttl: float) -> list[int]:
    prompt = prompt_of("t1", 10)
    scheduler.add_request(turn("t1", prompt, session_ttl=ttl))
    run(scheduler, executor)  # finishes at step time 2.0
    return prompt + [token_for("t1", p) for p in (10, 11, 12)]


def test_the_bound_releases_the_oldest_hold_first():  # U5
    scheduler, executor = sched(max_session_kv=0.2), FakeExecutor()  # 4 blocks
    scheduler.add_request(turn("a", prompt_of("a", 10), session="A"))
    run(scheduler, executor)  # 3 blocks held
    scheduler.add_request(turn("b", prompt_of("b", 6), session="B"))
    run(scheduler, executor, 10.0)  # 8 tokens: 2 blocks; 3 + 2 > 4 releases A
    assert list(scheduler.sessions.held) == [("", "B")]
    scheduler.add_request(turn("c", prompt_of("c", 18), session="C"))
    run(scheduler, executor, 20.0)  # 20 tokens: 5 blocks > 4, never held
    stats = scheduler.stats()
    assert (list(scheduler.sessions.held), stats.num_session_blocks) == ([("", "B")], 2)
    assert stats.session_releases == {"limit": 2}
    assert ("", "C") not in scheduler.sessions.sessions


def test_sessions_sharing_a_system_prompt_count_its_blocks_once():  # U5 G2
    """Sessions opening with one system prompt share its blocks (prefix hits): the bound
    counts the blocks kept, each once (the sessions pass: counted per session, six such
    sessions released each other at 8% of the pool under a 30% bound)."""
    scheduler, executor = sched(num_blocks=40, max_session_kv=0.3), FakeExecutor()  # 12
    system = prompt_of("system", 16)  # 4 full blocks, cached after the first turn

    def open_sessions(indices: range) -> None:
        for index in indices:
            scheduler.add_request(turn(f"t{index}", [*system, *prompt_of(f"t{index}", 2)],
                                       session=f"S{index}", session_ttl=1000.0))
            run(scheduler, executor, 10.0 * index)
            check_invariants(scheduler)

    open_sessions(range(5))
    # each holds 20 tokens, 5 blocks: the 4 shared and one of its own -> 4 + 5 = 9 <= 12
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.num_session_blocks) == (5, 9)
    assert stats.session_releases == {}
    assert scheduler.sessions.blocks_by_tenant() == {"": 9}
    # three more: 12 blocks; the fourth past the bound releases the oldest hold, whose own
    # block is all it gives back (the shared four stay, kept by the others)
    open_sessions(range(5, 9))
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.num_session_blocks) == (8, 12)
    assert stats.session_releases == {"limit": 1} and ("", "S0") not in scheduler.sessions.held
    for key in list(scheduler.sessions.held):
        scheduler.sessions.release(key, "deleted")
    assert scheduler.stats().num_session_blocks == 0
    assert scheduler.sessions.blocks_by_tenant() == {}
    check_invariants(scheduler)


def test_the_bound_releases_the_tenant_holding_most_first():  # U5 U7
    """One tenant opening sessions released every other tenant's held KV (QA: the globally
    oldest hold went first): the tenant holding the most blocks, counting the turn about to
    be held, gives up its own oldest hold first; a tie falls to the oldest hold."""
    scheduler, executor = sched(num_blocks=40, max_session_kv=0.2), FakeExecutor()  # 8
    scheduler.add_request(turn("b1", prompt_of("b1", 6), session="B", tenant="bob",
                               session_ttl=1000.0))
    run(scheduler, executor)  # bob: 2 blocks, the oldest hold
    for index in range(4):  # alice: 2 blocks each
        scheduler.add_request(turn(f"a{index}", prompt_of(f"a{index}", 6),
                                   session=f"A{index}", tenant="alice", session_ttl=1000.0))
        run(scheduler, executor, 10.0 * (index + 1))
    assert list(scheduler.sessions.held) == [("bob", "B"), ("alice", "A1"), ("alice", "A2"),
                                             ("alice", "A3")]
    assert scheduler.stats().session_releases == {"limit": 1}
    scheduler.sessions.release_oldest()  # U7 likewise: alice holds 6 of the 8
    assert list(scheduler.sessions.held)[:2] == [("bob", "B"), ("alice", "A2")]
    check_invariants(scheduler)


def test_an_admission_releases_held_sessions_before_blocking():  # U7
    scheduler, executor = sched(num_blocks=8), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)  # 3 held, 5 free
    scheduler.add_request(make_request("big", 28, max_tokens=1))  # needs 7 blocks
    scheduler.take_events()
    out, _ = step(scheduler, executor, 5.0)
    assert out.num_scheduled_tokens == {"big": 28}
    assert scheduler.stats().session_releases == {"pressure": 1}
    assert [(e.kind, e.request_id, e.reason) for e in scheduler.take_events()] == \
        [(EventType.RELEASED, "t1", "pressure"), (EventType.ADMITTED, "big", ""),
         (EventType.FINISHED, "big", "length")]
    run(scheduler, executor, 6.0)
    check_empty(scheduler)
    # released into the cache (G2): big took the 5 hashless blocks, then t1's blocks 2 and
    # 1 (freed tail first, so evicted first); block 0 survives and a new turn hits it
    scheduler.add_request(turn("t2", [*history, 1], arrival_time=9.0))
    run(scheduler, executor, 9.0)
    assert scheduler.stats().prefix_cache_hits == 4


def test_a_growing_request_releases_sessions_before_preempting():  # U7 F1
    scheduler, executor = sched(num_blocks=6), FakeExecutor(block_size=BS)
    first_turn(scheduler, executor)  # 3 held, 3 free
    scheduler.add_request(make_request("g", 8, max_tokens=8, ignore_eos=True))
    run(scheduler, executor, 5.0)  # grows to 15 tokens: 4 blocks
    stats = scheduler.stats()
    assert (stats.num_preemptions, stats.session_releases) == (0, {"pressure": 1})


def test_pressure_demotes_a_waiting_turn_to_an_ordinary_request():  # U7 L1
    scheduler, executor = sched(num_blocks=8, max_session_kv=1.0), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)  # 3 blocks held, 5 free
    scheduler.add_request(make_request("g", 8, max_tokens=16, ignore_eos=True))
    step(scheduler, executor, 1.0)  # g: 2 blocks; 3 free
    scheduler.add_request(turn("t2", history + prompt_of("t2", 15), arrival_time=2.0))
    step(scheduler, executor, 2.0)  # t2: 28 tokens, holds 3 blocks, needs 4 more: waits
    assert list(scheduler.held_waiting) == [scheduler.requests["t2"]]
    scheduler.take_events()
    outputs = run(scheduler, executor, 3.0, until="g")
    # g grew into the 3 free blocks, then needed a sixth: t2 gave its 3 blocks back
    # (demoted to the ordinary queue, its KV still cached) and nobody was preempted.
    stats = scheduler.stats()
    assert (stats.num_preemptions, stats.session_releases) == (0, {"pressure": 1})
    assert ("released", "t2", "pressure") in [(e.kind, e.request_id, e.reason)
                                              for e in scheduler.take_events()]
    assert outputs["g"] == [token_for("g", p) for p in range(10, 24)]  # 2 came before
    outputs = run(scheduler, executor, 30.0)
    assert outputs["t2"] == [token_for("t2", p) for p in range(28, 31)]
    assert scheduler.stats().num_sessions_held == 1  # held again after its turn
    check_empty(scheduler)


def test_release_session_deletes_held_or_in_flight():  # U8
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    assert scheduler.release_session("s", "") == 1
    assert scheduler.release_session("s", "") == 0
    assert scheduler.stats().num_free_blocks == 20
    scheduler.add_request(turn("t2", [*history, 1]))  # a new session, as a first turn
    step(scheduler, executor, 1.0)
    assert scheduler.release_session("s", "") == 1  # in flight: runs on, not held
    run(scheduler, executor, 2.0)
    stats = scheduler.stats()
    assert (stats.num_sessions_held, stats.session_releases) == (0, {"deleted": 2})
    check_empty(scheduler)


def test_a_release_between_steps_is_logged_at_its_own_time():  # U8
    """The record -> replay pass: a DELETE on an idle engine logged its ``released`` event
    at the last step's time (the turn's hold), so a recording placed it before the client
    asked."""
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    first_turn(scheduler, executor)
    scheduler.take_events()
    assert scheduler.release_session("s", "", now=7.5) == 1
    [event] = scheduler.take_events()
    assert (event.kind, event.reason, event.time) == ("released", "deleted", 7.5)


def test_a_replaced_hold_is_logged_when_the_new_version_arrives():  # U3
    """The review: a turn that replaced its session's hold logged the release at the last
    step's time, before the turn that replaced it arrived."""
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    first_turn(scheduler, executor)
    scheduler.take_events()
    scheduler.add_request(turn("v2", prompt_of("v2", 10), arrival_time=9.0))
    released = [e for e in scheduler.take_events() if e.kind == "released"]
    assert [(e.request_id, e.reason, e.time) for e in released] == [("t1", "replaced", 9.0)]


def test_an_aborted_turn_ends_its_session_and_frees_its_blocks():  # U8 H4
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    scheduler.add_request(turn("t2", [*history, 1, 2]))
    assert scheduler.abort("t2") is True  # waiting in the held queue, holding 3 blocks
    stats = scheduler.stats()
    assert (stats.num_free_blocks, stats.session_releases) == (20, {"aborted": 1})
    assert not scheduler.held_waiting and not scheduler.sessions.sessions
    check_empty(scheduler)


def test_a_preempted_turn_recomputes_and_is_held_after():  # U8 F4 F2
    scheduler, executor = sched(num_blocks=7, max_session_kv=1.0), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)  # 3 held, 4 free
    scheduler.add_request(make_request("x", 8, max_tokens=8, ignore_eos=True))
    step(scheduler, executor, 1.0)  # x: 2 blocks, 2 free
    scheduler.add_request(turn("t2", history + prompt_of("t2", 1), max_tokens=10,
                               arrival_time=2.0))
    scheduler.take_events()
    outputs = run(scheduler, executor, 2.0)
    log = [(e.kind.value, e.request_id) for e in scheduler.take_events()]
    # t2 (admitted last, F2's victim) loses its KV when x grows, is readmitted with prefix
    # hits, and its finished turn is held again
    assert log.index(("preempted", "t2")) < log.index(("resumed", "t2")) < \
        log.index(("held", "t2"))
    assert ("preempted", "x") not in log
    assert outputs["t2"] == [token_for("t2", p) for p in range(14, 24)]
    assert outputs["x"] == [token_for("x", p) for p in range(9, 16)]
    check_empty(scheduler)


def test_held_blocks_are_not_evictable():  # U2 G2
    scheduler, executor = sched(num_blocks=20), FakeExecutor(block_size=BS)
    first_turn(scheduler, executor)
    held = scheduler.sessions.held[("", "s")].blocks
    assert all(b.ref_cnt == 1 and b.prev_free is None for b in held)
    assert scheduler.requests == {} and scheduler.kv.req_to_blocks == {}
    assert not set(scheduler.kv.pool.free_queue.block_ids()) & {b.block_id for b in held}


@st.composite
def conversations(draw: st.DrawFn) -> dict:
    turn_spec = st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 3),
                          st.sampled_from([None, 1.0, 3.0, 50.0]),
                          st.sampled_from(["run", "run", "run", "abort", "delete"]))
    return {"num_blocks": draw(st.integers(8, 40)),
            "max_session_kv": draw(st.sampled_from([0.25, 0.5, 1.0])),
            "conversations": draw(st.lists(st.lists(turn_spec, min_size=1, max_size=4),
                                           min_size=1, max_size=4))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
# a session held twice with one expiry (its turns on one clock tick): expired once (QA: the
# expiry heap released it twice, a KeyError)
@example({"num_blocks": 8, "max_session_kv": 0.25, "conversations": [[
    (1, 1, 0, 3.0, "run"), (1, 2, 0, 1.0, "run"), (1, 1, 0, None, "run")]]})
def test_random_conversations_leak_nothing_and_get_exact_answers(case):  # U2-U8 I1 L1
    """Random conversations, ttls, pressure (small pools), aborts and deletes: after every
    step the pool's accounting holds (free + referenced by requests + held by sessions),
    every held block belongs to a live idle session, the KV read back through every block
    table is right, and every completed turn's answer is exactly the fake model's."""
    scheduler = sched(case["num_blocks"], case["max_session_kv"])
    executor = FakeExecutor(block_size=BS)
    convs = [{"turns": turns, "next": 0, "prompt": [], "due": 0, "live": None}
             for turns in case["conversations"]]
    tokens: dict[str, list[int]] = {}
    for now in range(400):
        for index, conv in enumerate(convs):
            if conv["live"] is None and conv["next"] < len(conv["turns"]) and \
                    now >= conv["due"]:
                new, max_tokens, _, ttl, _ = conv["turns"][conv["next"]]
                request_id = f"c{index}t{conv['next']}"
                prompt = conv["prompt"] + prompt_of(request_id, new)
                request = turn(request_id, prompt, session=f"S{index}", max_tokens=max_tokens,
                               arrival_time=float(now), session_ttl=ttl)
                try:
                    scheduler.add_request(request)
                except RequestError as error:
                    assert "pool" in str(error) or "max_model_len" in str(error), error
                    conv["next"] = len(conv["turns"])
                    continue
                conv["live"], conv["sent"] = request_id, prompt
        out = scheduler.schedule(float(now))
        for index, conv in enumerate(convs):  # aborts and deletes land mid-turn
            if conv["live"] is not None and conv["live"] in scheduler.requests:
                action = conv["turns"][conv["next"]][4]
                if action == "abort" and now % 2:
                    scheduler.abort(conv["live"], float(now))
                elif action == "delete" and now % 3 == 0:
                    scheduler.release_session(f"S{index}", "")
        results = scheduler.update(out, executor.execute(out), float(now))
        check_invariants(scheduler)
        finished = {r.request_id: r for r in results if r.finished}
        for result in results:
            tokens.setdefault(result.request_id, []).extend(result.new_token_ids)
        for conv in convs:
            live = conv["live"]
            if live is None or live in scheduler.requests:
                continue
            result = finished.get(live)
            answer = tokens.pop(live, [])
            if result is not None and result.finish_reason == "length":
                start = len(conv["sent"])
                assert answer == [token_for(live, p) for p in range(start, start + len(answer))]
                conv["prompt"] = conv["sent"] + answer
            else:  # aborted: the client resends what it had
                conv["prompt"] = conv["sent"]
            think = conv["turns"][conv["next"]][2]
            conv["live"], conv["next"], conv["due"] = None, conv["next"] + 1, now + 1 + think
        if not scheduler.has_unfinished_requests() and \
                all(c["next"] >= len(c["turns"]) for c in convs):
            break
    else:
        raise AssertionError("conversations left")
    while scheduler.sessions.release_oldest():
        pass
    check_empty(scheduler)
    assert scheduler.stats().num_free_blocks == case["num_blocks"]


def test_a_turn_stopped_by_a_stop_string_holds_only_its_prompt():  # U2
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    prompt = prompt_of("t1", 10)
    scheduler.add_request(turn("t1", prompt, max_tokens=8))
    step(scheduler, executor, 0.0)
    step(scheduler, executor, 1.0)  # 2 answer tokens; the server's text matched "###"
    scheduler.finish_request("t1", RequestStatus.FINISHED_STOPPED, stop_reason="###")
    held = scheduler.sessions.held[("", "s")]
    assert held.token_ids == prompt and len(held.blocks) == 3  # 10 tokens: 3 blocks
    check_invariants(scheduler)


def test_a_waiting_held_turn_counts_as_waiting():  # L1
    scheduler, executor = sched(), FakeExecutor(block_size=BS)
    history = first_turn(scheduler, executor)
    scheduler.add_request(turn("t2", [*history, 1], tenant=""))
    stats = scheduler.stats()
    assert (stats.num_waiting, stats.num_waiting_by_tenant) == (1, {"": 1})


def admissions_with_held_turns(sessions: str, limit: int, plain_priority: int = 0,
                               **config: object) -> list[str]:
    """Each of ``sessions`` runs a first turn, held afterwards; then a plain request "r"
    (``plain_priority``) waits, and every session's next turn arrives behind it: the order
    in which they are admitted, with max_held_first ``limit``, one seat."""
    scheduler = sched(num_blocks=80, max_num_batched_tokens=64, max_num_seqs=1,
                      max_held_first=limit, session_ttl_s=600.0, **config)  # held at 51 s
    executor = FakeExecutor(block_size=BS)
    histories = {}
    for name in sessions:
        prompt = prompt_of(name, 6)
        scheduler.add_request(turn(f"{name}1", prompt, session=name))
        run(scheduler, executor)
        histories[name] = [*prompt, *(token_for(f"{name}1", 6 + i) for i in range(3))]
    scheduler.add_request(make_request("r", 8, max_tokens=1, arrival_time=50.0,
                                       priority=plain_priority))
    for name in sessions:
        scheduler.add_request(turn(f"{name}2", histories[name] + prompt_of(name, 2),
                                   session=name, max_tokens=1, arrival_time=51.0))
    admitted = []
    for n in range(40):
        out, _ = step(scheduler, executor, 52.0 + n)
        admitted += [new.request_id for new in out.scheduled_new_reqs]
        if not scheduler.has_unfinished_requests():
            break
    check_invariants(scheduler)
    return admitted


def test_at_most_max_held_first_held_turns_go_before_a_waiting_request():  # L6 L1
    """QA: with held turns always first, a client sending turns back to back got 317
    requests served while a plain client got 21. With max_held_first K, once K held turns
    went ahead of the ordinary queue's waiting head, that head is served next; without it
    (0, the default) every held turn goes first (L1)."""
    assert admissions_with_held_turns("abc", 0) == ["a2", "b2", "c2", "r"]  # L1
    assert admissions_with_held_turns("abc", 2) == ["a2", "b2", "r", "c2"]  # L6
    assert admissions_with_held_turns("abc", 1) == ["a2", "r", "b2", "c2"]


def test_max_held_first_needs_sessions():
    from kvserve.core import ConfigError, SchedulerConfig

    with pytest.raises(ConfigError, match="max_held_first=2 bounds session turns"):
        SchedulerConfig(max_held_first=2)


def test_max_held_first_never_serves_a_less_urgent_request_first():  # L6 L5
    """QA: under the priority policy the bound let priority-5 requests go ahead of
    priority-0 held turns; it serves the ordinary head only where it is at least as
    urgent."""
    as_urgent = admissions_with_held_turns("ab", 1, 0, scheduling_policy="priority")
    less_urgent = admissions_with_held_turns("ab", 1, 5, scheduling_policy="priority")
    assert as_urgent == ["a2", "r", "b2"]  # as urgent: the bound serves it
    assert less_urgent == ["a2", "b2", "r"]  # less urgent: the held turns keep going first


def test_a_turn_demoted_for_an_ordinary_admission_is_queued_behind_it_not_lost():  # U7 I3
    """QA (core fuzz): the ordinary head's admission demoted a held waiting turn to the
    front of the ordinary queue, and the pop meant for the head took the turn instead: the
    turn was in no queue, never to finish, and the head was admitted twice."""
    from tests.conftest import run_to_completion

    scheduler = make_scheduler(num_blocks=8, block_size=4, max_session_kv=1.0,
                               max_held_first=1)
    executor = FakeExecutor(block_size=4)
    a1 = make_request("a1", 8, max_tokens=1, session_id="s1")
    c1 = make_request("c1", 8, max_tokens=1, session_id="s2")
    run_to_completion(scheduler, [a1, c1], executor=executor)  # 2 + 2 blocks held (U2)
    scheduler.add_request(make_request("a2", prompt_token_ids=a1.all_token_ids + [7] * 4,
                                       max_tokens=1, session_id="s1"))
    scheduler.add_request(make_request("x", 16, max_tokens=1))  # 4 blocks: needs c's
    scheduler.add_request(make_request("c2", prompt_token_ids=c1.all_token_ids + [7] * 4,
                                       max_tokens=1, session_id="s2"))
    out = scheduler.schedule(1.0)
    check_invariants(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a2", "x"]
    assert [r.request_id for r in scheduler.waiting] == ["c2"]  # demoted, at the front
    scheduler.update(out, executor.execute(out), 1.0)
    final = run_to_completion(scheduler, executor=executor)
    assert "c2" in final
    check_empty(scheduler)


def test_a_turn_ended_in_the_step_that_scheduled_it_holds_only_what_was_written():  # U2 H4
    """QA (core fuzz): a turn finished (a stop string, an abort) between schedule() and the
    update() of the step that scheduled its second chunk held both chunks for its session,
    and the next turn read the unwritten one."""
    from kvserve.core import ModelOutput
    from tests.conftest import run_to_completion

    scheduler = make_scheduler(num_blocks=50, block_size=4, max_session_kv=0.5,
                               max_num_batched_tokens=8, max_num_seqs=4)
    executor = FakeExecutor(block_size=4)
    a1 = make_request("a1", 16, max_tokens=4, session_id="s")
    scheduler.add_request(a1)
    step(scheduler, executor, 0.0)  # the first chunk, 8 tokens, written
    out = scheduler.schedule(1.0)  # the second scheduled ...
    scheduler.finish_request("a1", RequestStatus.FINISHED_STOPPED, now=1.0)
    scheduler.update(out, ModelOutput({}), 1.0)  # ... and never run
    a2 = make_request("a2", prompt_token_ids=[*a1.prompt_token_ids, 5, 6, 7], max_tokens=2,
                      session_id="s")
    final = run_to_completion(scheduler, [a2], executor=executor)  # reads back a2's KV
    assert len(final["a2"].new_token_ids) == 2
    check_empty(scheduler)


def test_a_held_turn_cannot_wait_not_ready_and_ready_is_always_taken():  # L1 L2
    """QA (core fuzz): set_not_ready was taken on a turn waiting with its session's KV,
    which was admitted regardless, and the flag could then not be cleared (a running
    request "is not waiting")."""
    from tests.conftest import run_to_completion

    scheduler = make_scheduler(num_blocks=50, block_size=4, max_session_kv=0.5)
    executor = FakeExecutor(block_size=4)
    first = make_request("t1", 8, max_tokens=1, session_id="s")
    run_to_completion(scheduler, [first], executor=executor)
    scheduler.add_request(make_request("t2", prompt_token_ids=[*first.all_token_ids, 9],
                                       max_tokens=1, session_id="s"))
    with pytest.raises(RequestError, match="'t2' is a session turn waiting with its "
                                           "session's KV"):
        scheduler.set_not_ready("t2", "input")
    with pytest.raises(RequestError, match="reason must be a non-empty string"):
        scheduler.set_not_ready("t2", "")
    scheduler.set_not_ready("t2", None)  # ready: always taken
    run_to_completion(scheduler, executor=executor)
    check_empty(scheduler)


@pytest.mark.parametrize("policy", ["reserve", "adaptive"])
def test_a_held_turn_is_admitted_on_the_reservation_of_what_runs_now(policy):  # L1 K2
    """QA (spec pass): the held pass read the admission policy's reservation for a running
    set of an earlier step (a request long finished), refused a turn that fit on every step,
    and the ordinary queue behind it (L1) waited for ever with half the pool free."""
    scheduler = sched(num_blocks=10, max_session_kv=1.0, max_num_seqs=2, max_model_len=64,
                      admission_policy=policy, session_ttl_s=3600.0)
    executor = FakeExecutor(block_size=BS)
    prompt = prompt_of("t1", 7)
    scheduler.add_request(turn("t1", prompt, max_tokens=2))
    run(scheduler, executor)  # 8 tokens held: 2 blocks
    history = [*prompt, token_for("t1", 7), token_for("t1", 8)]
    scheduler.add_request(make_request("big", 3, max_tokens=30, ignore_eos=True,
                                       arrival_time=10.0))
    run(scheduler, executor, 10.0)  # reserved for (7 blocks), and finished
    assert scheduler.sessions.num_held_blocks == 2
    scheduler.add_request(turn("t2", history + prompt_of("t2", 4), arrival_time=60.0))
    scheduler.add_request(make_request("other", 4, max_tokens=3, ignore_eos=True,
                                       arrival_time=60.0))
    assert set(run(scheduler, executor, 60.0, max_steps=20)) == {"t2", "other"}


def test_a_turn_the_pool_capped_holds_all_it_computed():  # U2 J2
    """QA (spec pass): a turn stopped by the pool's size (J2: finish length, stop reason
    "kv_capacity") was taken for one a stop string ended and held its prompt only."""
    scheduler, executor = sched(num_blocks=8, max_session_kv=1.0), FakeExecutor(block_size=BS)
    scheduler.add_request(turn("t1", prompt_of("t1", 10), max_tokens=100))
    run(scheduler, executor)
    [held] = scheduler.sessions.held.values()
    assert len(held.token_ids) == 32  # the whole pool: 10 prompt + 23 out - 1


@pytest.mark.parametrize(("running", "urgent_len", "preempted", "held_after"), [
    # QA (spec pass): both preempted while an idle session kept its 4 blocks; the seat
    # takes one victim, and the held KV gives way before a second (U7: before anything)
    ({"lo1": 20, "lo2": 20}, 22, ["lo2"], 0),
    # QA (session 47's review): the one qualifying victim too small to make room, the
    # arrival waited while the session's 4 blocks, with the victim's, would have made it
    ({"lo": 20, "hi": 0}, 22, ["lo"], 0),
    # QA (session 48's review): where even those together leave no room (8 blocks wanted,
    # 7 freed), the holds were released for nothing: kept now
    ({"lo": 20, "hi": 0}, 30, [], 4),
    # where no running request may be preempted, releasing the holds frees no seat: the
    # session keeps its KV and the arrival waits
    ({"a": 0, "b": 0}, 22, [], 4),
])
def test_an_urgent_arrival_releases_held_kv_only_where_that_helps(
        running, urgent_len, preempted, held_after):  # U7 M1
    scheduler = sched(num_blocks=10, max_session_kv=1.0, max_num_seqs=2, max_model_len=64,
                      scheduling_policy="priority", enable_priority_preemption=True)
    executor = FakeExecutor(block_size=BS)
    scheduler.add_request(turn("t1", prompt_of("t1", 15), max_tokens=2, priority=20))
    run(scheduler, executor)
    assert scheduler.sessions.num_held_blocks == 4
    for index, (name, priority) in enumerate(running.items()):
        scheduler.add_request(make_request(name, 11, max_tokens=100, ignore_eos=True,
                                           priority=priority, arrival_time=5.0 + index / 2))
    step(scheduler, executor, 6.0)
    assert scheduler.kv.num_free_blocks == 0
    scheduler.add_request(make_request("urgent", urgent_len, max_tokens=5, ignore_eos=True,
                                       priority=0, arrival_time=7.0))
    out, _ = step(scheduler, executor, 7.0)
    assert list(out.preempted_req_ids) == preempted
    assert [new.request_id for new in out.scheduled_new_reqs] == (["urgent"] if preempted
                                                                   else [])
    assert scheduler.sessions.num_held_blocks == held_after
    check_invariants(scheduler)
