"""What every handler of one server shares: the engine, the model's facts, keys, metrics."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from kvserve.core import SchedulerConfig
from kvserve.engine.async_engine import RequestStream, ServingEngine
from kvserve.engine.text import Tokenizer
from kvserve.server.auth import KeyRing
from kvserve.server.body import parse_json
from kvserve.server.errors import APIError, bad_request
from kvserve.server.limits import FanOutLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import model_error
from kvserve.server.response_store import ResponseStore

if TYPE_CHECKING:  # imported by the modules that build them, not on every request's path
    from kvserve.server.reasoning_parsers import ThinkParser
    from kvserve.server.recorder import Recorder
    from kvserve.server.tool_parsers import ToolParser

DEFAULT_MAX_BODY_BYTES = 4 << 20
BODY_READ_TIMEOUT_S = 60.0  # a 4 MiB body (the default limit) at 70 KB/s


def is_request_id(given: Any) -> bool:
    """Whether ``given`` may be a request's id: 1-128 printable ASCII characters (ASCII: a
    header is read as Latin-1, so UTF-8 came back garbled, 'cafÃ©')."""
    return isinstance(given, str) and 0 < len(given) <= 128 and given.isascii() and \
        given.isprintable()


@dataclass
class Queuing:
    """A request the engine has not answered the add of yet (tokenized, handed over; until
    the engine's next step ends): what /v1/abort asked of it meanwhile, done once the
    engine has it (QA: ``not_found``, and the request ran to its end). ``aborts``: None for
    the whole request, else choice ids, in the order asked."""

    choice_ids: frozenset[str]
    aborts: list[str | None] = field(default_factory=list)

    def ask(self, choice: str | None) -> bool:
        """Abort ``choice`` (None: every one) once queued; False if asked already."""
        if None in self.aborts or choice in self.aborts:
            return False
        self.aborts.append(choice)
        return True


@dataclass
class ServerState:
    engine: ServingEngine
    model_name: str
    keys: KeyRing = field(default_factory=lambda: KeyRing([]))
    priority_source: str = "body"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # seconds a request's body may take to arrive whole (QA: a body declared longer than
    # sent held its connection and task with no end, a slow-client hole); 408 past it
    body_read_timeout: float = BODY_READ_TIMEOUT_S
    metrics: ServerMetrics = field(init=False)
    fan_out: FanOutLimits = field(default_factory=FanOutLimits)
    groups: dict[str, RequestStream] = field(default_factory=dict)  # live, by request id
    # the engine ids of live requests that run under another id than the client gave (a
    # suffix, engine_id), by the client's: /v1/abort takes the id the client knows (QA: a
    # tenant's request could not be aborted while it ran)
    given: dict[str, list[str]] = field(default_factory=dict)
    # requests between their ids' hold and the engine's answer to their add, by request id
    queuing: dict[str, Queuing] = field(default_factory=dict)
    # Every id a live request holds (its group's and its choices' engine ids), held from the
    # check until the group ends, so that two requests sent at once cannot share one.
    ids_in_use: set[str] = field(default_factory=set)
    shutting_down: bool = False  # kvserve serve's shutdown began: new requests are refused
    # set when the shutdown aborts what is under way (its timeout, a second signal): a
    # body still arriving then ends in a 503 (QA: one slow upload held the exit 30-60 s)
    _reads_abort: asyncio.Future[None] | None = field(default=None, init=False, repr=False,
                                                      compare=False)
    started: float = field(default_factory=time.time)
    recorder: Recorder | None = None  # with --record (or started at run time)
    record_prompts: str = "hashes"  # --record-prompts
    record_max_file_bytes: int = 64 << 20  # --record-max-file-size
    model_id: str = ""  # the model's own name where model_name is an alias (recordings)
    # --served-model-name's names, model_name first: a request may name any of them
    served_model_names: tuple[str, ...] = ()
    # names a request may also give, not listed: without --served-model-name, the model as
    # given on the command line (vLLM's served name) beside its short name
    model_aliases: tuple[str, ...] = ()
    # --generation-config's: SamplingParams field -> default, for a request that sets none
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # vLLM's override_max_tokens: max_new_tokens from --generation-config DIR or from
    # --override-generation-config caps every request's max_tokens, its own too
    max_tokens_cap: int | None = None
    response_role: str = "assistant"  # --response-role: a chat answer's message's role
    max_logprobs: int = 20  # --max-logprobs: the most (prompt / top) logprobs a request asks
    log_requests: bool = False  # --enable-log-requests
    # --enable-auto-tool-choice --tool-call-parser: a ToolParser (server/tool_parsers.py)
    tool_parser: ToolParser | None = None
    # --reasoning-parser: a ThinkParser (server/reasoning_parsers.py)
    reasoning_parser: ThinkParser | None = None
    # vLLM's --enable-force-include-usage: every stream ends with its usage chunk
    force_include_usage: bool = False
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    prompt_tokens_details: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens token_id:N unless a request
    # says otherwise
    tokens_as_ids: bool = False
    # the Responses API's store (--enable-responses-store): off, store: true keeps nothing
    responses: ResponseStore = field(default_factory=ResponseStore)
    # background responses under way: id -> (their generation, their task)
    background: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = sorted({key.tenant for key in self.keys.keys}) if self.keys.enabled else None
        self.metrics = ServerMetrics(self.engine, self.model_name, known)
        deaths = getattr(self.engine, "death_observers", None)  # data parallel
        if deaths is not None:
            deaths.append(self._replica_died)

    def _replica_died(self, index: int, when: float, held: list[str]) -> None:
        """A replica died holding ``held``: those whose client had left already (their
        answer closed, its abort never reached the engine) are counted failed here, as no
        answer will (the chaos pass: counted nowhere, followed for the server's life)."""
        in_use = self.ids_in_use
        self.metrics.requests_failed([r for r in held if r not in in_use])

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as its model, model_name first."""
        return self.served_model_names or (self.model_name,)

    def check_model(self, name: str | None) -> None:
        """A 404 unless ``name`` (a request's model; None: any) is one this server serves."""
        if name is not None and name not in self.model_names and \
                name not in self.model_aliases:
            raise model_error(name, self.model_names)

    @property
    def tokenizer(self) -> Tokenizer:
        tokenizer = self.engine.info.tokenizer
        if tokenizer is None:
            raise RuntimeError("the server's engine has no tokenizer")
        return tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def scheduling_policy(self) -> str:
        return self.engine.info.scheduling_policy

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.engine.info.scheduler_config

    def new_request_id(self, given: str | None, what: str = "X-Request-Id") -> str:
        """A request's id: ``given`` (the header, or vLLM's body field ``request_id``: named
        by ``what`` in the error) or a fresh one."""
        if given is None:
            return uuid.uuid4().hex[:16]
        if not is_request_id(given):
            raise bad_request(f"{what} must be 1-128 printable ASCII characters",
                              param="request_id" if what != "X-Request-Id" else None)
        return given

    def engine_id(self, request_id: str, num_choices: int, private: bool = False) -> str:
        """The id a request goes to the engine with: ``request_id`` (the client's or a fresh
        one), or, when it or one of its choices' ``<id>-<index>`` is a live request's, that
        id with a random suffix: a client may reuse an X-Request-Id (a gateway's retry while
        the first attempt runs, a benchmark's fixed ids), as vLLM (since 0.14) accepts. The
        answer keeps the client's id; its ``kvserve.request_id`` is the engine's.
        ``private`` (a tenant's id among others'): always with a suffix, so that it tells
        nothing of the ids others hold."""
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}" if private else request_id
        while self._ids_taken(engine_id, num_choices):
            engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        return engine_id

    def _ids_taken(self, request_id: str, num_choices: int) -> bool:
        in_use = self.ids_in_use
        return request_id in in_use or (num_choices > 1 and any(
            f"{request_id}-{index}" in in_use for index in range(num_choices)))

    def hold_ids(self, request_id: str, sub_ids: list[str]) -> None:
        """Take a request's ids (its group's and its choices'), or a 400 naming one another
        live request holds; :meth:`release_ids` gives them back. No await between the check
        and the take, so two requests at once cannot both pass it."""
        ids = {request_id, *sub_ids}
        taken = sorted(ids & self.ids_in_use)
        if taken:
            what = "request id" if taken[0] == request_id else \
                f"request id {request_id!r} makes the choice id"
            raise bad_request(f"{what} {taken[0]!r}, which a live request already uses; "
                              "send another X-Request-Id")
        self.ids_in_use |= ids

    def release_ids(self, request_id: str, sub_ids: list[str]) -> None:
        self.ids_in_use.difference_update((request_id, *sub_ids))

    async def read_json(self, request: Request) -> Any:
        """The body as checked JSON (server/body.py); 413 past ``max_body_bytes`` (checked
        while reading); 415 for a compressed body (any Content-Encoding but identity)."""
        return parse_json(await self.read_body(request))

    async def read_body(self, request: Request) -> bytes:
        """The body's bytes, with :meth:`read_json`'s 413 and 415."""
        encoding = ", ".join(request.headers.getlist("content-encoding"))  # every header
        if any(part.strip().lower() not in ("", "identity") for part in encoding.split(",")):
            raise APIError(415, f"the request body has Content-Encoding '{encoding}'; this "
                                "server reads only uncompressed bodies: send it without "
                                "Content-Encoding")
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() \
                and int(declared) > limit:  # ("²" is a digit to isdigit, not to int)
            raise _too_large(int(declared), limit)
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)

        if self._reads_abort is None:
            self._reads_abort = asyncio.get_running_loop().create_future()
        # a task, as wait_for made; raced against the shutdown's abort and the timeout
        reading = asyncio.ensure_future(read())
        try:
            done, _ = await asyncio.wait((reading, self._reads_abort),
                                         timeout=self.body_read_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reading.done():  # timed out, aborted, or this handler cancelled
                reading.cancel()
        if reading in done:
            reading.result()  # its 413, if any
            return b"".join(chunks)
        if self._reads_abort in done:
            raise APIError(503, "the server is shutting down; send the request to another "
                                "replica", code="shutting_down")
        raise APIError(408, f"the request body did not arrive whole within "
                            f"{self.body_read_timeout:g} s ({sum(map(len, chunks))} "
                            "bytes came); send it at once")

    def abort_body_reads(self) -> None:
        """The shutdown aborts what is under way: the bodies still arriving end in a 503."""
        if self._reads_abort is None:
            self._reads_abort = asyncio.get_running_loop().create_future()
        if not self._reads_abort.done():
            self._reads_abort.set_result(None)

    def retry_after(self) -> str:
        """Seconds a refused client should wait: until the waiting queue is seated, at the
        recent requests' time in a seat (not their arrival-to-finish time, which holds the
        wait once more: QA, 14 s for a queue that drained in 2) over the running seats;
        between 1 and 60."""
        stats = self.engine.stats
        service = self.metrics.recent_service_time() or 1.0
        estimate = service * stats.num_waiting / max(stats.num_running, 1)
        return str(int(min(60, max(1, math.ceil(estimate)))))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; this server accepts at "
                         f"most {limit} bytes")
