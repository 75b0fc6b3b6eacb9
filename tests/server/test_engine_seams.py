"""Issue 17.3, typed seams: text goes through the Tokenizer protocol (any implementation
drives the engine), Engine.step returns its StepRecord, the trace runner takes its clock as an
argument, and the server reads the engine's facts from EngineInfo, never the scheduler."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvserve.core import CacheConfig, SamplingParams, Scheduler, SchedulerConfig
from kvserve.engine.engine import Engine, EngineInfo, StepRecord
from kvserve.engine.text import Detokenizer, StopChecker, Tokenizer
from kvserve.model.detokenizer import StopChecker as StringStopChecker
from kvserve.sim.executor import SimExecutor

SERVER = Path(__file__).resolve().parents[2] / "src" / "kvserve" / "server"


class LetterTokenizer:
    """A tokenizer of 26 ids, one lowercase letter each: the smallest Tokenizer there is."""

    eos_token_id: int | None = None
    vocab_size = 26

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        return "".join(m["content"] for m in messages)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def id_to_token(self, token_id: int) -> str | None:
        return self.decode([token_id]) if 0 <= token_id < self.vocab_size else None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)

    def detokenizer(self, prompt_token_ids: Sequence[int],
                    skip_special_tokens: bool = True) -> Detokenizer:
        return _LetterDetokenizer(self)  # no special tokens among the letters

    def stop_checker(self, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> StopChecker:
        return StringStopChecker(stop, include_stop_str_in_output)


class _LetterDetokenizer:
    def __init__(self, tokenizer: LetterTokenizer) -> None:
        self.tokenizer = tokenizer

    def step(self, new_token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(new_token_ids)

    def flush(self) -> str:
        return ""


class LetterExecutor(SimExecutor):
    """The simulator's executor with every sampled id folded into the letters' vocabulary."""

    def execute(self, scheduler_output):  # type: ignore[no-untyped-def]
        output = super().execute(scheduler_output)
        for ids in output.sampled_token_ids.values():
            ids[:] = [t % 26 for t in ids]
        return output


def letter_engine() -> tuple[Engine, LetterExecutor]:
    executor = LetterExecutor()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                          max_model_len=128, scheduling_policy="fcfs"),
                          CacheConfig(num_blocks=16, block_size=16))
    return Engine(scheduler, executor, LetterTokenizer(), clock=lambda: 0.0), executor


def generate_text(stop: list[str] | None = None,
                  **params: object) -> tuple[str, list[StepRecord]]:
    engine, executor = letter_engine()
    executor.register("r", 5, 8, True, 7)
    engine.add_request("r", "hello", SamplingParams(max_tokens=8, ignore_eos=True,
                                                    stop=stop or (), **params))
    records, text = [], ""
    while engine.has_unfinished_requests():
        record = engine.step()
        records.append(record)
        text += "".join(chunk.new_text for chunk in record.chunks)
    return text, records


def test_the_bundled_tokenizer_and_a_fake_both_implement_the_protocol():
    from kvserve.model.tokenizer import load_tokenizer

    for tokenizer in (load_tokenizer(None), LetterTokenizer()):
        assert isinstance(tokenizer, Tokenizer)
        assert isinstance(tokenizer.detokenizer([1, 2]), Detokenizer)
        assert isinstance(tokenizer.stop_checker(["x"]), StopChecker)


def test_a_protocol_tokenizer_drives_the_engine_text_and_stop_strings():
    """Any Tokenizer-protocol object turns ids into text and stop strings finish requests:
    the engine has no tokenizer of its own to fall back on."""
    text, records = generate_text()
    assert len(text) == 8 and text.isalpha()  # max_tokens letters, one per token
    assert records[-1].chunks[-1].finish_reason == "length"
    stop = text[3:5]
    stopped, records = generate_text(stop=[stop])
    assert stopped == text[:text.index(stop)]
    last = records[-1].chunks[-1]
    assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", stop)


def test_min_tokens_holds_stop_strings_and_a_stop_tokens_text_is_not_shown():
    """As vLLM's: the text of the first min_tokens tokens is not searched for stop strings
    (a stop string there ended a request that asked for more tokens), and the stop token id
    that ends a request is not shown as text (its letter was left at the end)."""
    text, _ = generate_text()
    stop = text[1:3]  # complete at the third token
    held, _ = generate_text(stop=[stop], min_tokens=3)
    # a stop string that ends after the third token is found, even where it begins inside
    # the first three, and the output ends at its start: their tail that may begin one is
    # held as any text's (QA: shown at once, the stop's start stayed in the output)
    assert held == (text[:text.index(stop, 2)] if stop in text[2:] else text)
    token = ord(text[4]) - ord("a")
    stopped, records = generate_text(stop_token_ids=[token])
    assert stopped == text[:text.index(text[4])]
    last = records[-1].chunks[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", token)
    assert last.new_token_ids[-1] == token  # the id is kept; only its text is not shown


def test_include_stop_str_in_output_keeps_what_ended_the_request():
    """vLLM's include_stop_str_in_output: the matched stop string, or the stop token's text,
    stays in the output (it was a 400 "unknown field")."""
    text, _ = generate_text()
    stop = text[3:5]
    kept, _ = generate_text(stop=[stop], include_stop_str_in_output=True)
    assert kept == text[:text.index(stop) + len(stop)]
    token = ord(text[4]) - ord("a")
    kept, _ = generate_text(stop_token_ids=[token], include_stop_str_in_output=True)
    assert kept == text[:text.index(text[4]) + 1]


def test_step_returns_its_record_with_the_chunks():
    engine, executor = letter_engine()
    executor.register("r", 5, 3, True, 1)
    engine.add_request("r", [0, 1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    record = engine.step()
    assert isinstance(record, StepRecord)
    # The prompt in one chunk: 5 tokens scheduled, one sequence, one token sampled.
    assert (record.num_scheduled_tokens, record.num_seqs, record.num_sampled) == (5, 1, 1)
    assert [(c.request_id, len(c.new_token_ids)) for c in record.chunks] == [("r", 1)]
    assert not hasattr(engine, "last_step")


def test_engine_info_holds_the_facts_a_front_end_needs():
    engine, _ = letter_engine()
    assert engine.info == EngineInfo(engine.tokenizer, max_model_len=128,
                                     scheduling_policy="fcfs", block_size=16,
                                     num_kv_blocks=16, enable_prefix_caching=True,
                                     scheduler_config=engine.scheduler.config)
    with pytest.raises(AttributeError):
        engine.info.max_model_len = 1  # type: ignore[misc]


def test_the_trace_runner_reads_the_clock_it_is_given_not_the_engines():
    from kvserve.engine.trace_runner import run_trace
    from kvserve.sim.workloads import WorkloadSpec, generate

    def engine_clock() -> float:
        raise AssertionError("the trace runner read the engine's clock")

    executor = SimExecutor()
    engine = Engine(Scheduler(SchedulerConfig(max_model_len=128), CacheConfig(num_blocks=16)),
                    executor, clock=engine_clock)
    ticks = iter(range(100, 10_000))
    trace = generate(WorkloadSpec(num_requests=2, rate=1000.0, prompt_len="fixed:8",
                                  output_len="fixed:2", max_tokens=2, ignore_eos=True, seed=1))
    for request in trace:
        executor.register(request.request_id, 8, 2, True, 0)
    run = run_trace(engine, trace, clock=lambda: float(next(ticks)), sleep=lambda s: None)
    assert engine.clock is engine_clock
    # The first reading (100) is the run's origin: the first step is decided at 1 s.
    assert run.steps[0].start == 1.0
    assert [r.finish_reason for r in run.result.records] == ["length", "length"]


def _reach_throughs(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "scheduler":
            found.append(f"{path.name}:{node.lineno} .scheduler")
        if isinstance(node, ast.Attribute) and node.attr == "engine" and \
                isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            found.append(f"{path.name}:{node.lineno} .engine.engine")
    return found


def test_the_server_never_reaches_through_the_engine_into_the_scheduler():
    found = [hit for path in sorted(SERVER.glob("*.py")) for hit in _reach_throughs(path)]
    assert found == []
