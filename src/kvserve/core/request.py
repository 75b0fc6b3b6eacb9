"""Requests, their status, sampling parameters and per-request timing (spec B1-B3)."""

from __future__ import annotations

import enum
import json
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any

from kvserve.core.checks import is_finite, is_int, is_one_of
from kvserve.core.errors import RequestError

# The most sequences one SamplingParams may ask for (n); the server's own limit is lower.
MAX_SAMPLES = 4096
# The most texts a choice-constrained request may choose from.
MAX_CHOICES = 4096
# vLLM's SamplingParams fields kvserve does not implement, in SamplingParams' order: the
# values taken (None always is), and what to give instead
_VLLM_NEUTRAL: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("spaces_between_special_tokens", (True, False), ""),  # a fast tokenizer's: no effect
    ("output_kind", (), "LLM.generate returns each request's final output"),
    ("structured_outputs", (), "give choices=, json_object=True or json_schema="),
    ("guided_decoding", (), "give choices=, json_object=True or json_schema="),
    ("logits_processors", ([],), ""),
    ("extra_args", ({},), ""),
    ("truncate_prompt_tokens", (), "cut the prompt before generate"),
)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_ERROR = 7
    SWAPPED = 8  # preempted with its KV in the host tier (S1); waits to be swapped in

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
        RequestStatus.FINISHED_ERROR,
    }
)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class EventType(str, enum.Enum):
    """What happens to a request: one vocabulary for its own timeline (``Request.events``,
    B3) and for the scheduler's event log (``SchedulerEvent.kind``), whose JSONL lines carry
    the value (docs/scheduler.md, "Events").

    A ``str`` mixin (Python 3.10 has no ``enum.StrEnum``): a member equals its value, so
    ``event.kind == "preempted"`` holds and JSON encodes the value.
    """

    ARRIVED = "arrived"  # queued by add_request
    ADMITTED = "admitted"  # first scheduled: left the waiting queue for running
    RESUMED = "resumed"  # admitted again after a preemption
    BLOCKED = "blocked"  # event log only: the waiting pass stopped at this request
    PROMOTED = "promoted"  # event log only: aging first lifted this waiting request (C7)
    PREEMPTED = "preempted"
    FINISHED = "finished"
    HELD = "held"  # event log only: a finished turn's KV is now held by its session (U2)
    RELEASED = "released"  # event log only: a session let its KV go (U5-U8)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class RequestEvent:
    type: EventType
    timestamp: float


def _as_json(value: Any) -> str:
    """A list or tuple as the client wrote it (["a", ""]), not as Python shows it."""
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    except (TypeError, ValueError):
        return repr(value)


def _sample_seed(seed: int) -> int:
    """A sample's seed in the seed range: past its top wraps to its bottom, and -1 (which a
    request sends for no seed) is 2**64 - 1, the same draws (seeds count modulo 2**64)."""
    if seed >= 1 << 64:
        return seed - (1 << 64)
    return (1 << 64) - 1 if seed == -1 else seed


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RequestError(message)


def _check_vllm_neutral(values: tuple[Any, ...]) -> None:
    """RequestError naming the first of vLLM's unimplemented fields given something other
    than its neutral value."""
    for (name, neutral, instead), value in zip(_VLLM_NEUTRAL, values, strict=True):
        if value is not None and not is_one_of(value, neutral):
            raise RequestError(f"{name}={value!r} is not supported by kvserve"
                               f"{f' ({instead})' if instead else ''}"[:300])


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    The scheduler reads the stop fields (max_tokens, min_tokens, ignore_eos, eos_token_id,
    stop_token_ids) and the priority; the model runner reads the sampling fields; the engine
    matches ``stop`` strings after detokenisation.

    As vLLM's, a field may be set after it is built (``params.max_tokens = 8``, vLLM's own
    offline example): the change is checked as a new object's would be, and a refused one
    leaves the object as it was. The engine takes a copy as it adds a request, so a change
    made after the add reaches no request; the scheduler reads a Request's params as given
    (the simulator shares one object among many requests).
    """

    # None: as many as the context leaves (max_model_len minus the prompt), as vLLM's; the
    # scheduler's add_request sets the number.
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Sequences sampled from the prompt (vLLM's n). The scheduler runs one sequence per
    # request: LLM.generate and the server expand n into n requests (sample k seeded seed+k).
    n: int = 1
    ignore_eos: bool = False
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # The model's other end-of-sequence ids (its generation config's, as Llama 3's
    # <|eot_id|>), which the engine fills: held back below min_tokens even with ignore_eos,
    # as vLLM's all_stop_token_ids (without ignore_eos the engine adds them to
    # stop_token_ids as well)
    extra_eos_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    # The stop string (or the stop token's text) that ended the request stays in its text.
    include_stop_str_in_output: bool = False
    # vLLM's: skip_special_tokens False keeps special tokens' text (a template's markers) in
    # the output; detokenize False makes no text at all (token ids only; no stop strings)
    skip_special_tokens: bool = True
    detokenize: bool = True
    priority: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # vLLM's (OpenAI's logit_bias with integer keys): added to these token ids' logits before
    # sampling, greedy too (-100 all but bans a token, 100 all but forces it); given as a dict
    # or (token id, bias) pairs, kept as pairs sorted by token id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: only these token ids may be sampled (None: any)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never generated (each as tokenized at the start of a text and after a
    # space); the engine that has the tokenizer fills bad_words_token_ids from them, and the
    # sampler bans a word's last token where the output ends in the rest of it
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's structured output by choice (guided_choice): the output is one of these texts,
    # then EOS; the engine that has the tokenizer fills choice_token_ids (each as it encodes)
    choices: tuple[str, ...] = ()
    choice_token_ids: tuple[tuple[int, ...], ...] = ()
    # JSON mode (OpenAI's response_format json_object): the output is one JSON object, then
    # EOS (the model runner keeps it so, kvserve/model/json_mode.py)
    json_object: bool = False
    # Structured output by JSON schema (OpenAI's response_format json_schema): the schema as
    # JSON text; the output is one object of it, then EOS (the subset kvserve/model/
    # json_mode.py honours; the engine refuses the rest by name)
    json_schema: str | None = None
    # A reasoning model's structured output (--reasoning-parser, docs/structured-outputs.md,
    # "Thinking first"): the choices or JSON above hold from the end of its thinking on, as
    # vLLM's. think_markers: the texts that open and close its thinking ("<think>",
    # "</think>"); think_open: the output begins inside its thinking (the prompt opened it, or
    # the model always thinks), else it thinks only where it begins with the opening marker.
    think_markers: tuple[str, str] | None = None
    think_open: bool = False
    # vLLM's prompt_logprobs: each prompt token's logprob (after the first) and the top this
    # many, computed as the prompt is; such a request is never a prefix-cache hit (G8).
    prompt_logprobs: int | None = None
    # Mixed into the first block's hash, so tenants with different salts never share a prefix.
    cache_salt: str | None = None
    # Seconds this request may wait before its first scheduling (K4); None: the global default.
    max_queue_delay: float | None = None
    # Who sent it (an API key's tenant, a user, a client address): per-tenant queue limits,
    # fair share between tenants (VTC) and the tenant-scoped prefix cache. "": nobody said.
    tenant: str = ""
    # The multi-turn session this request is a turn of (U1): with sessions on, its KV is held
    # for the session's next turn for session_ttl seconds (None: the scheduler's default).
    session_id: str | None = None
    session_ttl: float | None = None
    # vLLM's fields kvserve does not implement, taken with their neutral value only (so a
    # script that passes vLLM's defaults runs unchanged) and not kept (_VLLM_NEUTRAL)
    spaces_between_special_tokens: InitVar[bool] = True
    output_kind: InitVar[Any] = None
    structured_outputs: InitVar[Any] = None
    guided_decoding: InitVar[Any] = None
    logits_processors: InitVar[Any] = None
    extra_args: InitVar[Any] = None
    truncate_prompt_tokens: InitVar[Any] = None

    def __post_init__(self, *vllm_fields: Any) -> None:
        _check_vllm_neutral(vllm_fields)
        _require(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _require(is_int(self.n) and 1 <= self.n <= MAX_SAMPLES,
                 f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        _require(is_int(self.min_tokens) and 0 <= self.min_tokens <= (
                     self.min_tokens if self.max_tokens is None else self.max_tokens),
                 f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                 f"got {self.min_tokens!r}")
        for name in ("skip_special_tokens", "detokenize", "include_stop_str_in_output"):
            _require(isinstance(getattr(self, name), bool),
                     f"{name} must be true or false, got {getattr(self, name)!r}")
        _require(self.detokenize or not self.stop,
                 "stop strings need the text: they cannot be used with detokenize=False")
        _require(isinstance(self.ignore_eos, bool),
                 f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        _require(self.eos_token_id is None or (is_int(self.eos_token_id)
                                               and self.eos_token_id >= 0),
                 f"eos_token_id must be a non-negative integer, got {self.eos_token_id!r}")
        for name in ("stop_token_ids", "stop", "bad_words", "logit_bias"):
            if getattr(self, name) is None:  # None: vLLM's default, none
                object.__setattr__(self, name, ())
        for name in ("stop_token_ids", "extra_eos_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple):
                _require(isinstance(ids, (list, range, set, frozenset)),
                         f"{name} must be a list of token ids, got {ids!r}")
                ids = tuple(dict.fromkeys(sorted(ids) if isinstance(ids, (set, frozenset))
                                          else ids))
                object.__setattr__(self, name, ids)
            _require(all(is_int(t) and t >= 0 for t in ids),
                     f"{name} must be non-negative integers, got {ids!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            _require(isinstance(self.stop, list),
                     f"stop must be a string or a list of strings, got {self.stop!r}")
            object.__setattr__(self, "stop", tuple(self.stop))
        _require(all(isinstance(s, str) and s for s in self.stop),
                 f"stop must be non-empty strings, got {self.stop!r}")
        _require(is_int(self.priority), f"priority must be an integer, got {self.priority!r}")
        self._check_sampling_fields()
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_built" not in self.__dict__:  # __init__ assigning
            object.__setattr__(self, name, value)
            return
        if name in _VLLM_NAMES:  # taken at its neutral value, and not kept, as at __init__
            _check_vllm_neutral(tuple(value if n == name else None for n in _VLLM_NAMES))
            return
        if name not in _FIELDS:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        checked = replace(self, **{name: value})  # every check, and the normalised values
        self.__dict__.update(checked.__dict__)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SamplingParams fields cannot be deleted ({name!r}); set the "
                             "field to its default instead")

    def clone(self) -> SamplingParams:
        """vLLM's: an independent copy (every field holds immutable values)."""
        return replace(self)

    def _check_sampling_fields(self) -> None:
        _require(is_finite(self.temperature) and self.temperature >= 0,
                 f"temperature must be a number >= 0, got {self.temperature!r}")
        _require(self.n == 1 or self.temperature != 0,  # vLLM's: 0 alone is greedy there
                 f"n must be 1 when sampling greedily (temperature 0): its {self.n} "
                 "sequences would be one answer repeated")
        _require(is_finite(self.top_p) and 0 < self.top_p <= 1,
                 f"top_p must be in (0, 1], got {self.top_p!r}")
        _require(is_int(self.top_k) and self.top_k >= -1,
                 f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        _require(is_finite(self.min_p) and 0 <= self.min_p <= 1,
                 f"min_p must be in [0, 1], got {self.min_p!r}")
        if is_int(self.seed) and self.seed == -1:  # vLLM's: -1 is no seed
            object.__setattr__(self, "seed", None)
        _require(self.seed is None or (is_int(self.seed)
                                       and -(1 << 63) <= self.seed < 1 << 64),
                 f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(is_finite(value) and -2 <= value <= 2,
                     f"{name} must be in [-2, 2], got {value!r}")
        _require(is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
                 f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        # how many the engine gives at most is its own setting (max_logprobs, 20 by default);
        # -1: the whole vocabulary, and True: 1, as vLLM's
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                value = 1
                object.__setattr__(self, name, value)
            _require(value is None or (is_int(value) and value >= -1),
                     f"{name} must be an integer >= 0 (or -1: the whole vocabulary), "
                     f"got {value!r}")
        self._check_token_constraints()
        _require(self.cache_salt is None or isinstance(self.cache_salt, str),
                 f"cache_salt must be a string, got {self.cache_salt!r}")
        _require(self.max_queue_delay is None or (is_finite(self.max_queue_delay)
                                                  and self.max_queue_delay > 0),
                 f"max_queue_delay must be a number of seconds > 0 (0 could only time out), "
                 f"got {self.max_queue_delay!r}")
        _require(isinstance(self.tenant, str), f"tenant must be a string, got {self.tenant!r}")
        if self.session_id is not None or self.session_ttl is not None:
            self._check_session()

    def _check_token_constraints(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        _require(isinstance(bias, (tuple, list)) and all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in bias),
            f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        _require(all(is_int(t) and t >= 0 and is_finite(b) for t, b in bias),
                 f"logit_bias must map non-negative token ids to finite numbers, "
                 f"got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((int(t), float(b)) for t, b in dict(bias).items())))
        allowed = self.allowed_token_ids
        if allowed is not None:
            _require(isinstance(allowed, (tuple, list, range)) and len(allowed) > 0
                     and all(is_int(t) and t >= 0 for t in allowed),
                     f"allowed_token_ids must be a non-empty list of non-negative token ids, "
                     f"got {allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        words = self.bad_words
        _require(isinstance(words, (tuple, list)) and all(
            isinstance(word, str) and word.strip() for word in words),
            f"bad_words must be a list of words (non-blank strings), got {words!r}")
        object.__setattr__(self, "bad_words", tuple(words))
        self._check_token_sequences("bad_words_token_ids")
        self._check_structured_output()

    def _check_token_sequences(self, name: str) -> None:
        """A field of token id sequences (bad words', choices'), kept as tuples."""
        sequences = getattr(self, name)
        _require(isinstance(sequences, (tuple, list)) and all(
            isinstance(ids, (tuple, list)) and ids and all(is_int(t) and t >= 0 for t in ids)
            for ids in sequences),
            f"{name} must be non-empty lists of token ids, got {sequences!r}"[:300])
        object.__setattr__(self, name, tuple(tuple(ids) for ids in sequences))

    def _check_structured_output(self) -> None:
        """choices, JSON mode or a JSON schema: one at most; each ends at EOS."""
        choices = self.choices
        _require(isinstance(choices, (tuple, list)) and len(choices) <= MAX_CHOICES and all(
            isinstance(choice, str) and choice for choice in choices),
            f"choices must be a list of at most {MAX_CHOICES} non-empty strings, "
            f"got {_as_json(choices)[:200]}")
        object.__setattr__(self, "choices", tuple(choices))
        self._check_token_sequences("choice_token_ids")
        sequences = self.choice_token_ids
        _require(isinstance(self.json_object, bool),
                 f"json_object must be true or false, got {self.json_object!r}")
        _require(self.json_schema is None or isinstance(self.json_schema, str),
                 f"json_schema must be a JSON schema as text, got {self.json_schema!r}"[:200])
        given = [name for name, on in (("choices", choices or sequences),
                                       ("json_object", self.json_object),
                                       ("json_schema", self.json_schema is not None)) if on]
        _require(len(given) < 2, f"give one structured output, not {' and '.join(given)}")
        markers = self.think_markers
        if markers is not None:
            _require(isinstance(markers, (tuple, list)) and len(markers) == 2 and all(
                isinstance(marker, str) and marker for marker in markers),
                f"think_markers must be two non-empty texts (opening, closing), got "
                f"{markers!r}"[:200])
            object.__setattr__(self, "think_markers", tuple(markers))
        _require(isinstance(self.think_open, bool),
                 f"think_open must be true or false, got {self.think_open!r}")
        if not given:
            return
        constrained = given[0]  # it says what may be written, and ends at EOS
        _require(self.allowed_token_ids is None and not self.bad_words and not
                 self.bad_words_token_ids,
                 f"{constrained} says what may be written: allowed_token_ids and bad_words "
                 "cannot be given with it (together they could leave no token)")
        what = "choices end" if constrained == "choices" else "JSON output ends"
        _require(not self.ignore_eos, f"{what} at EOS: ignore_eos cannot be true")
        _require(self.min_tokens == 0, f"{what} at EOS: min_tokens must be 0")

    def samples(self) -> list[SamplingParams]:
        """The n sequences as n one-sequence params, the scheduler's unit: sample k is seeded
        seed + k (wrapped into the seed range), so seeded samples differ and repeat."""
        if self.n == 1:
            return [self]
        seeds = [None] * self.n if self.seed is None else \
            [_sample_seed(self.seed + k) for k in range(self.n)]
        return [replace(self, n=1, seed=seed) for seed in seeds]

    def _check_session(self) -> None:
        _require(isinstance(self.session_id, str) and 0 < len(self.session_id) <= 256,
                 f"session id must be a string of 1 to 256 characters, got {self.session_id!r}")
        _require(self.session_ttl is None or (is_finite(self.session_ttl)
                                              and 0 < self.session_ttl <= 86400),
                 f"session ttl must be a number of seconds in (0, 86400], "
                 f"got {self.session_ttl!r}")
        _require(self.n == 1, f"a session turn is one sequence: got n={self.n}; send it "
                              "with n=1")
        _require(self.prompt_logprobs is None or self.session_id is None,
                 "prompt_logprobs cannot be asked of a session turn: its held tokens are not "
                 "computed again (G8)")


_FIELDS = frozenset(f.name for f in fields(SamplingParams))  # not the InitVars
_VLLM_NAMES = tuple(name for name, _, _ in _VLLM_NEUTRAL)


@dataclass(eq=False, slots=True)
class Request:
    """One generation request as the scheduler sees it.

    ``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output): prefill, chunked
    prefill, recomputation after preemption and decode are all "tokens still to compute".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    stop_reason: int | str | None = None
    # Chained hashes of the request's full blocks, filled lazily by the KV cache manager.
    block_hashes: list[bytes | int] = field(default_factory=list)  # int: the builtin hash
    # L2: what this waiting request is not ready for yet ("kv_transfer", "input", ...);
    # None: ready. The waiting pass skips it and puts it back in its place.
    not_ready_reason: str | None = None
    # C7: aging has lifted it in this wait (the event log named it `promoted`); the waiting
    # queue sets it and clears it when it admits the request, so a request set aside while
    # not ready is named once (QA: on every pass) and a preempted one again
    aging_reported: bool = False

    # Counters (B3).
    num_preemptions: int = 0
    num_swaps: int = 0  # preemptions that moved its KV to the host tier (S1)
    num_cached_tokens: int = -1  # prefix-hit tokens at first admission; -1 until admitted
    num_recomputed_tokens: int = 0
    max_computed_tokens: int = 0  # high-water mark of num_computed_tokens, for recomputation
    events: list[RequestEvent] = field(default_factory=list)

    # Timing (seconds on the caller's clock).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    preempted_time: float | None = None  # set while a preemption stall is open
    longest_stall: float = 0.0  # longest preemption-to-next-token gap

    def __post_init__(self) -> None:
        _require(isinstance(self.request_id, str) and self.request_id != "",
                 f"request_id must be a non-empty string, got {self.request_id!r}")
        _require(isinstance(self.prompt_token_ids, list) and len(self.prompt_token_ids) > 0,
                 f"request {self.request_id}: prompt_token_ids must be a non-empty list")
        _require(is_finite(self.arrival_time),
                 f"request {self.request_id}: arrival_time must be a number")
        _require(isinstance(self.sampling_params, SamplingParams),
                 f"request {self.request_id}: sampling_params must be a SamplingParams")

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def sort_key(self) -> tuple[int, float, str]:
        """Priority order (B2): lower priority value first, then arrival, then id."""
        return (self.sampling_params.priority, self.arrival_time, self.request_id)

    def record(self, event: EventType, timestamp: float) -> None:
        self.events.append(RequestEvent(event, timestamp))

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) across prompt and output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]
