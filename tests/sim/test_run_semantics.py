"""What a run's report must add up to, on one engine and in a cluster: every request ends
once and is reported; a session's turns come in order, one at a time, whatever happened to
the turn before; a request's clock never runs backwards; a cluster's report carries what
one engine's does (tenants, the host tier); the run lasts to the end of its last step.
Found by a semantic pass over the simulator (none of these raised before: they reported
wrong figures, lost turns or crashed)."""

from __future__ import annotations

import math

import pytest

from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.cluster_report import add_cluster_sections
from kvserve.sim.deployment import Deployment
from kvserve.sim.report import build_report
from tests.sim.helpers import req

UNIT = Deployment(cost_model="unit")  # each step lasts 1 s
ONE = None
TWO = ClusterOptions(2, "round-robin")
LOCKSTEP = ClusterOptions(2, "round-robin", lockstep=True)


def run(trace, cluster: ClusterOptions | None = ONE, **settings) -> dict:
    settings.setdefault("num_kv_blocks", 400)
    echo, result = UNIT.simulate(trace, settings, check=True, cluster=cluster)
    report = build_report(echo, result)
    return add_cluster_sections(report, result) if cluster is not None else report


def rows(report: dict) -> dict[str, dict]:
    return {row["request_id"]: row for row in report["requests"]}


@pytest.mark.parametrize("cluster", [ONE, TWO], ids=["one", "cluster"])
@pytest.mark.parametrize("case", ["refused", "cancelled"])
def test_a_sessions_next_turn_comes_after_a_turn_refused_or_cancelled(cluster, case):
    """QA: the next turn was released into a queue nothing read, and the run ended with it
    "unfinished" (no time, no tokens, no warning)."""
    middle = req("t2", 1000, 5, 0.001, session_id="s") if case == "refused" else \
        req("t2", 10, 5, 0.001, session_id="s", cancel_time=0.002)
    trace = [req("t1", 10, 5, 0.0, session_id="s"), middle,
             req("t3", 10, 5, 0.002, session_id="s")]
    report = run(trace, cluster, num_kv_blocks=10)  # 160 tokens: t2's 1000 never fit
    ended = "rejected" if case == "refused" else "abort"
    assert report["aggregate"]["finish_reasons"] == {ended: 1, "stop": 2}
    t1, t3 = rows(report)["t1"], rows(report)["t3"]
    assert t3["output_tokens"] == 6 and t3["arrival_time"] >= t1["finished_time"]  # + EOS


def test_a_turn_cancelled_while_it_waits_keeps_the_turns_after_it_in_order():
    """QA: a turn arriving while an earlier one still waited for its session went first,
    and the gate then failed with a KeyError (a traceback from kvserve simulate)."""
    trace = [req("a", 15, 2, 0.0, session_id="s"),
             req("b", 15, 2, 1.0, session_id="s", cancel_time=1.9),
             req("c", 20, 7, 1.1, session_id="s"),
             req("d", 2, 2, 2.1),
             req("e", 20, 7, 2.1, session_id="s")]
    report = run(trace, max_model_len=256)
    by_id = rows(report)
    assert report["aggregate"]["finish_reasons"] == {"abort": 1, "stop": 4}
    assert by_id["e"]["arrival_time"] >= by_id["c"]["finished_time"]


def test_a_lockstep_cancellation_lands_at_the_step_boundary():
    """QA: it was recorded at its cancel time, before the token the same step made."""
    trace = [req("a", 100, 50, cancel_time=0.5), req("b", 100, 5)]
    row = rows(run(trace, LOCKSTEP))["a"]
    assert (row["finish_reason"], row["stop_reason"]) == ("abort", "cancelled")
    assert row["finished_time"] == 1.0 >= row["first_token_time"]


@pytest.mark.parametrize("cluster", [TWO, LOCKSTEP], ids=["independent", "lockstep"])
def test_a_clusters_report_has_the_tenants(cluster):
    """QA: a cluster's records had no tenant: no tenants table, no fairness index."""
    trace = [req(f"r{i}", 32, 4, 0.1 * i, tenant="AB"[i % 2]) for i in range(6)]
    plain, clustered = run(trace), run(trace, cluster)
    assert set(clustered["aggregate"]["tenants"]) == set(plain["aggregate"]["tenants"]) == \
        {"A", "B"}
    assert "jain_fairness_index" in clustered["aggregate"]
    assert [row["tenant"] for row in clustered["requests"]] == list("ABABAB")


def test_a_clusters_report_has_the_host_tiers_figures():
    """QA: a cluster with --preemption-mode swap reported no swaps and no preemption modes;
    one replica in lockstep runs the plain run's steps, so its figures must equal them."""
    trace = [req(f"r{i}", 60, 60, 0.01 * i) for i in range(8)]
    settings = {"num_kv_blocks": 30, "preemption_mode": "swap", "num_host_blocks": 400}
    plain = run(trace, **settings)["aggregate"]
    one = run(trace, ClusterOptions(1, "round-robin", lockstep=True), **settings)
    clustered = one["aggregate"]
    assert plain["num_preemptions"] > 0
    for key in ("num_preemptions", "preemptions_by_mode", "swapped_out_blocks",
                "swapped_in_blocks"):
        assert clustered[key] == plain[key], key
    assert sum(plain["preemptions_by_mode"].values()) >= plain["num_preemptions"]
    assert sum(row["num_swaps"] for row in one["requests"]) > 0


@pytest.mark.parametrize("cluster", [ONE, TWO], ids=["one", "cluster"])
def test_a_request_refused_before_its_cancel_time_stays_refused(cluster):
    """QA: in a cluster it was relabelled abort/cancelled and the run lasted to its cancel
    time (1000 s for 0.1 s of work)."""
    trace = [req("a", 5000, 10, cancel_time=1000.0), req("b", 10, 10)]
    report = run(trace, cluster, max_model_len=2048)
    assert rows(report)["a"]["finish_reason"] == "rejected"
    assert report["aggregate"]["duration_s"] == 11  # b's steps: ten tokens and EOS


@pytest.mark.parametrize("cluster", [ONE, TWO], ids=["one", "cluster"])
def test_the_run_lasts_to_the_end_of_its_last_step(cluster):
    """docs/simulator.md: duration_s is the first arrival to the end of the last step; a
    refusal or a cancellation after it adds no time (QA: 3600 s for 5 s of work)."""
    trace = [req("a", 10, 5), req("late", 5000, 5, 3600.0),
             req("gone", 10, 5, 7200.0, cancel_time=10.0)]
    report = run(trace, cluster, max_model_len=2048)
    assert report["aggregate"]["duration_s"] == 6  # a's five tokens and EOS, a step each
    assert report["aggregate"]["throughput_output_tok_s"] == 1.0


def test_one_replica_in_lockstep_counts_waiting_as_one_engine_does():
    """The cluster's series counts swapped and held requests as waiting, as one engine's
    (StepSeries.sample_state) does: one replica in lockstep runs the same steps."""
    trace = [req(f"r{i}", 60, 60, 0.01 * i) for i in range(8)]
    settings = {"num_kv_blocks": 30, "preemption_mode": "swap", "num_host_blocks": 400}
    _, plain = UNIT.simulate(trace, dict(settings))
    _, one = UNIT.simulate(trace, dict(settings),
                           cluster=ClusterOptions(1, "round-robin", lockstep=True))
    assert list(one.replicas[0].steps.num_waiting) == list(plain.steps.num_waiting)
    assert sum(one.steps.num_waiting) == sum(plain.steps.num_waiting)


@pytest.mark.parametrize(("bad", "message"), [
    ({"arrival_time": math.nan}, "arrival_time must be a number of seconds"),
    ({"arrival_time": -1.0}, "arrival_time must be a number of seconds"),
    ({"output_len": -1}, "output_len must be an integer >= 0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"prompt_len": "10"}, "prompt_len must be an integer >= 1"),
    # the rules between fields, as a parsed line keeps them (review: not checked here)
    ({"received_time": 2.0, "arrival_time": 1.0}, "received_time 2 is after arrival_time 1"),
    ({"prefix_id": "p", "prefix_len": 11}, "prefix_len 11 is longer than prompt_len 10"),
    ({"prefix_len": 4}, "prefix_len needs a prefix_id"),
    ({"priority": "high"}, "priority must be an integer, got 'high'"),
    ({"tenant": 3}, "tenant must be a string, got 3"),
    ({"session_ttl": 5.0}, r"session_ttl must be a number of seconds in \(0, 86400\], "
                           "with a session_id"),
    ({"session_id": "s", "prompt_logprobs": 1}, "prompt_logprobs cannot be asked of a session"),
    ({"prompt_hashes": ("h",), "hash_block_size": 4}, "prompt_hashes has 1 hashes; a prompt "
                                                      "of 10 tokens has 2 full blocks of 4"),
    ({"replica": -1}, "replica must be an integer >= 0"),
])
def test_a_trace_built_in_python_is_checked_as_a_file_is(bad, message):
    """QA: a NaN arrival never came due and the run waited forever; max_tokens 0 ran to the
    model length."""
    fields = {"arrival_time": 0.0, "output_len": 4, "prompt_len": 10, **bad}
    arrival, output_len = fields.pop("arrival_time"), fields.pop("output_len")
    trace = [req("a", fields.pop("prompt_len"), output_len, arrival, **fields)]
    for cluster in (ONE, TWO):
        with pytest.raises(ValueError, match=f"request 'a': {message}"):
            run(trace, cluster)


def test_a_request_id_twice_in_a_trace_is_refused():
    """QA: one engine failed with a bare RequestError, a cluster merged the two into one
    row with wrong figures."""
    for cluster in (ONE, TWO):
        with pytest.raises(ValueError, match="request 'a': the id is in the trace twice"):
            run([req("a", 10, 2), req("a", 10, 2, 1.0)], cluster)


def test_a_trace_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="a trace is a sequence of TraceRequest, got dict"):
        run([{"request_id": "a"}])


def test_an_unknown_setting_is_refused_by_name():
    """QA: Deployment.simulate dropped a misspelt key and ran at the default."""
    with pytest.raises(ValueError, match=r"unknown setting.*'max_num_seq'"):
        run([req("a", 10, 2)], max_num_seq=4)
