"""The unit cost model (every step 1.0 s) on scenarios counted by hand.

Conventions: step k runs from t = k-1 to t = k; tokens sampled in step k appear at t = k.
A request with output_len L samples L tokens and then EOS (L + 1 tokens in all).
"""

from kvserve.sim.report import aggregate

from .helpers import by_id, req, simulate, timings


def test_one_request_prefill_then_decode():
    # prompt 32, output_len 4:
    #   step 1: 32 prompt tokens -> token 1 at t=1 (TTFT 1)
    #   steps 2-5: one token each -> tokens 2, 3, 4 and EOS at t=5
    # 5 steps; scheduled tokens 32 + 4 = 36; 5 output tokens (EOS included); ITL 1.0.
    result = simulate([req("a", 32, 4)])
    a = aggregate(result)
    assert (a["num_steps"], a["duration_s"], a["scheduled_tokens"]) == (5, 5.0, 36)
    assert a["output_tokens"] == 5
    assert (a["ttft_max"], a["itl_max"], a["itl_p50"], a["e2e_max"]) == (1.0, 1.0, 1.0, 5.0)
    assert a["finish_reasons"] == {"stop": 1}
    assert timings(by_id(result)["a"]) == (0.0, 1.0, 5.0)


def test_chunked_prefill_counts_one_step_per_chunk():
    # budget 16 tokens a step, prompt 40, output_len 1:
    #   steps 1, 2: chunks of 16 (no token); step 3: the last 8 -> token 1 at t=3
    #   step 4: EOS at t=4.  4 steps, 41 tokens scheduled, TTFT 3.
    result = simulate([req("a", 40, 1)], max_num_batched_tokens=16, max_num_seqs=16)
    a = aggregate(result)
    assert (a["num_steps"], a["scheduled_tokens"], a["ttft_max"], a["e2e_max"]) == \
        (4, 41, 3.0, 4.0)
    assert list(result.steps.num_scheduled_tokens) == [16, 16, 8, 1]


def test_two_requests_share_the_token_budget():
    # budget 32; a and b: prompt 20, output_len 2, both at t=0.
    #   step 1: a 20 (-> token at t=1), b 12 (mid-prompt, nothing)
    #   step 2: a 1 (token 2), b 8 (-> its first token at t=2)
    #   step 3: a 1 (EOS, a done at t=3), b 1 (token 2)
    #   step 4: b 1 (EOS at t=4)
    result = simulate([req("a", 20, 2), req("b", 20, 2)], max_num_batched_tokens=32,
                      max_num_seqs=16)
    records = by_id(result)
    assert timings(records["a"]) == (0.0, 1.0, 3.0)
    assert timings(records["b"]) == (0.0, 2.0, 4.0)
    assert list(result.steps.num_scheduled_tokens) == [32, 9, 2, 1]
    assert aggregate(result)["num_steps"] == 4


def test_preemption_recompute_and_prefix_hit_by_hand():
    # 4 blocks of 16 tokens (64 slots). a, b: prompt 16, output_len 20 (21 tokens with EOS).
    # Before step s (s >= 2) each has s-1 outputs, s+15 tokens, s+14 computed.
    #   step 1: both prefill 16 (1 block each); steps 2-17: decode, 2 blocks each (pool full).
    #     After step 17 b has computed 32 tokens: its 2nd block is full and hashed.
    #   step 18 (t=17): a needs a 3rd block -> preempt b (the last admitted). b's blocks
    #     go to the free queue tail first: [b1, b0]; a takes b1. b: 17 outputs, 33 tokens.
    #   steps 19-21: b's prompt block b0 is still cached (hit 16 tokens), but the full
    #     sequence (33 tokens = 3 blocks) needs 3 free blocks and 1 is free: blocked.
    #     a samples EOS (its 21st token) at t=21 and frees 3 blocks.
    #   step 22 (t=21): b resumes: hit 16, computes 17 (positions 16-32; 16-31 are
    #     recomputed) -> token 18 at t=22. Stall: preempted at t=17, next token t=22: 5 s;
    #     preempted span: t=17 to the resume at t=21.
    #   steps 23-25: tokens 19, 20, EOS; b done at t=25.
    # Scheduled: a 16 + 20 = 36; b 16 + 16 + 17 + 3 = 52; 88 in all, 16 recomputed.
    # Prefix cache: a (16 queried, 0 hit), b (16, 0): 0 / 32; b again (33, 16) back from
    # its preemption is counted apart (G6).
    result = simulate([req("a", 16, 20), req("b", 16, 20)], num_blocks=4)
    a = aggregate(result)
    assert (a["num_steps"], a["num_preemptions"], a["num_preempted_requests"]) == (25, 1, 1)
    assert (a["scheduled_tokens"], a["recomputed_tokens"]) == (88, 16)
    assert a["wasted_fraction"] == round(16 / 88, 6)
    assert a["prefix_hit_rate"] == 0.0
    assert a["longest_stall_s"] == 5.0
    assert a["kv_usage_peak"] == 1.0
    records = by_id(result)
    assert timings(records["a"]) == (0.0, 1.0, 21.0)
    assert timings(records["b"]) == (0.0, 1.0, 25.0)
    assert records["b"].preempted_spans == [(17.0, 21.0)]
    assert records["b"].itl_max == 5.0
    assert a["blocked_steps"] == {"kv_cache": 3, "preemption": 1}


def test_idle_gap_jumps_to_the_next_arrival():
    # a: t=0, prompt 16, output_len 0 -> EOS at t=1. Nothing runs until b arrives at t=10;
    # b's EOS at t=11. 2 steps; 11 simulated seconds; 2 output tokens.
    result = simulate([req("a", 16, 0), req("b", 16, 0, arrival=10.0)])
    a = aggregate(result)
    assert (a["num_steps"], a["duration_s"], a["output_tokens"]) == (2, 11.0, 2)
    assert a["throughput_output_tok_s"] == round(2 / 11, 6)
    assert list(result.steps.time) == [0.0, 10.0]


def test_cancel_takes_effect_at_the_next_step_boundary():
    # a: prompt 16, output_len 100, cancelled at t=5.5: steps end at t=1..6, so the abort
    # happens at the boundary t=6, after 6 tokens.
    result = simulate([req("a", 16, 100, cancel_time=5.5)])
    record = by_id(result)["a"]
    assert (record.finish_reason, record.stop_reason) == ("abort", "cancelled")
    assert record.num_output_tokens == 6
    assert aggregate(result)["num_steps"] == 6


def test_cancel_before_arrival_means_it_never_runs():
    result = simulate([req("a", 16, 3), req("b", 16, 3, arrival=2.0, cancel_time=1.0)])
    assert by_id(result)["b"].finish_reason == "abort"
    assert by_id(result)["b"].metrics is None
    assert aggregate(result)["num_steps"] == 4


def test_a_client_timeout_after_the_request_finished_never_fires():
    # b finishes at t=4 (prompt 16, 3 tokens + EOS); its timeout at t=1000 is never reached,
    # so the run ends at t=4, not 1000 (it used to wait for it: 0 tok/s, and plan chose the
    # smallest max_num_seqs for a trace of client timeouts)
    from kvserve.core import CacheConfig, SchedulerConfig
    from kvserve.sim.cluster import ClusterOptions, ClusterSimulator
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.simulator import Simulator

    trace = [req("b", 16, 3, cancel_time=1000.0)]
    cluster = ClusterSimulator(Simulator(SchedulerConfig(), CacheConfig(100), UnitCostModel()),
                               ClusterOptions(2), [UnitCostModel(), UnitCostModel()])
    for result in (simulate(trace), cluster.run(trace)):
        assert by_id(result)["b"].finish_reason == "stop"
        assert aggregate(result)["duration_s"] == 4.0


def test_latency_counts_from_when_the_server_received_the_request():
    # a recorded request the server received at t=0 reached the scheduler at t=0.5 (it
    # waited for the step then running). Replaying the recorded steps (each held to its
    # logged start: 0.5, 1.5, ...) it reaches the scheduler at 0.5 as it did; its first token
    # at t=1.5 is a TTFT of 1.5, its queue time 0.5, as its client saw them (the replay used
    # to count from t=0.5)
    from kvserve.sim.cost_models import ReplayCostModel
    from kvserve.sim.report import request_latencies

    trace = [req("a", 16, 3, arrival=0.5, received_time=0.0)]
    replay = ReplayCostModel([1.0] * 4, [16, 1, 1, 1], starts=[0.5, 1.5, 2.5, 3.5])
    record = by_id(simulate(trace, cost_model=replay))["a"]
    assert record.arrival_time == 0.0
    assert request_latencies(record) == {"ttft": 1.5, "e2e": 4.5, "queue": 0.5}


def test_a_run_of_other_steps_hands_a_recorded_request_over_on_receipt():
    # under any other cost model the recorded engine's wait for its step boundary is not
    # this run's (its own steps make that wait): the request reaches the scheduler at t=0,
    # when the server received it. It was handed over at 0.5, so a run under the model the
    # recording was fitted to waited twice (once recorded, once for its own step).
    from kvserve.core import CacheConfig, SchedulerConfig
    from kvserve.sim.cluster import ClusterOptions, ClusterSimulator
    from kvserve.sim.cost_models import UnitCostModel
    from kvserve.sim.report import request_latencies
    from kvserve.sim.simulator import Simulator

    trace = [req("a", 16, 3, arrival=0.5, received_time=0.0)]
    cluster = ClusterSimulator(Simulator(SchedulerConfig(), CacheConfig(100), UnitCostModel()),
                               ClusterOptions(2), [UnitCostModel(), UnitCostModel()])
    for result in (simulate(trace), cluster.run(trace)):
        record = by_id(result)["a"]
        assert request_latencies(record) == {"ttft": 1.0, "e2e": 4.0, "queue": 0.0}


def test_max_tokens_caps_before_eos_and_ignore_eos_runs_to_max_tokens():
    # a: output_len 10 but max_tokens 3 -> "length" after 3 tokens (t=3).
    # b: ignore_eos, output_len 1, max_tokens 5 -> 5 tokens, "length" at t=5.
    result = simulate([req("a", 16, 10, max_tokens=3),
                       req("b", 16, 1, max_tokens=5, ignore_eos=True)])
    records = by_id(result)
    assert (records["a"].finish_reason, records["a"].num_output_tokens) == ("length", 3)
    assert (records["b"].finish_reason, records["b"].num_output_tokens) == ("length", 5)
    assert timings(records["b"])[2] == 5.0


def test_unservable_prompt_is_reported_as_rejected_not_run():
    result = simulate([req("big", 100, 1), req("ok", 16, 1)], num_blocks=4)
    records = by_id(result)
    assert records["big"].finish_reason == "rejected"
    assert "KV blocks" in (records["big"].stop_reason or "")
    assert records["ok"].finish_reason == "stop"
    assert aggregate(result)["finish_reasons"] == {"rejected": 1, "stop": 1}


def test_serial_and_static_batching_hold_arrivals_in_the_loop():
    # a, b, c: prompt 16, output_len 2 (3 tokens each: 3 steps per request alone).
    trace = [req("a", 16, 2), req("b", 16, 2), req("c", 16, 2)]
    # continuous: all three prefill in step 1 and finish at t=3.
    cont = by_id(simulate(trace))
    assert [timings(cont[x])[2] for x in "abc"] == [3.0, 3.0, 3.0]
    # serial: a [0, 3], b [3, 6], c [6, 9]; b's queue time is 3 s, its TTFT 4 s.
    serial = by_id(simulate(trace, batching="serial"))
    assert [timings(serial[x]) for x in "abc"] == [(0.0, 1.0, 3.0), (3.0, 4.0, 6.0),
                                                  (6.0, 7.0, 9.0)]
    # static with max_num_seqs 2: batch {a, b} runs [0, 3], then {c} [3, 6].
    static = by_id(simulate(trace, batching="static", max_num_seqs=2))
    assert [timings(static[x])[2] for x in "abc"] == [3.0, 3.0, 6.0]


def test_static_batch_waits_for_its_slowest_member():
    # a: output_len 1 (done t=2), b: output_len 5 (done t=6); c arrives at t=1 and must
    # wait for the whole batch, although a seat freed at t=2: it starts at t=6.
    trace = [req("a", 16, 1), req("b", 16, 5), req("c", 16, 0, arrival=1.0)]
    static = by_id(simulate(trace, batching="static", max_num_seqs=2))
    assert timings(static["c"]) == (6.0, 7.0, 7.0)
    cont = by_id(simulate(trace, max_num_seqs=2))
    assert timings(cont["c"])[0] == 2.0


def test_queue_timeout_aborts_a_request_that_waited_too_long():
    # max_num_seqs 1: a (output_len 9) runs t=0..10 while b waits. b's queue deadline is
    # t=2.5; the first schedule() after it is at t=3, which aborts b ("queue_timeout").
    result = simulate([req("a", 16, 9), req("b", 16, 1)], max_num_seqs=1,
                      max_queue_delay=2.5)
    b = by_id(result)["b"]
    assert (b.finish_reason, b.stop_reason) == ("abort", "queue_timeout")
    assert b.metrics is not None and b.metrics.finished_time == 3.0
    assert timings(by_id(result)["a"])[2] == 10.0


def test_deadline_misses_are_counted():
    # a finishes at t=3 (deadline 5: met), b at t=3 too (deadline 2: missed).
    result = simulate([req("a", 16, 2, deadline=5.0), req("b", 16, 2, deadline=2.0)])
    assert aggregate(result)["deadline_misses"] == 1


def test_conversation_turns_hit_the_previous_prompt_and_answer():
    # One conversation, 4 turns far apart; each turn adds 64 new tokens to the previous
    # prompt + answer (32 tokens, then EOS). Turn k computes prompt_k + 32 tokens of KV
    # (EOS is sampled, never computed), all full blocks, all hashed:
    #   turn   prompt                 hit (previous prompt + answer)
    #   0      64                     0
    #   1      64 + 32 + 64 = 160     96
    #   2      160 + 96 = 256         192
    #   3      256 + 96 = 352         288
    # hit rate = (96 + 192 + 288) / (64 + 160 + 256 + 352) = 576 / 832.
    prompts = [64, 160, 256, 352]
    trace = [req(f"c-t{k}", p, 32, arrival=100.0 * k, prefix_id="c", prefix_len=p)
             for k, p in enumerate(prompts)]
    result = simulate(trace)
    a = aggregate(result)
    assert a["prefix_hit_rate"] == round(576 / 832, 6)
    assert [r.metrics.num_cached_tokens for r in result.records] == [0, 96, 192, 288]
    # Without prefix caching every turn recomputes its whole prompt.
    uncached = aggregate(simulate(trace, enable_prefix_caching=False))
    assert uncached["scheduled_tokens"] - a["scheduled_tokens"] == 576


def test_a_request_that_preempts_itself_first_leaves_an_empty_step():
    # 3 blocks of 16; victim policy least-computed. a: prompt 16, b: prompt 30, both
    # output_len 2 (3 tokens with EOS).
    #   t=0: a 16, b 30 (3 blocks, pool full) -> tokens at t=1.
    #   t=1: a (first in running) needs a 2nd block; the least-computed victim is a itself
    #        (16 < 30): a is preempted and the running pass ends (D3), so nothing runs:
    #        an empty step, no time passes. The next schedule() at t=1 runs b alone; a is
    #        blocked (17 tokens need 2 blocks, 1 is free).
    #   t=1, t=2: b decodes -> token 2 at t=2, EOS at t=3.
    #   t=3: a resumes; its prompt block is still cached (16-token hit), 1 token to compute
    #        -> token 2 at t=4; EOS at t=5. Preempted span: t=1 to the resume at t=3;
    #        stall: t=1 to the next token at t=4, 3 s.
    result = simulate([req("a", 16, 2), req("b", 30, 2)], num_blocks=3,
                      victim_policy="least-computed")
    assert list(result.steps.num_scheduled_tokens) == [46, 1, 1, 1, 1]
    assert list(result.steps.time) == [0.0, 1.0, 2.0, 3.0, 4.0]
    records = by_id(result)
    assert timings(records["b"])[2] == 3.0
    assert timings(records["a"]) == (0.0, 1.0, 5.0)
    assert records["a"].preempted_spans == [(1.0, 3.0)]
    a = aggregate(result)
    assert (a["num_preemptions"], a["recomputed_tokens"], a["longest_stall_s"]) == (1, 0, 3.0)


def test_a_refused_request_takes_no_seat_in_a_static_batch():
    # Pool of 8 slots: "big" (8 tokens + 1 to generate) can never fit and is refused when
    # handed over; the batch of one seat goes to "small" instead of staying empty forever.
    result = simulate([req("big", 8, 0), req("small", 1, 0)], num_blocks=2, block_size=4,
                      batching="static", max_num_seqs=1)
    records = by_id(result)
    assert records["big"].finish_reason == "rejected"
    assert records["small"].finish_reason == "stop"


def test_a_full_priority_queue_displaces_the_least_urgent_in_a_simulation():  # K5
    # max_num_seqs 1, queue of 1: a runs from t=0; b (priority 50) waits from 0.1; c
    # (priority 0) comes at 0.2 to a full queue and takes b's place: b ends abort,
    # displaced, at 0.2; c runs after a
    result = simulate([req("a", 16, 3, priority=0), req("b", 16, 1, arrival=0.1, priority=50),
                       req("c", 16, 1, arrival=0.2, priority=0)],
                      scheduling_policy="priority", max_num_seqs=1, max_num_queued_reqs=1)
    records = by_id(result)
    assert (records["b"].finish_reason, records["b"].stop_reason) == ("abort", "displaced")
    assert records["b"].metrics.finished_time == 0.2
    assert records["c"].finish_reason == "stop"
