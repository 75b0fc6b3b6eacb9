"""State checks run after every step in tests and in the simulator's debug mode (spec I1-I4).

Both KV tiers are covered: the device pool (blocks, references, the prefix cache) and the
host tier (S1), where every host block is free or held by exactly one swapped request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.errors import InvariantError
from kvserve.core.request import RequestStatus

if TYPE_CHECKING:
    from kvserve.core.scheduler import Scheduler


def _fail(rule: str, message: str) -> None:
    raise InvariantError(f"{rule}: {message}")


def check_invariants(scheduler: Scheduler) -> None:
    """Raise :class:`InvariantError` naming the broken rule, or return None."""
    _check_blocks(scheduler)
    _check_host_blocks(scheduler)
    _check_requests(scheduler)
    if scheduler.sessions is not None:
        _check_sessions(scheduler)


def _check_blocks(scheduler: Scheduler) -> None:
    """I1: free + referenced == all blocks; ref counts equal the number of holders."""
    kv = scheduler.kv
    pool = kv.pool
    free_ids = pool.free_queue.block_ids()
    if len(free_ids) != pool.num_free_blocks:
        _fail("I1", f"free queue holds {len(free_ids)} blocks but counts {pool.num_free_blocks}")
    if len(set(free_ids)) != len(free_ids):
        _fail("I1", "a block appears twice in the free queue")
    holders = [0] * pool.num_blocks
    for request_id, blocks in kv.req_to_blocks.items():
        if request_id not in scheduler.requests:
            _fail("I1", f"finished request {request_id} still holds blocks")
        for block in blocks:
            holders[block.block_id] += 1
    if scheduler.sessions is not None:  # U2: a held session's reference
        for session in scheduler.sessions.held.values():
            for block in session.blocks:
                holders[block.block_id] += 1
    free = set(free_ids)
    for block in pool.blocks:
        if block.ref_cnt != holders[block.block_id]:
            _fail("I1", f"block {block.block_id} has ref {block.ref_cnt} but "
                        f"{holders[block.block_id]} holders")
        if (block.ref_cnt == 0) != (block.block_id in free):
            _fail("I1", f"block {block.block_id} (ref {block.ref_cnt}) is "
                        f"{'' if block.block_id in free else 'not '}in the free queue")
        if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
            _fail("I1", f"block {block.block_id} carries a hash the cache does not map to it")
    if pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt > 0) != pool.num_blocks:
        _fail("I1", "free + referenced blocks != num_blocks")


def _check_host_blocks(scheduler: Scheduler) -> None:
    """I1 for the host tier: free + held == all host blocks, each held once, only by a
    swapped request, which holds one host block per block of its computed tokens and no
    device block (a request's KV lives in one tier)."""
    kv = scheduler.kv
    host = kv.host_pool
    free_ids = host.free_block_ids()
    held_ids = [i for ids in kv.req_to_host_blocks.values() for i in ids]
    if len(set(free_ids)) != len(free_ids) or len(set(held_ids)) != len(held_ids):
        _fail("I1", "a host block is free twice or held twice")
    if set(free_ids) & set(held_ids):
        _fail("I1", f"host blocks both free and held: {sorted(set(free_ids) & set(held_ids))}")
    if sorted(free_ids + held_ids) != list(range(host.num_blocks)):
        _fail("I1", f"host tier: {len(free_ids)} free + {len(held_ids)} held != "
                    f"{host.num_blocks} blocks")
    swapped_ids = [r.request_id for r in scheduler.swapped]
    if sorted(kv.req_to_host_blocks) != sorted(swapped_ids):
        _fail("I1", f"host blocks held by {sorted(kv.req_to_host_blocks)}, swapped requests "
                    f"are {sorted(swapped_ids)}")
    for request in scheduler.swapped:
        if request.status is not RequestStatus.SWAPPED:
            _fail("I3", f"{request.request_id} is swapped with status {request.status.name}")
        num_host = len(kv.req_to_host_blocks[request.request_id])
        if num_host != kv.num_blocks_for(request.num_computed_tokens) or num_host == 0:
            _fail("I2", f"swapped {request.request_id} computed "
                        f"{request.num_computed_tokens} tokens but holds {num_host} host blocks")
        if kv.num_held_blocks(request.request_id):
            _fail("I1", f"swapped {request.request_id} still holds device blocks")


def _check_requests(scheduler: Scheduler) -> None:
    """I2: running requests hold their computed tokens' blocks; I3: queues are disjoint."""
    kv = scheduler.kv
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting.unordered()] + \
        [r.request_id for r in scheduler.held_waiting]
    swapped_ids = [r.request_id for r in scheduler.swapped]
    for ids in (running_ids, waiting_ids, swapped_ids):
        if len(set(ids)) != len(ids):
            _fail("I3", "a request appears twice in one queue")
    for (name, ids), (other, other_ids) in (((("running", running_ids), ("waiting", waiting_ids))),
                                            (("running", running_ids), ("swapped", swapped_ids)),
                                            (("waiting", waiting_ids), ("swapped", swapped_ids))):
        both = set(ids) & set(other_ids)
        if both:
            _fail("I3", f"requests both {name} and {other}: {sorted(both)}")
    queued = set(running_ids) | set(waiting_ids) | set(swapped_ids)
    if queued != set(scheduler.requests):
        _fail("I3", f"unfinished requests outside the queues: "
                    f"{sorted(set(scheduler.requests) - queued)}; "
                    f"queued but unknown: {sorted(queued - set(scheduler.requests))}")
    for request in scheduler.running:
        if request.status is not RequestStatus.RUNNING:
            _fail("I3", f"{request.request_id} is in running with status {request.status.name}")
        needed = kv.num_blocks_for(request.num_computed_tokens)
        if kv.num_held_blocks(request.request_id) < needed:
            _fail("I2", f"{request.request_id} computed {request.num_computed_tokens} tokens "
                        f"but holds {kv.num_held_blocks(request.request_id)} blocks")
    for request in scheduler.held_waiting:  # L1: waiting, holding its session's KV (U3)
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens == 0 or \
                kv.num_held_blocks(request.request_id) != \
                kv.num_blocks_for(request.num_computed_tokens):
            _fail("L1", f"held turn {request.request_id} ({request.status.name}, "
                        f"{request.num_computed_tokens} tokens) holds "
                        f"{kv.num_held_blocks(request.request_id)} blocks")
    for request in scheduler.waiting.unordered():
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            _fail("I3", f"{request.request_id} is waiting with status {request.status.name}")
        if kv.num_held_blocks(request.request_id) or request.num_computed_tokens:
            _fail("I3", f"waiting request {request.request_id} holds KV state")
    if len(scheduler.running) > scheduler.config.max_num_seqs:
        _fail("D8", f"{len(scheduler.running)} running > max_num_seqs")


def _check_sessions(scheduler: Scheduler) -> None:
    """U2-U5: held blocks belong to a live, idle session, counted once (a block two
    sessions share too), within the bound; a session with a turn in flight names an
    unfinished request."""
    sessions = scheduler.sessions
    assert sessions is not None
    held: set[int] = set()
    by_tenant: dict[str, set[int]] = {}
    for key, session in sessions.held.items():
        ids = {block.block_id for block in session.blocks}
        by_tenant.setdefault(key[0], set()).update(ids)
        held |= ids
        if sessions.sessions.get(key) is not session or session.turn_id is not None:
            _fail("U2", f"held session {key} is not a live idle session")
        if len(session.blocks) != scheduler.kv.num_blocks_for(len(session.token_ids)) or \
                not session.blocks:
            _fail("U2", f"session {key} holds {len(session.blocks)} blocks for "
                        f"{len(session.token_ids)} tokens")
    num_blocks = len(held)
    if num_blocks != sessions.num_held_blocks or num_blocks > sessions.max_blocks:
        _fail("U5", f"sessions hold {num_blocks} blocks, count {sessions.num_held_blocks}, "
                    f"bound {sessions.max_blocks}")
    counts = {tenant: len(ids) for tenant, ids in by_tenant.items()}
    if counts != sessions.blocks_by_tenant():
        _fail("U5", f"sessions hold {counts} blocks by tenant, count "
                    f"{sessions.blocks_by_tenant()}")
    for key, session in sessions.sessions.items():
        if session.turn_id is None and key not in sessions.held:
            _fail("U2", f"session {key} is neither held nor in a turn")
        if session.turn_id is not None and session.turn_id not in scheduler.requests:
            _fail("U2", f"session {key}'s turn {session.turn_id} is not a live request")


def check_empty(scheduler: Scheduler) -> None:
    """I4: after every request finished, nothing is left behind (hashes may stay: lazy
    eviction)."""
    check_invariants(scheduler)
    if scheduler.requests or scheduler.running or scheduler.waiting or scheduler.swapped or \
            scheduler.held_waiting:
        _fail("I4", f"{len(scheduler.requests)} requests left")
    if scheduler.kv.req_to_blocks or scheduler.kv.req_to_host_blocks:
        _fail("I4", f"block tables left for {sorted(scheduler.kv.req_to_blocks)}, host "
                    f"blocks for {sorted(scheduler.kv.req_to_host_blocks)}")
    host = scheduler.kv.host_pool
    if host.num_free_blocks != host.num_blocks:
        _fail("I4", f"{host.num_blocks - host.num_free_blocks} host blocks still held")
    pool = scheduler.kv.pool
    # Held sessions outlive their turns (U2): their blocks are the only ones still referenced.
    num_session = scheduler.sessions.num_held_blocks if scheduler.sessions is not None else 0
    if pool.num_free_blocks + num_session != pool.num_blocks:
        _fail("I4", f"{pool.num_blocks - pool.num_free_blocks - num_session} blocks still "
                    "referenced by no request or session")
