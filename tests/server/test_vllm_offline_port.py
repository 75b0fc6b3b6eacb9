"""A vLLM offline script ported as it is (the offline pass, session 53): vLLM's own basic
example sets fields of ``get_default_sampling_params()``; scripts pass vLLM's defaults for
fields and arguments kvserve does not implement, ``None`` where vLLM's default is None, an
empty batch, a dict prompt's ``cache_salt``, ``chat(chat_template=...)``. Each is taken as
vLLM takes it, or refused naming what to do instead."""

from __future__ import annotations

import logging

import pytest

from kvserve.core import RequestError, SamplingParams
from kvserve.engine.llm import LLM
from kvserve.model.loader import ModelNotFoundError, model_config_from_path

from .helpers import TINY, tokenizer

GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=64, max_model_len=256,
               dtype="float32", max_logprobs=-1)


def test_a_default_params_field_is_set_as_vllms_basic_example_sets_it(llm):
    params = llm.get_default_sampling_params()
    params.max_tokens = 2
    assert len(llm.generate([[5, 6]], params, use_tqdm=False)[0].token_ids) == 2
    params.stop = "x"  # normalised as a new object's
    assert params.stop == ("x",)
    with pytest.raises(RequestError, match="max_tokens must be an integer >= 1, got 0"):
        params.max_tokens = 0
    assert params.max_tokens == 2  # a refused change leaves it as it was
    with pytest.raises(AttributeError, match="no field 'max_token'"):
        params.max_token = 3
    copy = params.clone()
    copy.seed = 7
    assert params.seed is None and copy.seed == 7
    assert llm.get_default_sampling_params().max_tokens == 16  # a fresh object each time


def test_vllms_none_defaults_and_iterables_are_taken():
    params = SamplingParams(bad_words=None, logit_bias=None, stop_token_ids={9, 3})
    assert params.bad_words == () and params.logit_bias == ()
    assert params.stop_token_ids == (3, 9)
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1


def test_vllms_unimplemented_fields_are_taken_at_their_neutral_values_only():
    SamplingParams(spaces_between_special_tokens=False, output_kind=None, extra_args={},
                   logits_processors=[], structured_outputs=None, truncate_prompt_tokens=None)
    with pytest.raises(RequestError, match=r"structured_outputs=.* is not supported by kvserve "
                                           r"\(give choices=, json_object=True or json_schema="):
        SamplingParams(structured_outputs={"choice": ["a"]})
    with pytest.raises(RequestError, match=r"extra_args=.* is not supported"):
        SamplingParams(extra_args={"a": 1})
    params = SamplingParams()  # set as vLLM's may be (the review: AttributeError)
    params.output_kind = None
    params.spaces_between_special_tokens = False
    with pytest.raises(RequestError, match=r"logits_processors=\[1\] is not supported"):
        params.logits_processors = [1]


def test_logprobs_minus_one_is_the_whole_vocabulary_within_max_logprobs(llm):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=-1, prompt_logprobs=-1)
    [result] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(result.logprobs[0]) == 49152  # the model's vocabulary
    assert len(result.prompt_logprobs[1]) == 49152
    small = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8)  # max_logprobs 20
    with pytest.raises(ValueError, match=r"logprobs 49152 \(-1: the whole vocabulary\) is "
                                         r"more than this engine gives \(max_logprobs 20\)"):
        small.generate([[5]], SamplingParams(logprobs=-1), use_tqdm=False)


def test_an_empty_batch_gives_no_results_and_vllms_generate_keywords_are_taken(llm):
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    with pytest.raises(TypeError, match=r"prompts\[0\] is one chat message"):  # the review:
        llm.generate({"role": "user", "content": "hi"}, GREEDY)  # taken as a conversation
    assert llm.generate([[5]], GREEDY, use_tqdm=False, lora_request=None,
                        tokenization_kwargs={})[0].finish_reason == "length"
    with pytest.raises(ValueError, match="lora_request: there are no LoRA adapters"):
        llm.generate([[5]], GREEDY, lora_request=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokenization_kwargs are not taken here"):
        llm.generate([[5]], GREEDY, tokenization_kwargs={"truncation": True})


def test_vllms_llm_arguments_that_change_nothing_are_taken(caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, disable_log_stats=True,
                  seed=None, enable_lora=False, task="generate", cpu_offload_gb=0,
                  hf_overrides={}, served_model_name="m", skip_tokenizer_init=False)
    assert "disable_log_stats=True is taken and changes nothing" in caplog.text
    assert "seed None: " in caplog.text and "drawn at random" in caplog.text
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"enable_lora=True is not taken here \(there are no "
                                         r"LoRA adapters\); only False"):
        LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, enable_lora=True)
    with pytest.raises(ValueError, match=r"task='embed' is not taken here .*; only 'auto' or "
                                         r"'generate'"):
        LLM(TINY, tokenizer=tokenizer(), num_kv_blocks=8, task="embed")


def test_chat_takes_a_template_for_the_call_alone(llm):
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    [result] = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template,
                        chat_template_content_format="string", lora_request=None)
    assert result.prompt == "<<hi>>"
    from kvserve.model.tokenizer import compile_chat_template

    assert compile_chat_template(template) is compile_chat_template(template)  # once a text
    assert llm.chat(messages, GREEDY, use_tqdm=False)[0].prompt != "<<hi>>"  # the model's
    with pytest.raises(ValueError, match="chat_template_content_format='openai' is not taken"):
        llm.chat(messages, GREEDY, chat_template_content_format="openai")


def test_a_dict_prompts_cache_salt_keeps_its_blocks_apart(llm):
    prompt = list(range(100, 140))  # two whole blocks of 16 and more
    salted = [{"prompt_token_ids": prompt, "cache_salt": salt} for salt in ("a", "b", "a")]
    first, other, again = (llm.generate([p], GREEDY, use_tqdm=False)[0] for p in salted)
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 32  # the same salt's blocks
    with pytest.raises(ValueError, match=r"prompts\[0\]: cache_salt must be a non-empty "
                                         r"string, got ''"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, GREEDY)


def test_a_model_hubs_name_is_told_that_nothing_is_downloaded():
    with pytest.raises(ModelNotFoundError, match=r"does not exist; kvserve loads models from "
                                                 r"disk, never from a model hub"):
        model_config_from_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError, match=r"^model path /nowhere/m.gguf does not "
                                                 r"exist$"):
        model_config_from_path("/nowhere/m.gguf")


def test_a_field_set_after_the_add_reaches_no_request():
    """The review: with nothing to fill in (eos_token_id given), the engine kept the
    caller's object, so a field set for the next request changed the queued one."""
    from kvserve.engine.llm import build_engine

    engine = build_engine(TINY, tokenizer=tokenizer(), num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(max_tokens=12, ignore_eos=True, eos_token_id=2)
    assert engine.add_request("a", [5, 6, 7], params).sampling_params is not params
    params.max_tokens = 3  # for the next request, as a vLLM script may set it
    engine.add_request("b", [5, 6, 7], params)
    counts = {"a": 0, "b": 0}
    while engine.has_unfinished_requests():
        for chunk in engine.step().chunks:
            counts[chunk.request_id] += len(chunk.new_token_ids)
    assert counts == {"a": 12, "b": 3}
