"""Cluster-sized plans (issue 14 item 7): how many replicas meet an SLO, simulated in
parallel, byte-identical whether in one process, in worker processes or on Ray."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvserve.cli import main
from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.deployment import Deployment
from kvserve.sim.replica_plan import (
    fewest_replicas,
    recommend_replicas,
    replica_candidates,
    run_candidates,
)
from kvserve.sim.workloads import WorkloadSpec, generate


def test_candidates_double_up_to_the_maximum() -> None:
    assert replica_candidates(1) == [1]
    assert replica_candidates(6) == [1, 2, 4, 6]
    assert replica_candidates(64) == [1, 2, 4, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="--max-replicas must be >= 1, got 0"):
        replica_candidates(0)


@pytest.mark.parametrize(("needed", "max_replicas", "asked", "found"), [
    (3, 8, [1, 2, 4, 3], 3),  # QA: powers of two only, plan answered 4
    (12, 64, [1, 2, 4, 8, 16, 12, 10, 11], 12),
    (5, 6, [1, 2, 4, 6, 5], 5),  # the maximum closes the doubling
    (1, 64, [1], 1),
    (9, 6, [1, 2, 4, 6], None),
])
def test_the_search_finds_the_fewest_replicas(needed, max_replicas, asked, found) -> None:
    """Doubling brackets the fewest count meeting the SLO, bisection finds it: every count in
    [1, M] can be the answer, not only the powers of two."""
    seen: list[int] = []

    def meets(count: int) -> bool:
        seen.append(count)
        return count >= needed

    assert fewest_replicas(meets, max_replicas) == found
    assert seen == asked


def row(replicas: int, ttft: float | None, itl: float | None) -> dict:
    return {"replicas": replicas, "ttft_p99": ttft, "itl_p99": itl}


def test_recommendation_is_the_fewest_replicas_meeting_every_slo() -> None:
    rows = [row(1, 2.0, 0.05), row(2, 0.4, 0.05), row(4, 0.3, 0.02), row(8, 0.2, 0.01)]
    assert recommend_replicas(rows, 0.5, 0.03) == {
        "replicas_recommended": 4, "slo_ttft_p99_s": 0.5, "slo_itl_p99_s": 0.03,
        "replicas_meeting_slo": [4, 8]}
    assert recommend_replicas(rows, 0.5, None)["replicas_recommended"] == 2
    assert recommend_replicas(rows, 0.1, None)["replicas_recommended"] is None
    # no SLO given: nothing to meet, so no count is recommended (it used to say 1)
    assert recommend_replicas(rows, None, None)["replicas_recommended"] is None
    assert recommend_replicas([row(1, None, None)], 1.0, None)["replicas_meeting_slo"] == []


def test_a_count_that_shed_requests_meets_no_slo_and_itl_without_gaps_breaks_none() -> None:
    """QA: with --max-queue-delay, 1 replica shedding 118 of 200 requests "met" a TTFT
    target that needs 3 (its p99 covered what it served); and answers a token long, with
    no inter-token gap to measure, missed every ITL target, advised "raise --max-replicas"."""
    served = {"num_finished": 200, "num_shed": 0}
    rows = [{**row(1, 0.5, 0.01), "num_finished": 82, "num_shed": 118},
            {**row(2, 0.5, 0.01), **served}]
    assert recommend_replicas(rows, 1.0, None)["replicas_meeting_slo"] == [2]
    short = [{**row(1, 0.2, None), **served}]
    assert recommend_replicas(short, None, 0.1)["replicas_recommended"] == 1
    assert recommend_replicas([{**row(1, None, None), "num_finished": 0, "num_shed": 0}],
                              None, 0.1)["replicas_recommended"] is None  # served nothing


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "t.jsonl"
    assert main(["workload", "gen", "-n", "80", "--rate", "40", "--prefix-groups", "4",
                 "--prefix-len", "fixed:512", "--prompt-len", "uniform:16,64",
                 "--output-len", "uniform:8,32", "--seed", "7", "-o", str(path)]) == 0
    return path


def plan_json(trace_path, capsys, *flags: str) -> str:
    assert main(["plan", "--trace", str(trace_path), "--max-replicas", "8",
                 "--slo-ttft-p99", "0.02", "--router", "prefix-affinity",
                 "--num-kv-blocks", "300", "--json", *flags]) == 0
    return capsys.readouterr().out


def test_plan_is_byte_identical_with_one_or_two_workers(trace_path, capsys) -> None:
    serial = plan_json(trace_path, capsys, "--workers", "1")
    parallel = plan_json(trace_path, capsys, "--workers", "2")  # the search runs ahead
    assert serial == parallel
    plan = json.loads(serial)
    # p99 TTFT 23.1, 22.7, 19.5, 17.9 ms on 1, 2, 3, 4 replicas: 4 brackets the 20 ms SLO,
    # 3 meets it (QA: the powers of two 1, 2, 4, 8 answered 4); the rows are the counts
    # the search simulated, not its speculation's
    assert [r["replicas"] for r in plan["replica_sweep"]] == [1, 2, 3, 4]
    assert plan["router"] == "prefix-affinity"
    assert plan["replicas_recommended"] == 3
    assert plan["replicas_meeting_slo"] == [3, 4]
    ttfts = [r["ttft_p99"] for r in plan["replica_sweep"]]
    assert ttfts == sorted(ttfts, reverse=True)


def test_without_an_slo_the_powers_of_two_are_simulated(trace_path, capsys) -> None:
    assert main(["plan", "--trace", str(trace_path), "--max-replicas", "6",
                 "--num-kv-blocks", "300", "--json", "--workers", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["replicas"] for r in plan["replica_sweep"]] == [1, 2, 4, 6]
    assert plan["replicas_recommended"] is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--slo-ttft-p99", "1"], "--slo-ttft-p99 plans replicas: give --max-replicas M"),
    (["--max-replicas", "4", "--workers", "0"], "--workers must be >= 1, got 0"),
    (["--max-replicas", "4", "--slo-itl-p99", "-1"],
     "--slo-itl-p99 must be a finite number > 0, got -1"),
    (["--max-replicas", "4", "--slo-ttft-p99", "inf"],  # QA: taken
     "argument --slo-ttft-p99: must be a finite number, got 'inf'"),
    (["--max-replicas", "100000"], "--max-replicas 100000: at most 1024 replicas"),  # QA:
    # minutes into gigabytes, silent
])
def test_bad_plan_flags_are_one_line_errors(trace_path, capsys, flags, message) -> None:
    try:  # argparse's own refusals (a number flag's inf) exit rather than return
        status = main(["plan", "--trace", str(trace_path), *flags])
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.xdist_group("ray")  # one local Ray instance at a time (Makefile)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="kvserve[ray] not installed")
def test_plan_on_a_local_ray_instance_matches_local_processes() -> None:
    import ray

    trace = generate(WorkloadSpec(num_requests=40, rate=40, prompt_len="uniform:16,64",
                                  output_len="uniform:8,32", seed=9))
    args = (Deployment(cost_model="unit"), trace, {"num_kv_blocks": 200},
            ClusterOptions(router="round-robin"), [1, 2])
    local = run_candidates(*args, workers=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_candidates(*args, use_ray=True)
    finally:
        ray.shutdown()
    assert json.dumps(on_ray) == json.dumps(local)
    assert [r["replicas"] for r in on_ray] == [1, 2]


def test_no_candidate_meeting_the_slo_is_said_in_words(trace_path, capsys) -> None:
    assert main(["plan", "--trace", str(trace_path), "--max-replicas", "2",
                 "--slo-ttft-p99", "0.000001", "--num-kv-blocks", "300"]) == 0
    out = capsys.readouterr().out
    words = _right_column(out)
    assert "none of 1, 2 (" in words and "None" not in out
    assert "(raise --max-replicas)" in words or "more replicas barely help" in words


def test_a_target_below_what_a_request_takes_alone_is_said_so(tmp_path, capsys) -> None:
    """QA: a 1 ms TTFT target none of 1, 2, 4 replicas met was told to raise
    --max-replicas, though more replicas no longer helped: requests far apart each have
    the pool to themselves already."""
    trace = tmp_path / "sparse.jsonl"
    trace.write_text("".join(
        f'{{"request_id":"r{i}","arrival_time":{i * 100},"prompt_len":160,"output_len":9}}\n'
        for i in range(8)))
    assert main(["plan", "--trace", str(trace), "--max-replicas", "4", "--cost-model", "unit",
                 "--slo-ttft-p99", "0.001", "--num-kv-blocks", "300"]) == 0
    words = _right_column(capsys.readouterr().out)
    assert "none of 1, 2, 4 (more replicas barely help: TTFT p99 1 s at 4 replicas, 1 s " \
           "at 2; the target is below what a request takes with the pool to itself" in words


def _right_column(out: str) -> str:
    """The summary table's values, their wrapped lines joined (the left column's wrap
    interleaves with them line by line)."""
    return " ".join(" ".join(line.split("│")[2].split()) for line in out.splitlines()
                    if line.count("│") >= 3)


def test_plan_on_a_ray_cluster_that_cannot_be_reached_is_one_line(trace_path, capsys,
                                                                   monkeypatch) -> None:
    """QA: plan --ray with RAY_ADDRESS naming nothing hung in Ray's retries; it is refused
    at once, as serve's Ray backend is (kvserve.ray_tasks.connect)."""
    import socket
    import sys
    from types import SimpleNamespace

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    tried = []
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(
        is_initialized=lambda: False, init=lambda **kwargs: tried.append(kwargs)))
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert main(["plan", "--trace", str(trace_path), "--max-replicas", "2",
                 "--slo-ttft-p99", "1", "--ray", "--num-kv-blocks", "300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot reach the Ray cluster at RAY_ADDRESS=127.0.0.1:{port}" \
        in err[0] and not tried
