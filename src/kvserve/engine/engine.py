"""The engine: the step loop over one Scheduler and one Executor, plus text in and out.

One step: ``schedule(now)`` -> ``executor.execute`` -> ``update`` -> detokenise each
request's new tokens, match stop strings (finishing the request in the scheduler when one
matches) -> one :class:`CompletionChunk` per request that moved.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.core import (
    Executor,
    Request,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


@dataclass
class CompletionChunk:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class StepRecord:
    """One step as the engine ran it: when, how long, and the shape of the batch."""

    start: float  # the time schedule() was given
    end: float  # after update()
    num_scheduled_tokens: int
    num_seqs: int
    num_preempted: int
    num_sampled: int = 0  # requests the model sampled a token for
    scheduler_output: SchedulerOutput | None = None  # what ran (for step logs and shapes)


@dataclass
class _TextState:
    detokenizer: Any | None
    stop_checker: Any | None
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)


class Engine:
    """Drives ``scheduler`` and ``executor`` one step at a time.

    ``tokenizer`` may be None when prompts are token ids and no text is wanted (benchmarks,
    simulations of the runner).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Any | None = None,
                 *, clock: Callable[[], float] = time.monotonic,
                 detokenize: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.detokenize = detokenize and tokenizer is not None
        self._text: dict[str, _TextState] = {}
        self.last_step: StepRecord | None = None  # scheduling events: scheduler.take_events()

    # -- requests --------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (a list of {"role", "content"} dicts)."""
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        items = list(prompt)
        if items and all(isinstance(item, dict) for item in items):
            return self._require_tokenizer().encode_chat(items)
        if not items or not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError("a prompt is a string, a non-empty list of token ids, or a list of "
                             "chat messages")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is not None and not all(0 <= t < vocab_size for t in items):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return items

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompts as token ids")
        return self.tokenizer

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        params = params or SamplingParams()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if params.eos_token_id is None and eos is not None:
            params = dataclasses.replace(params, eos_token_id=eos)
        request = Request(request_id, self.encode_prompt(prompt), params,
                          arrival_time=self.clock() if arrival_time is None else arrival_time)
        self.scheduler.add_request(request)  # raises before anything else is recorded
        self._text[request_id] = self._new_text_state(request)
        return request

    def _new_text_state(self, request: Request) -> _TextState:
        if not self.detokenize:
            return _TextState(None, None)
        from kvserve.model.detokenizer import IncrementalDetokenizer, StopChecker
        params = request.sampling_params
        return _TextState(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
                          StopChecker(params.stop) if params.stop else None)

    def abort(self, request_id: str) -> RequestMetrics | None:
        """Abort a request in any state; its metrics, or None if it was unknown or done."""
        self._text.pop(request_id, None)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED,
                                             now=self.clock())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step --------------------------------------------------------------------------

    def step(self, now: float | None = None) -> list[CompletionChunk]:
        """One step; ``now`` (default: the clock) is the time the scheduler decides at."""
        start = self.clock() if now is None else now
        scheduler_output = self.scheduler.schedule(start)
        model_output = self.executor.execute(scheduler_output)
        now = self.clock()
        outputs = self.scheduler.update(scheduler_output, model_output, now)
        self.last_step = StepRecord(start, now, scheduler_output.total_num_scheduled_tokens,
                                    len(scheduler_output.num_scheduled_tokens),
                                    len(scheduler_output.preempted_req_ids),
                                    len(model_output.sampled_token_ids), scheduler_output)
        logprobs = model_output.logprobs or {}
        chunks = []
        for output in outputs:
            chunk = CompletionChunk(output.request_id, output.new_token_ids, "",
                                    output.finished, output.finish_reason, output.stop_reason,
                                    output.metrics, logprobs.get(output.request_id))
            self._add_text(chunk, now)
            chunks.append(chunk)
            if chunk.finished:
                self._text.pop(chunk.request_id, None)
        return chunks

    def _add_text(self, chunk: CompletionChunk, now: float) -> None:
        state = self._text.get(chunk.request_id)
        if state is None or state.detokenizer is None:
            return
        new_text = state.detokenizer.step(chunk.new_token_ids)
        if state.stop_checker is not None:
            new_text, stop = state.stop_checker.check(state.text, new_text)
            if stop is not None and not chunk.finished:
                chunk.metrics = self.scheduler.finish_request(
                    chunk.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop, now=now)
                chunk.finished, chunk.finish_reason, chunk.stop_reason = True, "stop", stop
            elif stop is not None:
                chunk.finish_reason, chunk.stop_reason = "stop", stop
            elif chunk.finished:
                new_text += state.stop_checker.flush()
        state.text += new_text
        chunk.new_text = new_text
