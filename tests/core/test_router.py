"""The data-parallel router (spec R1-R6): exact decisions per policy, and properties over
random load sequences (no policy picks a dead replica; prefix-affinity keeps its bound)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.errors import ConfigError
from kvserve.core.prefix_cache import extend_block_hashes, prompt_block_hashes
from kvserve.core.router import (
    ROUTER_POLICIES,
    NoReplicaError,
    ReplicaLoad,
    RouteDecision,
    load_score,
    make_router,
)
from tests.conftest import make_request


def loads(*specs: tuple[int, int] | None, kv: float = 0.0) -> list[ReplicaLoad]:
    """One (num_running, num_waiting) per replica, or None for a dead one."""
    return [ReplicaLoad(i, spec is not None, *(spec or (0, 0)), kv) for i, spec in
            enumerate(specs)]


IDLE3 = loads((0, 0), (0, 0), (0, 0))


def test_round_robin_cycles_in_order_r2() -> None:
    router = make_router("round-robin", 3)
    picks = [router.route([], IDLE3) for _ in range(7)]
    assert [d.replica for d in picks] == [0, 1, 2, 0, 1, 2, 0]
    assert {d.reason for d in picks} == {"round_robin"}


def test_round_robin_skips_dead_and_resumes_after_pick_r1_r2() -> None:
    router = make_router("round-robin", 4)
    one_dead = loads((0, 0), None, (0, 0), (0, 0))
    # 0, then 1 is dead -> 2, then 3, then 0
    assert [router.route([], one_dead).replica for _ in range(4)] == [0, 2, 3, 0]
    all_alive = loads((0, 0), (0, 0), (0, 0), (0, 0))
    assert router.route([], all_alive).replica == 1


def test_every_policy_raises_when_all_dead_r1() -> None:
    for policy in ROUTER_POLICIES:
        with pytest.raises(NoReplicaError, match="all 2 replicas are down"):
            make_router(policy, 2).route([b"a"], loads(None, None))


def test_load_score_weighs_waiting_four_times_r3() -> None:
    assert load_score(ReplicaLoad(0, True, num_running=3, num_waiting=2, kv_usage=0.9)) == 11


def test_least_loaded_picks_lowest_score_then_kv_usage_r3() -> None:
    router = make_router("least-loaded", 3)
    # scores: 4*1+0=4, 0*4+5=5, 4*0+3=3
    assert router.route([], loads((0, 1), (5, 0), (3, 0))) == RouteDecision(2, "least_loaded")
    tied = [ReplicaLoad(0, True, 2, 0, 0.5), ReplicaLoad(1, True, 2, 0, 0.25),
            ReplicaLoad(2, True, 2, 0, 0.75)]
    assert router.route([], tied) == RouteDecision(1, "least_loaded")


def test_least_loaded_rotates_exact_ties_r3() -> None:
    router = make_router("least-loaded", 3)
    # Loads unchanged between calls (a burst before the next report): ties spread out.
    assert [router.route([], IDLE3).replica for _ in range(4)] == [0, 1, 2, 0]


def test_least_loaded_never_picks_dead_even_if_idle_r1() -> None:
    router = make_router("least-loaded", 3)
    assert router.route([], loads(None, (9, 1), (4, 2))).replica == 2  # 13 vs 12


def test_prefix_affinity_returns_to_longest_match_r4() -> None:
    router = make_router("prefix-affinity", 3)
    assert router.route([b"a", b"b"], IDLE3) == RouteDecision(0, "least_loaded")
    assert router.route([b"x"], IDLE3) == RouteDecision(1, "least_loaded")
    # shares b"a" with the first: back to replica 0
    assert router.route([b"a", b"c"], IDLE3) == RouteDecision(0, "prefix_hit")
    # b"a" was last sent to 0, b"a", b"b" too: longest match is still 0
    assert router.route([b"a", b"b", b"d"], IDLE3) == RouteDecision(0, "prefix_hit")
    assert router.route([b"x", b"y"], IDLE3) == RouteDecision(1, "prefix_hit")
    assert router.route([b"z"], IDLE3) == RouteDecision(2, "least_loaded")


def test_prefix_affinity_longest_match_wins_over_shorter_owner_r4() -> None:
    router = make_router("prefix-affinity", 2)
    router.route([b"a"], loads((0, 0), (0, 0)))               # a -> 0
    router.route([b"a", b"b"], loads((0, 0), (5, 0)))         # prefix hit: a, b -> 0
    router.route([b"q"], loads((9, 0), (0, 0)))               # q -> 1
    router.route([b"a"], loads((30, 0), (0, 0)))              # imbalance: a -> 1
    # a is now owned by 1, a+b still by 0: the longer match decides
    assert router.route([b"a", b"b"], loads((0, 0), (0, 0))) == RouteDecision(0, "prefix_hit")


def test_prefix_affinity_bound_is_inclusive_then_falls_back_r4() -> None:
    router = make_router("prefix-affinity", 2, imbalance_bound=4)
    router.route([b"p"], loads((0, 0), (0, 0)))               # p -> 0
    # owner score 4 (one waiting), least 0: difference 4 <= 4 -> stays
    assert router.route([b"p"], loads((0, 1), (0, 0))) == RouteDecision(0, "prefix_hit")
    # owner score 5: over the bound -> least-loaded replica 1
    assert router.route([b"p"], loads((1, 1), (0, 0))) == RouteDecision(1, "imbalance")
    # and p now follows replica 1, where it was last sent
    assert router.route([b"p"], loads((0, 0), (0, 0))) == RouteDecision(1, "prefix_hit")


def test_prefix_affinity_ignores_dead_owner_r1_r4() -> None:
    router = make_router("prefix-affinity", 2)
    router.route([b"p"], loads((0, 0), (0, 0)))
    assert router.route([b"p"], loads(None, (3, 0))) == RouteDecision(1, "least_loaded")


def test_forget_replica_drops_its_affinity_r5() -> None:
    router = make_router("prefix-affinity", 2)
    router.route([b"p"], loads((0, 0), (0, 0)))               # p -> 0
    router.route([b"q"], loads((1, 0), (0, 0)))               # q -> 1
    router.forget_replica(0)
    # p is unknown now (it would have stayed on 0: 2 - 0 <= 16); q still hits on 1
    assert router.route([b"p"], loads((2, 0), (0, 0))) == RouteDecision(1, "least_loaded")
    assert router.route([b"q"], loads((0, 0), (0, 0))) == RouteDecision(1, "prefix_hit")
    with pytest.raises(ValueError, match=r"replica 2 out of range 0\.\.1"):
        router.forget_replica(2)


def test_prefix_affinity_forgets_least_recently_routed_past_capacity_r4() -> None:
    router = make_router("prefix-affinity", 2, max_tracked_blocks=2)
    router.route([b"a"], loads((0, 0), (0, 0)))               # a -> 0
    router.route([b"b"], loads((1, 0), (0, 0)))               # b -> 1
    router.route([b"a"], loads((0, 0), (5, 0)))               # a refreshed on 0
    router.route([b"c"], loads((0, 0), (5, 0)))               # c -> 0; b (oldest) forgotten
    assert router.route([b"b"], loads((5, 0), (0, 0))) == RouteDecision(1, "least_loaded")
    assert router.route([b"c"], loads((0, 0), (1, 0))) == RouteDecision(0, "prefix_hit")


def test_route_refuses_loads_that_do_not_match_replicas() -> None:
    router = make_router("least-loaded", 2)
    with pytest.raises(ValueError, match="router for 2 replicas got 1 loads"):
        router.route([], loads((0, 0)))
    swapped = [ReplicaLoad(1, True, 0, 0, 0.0), ReplicaLoad(0, True, 0, 0, 0.0)]
    with pytest.raises(ValueError, match=r"loads\[0\] describes replica 1"):
        router.route([], swapped)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "random"}, "unknown router 'random'; choose from round-robin, least-loaded"),
    ({"num_replicas": 0}, "data-parallel size must be an integer >= 1, got 0"),
    ({"imbalance_bound": -1}, "imbalance bound must be an integer >= 0, got -1"),
    ({"max_tracked_blocks": 0}, "max tracked blocks must be an integer >= 1, got 0"),
])
def test_make_router_refuses_bad_config(kwargs: dict, message: str) -> None:
    args = {"policy": "prefix-affinity", "num_replicas": 2} | kwargs
    with pytest.raises(ConfigError, match=message):
        make_router(args.pop("policy"), args.pop("num_replicas"), **args)


def test_prompt_block_hashes_equal_the_prefix_cache_hashes_g3() -> None:
    request = make_request("r", 70, cache_salt="tenant-a")
    expected = extend_block_hashes(request, 16, 70)
    assert len(expected) == 4
    assert prompt_block_hashes(request.prompt_token_ids, 16, "tenant-a") == expected
    assert prompt_block_hashes(request.prompt_token_ids, 16) != expected  # salt in block 0
    assert prompt_block_hashes(request.prompt_token_ids[:15], 16) == []


# -- properties ------------------------------------------------------------------------------

replica_state = st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 10)))


@st.composite
def routing_runs(draw: st.DrawFn) -> tuple[str, int, int, list]:
    num_replicas = draw(st.integers(1, 5))
    steps = draw(st.lists(st.tuples(
        st.lists(replica_state, min_size=num_replicas, max_size=num_replicas),
        st.lists(st.integers(0, 5), max_size=6),        # a request's prefix, from 6 tokens
        st.integers(-1, num_replicas - 1)), min_size=1, max_size=40))  # forget one, or -1
    return draw(st.sampled_from(ROUTER_POLICIES)), num_replicas, draw(st.integers(0, 12)), steps


@settings(max_examples=300, deadline=None)
@given(routing_runs())
def test_no_dead_replica_and_affinity_within_bound_r1_r4(run: tuple) -> None:
    policy, num_replicas, bound, steps = run
    router = make_router(policy, num_replicas, imbalance_bound=bound, max_tracked_blocks=8)
    for states, tokens, forget in steps:
        current = loads(*states)
        hashes = [bytes(tokens[:i + 1]) for i in range(len(tokens))]  # chained, like blocks
        if forget >= 0:
            router.forget_replica(forget)
        if not any(load.alive for load in current):
            with pytest.raises(NoReplicaError):
                router.route(hashes, current)
            continue
        decision = router.route(hashes, current)
        chosen = current[decision.replica]
        assert chosen.alive
        least = min(load_score(load) for load in current if load.alive)
        if policy == "prefix-affinity":
            assert load_score(chosen) - least <= bound
            if decision.reason != "prefix_hit":
                assert load_score(chosen) == least
        elif policy == "least-loaded":
            assert load_score(chosen) == least


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_a_session_turn_goes_where_its_session_is_r6(policy: str) -> None:
    router = make_router(policy, 3)
    first = router.route([], IDLE3, session=("t", "chat"))
    busy = [ReplicaLoad(i, True, 9 if i == first.replica else 0, 9 if i == first.replica
                        else 0, 0.9 if i == first.replica else 0.0) for i in range(3)]
    again = router.route([], busy, session=("t", "chat"))
    assert again == RouteDecision(first.replica, "session")  # load does not move it
    other = router.route([], busy, session=("u", "chat"))  # another tenant's "chat"
    assert other.reason != "session"


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_a_session_whose_replica_died_is_routed_afresh_r5_r6(policy: str) -> None:
    router = make_router(policy, 2)
    home = router.route([], loads((0, 0), (0, 0)), session="s").replica
    dead = [ReplicaLoad(i, i != home, 0, 0, 0.0) for i in range(2)]
    moved = router.route([], dead, session="s")
    assert moved.reason != "session" and moved.replica == 1 - home
    assert router.route([], loads((0, 0), (0, 0)), session="s") == \
        RouteDecision(1 - home, "session")  # remembered where it went
    router.forget_replica(1 - home)
    assert router.route([], loads((0, 0), (0, 0)), session="s").reason != "session"


def test_at_most_max_tracked_sessions_are_remembered_least_recent_first_out_r6() -> None:
    router = make_router("round-robin", 2)
    router.max_tracked_sessions = 2
    for name in ("a", "b"):
        router.route([], loads((0, 0), (0, 0)), session=name)
    router.route([], loads((0, 0), (0, 0)), session="a")  # a is the most recent now
    router.route([], loads((0, 0), (0, 0)), session="c")  # b goes
    reasons = {name: router.route([], loads((0, 0), (0, 0)), session=name).reason
               for name in ("a", "c", "b")}
    assert reasons == {"a": "session", "c": "session", "b": "round_robin"}


def test_prefix_affinity_learns_the_prefixes_of_session_turns_r4_r6() -> None:
    router = make_router("prefix-affinity", 2)
    home = router.route([b"x"], loads((0, 0), (0, 0)), session="s").replica
    turn = router.route([b"x", b"y"], loads((0, 0), (0, 0)), session="s")
    assert turn == RouteDecision(home, "session")
    # an ordinary request sharing the turn's prefix goes where the turn's blocks are
    assert router.route([b"x", b"y"], loads((0, 0), (0, 0))) == RouteDecision(home, "prefix_hit")


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_a_refused_request_leaves_the_router_as_it_found_it_r7(policy: str) -> None:
    """QA (data-parallel fuzz): a session's first turn refused by its replica (queue full)
    pinned the session there, and its prefix pointed there, though neither ran."""
    router = make_router(policy, 2)
    idle = loads((0, 0), (0, 0))
    refused = router.route([b"p", b"q"], idle, session="s")
    router.withdraw(refused, [b"p", b"q"], session="s")
    assert router.route([], loads((0, 0), (0, 0)), session="s").reason != "session"
    if policy == "prefix-affinity":
        assert router.route([b"p", b"q"], idle).reason == "least_loaded"  # not a hit


def test_withdraw_restores_what_the_router_knew_before_r7() -> None:
    router = make_router("prefix-affinity", 2)
    idle = loads((0, 0), (0, 0))
    home = router.route([b"a"], idle, session="s").replica  # s and a live on home
    busy_home = [ReplicaLoad(i, True, 40 if i == home else 0, 0, 0.0) for i in range(2)]
    dead_home = [ReplicaLoad(i, i != home, 0, 0, 0.0) for i in range(2)]
    moved = router.route([b"a", b"b"], dead_home, session="s")  # home down: elsewhere
    assert moved.replica == 1 - home
    router.withdraw(moved, [b"a", b"b"], session="s")  # refused there
    assert router.route([b"a"], idle) == RouteDecision(home, "prefix_hit")
    assert router.route([], idle, session="s") == RouteDecision(home, "session")
    # withdraw undoes only what its own route taught and nothing has taught since (QA,
    # review: a later accepted request's prefix, or a running turn's session pin, was
    # undone by an earlier refused one's withdrawal)
    first = router.route([b"c"], busy_home)
    second = router.route([b"c"], busy_home)
    assert first.replica == second.replica == 1 - home
    router.withdraw(first, [b"c"])
    assert router.route([b"c"], idle) == RouteDecision(1 - home, "prefix_hit")
    refused = router.route([b"d"], busy_home)  # to 1 - home
    only_home = [ReplicaLoad(i, i == home, 0, 0, 0.0) for i in range(2)]
    assert router.route([b"d"], only_home).replica == home  # d now points at home
    router.withdraw(refused, [b"d"])
    assert router.route([b"d"], idle) == RouteDecision(home, "prefix_hit")
    turn_a = router.route([], idle, session="t")  # a first turn, then a second one on it
    turn_b = router.route([], idle, session="t")
    assert turn_b == RouteDecision(turn_a.replica, "session")
    router.withdraw(turn_a, [], session="t")  # the first refused, the second running
    assert router.route([], idle, session="t") == RouteDecision(turn_a.replica, "session")
