"""The server's text of a request the engine ships as token ids (engine/server_text.py): a
stop string matched here ends the answer at once, asks the engine to finish it, and drops
the tokens it made meanwhile from the answer and its metrics. No process needed."""

from __future__ import annotations

from kvserve.core import RequestMetrics, SamplingParams, SchedulerStats
from kvserve.engine.core_loop import StepReport
from kvserve.engine.engine import CompletionChunk
from kvserve.engine.server_text import ServerText

from .helpers import tokenizer


def report(at: float, *chunks: CompletionChunk) -> StepReport:
    stats = SchedulerStats(1, 0, 0, 0.1, 90, 100, 1, 0, 0, 8, 0, 0, {}, {})
    return StepReport(at, 1, 0.5, list(chunks), [], stats)


def test_a_stop_string_ends_the_answer_and_drops_what_the_engine_made_after():
    tok = tokenizer()
    text = ServerText(tok)
    ids = tok.encode("The cat sat on the mat and then", add_special_tokens=False)
    text.open("r", [1, 2, 3], SamplingParams(max_tokens=50, stop=["sat"]))
    assert text
    first, finishes = text.apply(report(1.0, CompletionChunk("r", ids[:4], "")))
    assert finishes == [("r", "sat")]  # the engine is told to finish it
    assert first.chunks[0].new_text == "The cat "
    assert first.engine_chunks is not None and first.engine_chunks[0].new_token_ids == ids[:4]
    later, finishes = text.apply(report(2.0, CompletionChunk("r", ids[4:6], "")))
    assert later.chunks == [] and finishes == []  # made after the stop: dropped
    metrics = RequestMetrics(0.0, 0.5, 1.0, 3.5, 3, 7, 0, 0, 0, 0.0)
    last, _ = text.apply(report(3.0, CompletionChunk("r", ids[6:7], "", True, "stop", "sat",
                                                     metrics)))
    end = last.chunks[0]
    assert (end.finish_reason, end.stop_reason, end.new_text) == ("stop", "sat", "")
    # 3 of its 7 tokens were made after the stop; it ended with the step that matched it
    assert end.metrics is not None and end.metrics.num_output_tokens == 4
    assert end.metrics.finished_time == 1.5
    assert not text  # forgotten once finished


def test_a_request_without_text_passes_as_the_engine_made_it():
    text = ServerText(tokenizer())
    text.open("quiet", [1], SamplingParams(max_tokens=4, detokenize=False))
    chunk = CompletionChunk("quiet", [5, 6], "")
    assert not text
    assert text.apply(report(0.0, chunk))[0].chunks == [chunk]
