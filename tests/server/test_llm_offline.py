"""The offline API, ``LLM(...).generate`` and ``chat``, taken as a vLLM user takes it: vLLM's
dict prompts, a refused prompt that leaves nothing behind, and bad arguments named, not a
Python error from deep inside (README, "Generate with the real model")."""

from __future__ import annotations

import pytest

import kvserve
from kvserve.core import RequestError, SamplingParams
from kvserve.engine.llm import LLM

from .helpers import TINY, tokenizer

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64, max_model_len=256,
               dtype="float32")


def ids(results):
    return [r.token_ids for r in results]


def test_a_refused_prompt_leaves_nothing_queued_and_the_llm_works_on(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt token ids must be in "
                                         r"\[0, 49152\)"):
        llm.generate(["The capital of France is", [-1]], GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: .*max_model_len is 256"):
        llm.generate(["a", [5] * 300], GREEDY)  # named by its place, not an internal id
    assert not llm.engine.has_unfinished_requests()  # the first prompt was taken back
    [result] = llm.generate("Water boils at", GREEDY)
    assert result.finish_reason == "length" and len(result.token_ids) == 4


def test_a_step_that_fails_before_the_forward_leaves_the_prefix_cache_sound(llm):  # G3
    """QA (offline API fuzz): an interrupt in a step after schedule(), before the model
    wrote the KV, ended the call's requests by abort with their new blocks left in the
    prefix cache; the same prompt then hit the unwritten blocks and generated other text."""
    prompt = list(range(100, 150))  # three full blocks of 16
    [truth] = llm.generate([prompt], GREEDY)
    assert llm.engine.scheduler.kv.reset_prefix_cache()
    executor = llm.engine.executor
    execute = executor.execute

    def interrupted(scheduler_output):
        executor.execute = execute
        raise KeyboardInterrupt

    executor.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY)
    assert executor.execute == execute
    assert not llm.engine.scheduler.kv.pool.cached  # nothing it registered was written
    [after] = llm.generate([prompt], GREEDY)
    assert after.token_ids == truth.token_ids


def test_a_batch_past_the_queue_limits_is_refused_as_never_fitting():  # K4
    """QA (offline API fuzz): a QueueFullError ("retry later") for a batch that, queued
    whole by generate(), could never fit; nothing is left queued."""
    from kvserve.core import RequestRejected

    small = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=16, max_num_seqs=1,
                max_num_queued_reqs=1)
    with pytest.raises(RequestRejected, match=r"prompts\[2\]: the waiting queue is full .*"
                                              "send fewer prompts per call"):
        small.generate([[5, 6]] * 5, GREEDY, use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    assert len(small.generate([[5, 6]] * 2, GREEDY, use_tqdm=False)) == 2


def test_token_ids_the_sampling_params_name_are_checked_against_the_vocabulary(llm):
    """logit_bias, allowed_token_ids and stop_token_ids outside the vocabulary would do
    nothing (or leave nothing to sample): a ValueError naming the field, nothing queued."""
    for params in (SamplingParams(logit_bias={49152: 5.0}),
                   SamplingParams(allowed_token_ids=[3, 50000]),
                   SamplingParams(stop_token_ids=[60000]),
                   # QA: with choices, which end only at EOS, it ran on to max_tokens
                   SamplingParams(eos_token_id=49152, choices=["yes", "no"])):
        field = next(name for name in ("logit_bias", "allowed_token_ids", "stop_token_ids",
                                       "eos_token_id") if getattr(params, name))
        with pytest.raises(ValueError, match=rf"{field} holds token id\(s\) outside the "
                                             r"vocabulary \[0, 49152\)"):
            llm.generate("hello", params)
    assert not llm.engine.has_unfinished_requests()
    [forced] = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0,
                                                    logit_bias={42: 100}))
    assert forced.token_ids == [42, 42, 42]


def test_bad_words_offline_are_tokenized_by_the_engine(llm):
    plain = llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0,
                                                                    ignore_eos=True))
    word = plain[0].text.split()[0]
    [banned] = llm.generate("The capital of France is", SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, bad_words=[word]))
    assert word not in banned.text.split() and banned.text != plain[0].text


@pytest.mark.parametrize("params", [SamplingParams(bad_words=["ok", "\ud800"]),
                                    SamplingParams(choices=["\ud800"])])
def test_a_bad_word_or_choice_that_is_not_text_is_named_by_its_field(llm, params):
    """QA (offline API fuzz): "prompts[0]: the text is not valid UTF-8", the prompt blamed."""
    field = "bad_words" if params.bad_words else "choices"
    with pytest.raises(ValueError, match=rf"^prompts\[0\]: {field}: the text is not valid"):
        llm.generate("hello", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_choices_offline_are_tokenized_by_the_engine(llm):
    [result] = llm.generate("The sky is", SamplingParams(temperature=1.0, seed=4, n=3,
                                                         choices=["blue", "grey"]))
    assert [sample.text in ("blue", "grey") for sample in result.outputs] == [True] * 3
    assert result.finish_reason == "stop"


def test_json_mode_offline_keeps_the_output_json(llm):
    from kvserve.model.json_mode import DONE, read

    [result] = llm.generate("A cat as JSON:", SamplingParams(max_tokens=40, temperature=1.0,
                                                             seed=2, n=3, json_object=True))
    for sample in result.outputs:
        state = read(sample.text.encode())
        assert state is not None and sample.text.lstrip().startswith("{")
        assert (state.mode == DONE) == (sample.finish_reason == "stop")


def test_vllm_dict_prompts_are_the_prompts_they_name(llm):
    text = llm.generate("Hello there", GREEDY)
    as_dict = llm.generate({"prompt": "Hello there"}, GREEDY)
    prompt_ids = text[0].prompt_token_ids
    as_ids = llm.generate([{"prompt_token_ids": prompt_ids}, {"prompt": "Hello there"}],
                          GREEDY)
    assert as_dict[0].prompt_token_ids == prompt_ids
    assert ids(as_ids) == ids(text) * 2 and as_ids[0].prompt_token_ids == prompt_ids


@pytest.mark.parametrize(("prompts", "needle"), [
    (None, "prompts must be a string"),
    (5, "prompts must be a string"),
    (b"hello", "got bytes"),
    ({"prompt": "x", "multi_modal_data": {}}, "got keys ['multi_modal_data', 'prompt']"),
    ([{"role": "user", "content": "hi"}, "text"], "prompts[0] is one chat message"),
    (["ok", 3.5], "prompts[1] must be a string"),
])
def test_a_prompt_of_no_known_form_is_named(llm, prompts, needle):
    with pytest.raises((TypeError, ValueError)) as error:
        llm.generate(prompts, GREEDY)
    assert needle in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_of_another_kind_are_named(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate("a", {"max_tokens": 3})
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):  # as vLLM
        llm.generate(["a", "b"], [GREEDY])


@pytest.mark.parametrize(("messages", "needle"), [
    ([{"role": "user"}], "messages[0] (user) has no string 'content'"),
    ([{"content": "hi"}], "messages[0] must be a dict with a string 'role'"),
    ("hello", "chat() takes a conversation"),
    ([], "chat() takes a conversation"),
])
def test_a_bad_chat_message_is_named_before_the_template_runs(llm, messages, needle):
    with pytest.raises(TypeError) as error:
        llm.chat(messages, GREEDY)
    assert needle in str(error.value)


@pytest.mark.parametrize(("prompts", "needle"), [
    ([{"role": "user", "content": None}], "prompts[0]: messages[0] (user) has no string"),
    ([{"role": "user"}], "prompts[0]: messages[0] (user) has no string 'content'"),
    ([[{"role": "user", "content": "Hi"}], [{"role": 5, "content": "hi"}]],
     "prompts[1]: messages[0] must be a dict with a string 'role'"),
])
def test_a_conversation_given_to_generate_is_checked_as_chat_checks_it(llm, prompts, needle):
    """QA (offline API fuzz): the chat template failed on these with a TypeError or
    jinja2's UndefinedError naming neither the prompt nor the message."""
    with pytest.raises(TypeError) as error:
        llm.generate(prompts, GREEDY)
    assert needle in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_none_is_vllms_default_for_stop_and_stop_token_ids():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert (params.stop, params.stop_token_ids) == ((), ())
    with pytest.raises(RequestError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(RequestError, match="seed must be an integer in"):
        SamplingParams(seed=1 << 64)
    with pytest.raises(RequestError, match="max_queue_delay must be a number of seconds > 0"):
        SamplingParams(max_queue_delay=0)


def test_the_package_exports_vllms_two_names_lazily():
    assert kvserve.LLM is LLM and kvserve.SamplingParams is SamplingParams
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kvserve.Nope  # noqa: B018


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"block_size": 0}, "block_size=0 is out of range"),
    ({"seed": 1 << 64}, "seed must be an integer in"),
    ({"max_queue_delay": 0}, "max_queue_delay=0 is out of range"),
    ({"num_kv_blocks": 0}, r"num_kv_blocks must be an integer in \[1, "),
    ({"kv_cache_memory": -1}, "kv_cache_memory must be >= 1 bytes"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: 'lots' is not a size"),
    ({"swap_space": -1}, "swap_space must be >= 0 bytes"),
    ({"device": 3}, "device must be a name such as 'cpu' or 'cuda', got 3"),
    ({"router": "random"}, "unknown router 'random'"),
    ({"tokenizer": "no/such/file"}, "tokenizer: model path no/such/file does not exist"),
    # torch's allocator failed after the model loaded (QA: --swap-space 100000)
    ({"swap_space": 1 << 50}, r"swap space of 1048576.0 GiB, \d+% of this machine's memory "
                              r"\(\d+.\d GiB\): more than 70% of it is refused"),
    # as vLLM refuses its swap space above 70% of the memory; num_host_blocks too (the
    # sessions pass: only warned, and not checked)
    ({"swap_space": "1TiB", "preemption_mode": "swap"}, r"more than 70% of it is refused"),
    ({"num_host_blocks": 10_000_000, "preemption_mode": "swap"},
     r"num_host_blocks=10000000's host tier of \d+.\d GiB, .*: more than 70% of it is "
     r"refused"),
    # QA (offline API fuzz): each refused only after the model loaded
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
    ({"kv_cache_memory": 1}, "kv cache memory of 1 bytes holds no block"),
    ({"kv_cache_memory": "10TiB"}, r"kv_cache_memory of 10240.0 GiB is \d+ blocks of 16 "
                                   r"tokens, more than a pool holds"),
    ({"kv_cache_memory": "4TiB", "block_size": 1024},
     r"the KV cache of 4096.0 GiB, \d+% of this machine's memory .*: more than its memory "
     r"is refused"),
    ({"num_kv_blocks": 1 << 24, "block_size": 1024},
     r"the KV cache of \d+.\d GiB, .*: more than its memory is refused"),
    ({"preemption_mode": "swap"}, r"preemption_mode='swap' needs a host KV tier"),
])
def test_bad_engine_settings_are_refused_before_the_model_loads(kwargs, needle, monkeypatch):
    """Refused at once, not after loading the model (QA: num_kv_blocks=0 took 4-16 s on the
    bundled model; a string size and a device number failed inside with a TypeError)."""
    import kvserve.engine.llm as llm_module

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded before the setting was checked")

    monkeypatch.setattr(llm_module, "load_model", no_load)
    settings = {"tokenizer": tokenizer(), "num_kv_blocks": 8, **kwargs}
    if "kv_cache_memory" in kwargs and "num_kv_blocks" not in kwargs:
        del settings["num_kv_blocks"]
    from kvserve.model.loader import ModelNotFoundError

    with pytest.raises((ValueError, ModelNotFoundError), match=needle):
        LLM(TINY, **settings)


def test_vllms_no_op_arguments_are_taken_and_a_real_request_for_them_refused(caplog):
    """QA (offline API fuzz): LLM(enforce_eager=True), trust_remote_code=True and
    tensor_parallel_size=1, in most vLLM scripts, were refused as unknown arguments, though
    serve takes the same flags as no-ops. Each is taken, logging why it changes nothing; a
    tensor-parallel size above 1 is refused with what to give instead."""
    import logging

    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, enforce_eager=True,
                  trust_remote_code=True, tensor_parallel_size=1, kv_cache_dtype="auto",
                  logprobs_mode="raw_logprobs")
    assert "enforce_eager=True is taken and changes nothing: there are no CUDA graphs" \
        in caplog.text
    assert "trust_remote_code=True is taken and changes nothing: no model code is run" \
        in caplog.text
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not taken here \(one "
                                         r"engine holds the whole model.*\); only 1; give "
                                         r"nothing \(no tensor parallelism here\)"):
        LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not taken here"):
        LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs' is not taken"):
        LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, logprobs_mode="processed_logprobs")


def test_sizes_take_units_and_the_tokenizer_a_path_as_in_vllm():
    from kvserve.model.loader import default_model_path

    llm = LLM(TINY, tokenizer=str(default_model_path()), kv_cache_memory="1MiB",
              swap_space="1MiB", preemption_mode="swap")
    config = llm.engine.scheduler.cache_config
    per_block = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 4 * 16
    assert config.num_blocks == (1 << 20) // per_block > 0
    assert config.num_host_blocks == config.num_blocks
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


def test_text_that_is_not_unicode_is_named_and_a_closed_llm_says_so(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: the text is not valid UTF-8: "
                                         r"character 3 \(after 'ok '\) is an undecodable"):
        llm.generate(["fine", "ok \udcff"], use_tqdm=False)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        llm.chat([{"role": "user", "content": "\ud800"}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    closed = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8)  # the fixture is shared
    closed.close()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        closed.generate("hi", use_tqdm=False)


def test_a_vllm_gpu_argument_says_what_sizes_the_same_thing_here():
    with pytest.raises(ValueError, match=r"unknown argument\(s\) gpu_memory_utilization "
                                         r"\(gpu_memory_utilization: give kv_cache_memory"):
        LLM(TINY, tokenizer=tokenizer(), gpu_memory_utilization=0.5)


def test_a_result_reads_as_vllms_request_output(llm):
    result = llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    sequence = result.outputs[0]  # vLLM's RequestOutput.outputs[0] (QA: AttributeError)
    assert (sequence.text, sequence.token_ids, sequence.finish_reason) == \
        (result.text, result.token_ids, "length")
    assert len(result.outputs) == 1 and result.prompt_token_ids


def test_n_samples_come_back_as_vllms_outputs_seeded_repeatably(llm):
    """SamplingParams(n=3) offline: one result per prompt with n outputs (vLLM's
    RequestOutput.outputs), sample k seeded seed + k as the server seeds it."""
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first, second = llm.generate(["Hello", "Water boils at"], [sampled, greedy],
                                 use_tqdm=False)
    assert [o.index for o in first.outputs] == [0, 1, 2] and len(second.outputs) == 1
    texts = [tuple(o.token_ids) for o in first.outputs]
    assert len(set(texts)) == 3 and all(len(t) == 8 for t in texts)  # three draws
    assert first.text == first.outputs[0].text  # the result is sample 0, as before
    again = llm.generate("Hello", sampled, use_tqdm=False)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == texts  # seeded: repeatable
    assert all(o.prompt_token_ids == first.prompt_token_ids for o in first.outputs)
    assert not llm.engine.has_unfinished_requests()


def test_n_is_checked_and_a_request_is_one_sequence(llm):
    with pytest.raises(RequestError, match=r"n must be an integer in \[1, 4096\], got 0"):
        SamplingParams(n=0)
    # n greedy sequences would be one answer repeated: refused, as vLLM's
    with pytest.raises(RequestError, match="n must be 1 when sampling greedily"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=1e-6).n == 2  # vLLM samples it (at 0.01)
    # vLLM's: seed -1 is no seed
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    # a sample seeded -1 (seed - 2 + 1) stays seeded (QA: it became unseeded)
    assert [s.seed for s in SamplingParams(seed=-2, n=3).samples()] == [-2, (1 << 64) - 1, 0]
    with pytest.raises(RequestError, match="a session turn is one sequence: got n=2"):
        SamplingParams(n=2, session_id="s")  # when built, as every other bad n (QA)
    with pytest.raises(RequestError, match="n=2; a request is one sequence"):
        llm.engine.add_request("direct", [1, 2, 3], SamplingParams(n=2))
    # the seed range wraps rather than overflow: sample 1 of the largest seed is the smallest
    top = SamplingParams(n=2, seed=(1 << 64) - 1).samples()
    assert [p.seed for p in top] == [(1 << 64) - 1, 0] and {p.n for p in top} == {1}
    assert not llm.engine.has_unfinished_requests()


def test_a_result_has_vllms_finished_cumulative_logprob_and_none_for_no_logprobs(llm):
    """logprobs was [] where none were asked for (vLLM: None), and finished and
    cumulative_logprob were missing (QA)."""
    plain = llm.generate("Hi", GREEDY, use_tqdm=False)[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.finished
    asked = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0, logprobs=1),
                         use_tqdm=False)[0]
    assert asked.cumulative_logprob == pytest.approx(
        sum(entry[token] for token, entry in zip(asked.token_ids, asked.logprobs,
                                                 strict=True)))
    assert asked.cumulative_logprob < 0


def test_a_request_without_logprobs_gets_none_beside_one_with_them(llm):
    """QA (fuzz): a request that asked for no logprobs, in steps beside one that did, got
    an empty entry for each token sampled in those steps (the HTTP answer: null logprobs,
    fewer than its tokens); the one that asked gets one per token."""
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    asked = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    without, with_ = llm.generate(["Hi", "Hello there"], [plain, asked], use_tqdm=False)
    assert without.logprobs is None and without.cumulative_logprob is None
    assert len(with_.logprobs) == len(with_.token_ids) == 4
    assert all(token in entry for token, entry in zip(with_.token_ids, with_.logprobs,
                                                      strict=True))


def test_prompt_logprobs_offline_as_vllm_gives_them(llm):  # G8
    [result] = llm.generate("The capital of France is",
                            SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(result.prompt_token_ids)
    assert entries[0] is None
    for token_id, entry in zip(result.prompt_token_ids[1:], entries[1:], strict=True):
        assert token_id in entry and 2 <= len(entry) <= 3 and max(entry.values()) <= 0
    plain = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.token_ids[:2] == result.token_ids


def test_the_progress_bar_counts_prompts_as_vllms(llm, monkeypatch):
    """n samples of a prompt are one step of the bar (it counted sequences: 3/3 for one
    prompt of n=3; QA)."""
    import tqdm

    bars = []

    class Bar:
        def __init__(self, total: int, **_: object) -> None:
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, count: int) -> None:
            self.done += count

        def close(self) -> None:
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    llm.generate(["a", "b"], SamplingParams(n=3, max_tokens=2))
    assert [(bar.total, bar.done) for bar in bars] == [(2, 2)]


def test_logprobs_read_as_vllms_logprob_objects_and_as_floats(llm):
    """RL code reads entry[token].logprob (vLLM's Logprob): it was an AttributeError (QA). A
    value is still the float it was, with .logprob, .rank and .decoded_token."""
    result = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    for token, entry in zip(result.token_ids, result.logprobs, strict=True):
        own = entry[token]
        assert own.logprob == float(own) == own and own.rank == 1  # greedy: the likeliest
        assert own.decoded_token == llm.tokenizer.decode([token])
        assert sorted(e.rank for e in entry.values()) == [1, 2]
    for token, entry in zip(result.prompt_token_ids[1:], result.prompt_logprobs[1:],
                            strict=True):
        assert entry[token].rank >= 1 and entry[token].logprob <= 0
    assert result.cumulative_logprob == pytest.approx(
        sum(float(e[t]) for t, e in zip(result.token_ids, result.logprobs, strict=True)))


def test_a_sampled_tokens_rank_is_over_the_whole_vocabulary(llm):
    """QA (sampling pass): with logprobs=0 every sampled token read rank 1 (a rank-58 one
    too), and one at rank k within the top k read None: the rank was guessed from the
    entry. vLLM ranks it over the whole vocabulary, whatever logprobs asks."""
    params = {"max_tokens": 24, "temperature": 0.1, "seed": 7, "ignore_eos": True}
    [alone] = llm.generate("Once upon a time", SamplingParams(**params, logprobs=0),
                           use_tqdm=False)
    [wide] = llm.generate("Once upon a time", SamplingParams(**params, logprobs=20),
                          use_tqdm=False)
    assert alone.token_ids == wide.token_ids
    ranks = [entry[token].rank for token, entry in zip(alone.token_ids, alone.logprobs,
                                                         strict=True)]
    assert ranks == [entry[token].rank for token, entry in zip(wide.token_ids, wide.logprobs,
                                                                 strict=True)]
    assert min(ranks) == 1 and any(1 < r <= 20 for r in ranks) and max(ranks) > 20
    for token, entry in zip(wide.token_ids, wide.logprobs, strict=True):
        own = float(entry[token])  # the others: the top 20, less the token where it is one
        likelier = sum(float(value) >= own for value in list(entry.values())[1:])
        assert entry[token].rank == likelier + 1 if likelier < 20 else entry[token].rank > 20


def test_a_result_has_vllms_prompt_and_max_tokens_none_fills_the_context(llm):
    text, ids_only = llm.generate(["Hello", [5, 6, 7]], SamplingParams(max_tokens=2),
                                  use_tqdm=False)
    assert (text.prompt, ids_only.prompt) == ("Hello", None)
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2),
                      use_tqdm=False)
    assert chat.prompt == llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert llm.tokenizer.encode(chat.prompt) == chat.prompt_token_ids
    [long] = llm.generate([[5] * 250], SamplingParams(max_tokens=None, ignore_eos=True,
                                                       temperature=0), use_tqdm=False)
    assert len(long.token_ids) == 256 - 250 and long.finish_reason == "length"


def test_chat_takes_vllms_template_options_and_openais_content_parts(llm):
    """QA (offline API fuzz): chat() took no add_generation_prompt, continue_final_message,
    tools or chat_template_kwargs (TypeError), and refused a content of text parts and an
    assistant's None content, which vLLM and OpenAI's format take."""
    template = llm.tokenizer.apply_chat_template
    asked = [{"role": "user", "content": "Hi"}]
    started = [*asked, {"role": "assistant", "content": "Hello, I am"}]
    [closed] = llm.chat(asked, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt == template(asked, add_generation_prompt=False)
    [going_on] = llm.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=False,
                          continue_final_message=True)
    assert going_on.prompt.endswith("Hello, I am")
    assert going_on.prompt_token_ids == llm.tokenizer.encode(going_on.prompt)
    with pytest.raises(ValueError, match="cannot be used with add_generation_prompt"):
        llm.chat(started, GREEDY, continue_final_message=True)
    [parts] = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                        {"role": "assistant", "content": None},
                        {"role": "user", "content": "again"}], GREEDY, use_tqdm=False)
    assert parts.prompt == template([*asked, {"role": "assistant", "content": ""},
                                     {"role": "user", "content": "again"}])
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    [with_tools] = llm.chat(asked, GREEDY, use_tqdm=False, tools=[tool],
                            chat_template_kwargs={"custom": 1})
    assert with_tools.prompt == template(asked, tools=[tool], custom=1)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set "
                                         "'add_generation_prompt'"):
        llm.chat(asked, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(TypeError, match=r"messages\[0\] \(user\) has no string 'content'"):
        llm.chat([{"role": "user", "content": None}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_an_empty_text_prompt_is_named_as_text(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt '' is empty: its text "
                                         "encodes to no token"):
        llm.generate(["Hi", ""], GREEDY, use_tqdm=False)


def test_vllms_detokenize_and_skip_special_tokens_per_request(llm):
    """SamplingParams(detokenize=False) gives ids and no text; skip_special_tokens=False
    keeps a special token's text (QA: both were TypeErrors)."""
    eos = llm.tokenizer.eos_token_id
    greedy = dict(max_tokens=3, temperature=0, ignore_eos=True)
    [plain, ids_only] = llm.generate(
        ["Hello there"] * 2, [SamplingParams(**greedy),
                              SamplingParams(**greedy, detokenize=False)],
        use_tqdm=False)
    assert ids_only.token_ids == plain.token_ids and plain.text and ids_only.text == ""
    with pytest.raises(ValueError, match="stop strings need the text"):
        SamplingParams(stop=["x"], detokenize=False)
    wordless = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, detokenize=False)
    with pytest.raises(ValueError, match="stop strings need the text, and this LLM was "
                                         "built with detokenize=False"):  # QA: ignored
        wordless.generate(["Hello there"], SamplingParams(**greedy, stop=["."]))
    assert not wordless.engine.has_unfinished_requests()
    special = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert special and llm.tokenizer.decode([eos]) == ""
    [kept] = llm.generate(["Hello there"], SamplingParams(**greedy, skip_special_tokens=False),
                          use_tqdm=False)
    assert kept.token_ids == plain.token_ids
    assert kept.text == llm.tokenizer.decode(kept.token_ids, skip_special_tokens=False)
    # a special token drawn mid-output (not the one that ends it) shows only when asked
    from kvserve.engine.text import TextStream

    for skip, shown in ((True, ""), (False, special)):
        stream = TextStream.for_request(llm.tokenizer, [5, 6], SamplingParams(
            skip_special_tokens=skip))
        assert stream.step([eos], finished=False)[0] == shown
    assert TextStream.for_request(llm.tokenizer, [5], SamplingParams(detokenize=False)) is None


def test_generate_takes_one_priority_per_prompt_as_vllm():
    """QA: vLLM's generate(..., priority=[...]) was a TypeError."""
    llm = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64, max_model_len=256,
              scheduling_policy="priority", max_num_seqs=1)
    results = llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=2),
                           use_tqdm=False, priority=[2, 0, 1])
    waited = [result.metrics.queue_time for result in results]
    assert waited[1] < waited[2] < waited[0]  # admitted one at a time, most urgent first
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate([[5, 6]], use_tqdm=False, priority=["high"])
    assert not llm.engine.has_unfinished_requests()


def test_a_priority_without_priority_scheduling_is_refused_as_vllm():
    """The docs check: under the default fcfs policy generate(priority=[5, 7]) ran, the
    priorities ignored; vLLM raises, and the server answers 400."""
    llm = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValueError, match=r"prompts\[1\]: priority 7 was given but priority "
                                         r"scheduling is not enabled \(this LLM runs "
                                         r"scheduling_policy='fcfs'\); build it with "
                                         r"scheduling_policy='priority'"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, priority=[0, 7])
    with pytest.raises(ValueError, match="priority 3 was given"):
        llm.generate([[5, 6]], SamplingParams(priority=3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    [result] = llm.generate([[5, 6]], SamplingParams(max_tokens=1), use_tqdm=False,
                            priority=[0])  # 0 is every request's priority: taken
    assert len(result.token_ids) == 1


def test_a_tokenizer_with_only_the_protocols_methods_serves_a_conversation():
    """engine.text.Tokenizer is what the engine and LLM call (README): LLM.chat called
    apply_chat_template, which the protocol did not name, so a tokenizer written to it
    failed with an AttributeError read as a template error (QA)."""
    import typing

    from kvserve.engine.text import Tokenizer

    names = typing._get_protocol_attrs(Tokenizer)  # type: ignore[attr-defined]

    class ProtocolOnly:
        def __init__(self, inner: object) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> object:
            if name not in names:
                raise AttributeError(f"{name} is not in the Tokenizer protocol")
            return getattr(self._inner, name)

    only = ProtocolOnly(tokenizer())
    llm = LLM(TINY, tokenizer=only, num_kv_blocks=16, max_model_len=256, dtype="float32")
    try:
        [result] = llm.chat([{"role": "user", "content": "hi"}],
                            SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert len(result.outputs[0].token_ids) == 2
    finally:
        llm.close()
