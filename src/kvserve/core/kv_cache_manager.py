"""Per-request block tables on top of the block pool (spec E1-E5, G4-G6).

The manager answers two questions for the scheduler: "which leading blocks of this request
are already cached?" (:meth:`get_computed_blocks`) and "give this request slots for n more
tokens, or change nothing" (:meth:`allocate_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.config import CacheConfig
from kvserve.core.prefix_cache import extend_block_hashes, find_longest_cache_hit
from kvserve.core.request import Request

_NO_BLOCKS: list[KVBlock] = []


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int, watermark: float = 0.0,
                 *, tenant_scoped: bool = False):
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.enable_caching = cache_config.enable_prefix_caching
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * cache_config.num_blocks)
        self.tenant_scoped = tenant_scoped  # prefix_cache_scope "tenant": see first_block_key
        # J2: a sequence of n tokens needs n slots to keep decoding (the newest token is fed
        # back), so no sequence can grow past the whole pool plus that last token.
        self.max_sequence_tokens = min(max_model_len, cache_config.num_token_slots + 1)
        self.pool = BlockPool(cache_config.num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are full and registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, _NO_BLOCKS)]

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, _NO_BLOCKS))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached leading blocks of ``request`` and the number of tokens they cover.

        The last token is never a hit (G4): its logits must be computed, so the search covers
        at most ``num_tokens - 1`` tokens and a prompt of exactly k full blocks hits at most
        k - 1 of them::

            tokens  |--------|--------|--------|        3 full blocks, 48 tokens
            search  |--------|--------|-------|         47 tokens -> at most 2 blocks
        """
        if not self.enable_caching:
            return _NO_BLOCKS, 0
        num_tokens = request.num_tokens
        hashes = extend_block_hashes(request, self.block_size, num_tokens, self.tenant_scoped)
        hits = find_longest_cache_hit(self.pool, hashes, (num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: Sequence[KVBlock] = _NO_BLOCKS,
        *,
        apply_watermark: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens after its hits, or None.

        All or nothing (E4): on failure no reference count or queue is touched. On success the
        hit blocks are referenced, new blocks come from the free queue's head, and every block
        that the scheduled tokens fill is registered in the prefix cache (E5). Returns only
        the newly allocated blocks.

        ``apply_watermark`` (E2) and ``full_sequence_must_fit`` (E3) are for admission;
        ``reserved_blocks`` are blocks an admission policy keeps free for future growth (K2).
        """
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held is not None else 0
        num_hits = len(hit_blocks)
        num_computed = request.num_computed_tokens + num_hits * self.block_size
        num_slots = min(num_computed + num_new_tokens, self.max_model_len)
        num_new_blocks = -(-num_slots // self.block_size) - num_held - num_hits

        if num_new_blocks > 0 or hit_blocks or full_sequence_must_fit:
            num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
            num_needed = max(num_new_blocks, 0) + num_free_hits
            if full_sequence_must_fit:
                num_full = min(request.num_tokens, self.max_model_len)
                num_needed = max(num_needed, self.num_blocks_for(num_full) - num_held
                                 - num_hits + num_free_hits)
            if apply_watermark:
                num_needed += self.watermark_blocks
            if num_needed + reserved_blocks > self.pool.num_free_blocks:
                return None

        if held is None:
            held = self.req_to_blocks[request_id] = list(hit_blocks)
            self._num_cached_blocks[request_id] = num_hits
            self.pool.touch(hit_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else _NO_BLOCKS
        if new_blocks:
            held.extend(new_blocks)
        # A block is registered when the tokens scheduled now fill it (E5).
        if self.enable_caching and num_slots // self.block_size > num_computed // self.block_size:
            self._cache_full_blocks(request, held, min(num_slots, request.num_tokens))
        return new_blocks

    def grow_slots(self, request: Request, num_new_tokens: int) -> list[KVBlock] | None:
        """Slots for a running request's next ``num_new_tokens`` tokens, or None.

        The running pass's hot path (D3): no prefix lookup, no watermark, no gate. The
        scheduler caps ``num_new_tokens`` so the sequence stays within max_model_len, and
        skips the call when the tokens stay inside the last, partly filled block without
        filling it, which would allocate and register nothing.
        """
        held = self.req_to_blocks[request.request_id]
        block_size = self.block_size
        num_computed = request.num_computed_tokens
        num_slots = num_computed + num_new_tokens
        # Tokens that fit in the held blocks need no allocation: one comparison.
        if num_slots <= len(held) * block_size:
            new_blocks = _NO_BLOCKS
        else:
            num_new_blocks = (num_slots + block_size - 1) // block_size - len(held)
            if num_new_blocks > self.pool.free_queue.num_free:
                return None
            new_blocks = self.pool.allocate(num_new_blocks)
            held.extend(new_blocks)
        if self.enable_caching and num_slots // block_size > num_computed // block_size:
            self._cache_full_blocks(request, held, num_slots)
        return new_blocks

    def _cache_full_blocks(self, request: Request, held: list[KVBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        request_id = request.request_id
        num_cached = self._num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        hashes = extend_block_hashes(request, self.block_size, num_full * self.block_size,
                                     self.tenant_scoped)
        self.pool.cache_blocks(held[num_cached:num_full], hashes[num_cached:num_full])
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool, tail first (G2)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (G6): queries in tokens, hits in tokens."""
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
