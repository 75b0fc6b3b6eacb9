"""SimExecutor: the executor contract and the batch shape it reports."""

from kvserve.core import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from kvserve.sim.executor import SimExecutor, batch_view
from kvserve.sim.tokens import EOS_TOKEN_ID, stream_key, stream_token


def _setup(prompts, output_len, budget=64):
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16),
                          CacheConfig(100))
    executor = SimExecutor()
    for name, prompt_len in prompts:
        executor.register(name, prompt_len, output_len, False, stream_key(0, name))
        scheduler.add_request(Request(name, [stream_token(stream_key(1, name), p)
                                             for p in range(prompt_len)],
                                      SamplingParams(max_tokens=100, eos_token_id=EOS_TOKEN_ID)))
    return scheduler, executor


def test_mid_prompt_chunk_gets_no_token_and_eos_follows_output_len():
    # prompt 50, budget 32: step 1 is mid-prompt (no token); step 2 finishes the prompt
    # (token 1); output_len 2 -> tokens 1, 2, then EOS in step 4.
    scheduler, executor = _setup([("a", 50)], output_len=2, budget=32)
    out = scheduler.schedule(0.0)
    model_output = executor.execute(out)
    assert out.num_scheduled_tokens == {"a": 32} and model_output.sampled_token_ids == {}
    scheduler.update(out, model_output, 1.0)
    tokens = []
    for step in range(2, 10):
        out = scheduler.schedule(float(step))
        model_output = executor.execute(out)
        tokens += model_output.sampled_token_ids.get("a", [])
        outputs = scheduler.update(out, model_output, float(step))
        if not scheduler.has_unfinished_requests():
            break
    assert step == 4
    assert len(tokens) == 3 and tokens[-1] == EOS_TOKEN_ID
    assert EOS_TOKEN_ID not in tokens[:-1]
    assert outputs[-1].finish_reason == "stop"


def test_batch_view_counts_context_and_causal_pairs():
    # Step 1: a prefills 10 (c=0, n=10: 55 pairs), b prefills 6 (21 pairs); both sample.
    # Step 2: both decode: a c=10, n=1 (11 pairs), b c=6, n=1 (7 pairs); context 16.
    scheduler, executor = _setup([("a", 10), ("b", 6)], output_len=5)
    out = scheduler.schedule(0.0)
    mo = executor.execute(out)
    v = executor.view
    assert (v.num_seqs, v.num_tokens, v.num_sampled, v.num_decode_seqs) == (2, 16, 2, 0)
    assert (v.context_tokens, v.attention_pairs) == (0, 55 + 21)
    scheduler.update(out, mo, 1.0)
    out = scheduler.schedule(1.0)
    executor.execute(out)
    v = executor.view
    assert (v.num_seqs, v.num_tokens, v.num_sampled, v.num_decode_seqs) == (2, 2, 2, 2)
    assert (v.context_tokens, v.attention_pairs) == (16, 11 + 7)


def test_ignore_eos_continues_the_stream_past_the_drawn_answer():
    # output_len 2 but ignore_eos: the model keeps sampling stream tokens until max_tokens 5
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                          CacheConfig(100))
    executor = SimExecutor()
    key = stream_key(0, "a")
    executor.register("a", 10, 2, True, key)
    scheduler.add_request(Request("a", list(range(100, 110)),
                                  SamplingParams(max_tokens=5, ignore_eos=True,
                                                 eos_token_id=EOS_TOKEN_ID)))
    tokens = []
    for step in range(10):
        out = scheduler.schedule(float(step))
        model_output = executor.execute(out)
        tokens += model_output.sampled_token_ids.get("a", [])
        scheduler.update(out, model_output, float(step))
        if not scheduler.has_unfinished_requests():
            break
    assert tokens == [stream_token(key, p) for p in range(10, 15)]


def test_batch_view_from_the_output_alone_equals_the_executors_view():
    """What an engine records (batch_view of its SchedulerOutput) is the shape the simulator
    prices: the same on every step of a run with chunked prefill and preemption."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4),
                          CacheConfig(12, block_size=4))
    executor = SimExecutor()
    for i, prompt_len in enumerate((30, 9, 17, 5, 22)):
        name = f"r{i}"
        executor.register(name, prompt_len, 8 + i, False, stream_key(0, name))
        scheduler.add_request(Request(name, [stream_token(stream_key(1, name), p)
                                             for p in range(prompt_len)],
                                      SamplingParams(max_tokens=100, eos_token_id=EOS_TOKEN_ID)))
    steps = 0
    while scheduler.has_unfinished_requests() and steps < 500:
        out = scheduler.schedule(float(steps))
        model_output = executor.execute(out)
        assert batch_view(out, len(model_output.sampled_token_ids)) == executor.view
        scheduler.update(out, model_output, float(steps))
        steps += 1
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions > 0  # the pool of 12 blocks of 4 was short
