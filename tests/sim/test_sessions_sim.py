"""Sessions in the simulator (docs/scheduler.md, U): the trace's ``session_id``, turns sent
only after the previous answer (closed loop), held KV with --max-session-kv, and reports
unchanged when no session is named."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.sim.trace import parse_request
from kvserve.sim.workloads import WorkloadSpec, generate

from .helpers import aggregate, by_id, req, simulate


def conversation(turns: int = 3, sessions: bool = True) -> list:
    spec = WorkloadSpec(num_requests=turns, rate=1.0, turns=f"fixed:{turns}", think_time=0.0,
                        prompt_len="fixed:40", output_len="fixed:8", sessions=sessions)
    return generate(spec)


def test_trace_session_fields_round_trip_and_are_checked():  # U1
    row = {"request_id": "a", "arrival_time": 0, "prompt_len": 4, "output_len": 1,
           "session_id": "s", "session_ttl": 5}
    request = parse_request(row)
    assert (request.session_id, request.session_ttl) == ("s", 5.0)
    assert request.to_json()["session_id"] == "s"
    assert request.sampling_params(64).session_id is None  # sessions off: not named
    assert request.sampling_params(64, True).session_ttl == 5.0
    for bad in ({"session_id": None}, {"session_ttl": 0}, {"session_ttl": -1},
                {"session_ttl": 86401}, {"session_ttl": True}):  # one message for all (QA)
        with pytest.raises(ValueError, match=r"session_ttl must be a number of seconds in "
                                             r"\(0, 86400\], with a session_id"):
            parse_request({**row, **bad})
    with pytest.raises(ValueError, match="session_id must be a non-empty string"):
        parse_request({**row, "session_id": ""})


def test_a_session_ended_by_its_client_releases_its_hold_then():  # U8
    """The record -> replay pass: a DELETE /v1/sessions was in no trace, so the replay held
    the session's KV on (to the end, or until a later turn replaced it) where the server had
    released it. ``session_end_time`` on the turn the client ended the session after."""
    from kvserve.sim.cluster import ClusterOptions
    from kvserve.sim.deployment import Deployment

    row = {"request_id": "a", "arrival_time": 0, "prompt_len": 40, "output_len": 8,
           "session_id": "s", "session_end_time": 5}
    assert parse_request(row).session_end_time == 5.0
    assert parse_request(row).to_json()["session_end_time"] == 5.0
    with pytest.raises(ValueError, match="session_end_time needs a session_id"):
        parse_request({**row, "session_id": None})
    with pytest.raises(ValueError, match="session_end_time 1 is before arrival_time 2"):
        parse_request({**row, "arrival_time": 2, "session_end_time": 1})  # the review
    a = req("a", 40, 8, session_id="s", session_end_time=5.0)
    b = req("b", 10, 4, arrival=9.0)  # after the end: the hold is gone
    for cluster in (None, ClusterOptions(2, "round-robin")):
        result = Deployment(cost_model="unit").simulate(
            [a, b], {"max_session_kv": 0.5, "num_kv_blocks": 200}, cluster=cluster)[1]
        sessions = aggregate(result)["sessions"]
        assert sessions["session_releases"] == {"deleted": 1}, cluster
        assert sessions["sessions_held_at_end"] == 0, cluster
    kept = simulate([dataclasses.replace(a, session_end_time=None), b], max_session_kv=0.5)
    assert aggregate(kept)["sessions"]["sessions_held_at_end"] == 1  # as before: held on


@pytest.mark.parametrize("busy", [False, True])
def test_a_session_end_comes_after_the_turn_that_arrived_before_it(busy):  # U8
    """The review: the simulator applied a session end at once and handed the arrivals
    before it over later, so a turn that came just before its client's DELETE on a busy
    engine (the DELETE ending it in flight) was released ahead of it and then held on; the
    engine applies the add and then the DELETE."""
    from kvserve.sim.cluster import ClusterOptions
    from kvserve.sim.deployment import Deployment

    a = req("a", 40, 1, session_id="s", session_end_time=2.2)
    c = req("c", 30, 2, arrival=2.1, session_id="s")  # a new version, in flight at the end
    trace = [a, *([req("x", 40, 10, arrival=0.5)] if busy else []), c]
    for cluster in (None, ClusterOptions(1, "round-robin"), ClusterOptions(2, "round-robin")):
        result = Deployment(cost_model="unit").simulate(
            trace, {"max_session_kv": 0.5, "num_kv_blocks": 200}, cluster=cluster)[1]
        sessions = aggregate(result)["sessions"]
        assert sessions["session_releases"] == {"replaced": 1, "deleted": 1}, cluster
        assert sessions["sessions_held_at_end"] == 0, cluster


def test_a_session_end_waits_for_its_turn_in_a_slower_run():  # U8
    """The review: an end fired at its recorded time whether or not its turn had come; in
    a slower run, whose closed loop holds turn b until a finishes, it ended a's session in
    flight and b, arriving later, was held to the end where the server released it."""
    from kvserve.sim.cluster import ClusterOptions
    from kvserve.sim.deployment import Deployment

    a = req("a", 40, 8, session_id="s")
    b = req("b", 10, 4, arrival=1.0, session_id="s", session_end_time=2.0)
    for cluster in (None, ClusterOptions(2, "round-robin")):
        result = Deployment(cost_model="unit").simulate(
            [a, b], {"max_session_kv": 0.5, "num_kv_blocks": 200}, cluster=cluster)[1]
        sessions = aggregate(result)["sessions"]
        assert sessions["sessions_held_at_end"] == 0, cluster
        assert sessions["session_releases"].get("deleted") == 1, cluster


def test_the_generator_names_sessions_only_when_asked():
    assert [r.session_id for r in conversation()] == ["conv0"] * 3
    assert all("session_id" not in r.to_json() for r in conversation(sessions=False))


def test_a_turn_waits_for_the_previous_answer_and_starts_from_held_kv():  # U2 U3 L1
    trace = conversation()  # think time 0: every turn's trace arrival is t=0
    off, on = simulate(trace), simulate(trace, max_session_kv=0.5)
    for result in (off, on):
        rows = by_id(result)
        # closed loop: each turn arrives when the previous one finished
        assert rows["c0-t1"].arrival_time == rows["c0-t0"].metrics.finished_time
        assert rows["c0-t2"].arrival_time == rows["c0-t1"].metrics.finished_time
    # same answers; with sessions on the later turns start from the held tokens
    assert [r.num_output_tokens for r in on.records] == [r.num_output_tokens
                                                          for r in off.records]
    hits = [by_id(on)[f"c0-t{t}"].metrics.num_cached_tokens for t in range(3)]
    lengths = [r.num_prompt_tokens for r in trace]
    assert hits == [0, lengths[0] + 8, lengths[1] + 8]  # prompt + answer (EOS not computed)
    report = aggregate(on)
    assert report["sessions"] == {"session_hits": 2, "session_hit_tokens": sum(hits),
                                  "sessions_held_at_end": 1, "session_releases": {},
                                  "session_fallbacks": 0, "turns_deferred": 2}
    assert "sessions" not in aggregate(off)


def test_a_trace_without_sessions_reports_as_before():
    trace = [req(f"r{i}", 40, 8, i * 0.1) for i in range(6)]
    assert aggregate(simulate(trace)) == aggregate(simulate(trace, max_session_kv=0.0))


def test_a_turn_waits_for_its_previous_one_in_a_cluster_too():
    """Closed loop (kvserve.sim.conversations) across replicas: b, the next turn of a's
    session sent while a still runs, arrives when a finishes (t=4 under the unit model: a
    prefill and 3 tokens + EOS), whichever replica each runs on; one engine and two
    replicas then see the same client (the cluster used to send b at once)."""
    from kvserve.core import CacheConfig, SchedulerConfig
    from kvserve.sim.cluster import ClusterOptions, ClusterSimulator
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    trace = [req("a", 16, 3, session_id="s"), req("b", 40, 2, arrival=0.5, session_id="s"),
             req("c", 16, 3, arrival=1.0, session_id="s", cancel_time=2.0)]
    cluster = ClusterSimulator(Simulator(SchedulerConfig(), CacheConfig(100), UnitCostModel()),
                               ClusterOptions(2, "round-robin"),
                               [UnitCostModel(), UnitCostModel()])
    for result in (simulate(trace), cluster.run(trace)):
        records = by_id(result)
        assert records["b"].arrival_time == 4.0 and records["b"].finish_reason == "stop"
        assert records["c"].finish_reason == "abort"  # cancelled while it waited



def test_a_cluster_holds_session_kv_on_the_replica_that_ran_the_turn():  # U2 U3 R6
    """Each replica holds its own sessions, as the server's replicas do, and a session's
    turns follow it (R6) under every router: round robin too keeps the conversation on the
    replica that holds its KV, and each turn starts from it as on one engine (before R6
    round robin sent turn 1 to the other replica, which prefilled all of it). Each turn
    after the first is routed by its session."""
    from kvserve.sim.cluster import ClusterOptions
    from kvserve.sim.deployment import Deployment

    trace = conversation()
    settings = {"max_session_kv": 0.5, "num_kv_blocks": 200, "enable_prefix_caching": False}
    one = Deployment(cost_model="unit").simulate(trace, settings)[1]
    hits = [r.metrics.num_cached_tokens for r in one.records]
    assert hits[1] and hits[2]
    for router in ("prefix-affinity", "round-robin", "least-loaded"):
        result = Deployment(cost_model="unit").simulate(
            trace, settings, cluster=ClusterOptions(2, router))[1]
        assert [r.metrics.num_cached_tokens for r in result.records] == hits, router
        assert result.route_reasons["session"] == len(hits) - 1, router
        sessions = aggregate(result)["sessions"]
        assert sessions["session_hits"] == sum(1 for h in hits if h)
        assert sessions["turns_deferred"] == 2 and sessions["session_fallbacks"] == 0


def test_a_recorded_turn_extends_the_turn_before_as_its_client_sent_it():  # U4
    """A recording keeps prompts as block hashes, and the replay drew each block's ids from
    its hash: turn b's ids did not hold turn a's partial block and answer, so b did not
    extend a's session and ran as an ordinary request, prefilling everything the server had
    held (a recording made with sessions diverged from its own replay). b is now written
    over a's ids and simulated answer; the rest of b, its new message, is drawn as before."""
    from kvserve.sim.prompt_draws import SessionChains

    a = req("a", 40, 8, session_id="s", prompt_hashes=("h1", "h2"), hash_block_size=16)
    b = req("b", 60, 4, arrival=5.0, session_id="s", prompt_hashes=("h1", "h2", "h3"),
            hash_block_size=16)
    chains = SessionChains(seed=0)
    prompt_a, answer_a = chains.apply(a, a.synthesise_prompt(0))
    prompt_b, _ = chains.apply(b, b.synthesise_prompt(0))
    assert prompt_b[:48] == prompt_a + answer_a and len(prompt_b) == 60
    assert prompt_b[48:] == b.synthesise_prompt(0)[48:]
    result = simulate([a, b], max_session_kv=0.5, enable_prefix_caching=False)
    assert aggregate(result)["sessions"]["session_fallbacks"] == 0
    # a's prompt and answer held (the EOS after it never computed), as the server held them
    assert by_id(result)["b"].metrics.num_cached_tokens == 40 + 8


def test_a_turn_recorded_as_ids_extends_the_turn_before_as_replayed():  # U4
    """The chaos pass: a recording made with ``--record-prompts ids`` keeps turn b's ids as
    its client sent them, the server's answer to a among them, which the simulated model
    does not give: b did not extend a's session in the replay, which diverged from the
    recorded steps at b and failed. b's leading ids, a's prompt and the server's answer,
    are now a's prompt and simulated answer, and a version of b sent again (regenerated)
    takes b's ids as replayed, as with hashed prompts."""
    from kvserve.sim.prompt_draws import SessionChains

    ids_a = list(range(100, 140))
    ids_b = ids_a + [7] * 8 + list(range(200, 212))  # a, the server's answer, a new message
    a = req("a", 40, 8, session_id="s", prompt_token_ids=ids_a)
    b = req("b", 60, 4, arrival=5.0, session_id="s", prompt_token_ids=ids_b)
    again = req("r", 60, 4, arrival=10.0, session_id="s", prompt_token_ids=ids_b)
    chains = SessionChains(seed=0)
    prompt_a, answer_a = chains.apply(a, a.synthesise_prompt(0))
    prompt_b, _ = chains.apply(b, b.synthesise_prompt(0))
    assert prompt_a == ids_a and answer_a != [7] * 8
    assert prompt_b == ids_a + answer_a + ids_b[48:]
    prompt_r, _ = chains.apply(again, again.synthesise_prompt(0))
    assert prompt_r[:48] == prompt_b[:48]  # b's three full blocks, as b was replayed
    result = simulate([a, b], max_session_kv=0.5, enable_prefix_caching=False)
    assert aggregate(result)["sessions"]["session_fallbacks"] == 0
    assert by_id(result)["b"].metrics.num_cached_tokens == 40 + 8


def test_a_recorded_turn_that_edits_the_conversation_is_not_chained():  # U3
    """A turn whose leading blocks are not the turn before's (an earlier message edited)
    replaced its session on the server; written over the turn before, its replay extended
    the session instead and diverged from the recording."""
    from kvserve.sim.prompt_draws import SessionChains

    a = req("a", 40, 8, session_id="s", prompt_hashes=("h1", "h2"), hash_block_size=16)
    edited = req("e", 60, 4, arrival=5.0, session_id="s", prompt_hashes=("x1", "x2", "x3"),
                 hash_block_size=16)
    chains = SessionChains(seed=0)
    chains.apply(a, a.synthesise_prompt(0))
    prompt, _ = chains.apply(edited, edited.synthesise_prompt(0))
    assert prompt == edited.synthesise_prompt(0)  # as drawn from its own hashes
    result = simulate([a, edited], max_session_kv=0.5, enable_prefix_caching=False)
    assert by_id(result)["e"].metrics.num_cached_tokens == 0
    assert aggregate(result)["sessions"]["session_releases"] == {"replaced": 1}


def test_a_recorded_regenerated_turn_hits_what_the_server_hit():  # U3 G2
    """A regenerated turn (turn b sent again) replaced the session on the server and hit the
    released blocks in its prefix cache; the replay drew its blocks from their hashes, not
    as b's replay had sent them, hit nothing and diverged from the recording (QA)."""
    from kvserve.sim.prompt_draws import SessionChains

    a = req("a", 40, 8, session_id="s", prompt_hashes=("h1", "h2"), hash_block_size=16)
    b = req("b", 60, 4, arrival=5.0, session_id="s", prompt_hashes=("h1", "h2", "h3"),
            hash_block_size=16)
    again = req("r", 60, 4, arrival=10.0, session_id="s", prompt_hashes=("h1", "h2", "h3"),
                hash_block_size=16)
    chains = SessionChains(seed=0)
    chains.apply(a, a.synthesise_prompt(0))
    prompt_b, _ = chains.apply(b, b.synthesise_prompt(0))
    prompt_r, _ = chains.apply(again, again.synthesise_prompt(0))
    assert prompt_r[:48] == prompt_b[:48] and prompt_r[48:] == again.synthesise_prompt(0)[48:]
    result = simulate([a, b, again], max_session_kv=0.5)
    assert by_id(result)["r"].metrics.num_cached_tokens == 48  # b's three full blocks
    assert aggregate(result)["sessions"]["session_releases"] == {"replaced": 1}


def test_simulate_prints_the_session_figures(tmp_path, capsys):  # U2 U6
    """They were in the --report JSON only (QA)."""
    from kvserve.cli import main

    trace = tmp_path / "chat.jsonl"
    assert main(["workload", "gen", "-n", "12", "--rate", "2", "--turns", "fixed:3",
                 "--sessions", "--seed", "1", "--prompt-len", "fixed:64",
                 "--output-len", "fixed:8", "--output", str(trace)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--max-session-kv", "0.5",
                 "--cost-model", "unit"]) == 0
    out = capsys.readouterr().out
    assert "session hits" in out and "8 turns" in out, out
    assert "sessions held at end" in out
    assert main(["simulate", "--trace", str(trace), "--cost-model", "unit"]) == 0
    assert "session hits" not in capsys.readouterr().out  # sessions off: no rows


def test_a_request_asking_prompt_logprobs_replays_without_prefix_hits():  # G8
    """The server never gives such a request a prefix hit; its trace line says so, and the
    simulator computes its whole prompt too (a replay hit what the server did not)."""
    from kvserve.sim.deployment import Deployment

    shared = list(range(1, 65))
    rows = [{"request_id": "a", "arrival_time": 0, "prompt_token_ids": shared,
             "output_len": 2},
            {"request_id": "b", "arrival_time": 5, "prompt_token_ids": shared,
             "output_len": 2, "prompt_logprobs": 1},
            {"request_id": "c", "arrival_time": 10, "prompt_token_ids": shared,
             "output_len": 2}]
    trace = [parse_request(row) for row in rows]
    assert trace[1].to_json()["prompt_logprobs"] == 1
    _, result = Deployment(cost_model="unit").simulate(trace, {})
    hits = {r.request_id: r.metrics.num_cached_tokens for r in result.records}
    assert hits == {"a": 0, "b": 0, "c": 48}
    with pytest.raises(ValueError, match=r"prompt_logprobs cannot be asked of a session "
                                         r"turn \(G8\), got 1 on session 's'"):
        parse_request({**rows[1], "session_id": "s"})


def test_max_held_first_without_sessions_is_one_line(tmp_path, capsys):
    from kvserve.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"request_id": "a", "arrival_time": 0, "prompt_len": 8, '
                     '"output_len": 2}\n')
    assert main(["simulate", "--trace", str(trace), "--max-held-first", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_held_first=2 bounds session turns that hold KV" in err[0]


def test_a_replicas_load_counts_its_held_session_turns():  # R1 U2
    """The cluster's router sees a replica's load as the server's router does: a session
    turn held waiting for its KV (L1) is waiting (the server's stats.num_waiting counts it),
    so least-loaded does not send new work to a replica that only looks idle."""
    from kvserve.core import CacheConfig, SchedulerConfig
    from kvserve.sim.cluster import _Replica
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    sim = Simulator(SchedulerConfig(), CacheConfig(num_blocks=64), UnitCostModel())
    replica = _Replica(0, sim, UnitCostModel(), {})
    assert replica.load().num_waiting == 0
    replica.scheduler.held_waiting.append(object())  # type: ignore[arg-type]
    assert replica.load().num_waiting == 1


def test_a_turn_after_its_sessions_ttl_ran_out_in_an_idle_gap_is_no_session_hit():  # U6
    """QA: the simulator does not step while idle, and the turn 10 s after one with a 1 s
    ttl took the hold the server had released (its replay of a recording diverged)."""
    import dataclasses

    first, second = conversation(turns=2)
    second = dataclasses.replace(second, arrival_time=10.0)
    results = {}
    for ttl in (1.0, 30.0):
        trace = [dataclasses.replace(t, session_ttl=ttl) for t in (first, second)]
        result = simulate(trace, max_session_kv=0.5)
        results[ttl] = aggregate(result)["sessions"]["session_hits"]
    assert results == {1.0: 0, 30.0: 1}
