"""The decode lane (issue 15, item 3; core/decode_lane.py, docs/simulator-speed.md) changes
how fast the simulator runs and nothing else: on random traces, under every order, victim,
admission and preemption policy, with prefix caching, priorities, cancellations, queue
limits, swap, prefill-first steps and data-parallel replicas, a run with the lane on and one
with it off give the same report byte for byte and the same raw figures (every ITL sample,
every step, every record's float sums, the event log)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.sim import report as reports
from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.deployment import Deployment
from kvserve.sim.simulator import SimResult

from .helpers import req

DEPLOYMENT = Deployment(model="llama-3.1-8b", hardware="h100-sxm")

requests = st.lists(
    st.tuples(st.integers(1, 150),  # prompt
              st.integers(0, 60),  # output
              st.floats(0.0, 0.3),  # arrival (s): a step here is ~10-20 ms
              st.one_of(st.none(), st.floats(0.0, 0.6)),  # cancel time
              st.booleans(),  # ignore_eos
              st.one_of(st.none(), st.integers(1, 70))),  # max_tokens
    min_size=1, max_size=16)

POLICIES = [
    {}, {}, {"scheduling_policy": "priority"},
    {"scheduling_policy": "priority", "enable_priority_preemption": True,
     "priority_preemption_threshold": 0},
    {"scheduling_policy": "lpm"}, {"scheduling_policy": "dfs-weight"},
    {"tenant_fairness": "vtc"}, {"schedule_aging_s": 0.05, "scheduling_policy": "priority"},
    {"victim_policy": "sglang"}, {"victim_policy": "least-computed"},
    {"admission_policy": "reserve"}, {"admission_policy": "adaptive"}, {"watermark": 0.2},
    {"preemption_mode": "swap", "num_host_blocks": 64},
    {"preemption_mode": "auto", "num_host_blocks": 8},
    {"long_prefill_token_threshold": 24}, {"enable_chunked_prefill": False},
    {"max_num_queued_reqs": 3}, {"max_queue_delay": 0.05},
    {"step_mix": "prefill-first"}, {"step_mix": "prefill-first", "max_prefill_only_steps": 2},
]


def fingerprint(echo: dict[str, Any], result: SimResult) -> dict[str, Any]:
    """The report as written, and the raw figures under it (floats by repr)."""
    steps = result.steps
    return {
        "report": reports.dumps(reports.build_report(echo, result)),
        "itl": bytes(result.itl_samples),
        "steps": [bytes(getattr(steps, name)) for name in (
            "time", "duration", "num_scheduled_tokens", "num_running", "num_waiting",
            "kv_usage")],
        "records": [repr((r.request_id, r.finish_reason, r.stop_reason, r.metrics,
                          r.num_output_tokens, r.itl_sum, r.itl_max, r.last_token_time,
                          r.preempted_spans)) for r in result.records],
        "events": [repr(e) for e in result.events],
        "counts": (result.num_preemptions, result.num_scheduled_tokens,
                   result.num_recomputed_tokens, result.prefix_cache_queries,
                   result.prefix_cache_hits, sorted(result.num_blocked_steps.items()),
                   result.num_swapped_out_blocks, result.num_swapped_in_blocks),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests,
       num_blocks=st.integers(4, 80),
       block_size=st.sampled_from([1, 4, 16]),
       max_num_seqs=st.integers(1, 10),
       budget=st.sampled_from([16, 64, 512]),
       policy=st.sampled_from(POLICIES),
       prefix=st.sampled_from([None, 8, 40]),
       caching=st.booleans(),
       batching=st.sampled_from(["continuous", "continuous", "static", "serial"]),
       record_events=st.booleans(),
       replicas=st.sampled_from([1, 1, 1, 2]))
def test_the_lane_on_or_off_gives_the_same_run(requests, num_blocks, block_size, max_num_seqs,
                                               budget, policy, prefix, caching, batching,
                                               record_events, replicas):
    trace = [req(f"r{i}", prompt, output, arrival=arrival, priority=i % 3,
                 cancel_time=cancel, ignore_eos=ignore_eos, max_tokens=max_tokens,
                 tenant=f"t{i % 2}",
                 **({"prefix_id": f"p{i % 2}", "prefix_len": min(prompt, prefix)}
                    if prefix else {}))
             for i, (prompt, output, arrival, cancel, ignore_eos, max_tokens)
             in enumerate(requests)]
    if replicas > 1:
        batching = "continuous"  # a cluster holds no arrivals back
    if policy.get("enable_chunked_prefill") is False:
        budget = max(budget, 256)  # a whole prompt fits one step
    run_settings = {"num_kv_blocks": num_blocks, "block_size": block_size,
                    "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max(budget, max_num_seqs),
                    "max_model_len": 256, "enable_prefix_caching": caching,
                    "batching": batching, **policy}
    cluster = ClusterOptions(data_parallel_size=replicas) if replicas > 1 else None
    runs = [fingerprint(*DEPLOYMENT.simulate(trace, run_settings, record_events=record_events,
                                             cluster=cluster, fast_forward=on))
            for on in (False, True)]
    assert runs[0] == runs[1]


def test_the_lane_carries_most_decode_steps_of_a_busy_run() -> None:
    """Not a timing: the lane is really used where it should be (a lane that never formed
    would pass the property above trivially). 60 requests of 100 prompt tokens, 200 output
    tokens and EOS: 2,048-token steps prefill them 20 at a time, each group joining the lane
    the step after its prefill, and leaving it the step it samples EOS."""
    from kvserve.core.decode_lane import DecodeLane

    trace = [req(f"r{i}", 100, 200, arrival=0.0) for i in range(60)]
    lane_steps: list[int] = []
    original = DecodeLane.begin_step

    def counting(self, step):  # type: ignore[no-untyped-def]
        length = original(self, step)
        lane_steps.append(length)
        return length

    DecodeLane.begin_step = counting  # type: ignore[method-assign]
    try:
        _, result = DEPLOYMENT.simulate(trace, {"num_kv_blocks": 4000, "max_model_len": 1024})
    finally:
        DecodeLane.begin_step = original  # type: ignore[method-assign]
    assert result.num_steps == len(lane_steps) == 203
    assert lane_steps[:4] == [0, 20, 40, 60]
    assert lane_steps[-3:] == [60, 40, 20]
    assert lane_steps.count(60) == 198
    assert all(r.num_output_tokens == 201 and r.finish_reason == "stop"
               for r in result.records)


def test_conversations_with_and_without_sessions_are_the_same_with_the_lane(tmp_path) -> None:
    """Multi-turn conversations (a turn arrives when the previous one ends): with sessions
    off the lane runs and the turns' arrivals follow the same finishes; with sessions
    holding KV (U2) the lane stays off. Either way the run is the one stepping gives."""
    from kvserve.cli import main
    from kvserve.sim.trace import read_trace

    path = tmp_path / "conv.jsonl"
    assert main(["workload", "gen", "-n", "120", "--rate", "4", "--turns", "uniform:1,4",
                 "--think-time", "0.5", "--sessions", "--prompt-len", "uniform:50,400",
                 "--output-len", "uniform:10,120", "--seed", "3", "-o", str(path)]) == 0
    trace = read_trace(str(path))
    assert any(r.session_id is not None for r in trace)
    for extra in ({}, {"max_session_kv": 0.3}):
        run_settings = {"num_kv_blocks": 400, "enable_prefix_caching": True, **extra}
        runs = [fingerprint(*DEPLOYMENT.simulate(trace, run_settings, fast_forward=on))
                for on in (False, True)]
        assert runs[0] == runs[1]
