"""Routing requests among data-parallel replicas (spec R1-R5): one pure object that the
server's data-parallel mode and the simulator's cluster mode both call.

    decision = router.route(prompt_block_hashes(token_ids, block_size, salt), loads)

``loads`` holds one :class:`ReplicaLoad` per replica, index i describing replica i, as the
caller last saw it (a caller whose loads are reported late should count the requests it has
routed since). A router never picks a dead replica (R1); with every replica dead it raises
:class:`NoReplicaError`.

- ``round-robin``: replicas in turn, skipping dead ones (R2).
- ``least-loaded``: the lowest load score, ``4 * num_waiting + num_running`` (a queued request
  weighs four running ones, as in vLLM's data-parallel balancer), then the lowest KV usage;
  ties rotate so that a burst routed on unchanged loads spreads out (R3).
- ``prefix-affinity``: the replica the router last sent the longest run of this request's
  leading block hashes to, so a shared prefix is computed once and then hit; unless that
  replica's load score exceeds the least-loaded replica's by more than ``imbalance_bound``
  (reason ``imbalance``), or no hash matches (reason ``least_loaded``): then least-loaded (R4).
  It remembers at most ``max_tracked_blocks`` hashes, forgetting the least recently routed.
- ``forget_replica(i)`` drops every hash remembered for replica i: its cache is gone (R5).
- Under every policy a session turn (``route(..., session=key)``) goes to the replica its
  session's last turn went to, which holds its KV (reason ``session``), while that replica is
  alive; else the policy picks and the router remembers (R6). A released session is not
  forgotten: its next turn goes back where the released blocks are cached. At most
  ``max_tracked_sessions`` are remembered, the least recently routed forgotten first.
- ``withdraw(decision, ...)``: the replica refused the request (its queue limits, a session
  busy there): what ``route`` learnt from it is undone, so a session whose first turn never
  ran is not pinned and a prefix never computed there is not pointed at it (R7).

Everything is deterministic: no salted ``hash()``, no iteration over sets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvserve.core.checks import is_int
from kvserve.core.errors import ConfigError

ROUTER_POLICIES = ("round-robin", "least-loaded", "prefix-affinity")
WAITING_WEIGHT = 4
DEFAULT_IMBALANCE_BOUND = 16
DEFAULT_MAX_TRACKED_BLOCKS = 100_000
DEFAULT_MAX_TRACKED_SESSIONS = 100_000


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica: int
    alive: bool
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1, share of the replica's KV blocks in use


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    reason: str  # "round_robin" | "least_loaded" | "prefix_hit" | "imbalance" | "session"
    # what the router knew before it (the session's replica and each prefix hash's) and
    # the stamp of what it taught, for withdraw (R7); not part of the decision's value
    before: tuple[int | None, tuple[int | None, ...]] = field(
        default=(None, ()), compare=False, repr=False)
    stamp: int = field(default=0, compare=False, repr=False)


class NoReplicaError(RuntimeError):
    """Every replica is dead: the request cannot be routed (the server answers 503)."""


def load_score(load: ReplicaLoad) -> int:
    """A queued request weighs ``WAITING_WEIGHT`` running ones (R3)."""
    return WAITING_WEIGHT * load.num_waiting + load.num_running


class Router(ABC):
    """Picks a replica for each request: a session turn where its session is (R6), else by
    the subclass's policy (:meth:`_pick`). Subclasses hold only their own routing memory."""

    policy: str

    def __init__(self, num_replicas: int,
                 max_tracked_sessions: int = DEFAULT_MAX_TRACKED_SESSIONS) -> None:
        self.num_replicas = num_replicas
        self.max_tracked_sessions = max_tracked_sessions
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()  # least recent first
        # the route that last taught each session and prefix hash: withdraw undoes only
        # what its own route taught and nothing has taught since (QA: a later accepted
        # turn's pin, or prefix, undone by an earlier refused one's withdrawal)
        self._stamp = 0
        self._session_taught: dict[Hashable, int] = {}

    def route(self, prefix_hashes: Sequence[Hashable], loads: Sequence[ReplicaLoad],
              session: Hashable | None = None) -> RouteDecision:
        """The replica for a request whose leading full-block hashes are ``prefix_hashes``;
        ``session``: the session it is a turn of (a key naming the tenant too), or None."""
        alive = self._alive(loads)
        owner = None if session is None else self._sessions.get(session)
        before = (owner, self._owners_of(prefix_hashes))
        self._stamp += 1
        if owner is not None and loads[owner].alive:
            decision = RouteDecision(owner, "session")
            self._placed(prefix_hashes, owner)
        else:
            decision = self._pick(prefix_hashes, loads, alive)
        if session is not None:
            self._sessions[session] = decision.replica
            self._sessions.move_to_end(session)
            self._session_taught[session] = self._stamp
            if len(self._sessions) > self.max_tracked_sessions:
                gone, _ = self._sessions.popitem(last=False)
                self._session_taught.pop(gone, None)
        return RouteDecision(decision.replica, decision.reason, before, self._stamp)

    def session_replica(self, session: Hashable) -> int | None:
        """The replica ``session``'s turns go to (R6), None if it is not remembered."""
        return self._sessions.get(session)

    def withdraw(self, decision: RouteDecision, prefix_hashes: Sequence[Hashable],
                 session: Hashable | None = None) -> None:
        """The replica ``decision`` named refused the request (``route``'s arguments
        again): what routing it taught the router is undone where nothing has changed it
        since (R7)."""
        session_owner, hash_owners = decision.before
        if session is not None and self._session_taught.get(session) == decision.stamp:
            del self._session_taught[session]
            if session_owner is None:
                self._sessions.pop(session, None)
            else:
                self._sessions[session] = session_owner
        self._unlearn(prefix_hashes, hash_owners, decision.stamp)

    def _owners_of(self, prefix_hashes: Sequence[Hashable]) -> tuple[int | None, ...]:
        """The replica each hash points at, for withdraw (none but under prefix-affinity)."""
        return ()

    def _unlearn(self, prefix_hashes: Sequence[Hashable],  # noqa: B027
                 owners: tuple[int | None, ...], stamp: int) -> None:
        """Point the hashes the route stamped ``stamp`` taught, and nothing since, back
        at ``owners``."""

    @abstractmethod
    def _pick(self, prefix_hashes: Sequence[Hashable], loads: Sequence[ReplicaLoad],
              alive: list[ReplicaLoad]) -> RouteDecision:
        """The policy's choice among the ``alive`` replicas (at least one)."""

    def _placed(self, prefix_hashes: Sequence[Hashable], replica: int) -> None:  # noqa: B027
        """A request went to ``replica`` by its session: what the policy learns from it
        (nothing, but for prefix-affinity's memory)."""

    def forget_replica(self, replica: int) -> None:
        """Replica ``replica`` lost its cache (restart): drop what points at it (R5), its
        sessions too."""
        self._check_replica(replica)
        self._sessions = OrderedDict((key, owner) for key, owner in self._sessions.items()
                                     if owner != replica)
        self._session_taught = {key: stamp for key, stamp in self._session_taught.items()
                                if key in self._sessions}

    def _alive(self, loads: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
        if len(loads) != self.num_replicas:
            raise ValueError(f"router for {self.num_replicas} replicas got {len(loads)} loads")
        for index, load in enumerate(loads):
            if load.replica != index:
                raise ValueError(f"loads[{index}] describes replica {load.replica}; "
                                 f"loads must be in replica order")
        alive = [load for load in loads if load.alive]
        if not alive:
            raise NoReplicaError(f"all {self.num_replicas} replicas are down")
        return alive

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} out of range 0..{self.num_replicas - 1}")


class RoundRobinRouter(Router):
    policy = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _pick(self, prefix_hashes: Sequence[Hashable], loads: Sequence[ReplicaLoad],
              alive: list[ReplicaLoad]) -> RouteDecision:
        replica = self._next
        while not loads[replica].alive:
            replica = (replica + 1) % self.num_replicas
        self._next = (replica + 1) % self.num_replicas
        return RouteDecision(replica, "round_robin")


class LeastLoadedRouter(Router):
    policy = "least-loaded"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._tie_start = 0

    def _pick(self, prefix_hashes: Sequence[Hashable], loads: Sequence[ReplicaLoad],
              alive: list[ReplicaLoad]) -> RouteDecision:
        return RouteDecision(self._least_loaded(alive), "least_loaded")

    def _least_loaded(self, alive: Sequence[ReplicaLoad]) -> int:
        start, n = self._tie_start, self.num_replicas
        best = min(alive, key=lambda load: (load_score(load), load.kv_usage,
                                            (load.replica - start) % n))
        self._tie_start = (best.replica + 1) % n
        return best.replica


class PrefixAffinityRouter(LeastLoadedRouter):
    policy = "prefix-affinity"

    def __init__(self, num_replicas: int, imbalance_bound: int,
                 max_tracked_blocks: int) -> None:
        super().__init__(num_replicas)
        self.imbalance_bound = imbalance_bound
        self.max_tracked_blocks = max_tracked_blocks
        self._owner: dict[Hashable, int] = {}  # insertion order = least recently routed first
        self._hash_taught: dict[Hashable, int] = {}  # the stamp of the route that taught it

    def _pick(self, prefix_hashes: Sequence[Hashable], loads: Sequence[ReplicaLoad],
              alive: list[ReplicaLoad]) -> RouteDecision:
        owner = self._longest_match_owner(prefix_hashes)
        if owner is not None and loads[owner].alive:
            least = min(load_score(load) for load in alive)
            if load_score(loads[owner]) - least <= self.imbalance_bound:
                decision = RouteDecision(owner, "prefix_hit")
            else:
                decision = RouteDecision(self._least_loaded(alive), "imbalance")
        else:
            decision = RouteDecision(self._least_loaded(alive), "least_loaded")
        self._remember(prefix_hashes, decision.replica)
        return decision

    def _placed(self, prefix_hashes: Sequence[Hashable], replica: int) -> None:
        self._remember(prefix_hashes, replica)

    def _owners_of(self, prefix_hashes: Sequence[Hashable]) -> tuple[int | None, ...]:
        return tuple(self._owner.get(block_hash) for block_hash in prefix_hashes)

    def _unlearn(self, prefix_hashes: Sequence[Hashable], owners: tuple[int | None, ...],
                 stamp: int) -> None:
        taught = self._hash_taught
        for block_hash, owner in zip(prefix_hashes, owners, strict=False):
            if taught.get(block_hash) != stamp or block_hash not in self._owner:
                continue  # taught again since, or forgotten
            del taught[block_hash]
            if owner is None:
                del self._owner[block_hash]
            else:
                self._owner[block_hash] = owner

    def forget_replica(self, replica: int) -> None:
        super().forget_replica(replica)
        self._owner = {h: r for h, r in self._owner.items() if r != replica}
        self._hash_taught = {h: t for h, t in self._hash_taught.items() if h in self._owner}

    def _longest_match_owner(self, prefix_hashes: Sequence[Hashable]) -> int | None:
        # Hashes chain, so a request's k-th hash names its whole first k blocks: walk until
        # the first unknown one; the last known one is the longest match.
        owner = None
        for block_hash in prefix_hashes:
            replica = self._owner.get(block_hash)
            if replica is None:
                break
            owner = replica
        return owner

    def _remember(self, prefix_hashes: Sequence[Hashable], replica: int) -> None:
        owners, taught, stamp = self._owner, self._hash_taught, self._stamp
        for block_hash in prefix_hashes:
            owners.pop(block_hash, None)  # re-inserting moves it to the most recent end
            owners[block_hash] = replica
            taught[block_hash] = stamp
        excess = len(owners) - self.max_tracked_blocks
        if excess > 0:
            oldest = iter(owners)
            for block_hash in [next(oldest) for _ in range(excess)]:
                del owners[block_hash]
                taught.pop(block_hash, None)


def make_router(policy: str, num_replicas: int, *,
                imbalance_bound: int = DEFAULT_IMBALANCE_BOUND,
                max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS) -> Router:
    """A router for ``num_replicas`` replicas. ``imbalance_bound`` is in load-score units
    (R4) and only prefix-affinity uses it, as it does ``max_tracked_blocks``."""
    if policy not in ROUTER_POLICIES:
        raise ConfigError(f"unknown router {policy!r}; choose from {', '.join(ROUTER_POLICIES)}")
    if not is_int(num_replicas) or num_replicas < 1:
        raise ConfigError(f"data-parallel size must be an integer >= 1, got {num_replicas!r}")
    if not is_int(imbalance_bound) or imbalance_bound < 0:
        raise ConfigError(f"router imbalance bound must be an integer >= 0, "
                          f"got {imbalance_bound!r}")
    if not is_int(max_tracked_blocks) or max_tracked_blocks < 1:
        raise ConfigError(f"router max tracked blocks must be an integer >= 1, "
                          f"got {max_tracked_blocks!r}")
    if policy == "round-robin":
        return RoundRobinRouter(num_replicas)
    if policy == "least-loaded":
        return LeastLoadedRouter(num_replicas)
    return PrefixAffinityRouter(num_replicas, imbalance_bound, max_tracked_blocks)
