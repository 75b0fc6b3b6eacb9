"""BlockLayout: where each running request's KV blocks lie in the pool.

Attention reads a request's cached KV block by block. When consecutive blocks of a request
have consecutive ids the reads stream through memory and the hardware prefetcher runs
ahead; a block whose id does not follow its predecessor's by +1 starts a new stream. On
the development CPU the same decode batch costs 8-12% more with scattered blocks
(docs/fidelity.md), which a cost model pricing the batch's shape alone cannot see.

A block is *scattered* when its id is not the previous block's id + 1 (a request's first
block has no predecessor and is not counted). A step's scattered context tokens are the
already-computed tokens that sit in scattered blocks, summed over its requests::

    block table        [7, 8, 9, 3, 4, 12]       block_size 16
    scattered           .  .  .  x  .  x
    context 86 tokens  = blocks 0-4 in full (80) + 6 tokens of block 5
    scattered context  = 16 (block 3) + 6 (block 5) = 22

The tracker follows the block tables from SchedulerOutput alone, as a model runner does,
and keeps per request a running count of scattered blocks, so a step costs one lookup per
scheduled request plus one per newly added block, never a walk over whole tables.
"""

from __future__ import annotations

from kvserve.core import SchedulerOutput


class _Table:
    """One request's block layout: the last block id, and ``scattered_before[j]`` = the
    number of scattered blocks among its blocks 0 .. j-1 (one entry per block, plus one)."""

    __slots__ = ("last_block_id", "scattered_before")

    def __init__(self) -> None:
        self.last_block_id = -2  # no block yet: the first one appended is never scattered
        self.scattered_before = [0]

    def extend(self, block_ids: list[int]) -> None:
        before = self.scattered_before
        count, last = before[-1], self.last_block_id
        for block_id in block_ids:
            if last >= 0 and block_id != last + 1:
                count += 1
            before.append(count)
            last = block_id
        self.last_block_id = last

    def scattered_tokens(self, num_tokens: int, block_size: int) -> int:
        """How many of the request's first ``num_tokens`` tokens sit in scattered blocks."""
        before = self.scattered_before
        num_full, partial = divmod(num_tokens, block_size)
        tokens = block_size * before[num_full]
        if partial and before[num_full + 1] > before[num_full]:
            tokens += partial
        return tokens


class BlockLayout:
    """Tracks each request's block table across steps; :meth:`observe` returns a step's
    scattered context tokens. Opt-in: the simulator builds one only for a cost model that
    prices the layout, since it adds a pass over the scheduled requests to every step."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._tables: dict[str, _Table] = {}

    def observe(self, out: SchedulerOutput) -> int:
        """Apply the step's block changes, then count its scattered context tokens."""
        tables, block_size = self._tables, self.block_size
        for request_id in out.finished_req_ids:
            tables.pop(request_id, None)
        for request_id in out.preempted_req_ids:
            tables.pop(request_id, None)  # its blocks went back to the pool
        scattered = 0
        for new in out.scheduled_new_reqs:  # new or resumed: the whole table, afresh
            table = tables[new.request_id] = _Table()
            table.extend(new.block_ids)
            scattered += table.scattered_tokens(new.num_computed_tokens, block_size)
        cached = out.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
                cached.request_ids, cached.new_block_ids, cached.num_computed_tokens,
                strict=True):
            table = tables[request_id]
            if new_block_ids:
                table.extend(new_block_ids)
            scattered += table.scattered_tokens(num_computed, block_size)
        return scattered

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._tables)
