"""The answers' text when the server makes it (the engine in its own process ships token ids,
as vLLM V1's output processor works): each request's text made a step at a time, and its
stop strings matched, by :class:`~kvserve.engine.text.TextStream`, the code the in-process
engine runs.

A stop string that matches before the engine finished the request ends the answer there: the
text up to it goes out at once, the engine is asked to finish the request as stopped, and the
tokens it made meanwhile are dropped, from the answer and from its metrics (its output count,
and its finish time: the end of the step that completed the string).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvserve.core import SamplingParams
from kvserve.engine.core_loop import StepReport
from kvserve.engine.engine import CompletionChunk
from kvserve.engine.text import TextStream, Tokenizer, ended_by_token


class ServerText:
    """The text of the requests one engine runs; one thread's (a ProcessEngine's reader)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[str, TextStream] = {}
        # stop string matched, engine not finished yet: the string, and the end of the step
        # that made the token completing it (the answer's finish time)
        self._stop_matched: dict[str, tuple[str, float]] = {}
        self._dropped: dict[str, int] = {}  # tokens the engine made after that, not sent

    def __bool__(self) -> bool:
        return bool(self._text)

    def open(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Make ``request_id``'s text from now on (none with ``detokenize=False``)."""
        text = TextStream.for_request(self.tokenizer, prompt_ids, params)
        if text is not None:
            self._text[request_id] = text

    def apply(self, report: StepReport) -> tuple[StepReport, list[tuple[str, str]]]:
        """The report the observers and streams get (its chunks with their text, the
        engine's own kept as ``engine_chunks``), and the requests the engine is to finish as
        stopped by a string: (request id, the string)."""
        end = report.time + report.seconds
        finishes: list[tuple[str, str]] = []
        chunks = [c for c in (self._chunk(c, end, finishes) for c in report.chunks)
                  if c is not None]
        return dataclasses.replace(report, engine_chunks=report.chunks, chunks=chunks), finishes

    def clear(self) -> None:
        """Forget every request (its engine died: QA, the state was kept until a relaunched
        engine's reader replaced it)."""
        self._text.clear()
        self._stop_matched.clear()
        self._dropped.clear()

    def _chunk(self, chunk: CompletionChunk, end: float,
               finishes: list[tuple[str, str]]) -> CompletionChunk | None:
        """The chunk the request's stream gets: with its text, ended by a stop string, or
        None (tokens the engine made after a stop string matched here); ``end`` is the end
        of the step that made the chunk."""
        request_id = chunk.request_id
        text = self._text.get(request_id)
        if text is None:
            return chunk
        if request_id in self._stop_matched:
            dropped = self._dropped.get(request_id, 0) + len(chunk.new_token_ids)
            if not chunk.finished:
                self._dropped[request_id] = dropped
                return None
            del self._text[request_id]
            self._dropped.pop(request_id, None)
            stop, matched_at = self._stop_matched.pop(request_id)
            metrics = chunk.metrics  # the tokens made after the stop were never the answer,
            if metrics is not None:  # and the answer ended with the step that completed it
                metrics = dataclasses.replace(
                    metrics, num_output_tokens=metrics.num_output_tokens - dropped,
                    finished_time=matched_at)
            return CompletionChunk(request_id, [], "", True, "stop", stop, metrics)
        new_text, stop = text.step(chunk.new_token_ids, chunk.finished, ended_by_token(chunk))
        out = dataclasses.replace(chunk, new_text=new_text)
        if stop is not None and not chunk.finished:
            self._stop_matched[request_id] = (stop, end)
            finishes.append((request_id, stop))
        elif stop is not None:
            out.finish_reason, out.stop_reason = "stop", stop
        if chunk.finished:
            del self._text[request_id]
        return out
