"""`LLM(data_parallel_size=2)`: two engine processes behind the router (docs/scale-out.md)
answer a greedy batch exactly as one engine does, in the prompts' order; a batch with a bad
prompt queues nothing, and one the replicas refuse leaves no request behind."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvserve.core import SamplingParams
from kvserve.engine.data_parallel import replicas_on_this_machine
from kvserve.engine.llm import LLM

from .helpers import TINY, tokenizer, wait_for

SETTINGS = {"num_kv_blocks": 64, "max_model_len": 256, "tokenizer": None}


def settings() -> dict:
    return {**SETTINGS, "tokenizer": tokenizer()}


def batch() -> tuple[list, list[SamplingParams]]:
    """Six prompts of different lengths (two share a 32-token prefix, one is text) and
    different output lengths, so the replicas finish them out of order."""
    shared = list(range(300, 332))
    prompts = [[*shared, 5, 6, 7], [11] * 20, "The capital of France is", [*shared, 8],
               list(range(1000, 1050)), [42] * 3]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (12, 3, 9, 1, 6, 15)]
    return prompts, params


def answers(results: list) -> list[tuple]:
    return [(r.prompt_token_ids, r.token_ids, r.text, r.finish_reason) for r in results]


def pools_whole(llm: LLM) -> bool:
    figures = llm.replicas.engine.engine_figures()
    return len(figures) == 2 and all(
        f.stats.num_running == 0 and f.stats.num_waiting == 0
        and f.stats.num_free_blocks == f.stats.num_blocks for f in figures)


def test_two_replicas_answer_a_greedy_batch_as_one_engine_does_and_refuse_cleanly():
    prompts, params = batch()
    single = LLM(TINY, **settings())
    expected = answers(single.generate(prompts, params, use_tqdm=False))
    long_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    expected_long = answers(single.generate(prompts, long_params, use_tqdm=False))
    assert [len(tokens) for _, tokens, _, _ in expected] == [12, 3, 9, 1, 6, 15]
    with LLM(TINY, data_parallel_size=2, threads_per_replica=1, router="round-robin",
             **settings()) as llm:
        # tokenized here: a bad prompt is refused before any request is queued
        with pytest.raises(ValueError, match="a non-empty list of token ids"):
            llm.generate([[1, 2, 3], []], use_tqdm=False)
        assert llm.replicas.engine.router_figures().decisions == {}
        results = llm.generate(prompts, params, use_tqdm=False)
        assert answers(results) == expected
        assert [r.request_id for r in results] == [str(i) for i in range(6)]
        # round robin (R2): the six requests went 0, 1, 0, 1, 0, 1
        assert llm.replicas.engine.router_figures().decisions == {
            (0, "round_robin"): 3, (1, "round_robin"): 3}
        wait_for(lambda: pools_whole(llm), what="both pools whole")
        with pytest.raises(AttributeError, match="no single engine"):
            _ = llm.engine
        # refused by a replica (longer than max_model_len): the others are aborted
        with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt of 300 tokens .*"
                                             "max_model_len is 256"):
            llm.generate([prompts[0], [9] * 300, prompts[2]], params[:3], use_tqdm=False)
        wait_for(lambda: pools_whole(llm), what="both pools whole after the refusal")
        # the same replicas go on: the same answers, new request ids
        again = llm.generate(prompts[:2], params[:2], use_tqdm=False)
        assert answers(again) == expected[:2]
        assert [r.request_id for r in again] == ["9", "10"]
        # n samples of a prompt are n requests across the replicas, back as one result
        [pair] = llm.generate(prompts[:1], SamplingParams(n=2, max_tokens=3, seed=5,
                                                          ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in pair.outputs] == [3, 3]
        assert [o.request_id for o in pair.outputs] == ["11", "11-1"]
        # an interrupt (Ctrl-C) reaches the loop, not the batch's task: the batch is aborted,
        # as one engine's generate aborts it (the data-parallel pass: it ran on, and the
        # next generate finished it)
        def interrupt() -> None:
            raise KeyboardInterrupt

        def aborted() -> int:  # the replicas' reports arrive while the LLM's loop runs
            llm.replicas.loop.run_until_complete(asyncio.sleep(0.05))
            return sum(f.stats.num_finished.get("abort", 0)
                       for f in llm.replicas.engine.engine_figures())

        before = aborted()  # the refused batch's others above
        llm.replicas.loop.call_later(0.1, interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[7] * 8] * 8, SamplingParams(max_tokens=240, ignore_eos=True),
                         use_tqdm=False)
        wait_for(lambda: aborted() == before + 8 and pools_whole(llm),
                 what="the batch aborted")
        # a replica killed under a batch: its unfinished requests are placed again on the
        # other and read from the start, as the server places a request not streamed (the
        # data-parallel pass: the whole batch failed with EngineDeadError)
        replica = llm.replicas.engine.replicas[0]
        llm.replicas.loop.call_later(0.1, os.kill, replica.pid, signal.SIGKILL)
        assert answers(llm.generate(prompts, long_params, use_tqdm=False)) == expected_long
        assert llm.replicas.engine.replicas[0] is not replica or not replica.is_running
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # its relaunch, meanwhile


def test_the_data_parallel_size_is_checked():
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        LLM(TINY, data_parallel_size=0, **settings())
    import os

    from kvserve.engine.data_parallel import MAX_LOCAL_REPLICAS_PER_CPU

    too_many = MAX_LOCAL_REPLICAS_PER_CPU * (os.cpu_count() or 1) + 1  # a fork storm
    with pytest.raises(ValueError, match=rf"data_parallel_size \(--data-parallel-size\) "
                                         rf"{too_many} would start {too_many} engine"):
        LLM(TINY, data_parallel_size=too_many, **settings())


def test_bad_settings_are_refused_before_any_replica_starts(monkeypatch):
    """With two replicas a bad setting was an EngineStartError (a RuntimeError) after both
    processes had started and died; one engine raises a ValueError at once (QA)."""
    import kvserve.engine.llm as llm_module

    def no_spawn(*args, **kwargs):
        raise AssertionError("replicas were started for settings that cannot run")

    monkeypatch.setattr(llm_module, "ReplicatedEngines", no_spawn)
    for settings, needle in (({"block_size": 0}, "block_size=0 is out of range"),
                             ({"num_kv_blocks": 0}, "num_kv_blocks must be an integer"),
                             ({"max_num_seqz": 4}, r"unknown argument\(s\) max_num_seqz")):
        with pytest.raises(ValueError, match=needle):
            LLM(TINY, tokenizer=tokenizer(), data_parallel_size=2, **settings)


def test_a_script_that_never_closes_its_replicas_still_exits(tmp_path):
    """A script ending with replicas open hung for ever at exit: multiprocessing's exit
    handler waited for engine processes that waited for their pipe (QA, the README's
    example without `with`); then it printed a traceback as it exited (the docs check: the
    exit handler's stop asked for a worker thread after the interpreter had stopped
    giving them)."""
    import subprocess
    import sys

    script = tmp_path / "batch.py"
    script.write_text(
        "from kvserve.core import SamplingParams\n"
        "from kvserve.engine.llm import LLM\n"
        "from kvserve.model.config import ModelConfig\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(ModelConfig(name='t', vocab_size=512, hidden_size=64, "
        "intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, "
        "max_position_embeddings=256), "
        "data_parallel_size=2, threads_per_replica=1, num_kv_blocks=16, max_model_len=64)\n"
        "    [r] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), "
        "use_tqdm=False)\n"
        "    print('tokens', len(r.token_ids))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "tokens 2" in done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, \
        done.stderr


def test_the_host_tier_is_checked_for_every_replica_on_this_machine(monkeypatch):
    """Each local replica allocates its own host tier: -dp 2 with a swap space of 45% of the
    memory each commits 90%, yet the check saw one replica's 45% (a warning) and the
    machine ran out of memory under load (the data-parallel pass). vLLM checks its swap
    space over a node's workers; so does this, before any replica starts."""
    import kvserve.engine.llm as llm_module

    def no_spawn(*args, **kwargs):
        raise AssertionError("replicas were started for settings that cannot run")

    monkeypatch.setattr(llm_module, "ReplicatedEngines", no_spawn)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    each = int(0.45 * total)
    with pytest.raises(ValueError, match=r"swap space of \d+.\d GiB \(2 replicas on this "
                                         r"machine, \d+.\d GiB each\), 9\d% of this machine's "
                                         r"memory .*: more than 70% of it is refused"):
        LLM(TINY, tokenizer=tokenizer(), data_parallel_size=2, num_kv_blocks=8,
            swap_space=each)
    # one engine with the same tier is taken (a warning); nothing is allocated by the check
    llm_module.check_engine_args(TINY, tokenizer=tokenizer(), num_kv_blocks=8, swap_space=each)
    # the KV pools too: two of 60% each are more than the machine holds
    with pytest.raises(ValueError, match=r"the KV cache of .*2 replicas on this machine.*: "
                                         r"more than its memory is refused"):
        LLM(TINY, tokenizer=tokenizer(), data_parallel_size=2, block_size=1024,
            kv_cache_memory=int(0.6 * total))
    # a Ray cluster elsewhere places its replicas where it will: one is checked
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert replicas_on_this_machine(2, "ray") == 1
    assert replicas_on_this_machine(2, "mp") == 2
    monkeypatch.delenv("RAY_ADDRESS")
    assert replicas_on_this_machine(2, "ray") == 2  # the instance a server starts here


def test_a_batch_past_the_replicas_queue_limits_is_refused_as_with_one_engine(
        monkeypatch, caplog):  # K4
    """The data-parallel pass: one engine refuses such a batch as RequestRejected, saying
    generate() queues it whole; two replicas raised the QueueFullError ("retry later"), so an
    `except RequestRejected` written for one engine missed it. And more threads than CPUs
    are warned about, as serve warns (it said nothing offline)."""
    import logging

    import kvserve.engine.data_parallel as data_parallel
    from kvserve.core import RequestRejected

    monkeypatch.setattr(data_parallel.os, "cpu_count", lambda: 1)  # 2 replicas x 1 thread
    limits = {**settings(), "max_num_seqs": 1, "max_num_queued_reqs": 1}
    with caplog.at_level(logging.WARNING, logger="kvserve"), \
            LLM(TINY, data_parallel_size=2, threads_per_replica=1, router="round-robin",
                **limits) as llm:
        assert "2 local replicas x 1 threads = 2 threads on 1 CPUs" in caplog.text
        with pytest.raises(RequestRejected, match=r"^prompts\[\d\]: .*the waiting queue is "
                                                  r"full .*send fewer prompts per call"):
            llm.generate([[5, 6]] * 8, SamplingParams(max_tokens=2), use_tqdm=False)
        wait_for(lambda: pools_whole(llm), what="both pools whole after the refusal")
        assert len(llm.generate([[5, 6]] * 2, SamplingParams(max_tokens=2),
                                use_tqdm=False)) == 2
