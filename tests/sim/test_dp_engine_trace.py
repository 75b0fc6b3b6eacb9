"""The calibrated simulator on benchmarks/data_parallel.py's engine conversation trace (issue
14, "Show it"): prefix affinity beats round robin on hit rate and TTFT on two one-thread
replicas, the ordering the engine showed (docs/scale-out.md, "Data parallel on the engine").

The cost model is the one-thread calibration that section prints, so the simulated cluster
is as busy as the engine's replicas were; with the uncalibrated roofline (ten times faster
than this engine) it would see an idle cluster instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.cluster_report import add_cluster_sections
from kvserve.sim.deployment import Deployment
from kvserve.sim.report import build_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from data_parallel_engine import conversations

# `kvserve calibrate --trace` of one replica with one thread (docs/scale-out.md prints it).
ONE_THREAD = {"fixed_s": 0.030065441731541576,
              "per_token_s": 0.0012280013783227996,
              "per_context_token_s": 1.3287627540536217e-06,
              "per_attention_pair_s": 1.1877260000567914e-06}
MIN_TOKENS = 4
TRACE = dict(num_requests=48, rate=0.25, think_time=3.0)  # the benchmark's defaults


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("cal") / "one-thread.json"
    path.write_text(json.dumps({"format": "kvserve-cost-model/1", "coefficients": ONE_THREAD,
                                "min_tokens": MIN_TOKENS}))
    deployment = Deployment(model="smollm2-135m", hardware="cpu-local", dtype="bf16",
                            cost_model="calibrated", calibration=str(path))
    trace = conversations(**TRACE)
    out = {}
    for policy in ("round-robin", "prefix-affinity"):
        echo, result = deployment.simulate(trace, {"kv_cache_memory": 1 << 30},
                                           cluster=ClusterOptions(2, policy))
        out[policy] = add_cluster_sections(build_report(echo, result), result)
    return out


def test_benchmark_trace_is_the_documented_one() -> None:
    trace = conversations(**TRACE)
    assert len(trace) == 48
    assert len({r.request_id.split("-")[0] for r in trace}) == 11


def test_affinity_beats_round_robin_on_hits_and_ttft_r4(reports) -> None:
    rr, pa = reports["round-robin"]["aggregate"], reports["prefix-affinity"]["aggregate"]
    assert rr["num_finished"] == pa["num_finished"] == 48
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.2
    assert pa["ttft_p50"] < rr["ttft_p50"]
    assert reports["prefix-affinity"]["router"]["decisions"].get("imbalance", 0) == 0
