"""Multi-turn sessions that keep their KV between turns (spec U1-U8, L1).

A session is named by a request (``SamplingParams.session_id``) and scoped to its tenant: the
key is (tenant, session id). Its life::

    turn 1 arrives ----> runs like any request ----> finishes (stop or length)
                                                        | U2: its blocks stay referenced
                                                        v
                          +------------------------- HELD (idle, expires after its ttl)
    turn 2 arrives, its   |                             | released (U5-U8): ttl, pressure,
    prompt extends the    | U3: takes the blocks,       | limit, deleted, replaced -> the
    held tokens (else it  |     waits in the held       v    blocks go back to the free
    replaces them, U3)    v     queue, drained first    (gone)   queue, still cached (G2)
                    waiting, holding KV (L1) --> admitted, prefilling only its new tokens

A held session's blocks carry one reference of the session's own, so they are neither free
nor evictable; releasing one drops that reference like a finished request's free (G2): its
full blocks stay findable by hash until reused, so a released session falls back to
ordinary prefix caching. Standard library only.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.core.block_pool import KVBlock
from kvserve.core.errors import RequestError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request, RequestStatus

# Why a held session let go of its KV (kvserve:session_releases_total{reason}).
TTL, PRESSURE, LIMIT, DELETED, ABORTED = "ttl", "pressure", "limit", "deleted", "aborted"
REPLACED = "replaced"  # a turn that does not extend the held tokens: another version (U3)
RELEASE_REASONS = (TTL, PRESSURE, LIMIT, DELETED, ABORTED, REPLACED)
_HELD_FINISHES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

SessionKey = tuple[str, str]  # (tenant, session id)
# (event kind, request id, tokens, reason): the scheduler's event log
EmitFn = Callable[[str, str, int, str], None]


class SessionError(RequestError):
    """A turn its session cannot take (U3, U4): the server answers 400."""


class SessionBusy(SessionError):
    """A turn sent while its session's previous turn still runs (U4): the server answers
    409 Conflict, since the same turn succeeds once the other has finished."""


class SessionNotFound(RequestError):
    """No live session of that id (for that tenant): ``DELETE /v1/sessions/{id}`` answers
    404."""


def session_key(request: Request) -> SessionKey:
    params = request.sampling_params
    assert params.session_id is not None
    return (params.tenant, params.session_id)


@dataclass(eq=False, slots=True)
class Session:
    key: SessionKey
    cache_salt: str | None
    turn_id: str | None  # the request of the turn in flight; None while held
    last_request_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV the blocks hold
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    expires_at: float = 0.0
    hold_order: int = 0  # when it was last held, in the store's count of holds


class SessionStore:
    """Every live session, the held ones oldest hold first, and their counters."""

    def __init__(self, kv: KVCacheManager, max_fraction: float, default_ttl: float,
                 emit: EmitFn | None = None) -> None:
        self.kv = kv
        self.max_blocks = int(max_fraction * kv.num_blocks)  # U5
        self.default_ttl = default_ttl
        self.sessions: dict[SessionKey, Session] = {}
        self.held: OrderedDict[SessionKey, Session] = OrderedDict()  # oldest hold first
        self.next_expiry = float("inf")
        # what releases read without a pass over every hold (QA: each expiry and each U5/U7
        # release scanned them all): a heap of (expiry, hold order, session), stale entries
        # skipped; each tenant's holds, oldest first
        self._expiries: list[tuple[float, int, Session]] = []
        self._holds_by_tenant: dict[str, OrderedDict[SessionKey, Session]] = {}
        # The held blocks, each once (U5: sessions opening with one system prompt share its
        # blocks, the prefix cache's; the sessions pass: each was counted per session, so
        # six such sessions released each other at 8% of the pool under a 30% bound):
        # block id -> the held sessions keeping it, overall and per tenant
        self._holders: dict[int, int] = {}
        self._holders_by_tenant: dict[str, dict[int, int]] = {}
        self._hold_count = itertools.count()
        self.num_hits = 0
        self.num_hit_tokens = 0
        self.releases: dict[str, int] = {}
        self._emit = emit

    # -- a turn arrives (U3, U4) ------------------------------------------------------------

    def check_turn(self, request: Request) -> Session | None:
        """The live session ``request`` is a turn of, None for a first turn (or one after a
        release); raise SessionBusy, changing nothing, while its previous turn runs (U4)."""
        key = session_key(request)
        session = self.sessions.get(key)
        if session is None:
            return None
        if session.turn_id is not None:
            raise SessionBusy(f"request {request.request_id}: session {key[1]!r} already has "
                              f"a turn in flight ({session.turn_id}); send one turn at a time")
        return session

    def start_turn(self, request: Request, session: Session | None) -> bool:
        """Record ``request`` as its session's turn in flight (``session``: what
        :meth:`check_turn` returned). A turn that extends the held tokens, with the
        session's cache salt, takes the session's blocks (their reference becomes the
        request's); one that does not (a regenerated or edited turn) replaces them: the
        session's KV is released and the turn starts it afresh (U3). True if it now holds
        KV."""
        if session is not None and not _extends(session, request):
            self._release_held(session, REPLACED)
            session = None
        if session is None:
            key = session_key(request)
            self.sessions[key] = Session(key, request.sampling_params.cache_salt,
                                         request.request_id, request.request_id)
            return False
        self._unhold(session)
        self.kv.adopt_blocks(request, session.blocks, session.num_cached_blocks)
        request.num_computed_tokens = len(session.token_ids)
        session.turn_id = session.last_request_id = request.request_id
        session.blocks, session.token_ids = [], []
        return True

    def note_hit(self, num_tokens: int) -> None:
        """A turn admitted on its session's held KV (kvserve:session_hits_total)."""
        self.num_hits += 1
        self.num_hit_tokens += num_tokens

    def stats(self) -> dict[str, object]:
        """The SchedulerStats fields of sessions."""
        return {"num_sessions_held": len(self.held),
                "num_session_blocks": self.num_held_blocks,
                "num_session_hits": self.num_hits,
                "num_session_hit_tokens": self.num_hit_tokens,
                "session_releases": dict(self.releases)}

    # -- a turn ends (U2, U8) ---------------------------------------------------------------

    def end_turn(self, request: Request, now: float) -> int:
        """Called as ``request`` finishes, before its blocks are freed: a completed turn's KV
        becomes the session's (U2, bounded by U5); an aborted or failed one ends the session
        (U8). Nothing happens if the session was deleted meanwhile. Returns the tokens held
        for the session's next turn (0: none, and why is logged and counted)."""
        key = session_key(request)
        session = self.sessions.get(key)
        if session is None or session.turn_id != request.request_id:
            return 0
        num_tokens = request.num_computed_tokens
        if request.status is RequestStatus.FINISHED_STOPPED and \
                isinstance(request.stop_reason, str):  # a stop string: the client's text
            num_tokens = min(num_tokens, request.num_prompt_tokens)  # ends inside the answer
            # (not J2's "kv_capacity", a length finish: QA, that held its prompt only)
        if request.status not in _HELD_FINISHES or num_tokens == 0 or \
                self.kv.num_held_blocks(request.request_id) == 0:
            self._forget(session, ABORTED)
            return 0
        num_blocks = self.kv.num_blocks_for(num_tokens)
        if num_blocks > self.max_blocks:
            self._forget(session, LIMIT)  # its blocks are freed with the request's
            return 0
        kept = self.kv.req_to_blocks[request.request_id][:num_blocks]
        while (adding := sum(block.block_id not in self._holders for block in kept)) and \
                self.num_held_blocks + adding > self.max_blocks:
            self.release_oldest(LIMIT, (key[0], adding))
        blocks, num_cached = self.kv.detach_blocks(request, num_tokens)
        session.turn_id = None
        session.token_ids = request.all_token_ids[:num_tokens]
        session.blocks, session.num_cached_blocks = blocks, num_cached
        ttl = request.sampling_params.session_ttl
        session.expires_at = now + (self.default_ttl if ttl is None else ttl)
        self.next_expiry = min(self.next_expiry, session.expires_at)
        self._hold(session)
        if self._emit is not None:
            self._emit("held", request.request_id, num_tokens, f"session {key[1]}")
        return num_tokens

    # -- releases (U5-U8) -------------------------------------------------------------------

    def release(self, key: SessionKey, reason: str) -> bool:
        """End one session; a held one's blocks go back to the pool. False if unknown."""
        session = self.sessions.get(key)
        if session is None:
            return False
        if session.turn_id is None:
            self._release_held(session, reason)
        else:
            self._forget(session, reason)  # the turn runs on; its KV will not be held
        return True

    def release_oldest(self, reason: str = PRESSURE,
                       arriving: tuple[str, int] | None = None) -> bool:
        """Release the oldest hold of the tenant that holds the most blocks (U5, U7; with
        one tenant, the session held longest), counting ``arriving`` (a tenant's turn about
        to be held, in blocks) as that tenant's: a tenant opening sessions releases its own
        before anyone else's (QA: one released every other tenant's). False if none is
        held."""
        if not self.held:
            return False
        blocks = self.blocks_by_tenant()
        if arriving is not None and arriving[0] in blocks:
            blocks[arriving[0]] += arriving[1]
        most = max(blocks.values())
        oldest = min((self._oldest_hold(tenant) for tenant, count in blocks.items()
                      if count == most), key=lambda session: session.hold_order)
        self._release_held(oldest, reason)
        return True

    def expire(self, now: float) -> None:
        """U6: release every held session whose ttl ran out by ``now`` (oldest hold
        first)."""
        if now < self.next_expiry:
            return
        heap, expired = self._expiries, []
        while heap and heap[0][0] <= now:
            _, hold_order, session = heapq.heappop(heap)
            if self._holds(session, hold_order):
                expired.append(session)
        for session in sorted(expired, key=lambda session: session.hold_order):
            self._release_held(session, TTL)
        self.next_expiry = heap[0][0] if heap else float("inf")

    def _hold(self, session: Session) -> None:
        key, tenant = session.key, session.key[0]
        session.hold_order = next(self._hold_count)
        self.held[key] = session
        self._holds_by_tenant.setdefault(tenant, OrderedDict())[key] = session
        holders, tenants = self._holders, self._holders_by_tenant.setdefault(tenant, {})
        for block in session.blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
            tenants[block.block_id] = tenants.get(block.block_id, 0) + 1
        heap = self._expiries
        heapq.heappush(heap, (session.expires_at, session.hold_order, session))
        if len(heap) > 2 * len(self.held) + 64:  # entries of sessions no longer held
            self._expiries = [entry for entry in heap if self._holds(entry[2], entry[1])]
            heapq.heapify(self._expiries)

    def _holds(self, session: Session, hold_order: int) -> bool:
        """Whether ``session`` is held still by the hold numbered ``hold_order``."""
        return session.hold_order == hold_order and self.held.get(session.key) is session

    def _unhold(self, session: Session) -> None:
        key, tenant = session.key, session.key[0]
        del self.held[key]
        holds = self._holds_by_tenant[tenant]
        del holds[key]
        for holders in (self._holders, self._holders_by_tenant[tenant]):
            for block in session.blocks:
                count = holders.pop(block.block_id)
                if count > 1:
                    holders[block.block_id] = count - 1
        if not holds:
            del self._holds_by_tenant[tenant], self._holders_by_tenant[tenant]

    @property
    def num_held_blocks(self) -> int:
        """The blocks held sessions keep, each once (U5)."""
        return len(self._holders)

    def blocks_by_tenant(self) -> dict[str, int]:
        """The blocks each tenant's held sessions keep, each once (a copy)."""
        return {tenant: len(holders) for tenant, holders in self._holders_by_tenant.items()}

    def _oldest_hold(self, tenant: str) -> Session:
        return next(iter(self._holds_by_tenant[tenant].values()))

    def demoted(self, request: Request) -> None:
        """A waiting turn gave up its session's KV under pressure (U7): it is an ordinary
        request now; the session waits for it as for any turn in flight."""
        self._count(PRESSURE, request.request_id, request.num_computed_tokens)

    def _release_held(self, session: Session, reason: str) -> None:
        self._unhold(session)
        del self.sessions[session.key]
        blocks = session.blocks
        self.kv.pool.free(reversed(blocks))  # tail first, as a request's (G2)
        self._count(reason, session.last_request_id, len(session.token_ids))
        session.blocks, session.token_ids = [], []

    def _forget(self, session: Session, reason: str) -> None:
        del self.sessions[session.key]
        self._count(reason, session.last_request_id, 0)

    def _count(self, reason: str, request_id: str, num_tokens: int) -> None:
        self.releases[reason] = self.releases.get(reason, 0) + 1
        if self._emit is not None:
            self._emit("released", request_id, num_tokens, reason)


def _extends(session: Session, request: Request) -> bool:
    """U3: whether ``request``'s prompt starts with exactly the held tokens and is longer,
    under the session's cache salt."""
    held, prompt = session.token_ids, request.prompt_token_ids
    return request.sampling_params.cache_salt == session.cache_salt and \
        len(prompt) > len(held) and prompt[:len(held)] == held
