"""The engine: the step loop over one Scheduler and one Executor, plus text in and out.

One step: ``schedule(now)`` -> ``executor.execute`` -> ``update`` -> detokenise each
request's new tokens, match stop strings (finishing the request in the scheduler when one
matches) -> one :class:`CompletionChunk` per request that moved, returned in the step's
:class:`StepRecord`.

Text goes through the :class:`kvserve.engine.text.Tokenizer` protocol; time through a
:data:`kvserve.core.Clock` (seconds, any origin). What a front end may know about the engine
without holding it is :class:`EngineInfo`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.core import (
    Clock,
    Executor,
    Request,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from kvserve.core.outputs import PromptLogprobs
from kvserve.engine.text import (
    TextStream,
    Tokenizer,
    bad_words_token_ids,
    choice_token_ids,
    ended_by_token,
)

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def encode_prompt(tokenizer: Tokenizer | None, prompt: Prompt) -> list[int]:
    """A prompt's token ids: text, token ids (checked against the vocabulary), or chat
    messages (a list of {"role", "content"} dicts, through the chat template)."""
    if isinstance(prompt, str):
        ids = _require(tokenizer).encode(prompt, add_special_tokens=True)  # vLLM's
        if not ids:
            raise ValueError(f"the prompt {prompt!r} is empty: its text encodes to no token")
        return ids
    items = list(prompt)
    if items and all(isinstance(item, dict) for item in items):
        return _require(tokenizer).encode_chat(items)
    if not items or not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise ValueError("a prompt is a string, a non-empty list of token ids, or a list of "
                         "chat messages")
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in items):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return items  # type: ignore[return-value]


# vLLM's default max_logprobs: OpenAI's limit of top_logprobs
DEFAULT_MAX_LOGPROBS = 20


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the first field whose token id the model has not (a bias or a stop
    on it would do nothing, an allowed list of none would leave nothing to sample)."""
    for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                            ("logit_bias", [t for t, _ in params.logit_bias]),
                            ("allowed_token_ids", params.allowed_token_ids or ()),
                            ("bad_words_token_ids",
                             [t for ids in params.bad_words_token_ids for t in ids]),
                            ("choice_token_ids",
                             [t for ids in params.choice_token_ids for t in ids]),
                            # QA: one outside ended nothing, and choices or JSON, which may
                            # only end at EOS, ran on to max_tokens on token 0
                            ("eos_token_id", [] if params.eos_token_id is None
                             else [params.eos_token_id])):
        outside = [t for t in token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} holds token id(s) outside the vocabulary "
                             f"[0, {vocab_size}): {outside[:5]}")


def _tokenizer_for(tokenizer: Tokenizer | None, field: str, instead: str) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"{field} need a tokenizer: this engine has none; give {instead}")
    return tokenizer


def _require(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer: pass prompts as token ids")
    return tokenizer


PromptLogprob = tuple[dict[int, float], int]  # (token id -> logprob, the token's rank)


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
    # With SamplingParams.prompt_logprobs, on the request's first chunk: per prompt token,
    # None for the first, then (token id -> logprob for the token and the top ones, the
    # token's rank) (G8)
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(frozen=True)
class StepRecord:
    """One step as the engine ran it: when, how long, the shape of the batch, and one chunk
    per request that moved. Scheduling events are the scheduler's: ``take_events()``."""

    start: float  # the time schedule() was given
    end: float  # after update()
    num_scheduled_tokens: int
    num_seqs: int
    num_preempted: int
    num_sampled: int = 0  # requests the model sampled a token for
    scheduler_output: SchedulerOutput | None = None  # what ran (for step logs and shapes)
    chunks: list[CompletionChunk] = field(default_factory=list)


@dataclass(frozen=True)
class EngineInfo:
    """The engine's fixed facts, read-only, for a front end (server, metrics, logs) that must
    not reach into the scheduler: plain data, the same for the engine's whole life."""

    tokenizer: Tokenizer | None
    max_model_len: int
    scheduling_policy: str
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    scheduler_config: SchedulerConfig  # frozen: admission checks before queueing
    num_host_blocks: int = 0  # the host KV tier, --swap-space (docs/preemption.md)
    host_kv_cache_bytes: int = 0  # its size as the executor allocated it (0: unknown)


class Engine:
    """Drives ``scheduler`` and ``executor`` one step at a time.

    ``tokenizer`` may be None when prompts are token ids and no text is wanted (benchmarks,
    simulations of the runner).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor,
                 tokenizer: Tokenizer | None = None, *, clock: Clock = time.monotonic,
                 detokenize: bool = True, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 vocab_size: int | None = None) -> None:
        self.scheduler = scheduler
        # vLLM's max_logprobs: the most logprobs or prompt_logprobs a request may ask for
        self.max_logprobs = max_logprobs
        # the model's vocabulary (a request's logprobs -1: all of it); None: the tokenizer's
        self.vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer else None)
        self.executor = executor
        self.tokenizer = tokenizer
        # the model's end-of-sequence ids besides the tokenizer's (generation_config.json's
        # or config.json's, model_eos_ids): stop ids of every request not ignoring EOS
        self.extra_eos_ids: tuple[int, ...] = ()
        self.clock = clock
        self.detokenize = detokenize and tokenizer is not None
        self._text: dict[str, TextStream] = {}
        # requests that asked for prompt logprobs, until their first chunk carries them
        self._prompt_logprobs: dict[str, list[PromptLogprob | None]] = {}
        config, cache = scheduler.config, scheduler.cache_config
        host = getattr(executor, "host_kv_cache", None)
        self.info = EngineInfo(tokenizer, config.max_model_len, config.scheduling_policy,
                               cache.block_size, cache.num_blocks, cache.enable_prefix_caching,
                               config, cache.num_host_blocks,
                               host.num_blocks * host.bytes_per_block if host else 0)

    # -- requests --------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (a list of {"role", "content"} dicts)."""
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        params = self._with_token_ids(params or SamplingParams())
        request = Request(request_id, self.encode_prompt(prompt), params,
                          arrival_time=self.clock() if arrival_time is None else arrival_time)
        self.scheduler.add_request(request)  # raises before anything else is recorded
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None] * request.num_prompt_tokens
        if self.detokenize and self.tokenizer is not None:
            params = request.sampling_params
            text = TextStream.for_request(self.tokenizer, request.prompt_token_ids, params)
            if text is not None:
                self._text[request_id] = text
        return request

    def _with_token_ids(self, params: SamplingParams) -> SamplingParams:
        """A copy of ``params`` with what the tokenizer supplies (EOS, the token ids of
        bad_words and of choices), checked against its vocabulary and max_logprobs;
        ValueError naming what is missing or too much."""
        tokenizer = self.tokenizer
        filled: dict[str, Any] = {}
        try:  # a text the tokenizer refuses is named by its field (QA: blamed on the prompt)
            if params.bad_words and not params.bad_words_token_ids:
                field = "bad_words"
                filled["bad_words_token_ids"] = bad_words_token_ids(
                    _tokenizer_for(tokenizer, field, "bad_words_token_ids"), params.bad_words)
            if params.choices and not params.choice_token_ids:
                field = "choices"
                filled["choice_token_ids"] = choice_token_ids(
                    _tokenizer_for(tokenizer, field, "choice_token_ids"), params.choices)
        except ValueError as error:
            message = str(error)
            raise ValueError(message if message.startswith(field) else f"{field}: {message}"
                             ) from None
        if params.eos_token_id is None and tokenizer is not None and \
                tokenizer.eos_token_id is not None:
            filled["eos_token_id"] = tokenizer.eos_token_id
        if self.extra_eos_ids and not params.extra_eos_token_ids:
            # as vLLM's update_from_generation_config: stops unless ignore_eos, and held
            # back below min_tokens either way (the sampler's held_stops)
            filled["extra_eos_token_ids"] = self.extra_eos_ids
            extra = [i for i in self.extra_eos_ids if i not in params.stop_token_ids]
            if extra and not params.ignore_eos:
                filled["stop_token_ids"] = (*params.stop_token_ids, *extra)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked == -1:  # vLLM's: the whole vocabulary
                if self.vocab_size is None:
                    raise ValueError(f"{name} -1 asks for the whole vocabulary, and this "
                                     "engine knows no vocabulary size")
                asked = filled[name] = self.vocab_size
            if asked is not None and asked > self.max_logprobs:
                whole = " (-1: the whole vocabulary)" if getattr(params, name) == -1 else ""
                raise ValueError(f"{name} {asked}{whole} is more than this engine gives "
                                 f"(max_logprobs {self.max_logprobs})")
        # always a copy: the request's own, which the caller's changes after the add cannot
        # reach (the review: a field set after the add changed a queued request)
        params = dataclasses.replace(params, **filled)
        json_output = params.json_object or params.json_schema is not None
        if json_output and tokenizer is None:
            raise ValueError("JSON output needs a tokenizer (the tokens' bytes): this engine "
                             "has none")
        if params.json_schema is not None:
            from kvserve.model.json_mode import check_schema  # no torch: stdlib only
            check_schema(params.json_schema)
        if (params.choice_token_ids or json_output) and params.eos_token_id is None:
            raise ValueError("choices and JSON mode end at EOS, and this engine knows no EOS "
                             "token: give eos_token_id")
        if tokenizer is not None:
            check_vocabulary(params, tokenizer.vocab_size)
        return params

    def abort(self, request_id: str) -> RequestMetrics | None:
        """Abort a request in any state; its metrics, or None if it was unknown or done."""
        self._text.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED,
                                             now=self.clock())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step --------------------------------------------------------------------------

    def step(self, now: float | None = None, *, clock: Clock | None = None) -> StepRecord:
        """One step; ``now`` (default: the clock) is the time the scheduler decides at, and
        ``clock`` (default: the engine's) the one the step's end is read from."""
        clock = clock or self.clock
        start = clock() if now is None else now
        scheduler_output = self.scheduler.schedule(start)
        model_output = self.executor.execute(scheduler_output)
        now = clock()
        outputs = self.scheduler.update(scheduler_output, model_output, now)
        if model_output.prompt_logprobs:
            self._gather_prompt_logprobs(model_output.prompt_logprobs)
        logprobs = model_output.logprobs or {}
        chunks = []
        for output in outputs:
            chunk = CompletionChunk(output.request_id, output.new_token_ids, "",
                                    output.finished, output.finish_reason, output.stop_reason,
                                    output.metrics, logprobs.get(output.request_id),
                                    self._prompt_logprobs.pop(output.request_id, None))
            self._add_text(chunk, now)
            chunks.append(chunk)
            if chunk.finished:
                self._text.pop(chunk.request_id, None)
        return StepRecord(start, now, scheduler_output.total_num_scheduled_tokens,
                          len(scheduler_output.num_scheduled_tokens),
                          len(scheduler_output.preempted_req_ids),
                          len(model_output.sampled_token_ids), scheduler_output, chunks)

    def _gather_prompt_logprobs(self, parts: dict[str, PromptLogprobs]) -> None:
        """A step's prompt logprobs, into their requests' lists until their first chunk (a
        request recomputed after a preemption computes them again: the same values)."""
        for request_id, part in parts.items():
            slots = self._prompt_logprobs.get(request_id)
            if slots is None:  # delivered already, or aborted
                continue
            for offset, (entry, rank) in enumerate(zip(part.entries, part.ranks,
                                                       strict=True)):
                slots[part.first + offset] = (entry, rank)

    def _add_text(self, chunk: CompletionChunk, now: float) -> None:
        text = self._text.get(chunk.request_id)
        if text is None:
            return
        chunk.new_text, stop = text.step(chunk.new_token_ids, chunk.finished,
                                         ended_by_token(chunk))
        if stop is not None and not chunk.finished:
            chunk.metrics = self.finish_stopped(chunk.request_id, stop, now)
            chunk.finished = True
        if stop is not None:
            chunk.finish_reason, chunk.stop_reason = "stop", stop

    def finish_stopped(self, request_id: str, stop: str, now: float | None = None
                       ) -> RequestMetrics | None:
        """Finish a request whose output reached the stop string ``stop`` (matched here, or
        by the server's process for an engine process); its metrics, or None if it was
        unknown or already done."""
        self._text.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED,
                                             stop_reason=stop,
                                             now=self.clock() if now is None else now)
