"""The host KV tier: a second pool of block ids in host memory (spec K3, S1).

A swap-mode victim's KV blocks are copied to host blocks instead of being thrown away, and
copied back into newly allocated device blocks when it resumes. Host blocks hold no prefix
cache hash and are never shared, so the pool is only a set of free ids: the lowest free ids
are handed out first, which keeps block ids in tests and logs predictable.
"""

from __future__ import annotations

import heapq


class HostBlockPool:
    """``num_blocks`` host block ids, 0 .. num_blocks - 1; each is free or held by exactly
    one swapped request."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: allocation takes the lowest ids

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        return sorted(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} host blocks: only "
                             f"{len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            heapq.heappush(self._free, block_id)
