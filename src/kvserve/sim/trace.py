"""The trace file (docs/trace-format.md): JSONL, one request a line.

Fields: ``request_id`` (str), ``arrival_time`` (s), either ``prompt_token_ids`` or
``prompt_len``, optional ``prefix_id`` + ``prefix_len``, ``output_len`` (tokens the model
produces before EOS), optional ``max_tokens``, ``priority``, ``deadline`` (s, absolute: the
request should finish by then), ``cancel_time`` (s, absolute: the client aborts then),
``max_queue_delay`` (s: its own queue deadline, K4, over the scheduler's), ``cache_salt``
(a string: prompts of other salts share no cached block, G3) and
``ignore_eos``, ``tenant`` (who sent it: per-tenant queue limits, fair share and the
tenant-scoped prefix cache, as in ``kvserve serve``) and ``session_id`` with optional
``session_ttl`` (s): the multi-turn session the request is a turn of, whose KV the
scheduler holds between turns when the simulation runs with ``--max-session-kv`` (U1;
ignored otherwise, but its turns are still sent closed loop, docs/sessions.md), with
optional ``session_end_time`` (s, absolute) on a turn after which its client ended the
session (``DELETE /v1/sessions/{id}``, U8: its hold is released then), and
``replica`` (an integer >= 0): the data-parallel replica a recorded server placed the
request on, which ``--router recorded`` follows, and ``received_time`` (s, at or before
``arrival_time``): when a recorded server received the request, which its latencies count
from and its scheduler orders by, while the request reaches the scheduler at
``arrival_time`` in a replay of the recorded steps and at ``received_time`` in any other run
(:meth:`TraceRequest.at_receipt`, docs/recording.md). A
recorded prompt (``kvserve serve --record``, docs/recording.md) may come as ``prompt_len``
with ``prompt_hashes``, the chained hashes of its full blocks of ``hash_block_size`` tokens:
equal hashes stand for equal prefixes. Unknown fields are errors: a field that is accepted
must be honoured.

Token ids for ``prompt_len`` requests come from :mod:`kvserve.sim.tokens`: positions below
``prefix_len`` from the stream of ``prefix_id``, the rest from the stream of ``request_id``.
A hashed prompt's block i comes from the stream of its hash (so prompts that shared a prefix
share it again, block for block), the partial block at its end from the request's stream.
The simulated model continues the stream its prompt ended in, so a request whose prefix is
its whole prompt (a conversation turn) answers from the conversation's stream, and the next
turn's prompt can contain that answer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.core import SamplingParams
from kvserve.core.checks import is_finite, is_int, is_real
from kvserve.sim.tokens import EOS_TOKEN_ID, stream_key, stream_tokens


class TraceError(ValueError):
    """A malformed trace; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float
    output_len: int
    prompt_len: int | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prefix_id: str | None = None
    prefix_len: int = 0
    max_tokens: int | None = None
    priority: int = 0
    deadline: float | None = None
    cancel_time: float | None = None
    ignore_eos: bool = False
    tenant: str = ""
    prompt_hashes: tuple[str, ...] | None = None
    hash_block_size: int = 0
    session_id: str | None = None
    session_ttl: float | None = None
    session_end_time: float | None = None  # U8: the client ended the session then
    replica: int | None = None
    received_time: float | None = None
    # It asked for its prompt's logprobs (G8): it computes its whole prompt, never a hit.
    prompt_logprobs: int | None = None
    max_queue_delay: float | None = None  # K4: its own queue deadline (s after it arrived)
    cache_salt: str | None = None  # G3: its blocks are shared only with this salt's

    @property
    def received(self) -> float:
        """When the request was sent: latencies count from it, the scheduler orders by it."""
        return self.arrival_time if self.received_time is None else self.received_time

    def at_receipt(self) -> TraceRequest:
        """This request reaching the scheduler when the server received it: for a run whose
        steps are not the recorded ones (a changed setting, a fitted cost model), where the
        recorded engine's wait for its step boundary is not this run's (its own steps
        make that wait)."""
        if self.received_time is None:
            return self
        return dataclasses.replace(self, arrival_time=self.received_time, received_time=None)

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        assert self.prompt_len is not None
        return self.prompt_len

    def continuation_key(self, seed: int) -> int:
        """The stream the simulated model's output continues (see the module docstring)."""
        if self.prefix_id is not None and self.prefix_len >= self.num_prompt_tokens:
            return stream_key(seed, "prefix:" + self.prefix_id)
        return stream_key(seed, "request:" + self.request_id)

    def synthesise_prompt(self, seed: int) -> list[int]:
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        assert self.prompt_len is not None
        own = stream_key(seed, "request:" + self.request_id)
        if self.prompt_hashes is not None:
            return self._from_hashes(seed, own)
        if self.prefix_id is None:
            return stream_tokens(own, 0, self.prompt_len)
        ids = stream_tokens(stream_key(seed, "prefix:" + self.prefix_id), 0, self.prefix_len)
        ids += stream_tokens(own, len(ids), self.prompt_len)
        return ids

    def synthesise_with_answer(self, seed: int) -> tuple[list[int], list[int] | None]:
        """The prompt's ids and, where the answer continues the request's own stream (no
        prefix covering the whole prompt, no given or hashed prompt), the first
        ``output_len`` ids of that answer, drawn in the same pass: the same ids as
        :meth:`synthesise_prompt` and a separate draw after it (None: draw it separately)."""
        if self.prompt_token_ids is not None or self.prompt_hashes is not None or \
                self.prompt_len is None or \
                (self.prefix_id is not None and self.prefix_len >= self.prompt_len):
            return self.synthesise_prompt(seed), None
        own = stream_key(seed, "request:" + self.request_id)
        start = 0 if self.prefix_id is None else self.prefix_len
        ids = stream_tokens(own, start, self.prompt_len + self.output_len)
        split = self.prompt_len - start
        answer = ids[split:]
        del ids[split:]
        if self.prefix_id is None:
            return ids, answer
        return stream_tokens(stream_key(seed, "prefix:" + self.prefix_id), 0,
                             self.prefix_len) + ids, answer

    def _from_hashes(self, seed: int, own: int) -> list[int]:
        assert self.prompt_len is not None and self.prompt_hashes is not None
        size, ids = self.hash_block_size, []
        for index, digest in enumerate(self.prompt_hashes):
            ids += stream_tokens(stream_key(seed, "block:" + digest), index * size,
                                 (index + 1) * size)
        ids += stream_tokens(own, len(ids), self.prompt_len)
        return ids

    def sampling_params(self, default_max_tokens: int, sessions: bool = False) -> SamplingParams:
        """How the request is sampled: EOS is the simulated model's, max_tokens defaults to
        ``default_max_tokens`` (the model length) so that EOS or a length limit stops it;
        with ``sessions`` (the scheduler holds sessions' KV) the turn names its session."""
        params = _sampling_params(self.max_tokens or default_max_tokens, self.ignore_eos,
                                  self.priority, self.tenant)
        if self.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.prompt_logprobs)
        if self.max_queue_delay is not None:
            params = dataclasses.replace(params, max_queue_delay=self.max_queue_delay)
        if self.cache_salt is not None:
            params = dataclasses.replace(params, cache_salt=self.cache_salt)
        if sessions and self.session_id is not None:
            return dataclasses.replace(params, session_id=self.session_id,
                                       session_ttl=self.session_ttl)
        return params

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"request_id": self.request_id, "arrival_time": self.arrival_time}
        if self.prompt_token_ids is not None:
            row["prompt_token_ids"] = list(self.prompt_token_ids)
        else:
            row["prompt_len"] = self.prompt_len
        if self.prompt_hashes is not None:
            row["prompt_hashes"] = list(self.prompt_hashes)
            row["hash_block_size"] = self.hash_block_size
        if self.prefix_id is not None:
            row["prefix_id"] = self.prefix_id
            row["prefix_len"] = self.prefix_len
        row["output_len"] = self.output_len
        for name, default in (("max_tokens", None), ("priority", 0), ("deadline", None),
                              ("cancel_time", None), ("ignore_eos", False), ("tenant", ""),
                              ("session_id", None), ("session_ttl", None),
                              ("session_end_time", None), ("replica", None),
                              ("received_time", None), ("prompt_logprobs", None),
                              ("max_queue_delay", None), ("cache_salt", None)):
            value = getattr(self, name)
            if value != default:
                row[name] = value
        return row


@functools.lru_cache(maxsize=1024, typed=True)
def _sampling_params(max_tokens: int, ignore_eos: bool, priority: int,
                     tenant: str) -> SamplingParams:
    # Shared between requests (nothing in the simulator sets a field of one; the scheduler
    # replaces a request's params, never changes them): a trace has a handful of distinct
    # ones, and validating a new one costs more than the rest of submitting a request.
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                          eos_token_id=EOS_TOKEN_ID, priority=priority, tenant=tenant)


_FIELDS = ("request_id", "arrival_time", "prompt_token_ids", "prompt_len", "prefix_id",
           "prefix_len", "output_len", "max_tokens", "priority", "deadline", "cancel_time",
           "ignore_eos", "tenant", "prompt_hashes", "hash_block_size", "session_id",
           "session_ttl", "session_end_time", "replica", "received_time", "prompt_logprobs",
           "max_queue_delay", "cache_salt")


def _int(row: dict[str, Any], name: str, lo: int, default: Any = None) -> Any:
    value = row.get(name, default)
    if value is default and name not in row:
        return value
    if not is_int(value) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


# Seconds since the trace's start; later than this (about 317 years, Unix time included)
# leaves too few bits of a float for the microseconds the latencies are measured in.
MAX_TIME = 1e10


def _time(row: dict[str, Any], name: str, required: bool = False) -> float | None:
    if name not in row:
        if required:
            raise ValueError(f"missing {name}")
        return None
    value = row[name]
    if not is_finite(value) or not 0 <= value <= MAX_TIME:
        raise ValueError(f"{name} must be a number of seconds in [0, {MAX_TIME:.0e}], got "
                         f"{value!r}")
    return float(value)


def check_trace(trace: Sequence[Any]) -> None:
    """The checks of :func:`parse_request` a run cannot do without, for a trace built in
    Python (a file's lines are parsed): TraceRequest items, times that are numbers of
    seconds in range (a NaN arrival never came due: the run waited forever), the lengths'
    ranges and one prompt, and every rule a parsed line's fields keep between them
    (received before arrival, the prefix's, the session's). Raises TypeError or ValueError
    naming the request and field."""
    seen: set[str] = set()
    for item in trace:
        if not isinstance(item, TraceRequest):
            raise TypeError(f"a trace is a sequence of TraceRequest, got "
                            f"{type(item).__name__}")
        where = f"request {item.request_id!r}: "
        if item.request_id in seen:  # a cluster merged the two into one row (QA)
            raise ValueError(f"{where}the id is in the trace twice")
        seen.add(item.request_id)
        for name in ("arrival_time", "deadline", "cancel_time", "received_time",
                     "session_end_time"):
            value = getattr(item, name)
            if value is None and name != "arrival_time":
                continue
            if not is_finite(value) or not 0 <= value <= MAX_TIME:
                raise ValueError(f"{where}{name} must be a number of seconds in "
                                 f"[0, {MAX_TIME:.0e}], got {value!r}")
        counts = [("output_len", 0, False), ("max_tokens", 1, True)]
        if item.prompt_token_ids is None:  # else the ids are the prompt (its length unread)
            counts.append(("prompt_len", 1, False))
        for name, lo, optional in counts:
            value = getattr(item, name)
            if value is None and optional:
                continue
            if not is_int(value) or value < lo:
                raise ValueError(f"{where}{name} must be an integer >= {lo}, got {value!r}")
        if item.prompt_token_ids is not None and not item.prompt_token_ids:
            raise ValueError(f"{where}prompt_token_ids must not be empty")
        try:
            _check_fields(item)
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None


def parse_request(row: Any) -> TraceRequest:
    """One decoded JSON line -> TraceRequest; raises ValueError naming the bad field."""
    if not isinstance(row, dict):
        raise ValueError("a trace line must be a JSON object")
    unknown = sorted(set(row) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}")
    request_id = row.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    ids = row.get("prompt_token_ids")
    prompt_len = _int(row, "prompt_len", 1)
    if (ids is None) == (prompt_len is None):
        raise ValueError("give exactly one of prompt_token_ids and prompt_len")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of integers >= 0")
        ids = tuple(ids)
    prefix_id = row.get("prefix_id")
    if prefix_id is not None and "prefix_len" not in row:
        raise ValueError("prefix_id must be a string, with prefix_len and prompt_len")
    if prefix_id is None and "prefix_len" in row:
        raise ValueError("prefix_len needs a prefix_id")
    hashes, hash_block_size = _hashes(row, prompt_len)
    if "output_len" not in row:
        raise ValueError("missing output_len")
    session_ttl = row.get("session_ttl")
    if isinstance(session_ttl, int) and not isinstance(session_ttl, bool):
        session_ttl = float(session_ttl)
    request = TraceRequest(
        request_id=request_id,
        arrival_time=_time(row, "arrival_time", required=True),  # type: ignore[arg-type]
        output_len=_int(row, "output_len", 0),
        prompt_len=prompt_len,
        prompt_token_ids=ids,
        prefix_id=prefix_id,
        prefix_len=_int(row, "prefix_len", 0, 0),
        max_tokens=_int(row, "max_tokens", 1),
        priority=row.get("priority", 0),
        deadline=_time(row, "deadline"),
        cancel_time=_time(row, "cancel_time"),
        ignore_eos=row.get("ignore_eos", False),
        tenant=row.get("tenant", ""),
        prompt_hashes=hashes,
        hash_block_size=hash_block_size,
        session_id=row.get("session_id"),
        session_ttl=session_ttl,
        session_end_time=_time(row, "session_end_time"),
        replica=_int(row, "replica", 0),
        received_time=_time(row, "received_time"),
        prompt_logprobs=_int(row, "prompt_logprobs", 0),
        max_queue_delay=row.get("max_queue_delay"),
        cache_salt=row.get("cache_salt"),
    )
    _check_fields(request)
    return request


def _check_fields(request: TraceRequest) -> None:
    """The rules on a request's fields that are not a JSON line's alone, for a parsed line
    and a request built in Python alike; raises ValueError naming the field."""
    prefix_id, prefix_len, prompt_len = request.prefix_id, request.prefix_len, request.prompt_len
    if prefix_id is not None:
        if not isinstance(prefix_id, str) or request.prompt_token_ids is not None:
            raise ValueError("prefix_id must be a string, with prefix_len and prompt_len")
        if not is_int(prefix_len) or prefix_len < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {prefix_len!r}")
        if prompt_len is not None and prefix_len > prompt_len:
            raise ValueError(f"prefix_len {prefix_len} is longer than prompt_len {prompt_len}")
        if request.prompt_hashes is not None:
            raise ValueError("prompt_hashes and prefix_id cannot be combined")
    elif prefix_len:
        raise ValueError("prefix_len needs a prefix_id")
    if request.prompt_hashes is not None or request.hash_block_size:
        _check_hashes(request)
    if not isinstance(request.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be true or false, got {request.ignore_eos!r}")
    priority = request.priority
    if not is_int(priority):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not isinstance(request.tenant, str):
        raise ValueError(f"tenant must be a string, got {request.tenant!r}")
    session_id, session_ttl = request.session_id, request.session_ttl
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
    if session_ttl is not None and (  # the server's range (one message: QA saw two)
            not is_real(session_ttl) or not 0 < session_ttl <= 86400 or session_id is None):
        raise ValueError(f"session_ttl must be a number of seconds in (0, 86400], with a "
                         f"session_id, got {session_ttl!r}")
    delay = request.max_queue_delay
    if delay is not None and (not is_real(delay) or not 0 < delay <= 86400):  # the server's
        raise ValueError(f"max_queue_delay must be a number of seconds in (0, 86400], got "
                         f"{delay!r}")
    if request.cache_salt is not None and not isinstance(request.cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {request.cache_salt!r}")
    if request.session_end_time is not None and session_id is None:
        raise ValueError("session_end_time needs a session_id (the session it ends)")
    if request.session_end_time is not None and \
            request.session_end_time < request.arrival_time:  # the review: it ended a turn
        raise ValueError(f"session_end_time {request.session_end_time:g} is before "  # before
                         f"arrival_time {request.arrival_time:g} (it ends the session after "
                         "this turn)")
    replica = request.replica
    if replica is not None and (not is_int(replica) or replica < 0):
        raise ValueError(f"replica must be an integer >= 0, got {replica!r}")
    received = request.received_time
    if received is not None and received > request.arrival_time:
        raise ValueError(f"received_time {received:g} is after arrival_time "
                         f"{request.arrival_time:g}: a request reaches the scheduler after "
                         "the server received it")
    logprobs = request.prompt_logprobs
    if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
        raise ValueError(f"prompt_logprobs must be an integer >= 0, got {logprobs!r}")
    if logprobs is not None and session_id is not None:
        raise ValueError(f"prompt_logprobs cannot be asked of a session turn (G8), got "
                         f"{logprobs!r} on session {session_id!r}")


def _hashes(row: dict[str, Any], prompt_len: int | None) -> tuple[tuple[str, ...] | None, int]:
    """A hashed prompt's block hashes and block size; (None, 0) for any other prompt (their
    rules: :func:`_check_hashes`)."""
    if "prompt_hashes" not in row and "hash_block_size" not in row:
        return None, 0
    hashes = row.get("prompt_hashes")
    return tuple(hashes) if isinstance(hashes, list) else hashes, row.get("hash_block_size")


def _check_hashes(request: TraceRequest) -> None:
    hashes, size, prompt_len = request.prompt_hashes, request.hash_block_size, request.prompt_len
    if prompt_len is None or not is_int(size) or size < 1 \
            or not isinstance(hashes, tuple) or not all(isinstance(h, str) and h for h in hashes):
        raise ValueError("prompt_hashes (a list of strings) needs hash_block_size and "
                         "prompt_len")
    if len(hashes) != prompt_len // size:
        raise ValueError(f"prompt_hashes has {len(hashes)} hashes; a prompt of {prompt_len} "
                         f"tokens has {prompt_len // size} full blocks of {size}")

def read_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace ("-": standard input); blank lines are skipped. Raises TraceError
    naming the line."""
    if str(path) == "-":
        return parse_trace(sys.stdin, "<stdin>")
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise TraceError(f"cannot read trace {path}: {error.strerror}") from None
    with handle:
        try:
            return parse_trace(handle, str(path))
        except OSError as error:  # QA: a read error was told as "writing the output"
            raise TraceError(f"cannot read trace {path}: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not a trace: it is not UTF-8 text (a trace is JSON "
                             "lines, one request per line)") from None


def decode_line(line: str) -> Any:
    """One line's JSON value; ValueError saying why it is none (QA: a line nested 100,000
    deep was a RecursionError's traceback, a 5,000-digit number named no line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON: {error.msg}") from None
    except RecursionError:
        raise ValueError("not valid JSON: nested too deep") from None
    except ValueError as error:  # Python's limit on an integer's digits
        raise ValueError(f"not valid JSON: {str(error).split(';')[0]}") from None


def parse_trace(lines: Iterable[str], name: str) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
        if not line.strip():
            continue
        try:
            request = parse_request(decode_line(line))
        except ValueError as error:
            raise TraceError(f"{name}:{number}: {error}") from None
        if request.request_id in seen:
            raise TraceError(f"{name}:{number}: duplicate request_id {request.request_id!r}")
        seen.add(request.request_id)
        requests.append(request)
    if not requests:
        raise TraceError(f"{name}: the trace has no requests")
    return requests


def dump_trace(requests: Iterable[TraceRequest]) -> str:
    return "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in requests)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    Path(path).write_text(dump_trace(requests), encoding="utf-8")
