"""Every scheduler policy runs a pressured workload to completion inside the simulator, with
the core's invariants checked after every step (the simulator adds no policy of its own)."""

import pytest

from kvserve.sim.report import aggregate
from kvserve.sim.workloads import WorkloadSpec, generate

from .helpers import by_id, req, simulate

TRACE = generate(WorkloadSpec(num_requests=60, rate=40.0, prompt_len="uniform:16,200",
                              output_len="uniform:1,80", prefix_groups=3,
                              prefix_len="fixed:48", prefix_fraction=0.5,
                              priorities="0:1,1:1,2:1", seed=11))


@pytest.mark.parametrize("config", [
    {},
    {"scheduling_policy": "priority"},
    {"scheduling_policy": "lpm"},
    {"scheduling_policy": "dfs-weight"},
    {"scheduling_policy": "lpm", "lpm_max_queue": 4, "schedule_aging_s": 0.05},
    {"scheduling_policy": "priority", "schedule_aging_s": 0.05},
    {"victim_policy": "sglang"},
    {"victim_policy": "least-computed"},
    {"admission_policy": "reserve"},
    {"admission_policy": "adaptive"},
    {"watermark": 0.1},
    {"long_prefill_token_threshold": 32},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 512},
    {"reserve_full_sequence": False},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_policy_finishes_every_request_under_pressure(config):
    config = {"max_num_batched_tokens": 128, "max_num_seqs": 16, "max_model_len": 512,
              **config}
    result = simulate(TRACE, num_blocks=48, **config)  # 768 token slots for 60 requests
    a = aggregate(result)
    assert a["finish_reasons"] == {"stop": 60}, a
    # Every request produced exactly its answer and EOS, however often it was preempted.
    output_len = {r.request_id: r.output_len for r in TRACE}
    assert all(rec.num_output_tokens == output_len[rec.request_id] + 1
               for rec in result.records)
    if config.get("admission_policy") == "reserve":
        assert a["num_preemptions"] == 0  # reserving prompt + max_tokens never preempts


def test_a_sequence_the_pool_cannot_hold_reports_kv_capacity():  # J2
    result = simulate([req("big", 10, 100, ignore_eos=True), req("small", 10, 3)],
                      num_blocks=4, block_size=4, max_model_len=64)
    records = by_id(result)
    assert (records["big"].finish_reason, records["big"].stop_reason) == \
        ("length", "kv_capacity")
    assert records["big"].num_output_tokens == 7  # 16 slots + the last token, never fed back
    assert (records["small"].finish_reason, records["small"].stop_reason) == ("stop", None)
