"""Issue 4 with the bundled SmolLM2-135M: the engine's greedy text equals a dense reference
token for token, whatever the batching, chunking, caching or preemption."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvserve.core import CacheConfig, SamplingParams, Scheduler, SchedulerConfig, check_empty
from kvserve.engine.engine import Engine
from kvserve.engine.llm import LLM
from kvserve.model.kv_cache import allocate_kv_cache
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_model_weights
from kvserve.model.runner import ModelRunner
from kvserve.model.tokenizer import load_tokenizer
from tests.model.reference import dense_greedy

TEXTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
         "The three primary colours are red,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def bundled():
    config, weights = load_model_weights(None)
    network = LlamaForCausalLM.from_weights(config, dict(weights))
    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    expected = [dense_greedy(weights, config, p, MAX_TOKENS) for p in prompts]
    return network, tokenizer, prompts, expected


def run_engine(network, prompts, num_blocks=256, block_size=16, caching=True, stagger=False,
               **config):
    config.setdefault("max_model_len", 1024)
    scheduler = Scheduler(SchedulerConfig(**config),
                          CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching))
    runner = ModelRunner(network, allocate_kv_cache(network.config, num_blocks, block_size,
                                                    torch.float32), block_size)
    engine = Engine(scheduler, runner, None)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for i, prompt in pending[:1] if stagger else pending:
            engine.add_request(str(i), prompt, params)
        pending = pending[1:] if stagger else []
        for chunk in engine.step().chunks:
            tokens[chunk.request_id] += chunk.new_token_ids
    check_empty(scheduler)
    return [tokens[str(i)] for i in range(len(prompts))], scheduler


def test_the_dense_reference_answers_sensibly(bundled):
    _, tokenizer, _, expected = bundled
    assert tokenizer.decode(expected[0]).strip().startswith("Paris")


@pytest.mark.parametrize(("chunk", "caching", "stagger"), [
    (2048, True, False), (16, False, True), (64, True, True)])
def test_batched_engine_equals_dense_reference(bundled, chunk, caching, stagger):
    network, _, prompts, expected = bundled
    outputs, _ = run_engine(network, prompts, caching=caching, stagger=stagger,
                            max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 256))
    assert outputs == expected


def test_preempted_requests_produce_the_same_text(bundled):
    network, _, prompts, expected = bundled
    outputs, scheduler = run_engine(network, prompts, num_blocks=10, block_size=4)
    assert scheduler.num_preemptions > 0
    assert outputs == expected


def test_llm_chat_answers_and_stops_on_a_stop_string():
    llm = LLM(None, dtype="float32", num_kv_blocks=64)  # the float32 answer is pinned
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [answer] = llm.chat(question, SamplingParams(max_tokens=20, temperature=0.0))
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop" and answer.stop_reason is None  # EOS
    [cut] = llm.chat(question, SamplingParams(max_tokens=20, temperature=0.0, stop=["Paris"]))
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("The capital of France is ",
                                                             "stop", "Paris")
    assert llm.engine.scheduler.kv.num_free_blocks == 64  # the early stop freed its blocks


def test_seeded_sampling_is_reproducible_and_batch_independent():
    llm = LLM(None, dtype="float32", num_kv_blocks=128)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    alone = llm.generate("Tell me a story", params)[0].token_ids
    batched = llm.generate(["Tell me a story", "Another prompt"], params)[0].token_ids
    assert alone == batched


def test_generate_cli_prints_the_answer_and_refuses_bad_input():
    ok = subprocess.run([sys.executable, "-m", "kvserve", "generate", "--chat",
                         "--prompt", "What is the capital of France?", "--prompt", "Hi",
                         "--max-tokens", "12", "--num-kv-blocks", "64", "--dtype", "float32"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "Paris" in ok.stdout, ok.stderr
    # several answers, each under its prompt's number (an answer may span lines)
    lines = ok.stdout.splitlines()
    assert lines[0] == "--- prompt 1 ---" and "--- prompt 2 ---" in lines
    bad = subprocess.run([sys.executable, "-m", "kvserve", "generate", "--prompt", "hi",
                          "--max-tokens", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "kvserve generate: error: max_tokens must be an integer >= 1, got 0"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt", ""], "prompt 1 is empty: a completion needs at least one token"),
    (["--prompt", "hi", "--max-model-len", "0"], "max_model_len must be >= 1, got 0"),
    (["--prompt", "hi", "--max-model-len", "100000"],
     "max_model_len 100000 is longer than this model's context (max_position_embeddings "
     "8192); give max_model_len (--max-model-len) 8192 or less (vLLM's "
     "VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
    (["/nonexistent/model.gguf", "--prompt", "hi"],
     "model path /nonexistent/model.gguf does not exist"),
    (["--prompt", "hi", "--block-size", "0"], "block_size=0 is out of range"),
    # bytes that are not UTF-8 reach argv as lone surrogates (QA: a TypeError traceback)
    (["--prompt", "ok \udcff"], "prompt 1: the text is not valid UTF-8: character 3 "
                                "(after 'ok ') is an undecodable byte or a lone surrogate"),
    (["--prompt", "hi", "--max-queue-delay", "0"], "max_queue_delay=0.0 is out of range"),
])
def test_generate_refuses_bad_input_before_loading_the_model(capsys, argv, message):
    """One line, exit 2, and nothing logged first: no dtype line, no kernel report (a
    path that does not exist used to log the dtype it would have loaded)."""
    from kvserve.cli import main

    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert f"kvserve generate: error: {message}" in err
    assert "dtype" not in err and "kernels" not in err


def test_a_seed_out_of_a_generators_range_is_named(capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "hi", "--seed", str(1 << 70)])
    assert exit_.value.code == 2
    assert f"argument --seed: {1 << 70} is out of range: a seed is in [-2**63, 2**64)" in \
        capsys.readouterr().err
