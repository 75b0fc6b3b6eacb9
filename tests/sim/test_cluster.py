"""The cluster simulation (issue 14 item 6): N replicas on one virtual clock behind the
shared router (spec R1-R5), lockstep stepping with the prefill throttle (spec N)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.sim.cluster import ClusterOptions, ClusterResult
from kvserve.sim.cluster_report import add_cluster_sections
from kvserve.sim.deployment import Deployment
from kvserve.sim.report import aggregate, build_report
from kvserve.sim.workloads import WorkloadSpec, generate
from tests.sim.helpers import req

UNIT = Deployment(cost_model="unit")


def run(trace, options: ClusterOptions, deployment: Deployment = UNIT, check: bool = True,
        **settings):
    """Checks every replica's invariants after each of its steps, unless told not to."""
    settings.setdefault("num_kv_blocks", 400)
    echo, result = deployment.simulate(trace, settings, check=check, cluster=options)
    return add_cluster_sections(build_report(echo, result), result), result


def test_round_robin_assigns_in_arrival_order_r2() -> None:
    trace = [req(f"r{i}", 32, 4, arrival=0.01 * i) for i in range(7)]
    report, result = run(trace, ClusterOptions(3, "round-robin"))
    assert isinstance(result, ClusterResult)
    assert [row["replica"] for row in report["requests"]] == [0, 1, 2, 0, 1, 2, 0]
    assert [r["num_requests"] for r in report["replicas"]] == [3, 2, 2]
    assert report["router"] == {"decisions": {"round_robin": 7}, "prefix_hit_share": 0.0}
    assert report["aggregate"]["finish_reasons"] == {"stop": 7}
    assert report["config"]["data_parallel"] == {
        "size": 3, "router": "round-robin", "lockstep": False,
        "prefill_schedule_interval": 1, "imbalance_bound": 16}


def test_least_loaded_sends_a_burst_to_every_replica_r3() -> None:
    # Eight arrivals at once: each routed request counts as waiting on its replica, so a
    # burst spreads 2-2-2-2 rather than all landing on the replica that looked idle.
    trace = [req(f"r{i}", 64, 8) for i in range(8)]
    report, _ = run(trace, ClusterOptions(4, "least-loaded"))
    assert [row["replica"] for row in report["requests"]] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_every_request_finishes_once_and_replicas_add_up() -> None:
    trace = generate(WorkloadSpec(num_requests=120, rate=60, prefix_groups=3, seed=2,
                                  prompt_len="uniform:16,200", output_len="uniform:4,40"))
    report, result = run(trace, ClusterOptions(3, "prefix-affinity"))
    a = report["aggregate"]
    assert a["num_finished"] == 120
    assert sum(r["num_requests"] for r in report["replicas"]) == 120
    assert sum(r["num_finished"] for r in report["replicas"]) == 120
    assert a["output_tokens"] == sum(aggregate(p)["output_tokens"] for p in result.replicas)
    assert a["num_steps"] == sum(r["num_steps"] for r in report["replicas"])
    assert sorted(result.replica_of) == sorted(r.request_id for r in trace)


def shared_prefix_trace():
    """16 system prompts of 1,024 tokens, more than one replica's 600 blocks hold."""
    return generate(WorkloadSpec(num_requests=200, rate=50, prefix_groups=16,
                                 prefix_len="fixed:1024", prompt_len="uniform:16,64",
                                 output_len="uniform:16,48", seed=1))


def test_prefix_affinity_beats_round_robin_on_hits_and_ttft_r4() -> None:
    roofline = Deployment()  # llama-3.1-8b on h100-sxm: a cache hit saves prefill time
    trace = shared_prefix_trace()
    rr, _ = run(trace, ClusterOptions(4, "round-robin"), roofline, num_kv_blocks=600)
    pa, _ = run(trace, ClusterOptions(4, "prefix-affinity"), roofline, num_kv_blocks=600)
    rr_a, pa_a = rr["aggregate"], pa["aggregate"]
    assert rr_a["num_finished"] == pa_a["num_finished"] == 200
    # figures of this seeded trace: 0.52 -> 0.89 hit rate, TTFT mean 22.9 -> 15.4 ms
    assert pa_a["prefix_hit_rate"] > rr_a["prefix_hit_rate"] + 0.3
    assert pa_a["ttft_mean"] < 0.8 * rr_a["ttft_mean"]
    assert pa_a["ttft_p50"] < rr_a["ttft_p50"]
    assert pa["router"]["prefix_hit_share"] > 0.9


def test_lockstep_steps_last_as_long_as_the_slowest_rank() -> None:
    trace = [req("long", 1500, 4), req("short", 16, 30)]
    report, result = run(trace, ClusterOptions(2, "round-robin", lockstep=True),
                         Deployment(), max_num_batched_tokens=512)
    first, second = result.replicas
    # both ranks step together while both have work: same start times and durations
    shared = min(len(first.steps.time), len(second.steps.time))
    assert list(first.steps.time[:shared]) == list(second.steps.time[:shared])
    assert list(first.steps.duration[:shared]) == list(second.steps.duration[:shared])
    assert report["aggregate"]["num_finished"] == 2


def mixed_trace():
    """Prompts of ~2,000 tokens (chunked over steps) at a rate that leaves ranks room."""
    return generate(WorkloadSpec(num_requests=160, rate=8, seed=5,
                                 prompt_len="lognormal:mean=2000,sigma=0.8,max=6000",
                                 output_len="uniform:60,200"))


def test_prefill_throttle_trades_ttft_for_steadier_decode_n1_n2() -> None:
    settings = {"num_kv_blocks": 4000, "max_model_len": 8192, "check": False}  # for speed
    off, _ = run(mixed_trace(), ClusterOptions(4, "least-loaded", lockstep=True),
                 Deployment(), **settings)
    on, _ = run(mixed_trace(), ClusterOptions(4, "least-loaded", lockstep=True,
                                              prefill_schedule_interval=8),
                Deployment(), **settings)
    off_a, on_a = off["aggregate"], on["aggregate"]
    assert off_a["num_finished"] == on_a["num_finished"] == 160
    assert "prefill_throttle" not in off_a["blocked_steps"]
    assert on_a["blocked_steps"]["prefill_throttle"] > 0
    # figures of this seeded trace: ITL p90 29.7 -> 10.1 ms, mean 14.1 -> 12.7 ms; TTFT p50
    # 52 -> 110 ms. Decode steps no longer wait on some rank's prefill...
    assert on_a["itl_p90"] < 0.5 * off_a["itl_p90"]
    assert on_a["itl_mean"] < off_a["itl_mean"]
    assert on_a["ttft_p50"] > off_a["ttft_p50"]  # ...and prefills wait for their turn


def test_one_replica_report_is_byte_identical(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "30", "--rate", "20", "--prefix-groups", "2",
                 "--seed", "4", "-o", str(trace)]) == 0
    plain, one = tmp_path / "plain.json", tmp_path / "one.json"
    assert main(["simulate", "--trace", str(trace), "--report", str(plain), "--quiet",
                 "--num-kv-blocks", "300"]) == 0
    assert main(["simulate", "--trace", str(trace), "--report", str(one), "--quiet",
                 "--num-kv-blocks", "300", "--data-parallel-size", "1",
                 "--router", "prefix-affinity"]) == 0
    assert plain.read_bytes() == one.read_bytes()
    assert "replica" not in json.loads(plain.read_text())["requests"][0]


def test_the_cluster_table_says_its_kv_blocks_are_each_replicas(tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "8", "--rate", "20", "--seed", "4",
                 "-o", str(trace)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(trace), "--num-kv-blocks", "300",
                 "--data-parallel-size", "2"]) == 0
    header = " ".join(capsys.readouterr().out.split())
    assert "max_num_seqs 256, 300 KV blocks per replica, continuous batching, 2 replicas" \
        in header
    assert main(["simulate", "--trace", str(trace), "--num-kv-blocks", "300"]) == 0
    assert "300 KV blocks, continuous batching" in " ".join(capsys.readouterr().out.split())


def test_cluster_cli_writes_replicas_to_report_and_html(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "30", "--rate", "20", "--seed", "4",
                 "-o", str(trace)]) == 0
    report, html, events = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "e.jsonl"
    assert main(["simulate", "--trace", str(trace), "--report", str(report), "--html",
                 str(html), "--num-kv-blocks", "300", "--data-parallel-size", "2",
                 "--router", "round-robin", "--events", str(events)]) == 0
    data = json.loads(report.read_text())
    assert [row["replica"] for row in data["requests"][:4]] == [0, 1, 0, 1]
    where = {row["request_id"]: row["replica"] for row in data["requests"]}
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines and all(line["replica"] == where[line["request_id"]] for line in lines)
    assert [r["replica"] for r in data["replicas"]] == [0, 1]
    page = html.read_text()
    assert "<h2>Replicas</h2>" in page and "KV cache usage per replica" in page


@pytest.mark.parametrize(("flags", "message"), [
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--data-parallel-size", "2", "--batching", "static"],
     "a cluster simulation needs continuous batching"),
    (["--data-parallel-size", "2", "--prefill-schedule-interval", "4"],
     "add --data-parallel-lockstep"),
    (["--data-parallel-size", "2", "--router-imbalance-bound", "-1"],
     "--router-imbalance-bound must be >= 0, got -1"),
    (["-dp", "1000000000"], "--data-parallel-size 1000000000: at most 1024 replicas"),
])
def test_bad_cluster_flags_are_one_line_errors(tmp_path, capsys, flags, message) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"request_id": "a", "arrival_time": 0, "prompt_len": 8,
                                 "output_len": 2}) + "\n")
    assert main(["simulate", "--trace", str(trace), "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_cluster_refuses_a_prompt_too_long_without_drawing_it() -> None:
    """J1 on the length alone, as one engine's (QA: a cluster drew a 10**13-token prompt's
    ids to hash them for the router: 72.8 TiB asked for)."""
    trace = [req("huge", 10**13, 5), req("ok", 32, 4)]
    report, _ = run(trace, ClusterOptions(2, "prefix-affinity"), max_model_len=2048)
    assert report["aggregate"]["finish_reasons"] == {"rejected": 1, "stop": 1}
    # never routed, as the server refuses it before its router (QA: it took a turn)
    assert sum(r["num_requests"] for r in report["replicas"]) == 1
    rr = [req("big", 5000, 2), *(req(n, 50, 2, arrival=0.01) for n in "abc")]
    report, _ = run(rr, ClusterOptions(2, "round-robin"), max_model_len=2048)
    assert [(row["request_id"], row["replica"]) for row in report["requests"]
            if row["request_id"] != "big"] == [("a", 0), ("b", 1), ("c", 0)]
    assert report["router"]["decisions"] == {"round_robin": 3}


@pytest.mark.parametrize("lockstep", [False, True])
def test_cancellations_reach_the_replica_that_holds_the_request(lockstep: bool) -> None:
    # unit cost: each step lasts 1 s. "early" is cancelled before it arrives, "mid" while
    # it decodes on replica 1, "late" after it finished (a no-op).
    trace = [req("a", 16, 20), req("mid", 16, 20, cancel_time=5.5),
             req("early", 16, 20, arrival=10.0, cancel_time=2.0),
             req("late", 16, 2, arrival=0.5, cancel_time=30.0)]
    report, result = run(trace, ClusterOptions(2, "round-robin", lockstep=lockstep))
    rows = {row["request_id"]: row for row in report["requests"]}
    assert (rows["mid"]["finish_reason"], rows["mid"]["stop_reason"]) == ("abort", "cancelled")
    assert (rows["early"]["finish_reason"], rows["early"]["stop_reason"]) == \
        ("abort", "cancelled")
    assert rows["early"]["replica"] is None  # never routed
    assert rows["a"]["finish_reason"] == "stop" and rows["late"]["finish_reason"] == "stop"
    # "mid" is mid-step at 5.5: the cancellation lands when that step ends, at 6, after
    # its sixth token (the first at 1 s, then one a second)
    assert rows["mid"]["replica"] == 1 and rows["mid"]["output_tokens"] == 6
    assert result.route_reasons == {"round_robin": 3}


@pytest.mark.parametrize("scope", ["global", "tenant"])
def test_prefix_affinity_salts_its_guesses_as_the_replicas_cache_does_r4_t7(scope) -> None:
    """Under the tenant scope the replicas' caches keep tenants apart, so the router must not
    predict a hit for tenant B on blocks tenant A sent; within a tenant it still does."""
    shared = tuple(range(100, 164))  # four 16-token blocks
    trace = [req("a", 0, 2, 0.0, prompt_token_ids=shared, tenant="A"),
             req("b", 0, 2, 5.0, prompt_token_ids=shared, tenant="B"),
             req("a2", 0, 2, 10.0, prompt_token_ids=shared, tenant="A")]
    report, result = run(trace, ClusterOptions(2, "prefix-affinity"),
                         prefix_cache_scope=scope, block_size=16)
    hits = {r["request_id"]: r["cached_tokens"] for r in report["requests"]}
    if scope == "tenant":
        assert result.route_reasons == {"least_loaded": 2, "prefix_hit": 1}
        assert hits == {"a": 0, "b": 0, "a2": 48}
    else:
        assert result.route_reasons == {"least_loaded": 1, "prefix_hit": 2}
        assert hits == {"a": 0, "b": 48, "a2": 48}
    assert result.replica_of["a2"] == result.replica_of["a"]


def test_kv_figures_mean_the_same_for_one_replica_and_a_cluster(tmp_path):
    """QA: one replica's KV mean was over its busy steps (0.49), a cluster's over the whole
    run and averaged over replicas (0.045), so adding a replica looked like a tenfold cut.
    Now both are time-averages over the run, idle time counted; a cluster's is the
    replicas' average (each replica's is its own), its peak the fullest replica's."""
    trace = tmp_path / "sparse.jsonl"
    trace.write_text('{"request_id":"r0","arrival_time":0,"prompt_len":160,"output_len":9}\n'
                     '{"request_id":"r1","arrival_time":100,"prompt_len":160,"output_len":9}\n')
    reports = []
    for replicas in (1, 2):
        path = tmp_path / f"r{replicas}.json"
        assert main(["simulate", "--trace", str(trace), "--cost-model", "unit",
                     "--num-kv-blocks", "20", "--data-parallel-size", str(replicas),
                     "--router", "round-robin", "--report", str(path)]) == 0
        reports.append(json.loads(path.read_text()))
    one, two = (r["aggregate"] for r in reports)
    # one request at a time, each alone in its pool: the same busy usage either way, over
    # twice the replicas' time with two
    assert one["duration_s"] == two["duration_s"] == 110
    assert one["kv_usage_mean"] == pytest.approx(2 * two["kv_usage_mean"], rel=1e-3)
    rows = reports[1]["replicas"]
    assert two["kv_usage_mean"] == pytest.approx(
        sum(r["kv_usage_mean"] for r in rows) / 2, abs=2e-6)  # as rounded in the report
    assert one["kv_usage_peak"] == two["kv_usage_peak"] == max(r["kv_usage_peak"]
                                                               for r in rows) > 0.5
    assert 0.08 < one["kv_usage_mean"] < 0.1  # ~0.49 busy for 20 s of 110


def test_a_router_with_one_replica_says_it_changes_nothing(tmp_path, capsys):
    """QA: --router prefix-affinity with one replica was taken and silently ignored."""
    trace = tmp_path / "one.jsonl"
    trace.write_text('{"request_id":"r0","arrival_time":0,"prompt_len":16,"output_len":2}\n')
    assert main(["simulate", "--trace", str(trace), "--cost-model", "unit",
                 "--router", "prefix-affinity"]) == 0
    assert "--router prefix-affinity spreads arrivals over replicas; with one replica it " \
           "changes nothing" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace), "--cost-model", "unit",
                 "--router", "prefix-affinity", "--data-parallel-size", "2"]) == 0
    assert "changes nothing" not in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace), "--cost-model", "unit",
                 "--data-parallel-lockstep"]) == 0  # QA: taken silently
    assert "--data-parallel-lockstep steps replicas together; with one replica it changes " \
           "nothing" in capsys.readouterr().err


def test_a_recorded_cluster_s_router_is_not_said_to_change_nothing(capsys):
    """The record -> replay pass: ``kvserve plan --trace`` of a two-replica recording (the
    manifest's router taken as --router; plan has no --data-parallel-size) noted that the
    router changes nothing with one replica, while it planned the recorded two. Plan passes
    the recorded number; a one-replica recording's --router is noted (it was taken silently)."""
    import argparse

    from kvserve.sim.cli_common import cluster_from_args

    args = argparse.Namespace(router="least-loaded", router_imbalance_bound=None,
                              data_parallel_lockstep=False, prefill_schedule_interval=1)
    assert cluster_from_args(args, 2).data_parallel_size == 2
    assert "changes nothing" not in capsys.readouterr().err
    cluster_from_args(args, 1)
    assert "changes nothing (give --max-replicas M to plan replicas)" in \
        capsys.readouterr().err  # plan has no --data-parallel-size


def test_a_request_its_replica_refuses_is_no_decision_r7() -> None:
    """As the server's DataParallelEngine: a request its replica's queue limits refuse (they
    hold per replica) is not counted as a router decision, and its prefix teaches the
    router nothing. Five arrivals at once on two replicas that queue one each: round robin
    puts three on replica 0, whose queue refuses the third."""
    shared = tuple(range(100, 164))
    trace = [req(f"r{i}", 0, 4, 0.0, prompt_token_ids=(i, *shared)) for i in range(5)]
    report, result = run(trace, ClusterOptions(2, "round-robin"), max_num_seqs=1,
                         max_num_queued_reqs=1, block_size=16)
    reasons = {row["request_id"]: row["finish_reason"] for row in report["requests"]}
    refused = sorted(r for r, reason in reasons.items() if reason != "stop")
    assert refused == ["r4"]
    assert result.route_reasons == {"round_robin": 4}
    # prefix-affinity: the refused request's prefix does not point at the replica that
    # refused it, so a later request with it is routed by load, not as a hit
    late = req("late", 0, 2, 50.0, prompt_token_ids=(4, *shared))
    _, result = run([*trace, late], ClusterOptions(2, "prefix-affinity"), max_num_seqs=1,
                    max_num_queued_reqs=1, block_size=16)
    assert result.route_reasons.get("prefix_hit", 0) == 0, result.route_reasons
    assert sum(result.route_reasons.values()) == 5
