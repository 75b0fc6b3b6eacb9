"""Property: any small trace under any policy and pool size runs to the end in the
simulator, invariants hold after every step, and every admitted request gets exactly its
answer (output_len tokens, then EOS) unless a length limit stops it first."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.sim.report import aggregate

from .helpers import req, simulate

requests = st.lists(
    st.tuples(st.integers(1, 120), st.integers(0, 40), st.integers(0, 20),
              st.one_of(st.none(), st.integers(0, 40))),  # prompt, output, arrival, cancel
    min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests,
       num_blocks=st.integers(2, 40),
       block_size=st.sampled_from([4, 16]),
       max_num_seqs=st.integers(1, 8),
       budget=st.sampled_from([8, 32, 300]),
       policy=st.sampled_from([{}, {"scheduling_policy": "priority"},
                               {"victim_policy": "sglang"}, {"victim_policy": "least-computed"},
                               {"admission_policy": "reserve"},
                               {"admission_policy": "adaptive"}, {"watermark": 0.2}]),
       prefix=st.booleans(),
       batching=st.sampled_from(["continuous", "continuous", "static", "serial"]),
       overload=st.sampled_from([{}, {}, {"max_num_queued_reqs": 2},
                                 {"max_queue_delay": 3.0}]))
def test_every_request_ends_with_its_answer(requests, num_blocks, block_size, max_num_seqs,
                                            budget, policy, prefix, batching, overload):
    trace = [req(f"r{i}", prompt, output, arrival=float(arrival), priority=i % 3,
                 cancel_time=None if cancel is None else float(cancel),
                 **({"prefix_id": "p", "prefix_len": min(prompt, 24)} if prefix else {}))
             for i, (prompt, output, arrival, cancel) in enumerate(requests)]
    result = simulate(trace, num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max(budget, max_num_seqs), max_model_len=256,
                      batching=batching, **policy, **overload)
    pool = num_blocks * block_size
    for trace_request, record in zip(sorted(trace, key=lambda r: (r.arrival_time,
                                                                  r.request_id)),
                                     result.records, strict=True):
        prompt = trace_request.prompt_len
        if record.finish_reason == "abort":
            if record.stop_reason == "queue_timeout":
                assert "max_queue_delay" in overload and record.num_output_tokens == 0
            elif record.stop_reason == "displaced":  # K5: a more urgent arrival's place
                assert "max_num_queued_reqs" in overload and record.num_output_tokens == 0
                assert policy.get("scheduling_policy") == "priority"
            else:
                assert record.stop_reason == "cancelled"
                assert trace_request.cancel_time is not None
            assert record.num_output_tokens <= trace_request.output_len + 1
            continue
        if record.finish_reason == "queue_full":
            assert "max_num_queued_reqs" in overload
            continue
        if prompt + 1 > pool or prompt >= 256:
            assert record.finish_reason == "rejected"
        elif record.finish_reason == "stop":
            assert record.num_output_tokens == trace_request.output_len + 1
        else:
            # Capped: the sequence reached the model length or outgrew the whole pool (J2).
            assert record.finish_reason == "length", record
            assert prompt + record.num_output_tokens >= min(256, pool + 1)
    assert aggregate(result)["num_requests"] == len(trace)
