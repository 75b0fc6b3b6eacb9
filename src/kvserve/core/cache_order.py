"""Cache-aware waiting orders: longest prefix match and SGLang's dfs-weight (spec C4-C7).

Both sort the waiting queue once per waiting pass from a read-only query of the prefix cache
(:meth:`KVCacheManager.cached_prefix_hashes`), so the requests that reuse the most cached KV,
or that share the busiest branch of the prefix tree, are admitted while that KV is still
cached. Between passes the queue keeps arrival order (a FCFS deque, preempted requests at its
head, C2), which is also the order ties keep and the order a queue longer than
``max_queue`` is served in (C6).

- ``lpm``: most cached leading blocks first (C4).
- ``dfs-weight``: the requests' matched prefixes form a tree (a block hash names its whole
  prefix, so it is a node); each node weighs the number of waiting requests whose match
  passes through it. A depth-first walk from the root visits children heaviest first and
  emits a node's own requests after its children's, so the deepest matches of the most
  shared branch come first and requests matching nothing come last (C5).
- aging (``aging_s``, C7): a request that has waited ``aging_s`` seconds since arrival is
  promoted ahead of every request that has not, in arrival order among the promoted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvserve.core.config import CACHE_AWARE_POLICIES
from kvserve.core.queues import PrefixView, WaitingQueue
from kvserve.core.request import Request

_ROOT = b""  # the tree node of an empty match


class CacheAwareQueue(WaitingQueue):
    """Arrival order between passes; ``start_pass`` sorts it for one pass (C4-C7)."""

    def __init__(self, policy: str, max_queue: int, aging_s: float | None = None) -> None:
        super().__init__()
        if policy not in CACHE_AWARE_POLICIES:
            raise ValueError(f"{policy!r} is not a cache-aware order "
                             f"({', '.join(CACHE_AWARE_POLICIES)})")
        self.policy = policy
        self.max_queue = max_queue
        self.aging_s = aging_s
        self._arrival: deque[Request] = deque()
        self._order: list[Request] | None = None  # this pass's order, or None: arrival order
        self.num_sorted_passes = 0
        self.num_fcfs_passes = 0  # passes whose queue was over max_queue (C6)
        self.promoted: list[Request] = []  # promoted by aging in the last sorted pass (C7)

    # -- the order -------------------------------------------------------------------------

    def start_pass(self, cache: PrefixView, now: float) -> list[Request]:
        self._order = None
        self.promoted = []
        num_waiting = len(self._arrival)
        if num_waiting > self.max_queue:
            self.num_fcfs_passes += 1
            return []
        if num_waiting < 2:
            return []
        self.num_sorted_passes += 1
        rest: list[Request] = list(self._arrival)
        if self.aging_s is not None:
            limit = now - self.aging_s
            self.promoted = [r for r in rest if r.arrival_time <= limit]
            if self.promoted:
                rest = [r for r in rest if r.arrival_time > limit]
        if self.policy == "lpm":
            matched = {id(r): len(cache.cached_prefix_hashes(r)) for r in rest}
            rest.sort(key=lambda r: -matched[id(r)])  # stable: ties keep arrival order
        else:
            rest = dfs_weight_order(rest, [cache.cached_prefix_hashes(r) for r in rest])
        self._order = self.promoted + rest
        lifted = [r for r in self.promoted if not r.aging_reported]
        for request in lifted:
            request.aging_reported = True
        return lifted

    # -- the queue -------------------------------------------------------------------------

    def push(self, request: Request) -> None:
        self._arrival.append(request)
        if self._order is not None:
            self._order.append(request)
        self._added(request)

    def push_front(self, request: Request) -> None:
        self._arrival.appendleft(request)
        if self._order is not None:
            self._order.insert(0, request)
        self._added(request)

    def pop(self) -> Request:
        if self._order is None:
            request = self._arrival.popleft()
        else:
            request = self._order.pop(0)
            self._arrival.remove(request)
        request.aging_reported = False  # admitted: its wait is over
        self._removed(request)
        return request

    def peek(self) -> Request:
        return self._arrival[0] if self._order is None else self._order[0]

    def remove(self, request: Request) -> None:
        self._arrival.remove(request)
        if self._order is not None:
            self._order.remove(request)
        self._removed(request)

    def __len__(self) -> int:
        return len(self._arrival)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._arrival if self._order is None else self._order))


def dfs_weight_order(requests: list[Request], matches: list[list[bytes]]) -> list[Request]:
    """SGLang's dfs-weight order of ``requests`` (in arrival order), whose matched prefixes
    are ``matches`` (chained block hashes, C5). Children of equal weight keep the order in
    which the first request reached them; a node's own requests keep arrival order."""
    weight: dict[bytes, int] = {_ROOT: len(requests)}
    children: dict[bytes, list[bytes]] = {}
    at_node: dict[bytes, list[Request]] = {}
    for request, path in zip(requests, matches, strict=True):
        parent = _ROOT
        for block_hash in path:
            if block_hash in weight:
                weight[block_hash] += 1
            else:
                weight[block_hash] = 1
                children.setdefault(parent, []).append(block_hash)
            parent = block_hash
        at_node.setdefault(parent, []).append(request)
    order: list[Request] = []
    # Iterative post-order walk: a prefix can be deeper than Python's recursion limit.
    stack: list[tuple[bytes, Iterator[bytes]]] = [(_ROOT, _heaviest_first(_ROOT, children,
                                                                            weight))]
    while stack:
        node, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            order.extend(at_node.get(node, ()))
        else:
            stack.append((child, _heaviest_first(child, children, weight)))
    return order


def _heaviest_first(node: bytes, children: dict[bytes, list[bytes]],
                    weight: dict[bytes, int]) -> Iterator[bytes]:
    return iter(sorted(children.get(node, ()), key=lambda child: -weight[child]))
