"""Per-request block tables on top of the block pool (spec E1-E5, G4-G6).

The manager answers two questions for the scheduler: "which leading blocks of this request
are already cached?" (:meth:`get_computed_blocks`) and "give this request slots for n more
tokens, or change nothing" (:meth:`allocate_slots`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.config import CacheConfig
from kvserve.core.host_pool import HostBlockPool
from kvserve.core.prefix_cache import (
    BLOCK_HASHERS,
    BlockHash,
    find_longest_cache_hit,
    first_block_key,
    prompt_bytes_block_hashes,
)
from kvserve.core.request import Request

_NO_BLOCKS: list[KVBlock] = []


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int, watermark: float = 0.0,
                 *, tenant_scoped: bool = False):
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.enable_caching = cache_config.enable_prefix_caching
        self.hash_algo = cache_config.prefix_caching_hash_algo
        # Fills a request's block_hashes up to a token count (G3), by the chosen algorithm.
        self._extend_hashes = BLOCK_HASHERS[self.hash_algo]
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * cache_config.num_blocks)
        self.tenant_scoped = tenant_scoped  # prefix_cache_scope "tenant": see first_block_key
        # J2: a sequence of n tokens needs n slots to keep decoding (the newest token is fed
        # back), so no sequence can grow past the whole pool plus that last token.
        self.max_sequence_tokens = min(max_model_len, cache_config.num_token_slots + 1)
        self.pool = BlockPool(cache_config.num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The host tier (K3): a swapped-out request's KV, one host block id per device block
        # it held for its computed tokens.
        self.host_pool = HostBlockPool(cache_config.num_host_blocks)
        self.req_to_host_blocks: dict[str, list[int]] = {}
        # Host blocks read by this step's swap-ins: free only once the step is built, since
        # a swap-out of the same step is copied first and must not overwrite them.
        self._host_blocks_being_read: list[int] = []
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # How many leading blocks of each request are full and registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_preempted_queries = 0  # the same of requests back from preemption
        self.prefix_cache_preempted_hits = 0

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
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return _NO_BLOCKS, 0  # G8: a cached token's logits are not kept
        num_tokens = request.num_tokens
        hashes = self._extend_hashes(request, self.block_size, num_tokens, self.tenant_scoped)
        hits = find_longest_cache_hit(self.pool, hashes, (num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def hash_prompt(self, request: Request, prompt_bytes: bytes) -> None:
        """Fill a fresh request's block hashes from its prompt ids' int64 bytes
        (``array("q", request.prompt_token_ids).tobytes()``) before it is added: the digests
        its first lookup would compute from the list. A simulator that draws prompts as
        arrays has these bytes; converting the list again cost a few percent of a run.
        Nothing to do without prefix caching, when the request has hashes already, or with
        the ``builtin`` algorithm, which hashes the ids themselves."""
        if not self.enable_caching or request.block_hashes or self.hash_algo != "blake2b":
            return
        if len(prompt_bytes) != 8 * len(request.prompt_token_ids):
            raise ValueError(f"request {request.request_id}: {len(prompt_bytes)} bytes for "
                             f"{len(request.prompt_token_ids)} prompt tokens")
        request.block_hashes = prompt_bytes_block_hashes(
            prompt_bytes, self.block_size, first_block_key(request, self.tenant_scoped))

    def hash_ahead(self, request: Request, upcoming: list[int]) -> None:
        """Hash a fresh request's full blocks over its prompt followed by ``upcoming``, the
        tokens it will sample first, in one pass: the digests the cache would compute block
        by block as those tokens arrive. For a model that knows its answers (a simulator);
        the request's output must begin with ``upcoming``. Hashes past the request's tokens
        are never read: a lookup stops at its last token (G4) and a block is registered
        only once its tokens are in (E5). Nothing to do without prefix caching."""
        if not self.enable_caching or request.output_token_ids:
            return
        # The hash functions read tokens through request.token_slice: lend them the answer.
        request.output_token_ids = upcoming
        try:
            self._extend_hashes(request, self.block_size, request.num_tokens,
                                self.tenant_scoped)
        finally:
            request.output_token_ids = []

    def cached_prefix_hashes(self, request: Request) -> list[BlockHash]:
        """The leading block hashes of ``request`` that the prefix cache holds now, up to the
        G4 cap: the blocks :meth:`get_computed_blocks` would hit. Read-only: nothing is
        referenced, touched or counted (a cache-aware waiting order asks this, C4, C5);
        none for a request that asked for its prompt's logprobs (G8: it computes them all;
        QA: lpm sorted it as a hit it never got)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        num_tokens = request.num_tokens
        hashes = self._extend_hashes(request, self.block_size, num_tokens, self.tenant_scoped)
        cached = self.pool.cached
        num_hits = 0
        for block_hash in hashes[:(num_tokens - 1) // self.block_size]:
            if block_hash not in cached:
                break
            num_hits += 1
        return hashes[:num_hits]

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
        held, num_computed, num_slots, num_new_blocks = self._slots(request, num_new_tokens,
                                                                    hit_blocks)
        num_held = len(held) if held is not None else 0
        num_hits = len(hit_blocks)

        if num_new_blocks > 0 or hit_blocks or full_sequence_must_fit:
            num_needed = self._num_blocks_needed(request, num_new_blocks, num_held, hit_blocks,
                                                 apply_watermark, full_sequence_must_fit)
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

    def _slots(self, request: Request, num_new_tokens: int, hit_blocks: Sequence[KVBlock]
               ) -> tuple[list[KVBlock] | None, int, int, int]:
        """An allocation's shape: the blocks ``request`` holds (None: none yet), its tokens
        computed with the hits, the slots it needs after ``num_new_tokens``, and the blocks
        those take beyond the held and hit ones."""
        held = self.req_to_blocks.get(request.request_id)
        num_held = len(held) if held is not None else 0
        num_computed = request.num_computed_tokens + len(hit_blocks) * self.block_size
        num_slots = min(num_computed + num_new_tokens, self.max_model_len)
        return held, num_computed, num_slots, \
            -(-num_slots // self.block_size) - num_held - len(hit_blocks)

    def _num_blocks_needed(self, request: Request, num_new_blocks: int, num_held: int,
                           hit_blocks: Sequence[KVBlock], apply_watermark: bool,
                           full_sequence_must_fit: bool,
                           released: dict[int, int] | None = None) -> int:
        """Free blocks an allocation takes (E2-E4): new blocks, hit blocks that now sit
        free, the full-sequence gate and the watermark. ``released`` counts references
        about to be dropped per block id (urgent preemption's dry run, M2)."""
        if released:
            num_free_hits = sum(1 for block in hit_blocks
                                if block.ref_cnt == released.get(block.block_id, 0))
        else:
            num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        num_hits = len(hit_blocks)
        num_needed = max(num_new_blocks, 0) + num_free_hits
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            num_needed = max(num_needed, self.num_blocks_for(num_full) - num_held
                             - num_hits + num_free_hits)
        if apply_watermark:
            num_needed += self.watermark_blocks
        return num_needed

    def refusal_reason(self, request: Request, num_new_tokens: int,
                       hit_blocks: Sequence[KVBlock], *, apply_watermark: bool,
                       full_sequence_must_fit: bool, reserved_blocks: int) -> str:
        """Why :meth:`allocate_slots` with these arguments refused an admission (its
        ``blocked`` reason): ``"kv_cache"`` where the free blocks are too few for the request
        itself; ``"admission_reserve"`` where they suffice but for the blocks an admission
        policy keeps for growth, the running requests' and its own (K2); ``"watermark"``
        where they suffice but for the watermark's (E2). (QA: an operator saw ``kv_cache``
        with most blocks free.)"""
        held, _, _, num_new_blocks = self._slots(request, num_new_tokens, hit_blocks)
        num_needed = self._num_blocks_needed(request, num_new_blocks,
                                             len(held) if held is not None else 0, hit_blocks,
                                             False, full_sequence_must_fit)
        free = self.pool.num_free_blocks
        if num_needed > free:
            return "kv_cache"
        if num_needed + reserved_blocks > free:
            return "admission_reserve"
        return "watermark" if apply_watermark and self.watermark_blocks else "kv_cache"

    def fits_after_release(self, request: Request, num_new_tokens: int,
                           hit_blocks: Sequence[KVBlock], released: dict[int, int], *,
                           apply_watermark: bool, full_sequence_must_fit: bool,
                           reserved_blocks: int) -> bool:
        """Would :meth:`allocate_slots` for a request holding no blocks succeed once the
        references counted in ``released`` (block id -> count) are dropped? (M2)"""
        num_slots = min(len(hit_blocks) * self.block_size + num_new_tokens, self.max_model_len)
        num_new_blocks = -(-num_slots // self.block_size) - len(hit_blocks)
        num_needed = self._num_blocks_needed(request, num_new_blocks, 0, hit_blocks,
                                             apply_watermark, full_sequence_must_fit, released)
        num_freed = sum(1 for block_id, count in released.items()
                        if self.pool.blocks[block_id].ref_cnt == count)
        return num_needed + reserved_blocks <= self.pool.num_free_blocks + num_freed

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
            pool = self.pool
            if num_new_blocks > pool.free_queue.num_free:
                return None
            if num_new_blocks == 1:  # a decode crossing into its next block: the usual case
                block = pool.allocate_one()
                held.append(block)
                new_blocks = [block]
            else:
                new_blocks = pool.allocate(num_new_blocks)
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
        hashes = request.block_hashes
        if len(hashes) < num_full:  # else hashed ahead (hash_ahead) or at an earlier call
            hashes = self._extend_hashes(request, self.block_size, num_full * self.block_size,
                                         self.tenant_scoped)
        if num_full == num_cached + 1:  # one block, as when decoding fills one
            self.pool.cache_block(held[num_cached], hashes[num_cached])
        else:
            self.pool.cache_blocks(held[num_cached:num_full], hashes[num_cached:num_full])
        self._num_cached_blocks[request_id] = num_full

    def forget_uncomputed(self, request: Request, num_written: int | None = None) -> None:
        """Take out of the prefix cache the blocks ``request`` registered for tokens it has
        not computed: blocks are registered when allocated for a step (as vLLM's), so a
        request preempted in the step that scheduled them, before the step ran, left full
        hashes on blocks whose last slots were never written, and the next request with that
        prefix (the victim itself, resumed) read them as computed (an urgent arrival's
        preemption, M1, found by the progress property test). A no-op for a request
        preempted between steps: everything it registered is computed. ``num_written``: the
        tokens whose KV is written, where fewer than its computed ones (a request ended
        after schedule() counted its chunk computed, before the step ran it)."""
        unwritten = self.unwritten_cached_blocks(request, num_written)
        if unwritten:
            self.pool.uncache(unwritten)
            self._num_cached_blocks[request.request_id] -= len(unwritten)

    def unwritten_cached_blocks(self, request: Request,
                                num_written: int | None = None) -> list[KVBlock]:
        """The blocks ``request`` registered in the prefix cache for tokens it has not
        computed yet: those its chunk scheduled this step will write; [] between steps."""
        request_id = request.request_id
        num_cached = self._num_cached_blocks.get(request_id, 0)
        written = request.num_computed_tokens if num_written is None else num_written
        keep = written // self.block_size
        if num_cached <= keep:
            return []
        return self.req_to_blocks[request_id][keep:num_cached]

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the pool, tail first (G2), and any host
        blocks it holds to the host tier."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        host_blocks = self.req_to_host_blocks.pop(request.request_id, None)
        if host_blocks:
            self.host_pool.free(host_blocks)

    # -- sessions (U2, U3) ------------------------------------------------------------------

    def detach_blocks(self, request: Request, num_tokens: int) -> tuple[list[KVBlock], int]:
        """Take the blocks holding ``request``'s first ``num_tokens`` tokens away from it,
        references and all (a session keeps them, U2); free the rest, tail first. Returns
        the blocks and how many leading ones are registered in the prefix cache."""
        blocks = self.req_to_blocks.pop(request.request_id)
        num_cached = self._num_cached_blocks.pop(request.request_id, 0)
        num_kept = self.num_blocks_for(num_tokens)
        if len(blocks) > num_kept:
            self.pool.free(reversed(blocks[num_kept:]))
            del blocks[num_kept:]
        return blocks, min(num_cached, num_kept)

    def adopt_blocks(self, request: Request, blocks: list[KVBlock], num_cached: int) -> None:
        """Give ``request`` (holding nothing) blocks whose references it takes over: a
        session's held KV for its next turn (U3)."""
        assert request.request_id not in self.req_to_blocks
        self.req_to_blocks[request.request_id] = blocks
        self._num_cached_blocks[request.request_id] = num_cached

    # -- the host tier (K3, S1-S3) ---------------------------------------------------------

    def end_step(self) -> None:
        """The step's output is built: the host blocks its swap-ins read are free again."""
        if self._host_blocks_being_read:
            self.host_pool.free(self._host_blocks_being_read)
            self._host_blocks_being_read = []

    def surviving_prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s leading blocks that stay in the prefix cache when it lets
        them go: cached blocks another request holds too, so freeing cannot evict them
        (S4). A resumed request would hit them; the last token is never a hit (G4)."""
        if not self.enable_caching:
            return 0
        held = self.req_to_blocks.get(request.request_id, _NO_BLOCKS)
        max_blocks = min(len(held), (request.num_tokens - 1) // self.block_size,
                         request.num_computed_tokens // self.block_size)
        num_blocks = 0
        while num_blocks < max_blocks:
            block = held[num_blocks]
            if block.block_hash is None or block.ref_cnt < 2:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def num_blocks_to_swap(self, request: Request) -> int:
        """Device blocks holding ``request``'s computed tokens: what a swap-out copies."""
        return self.num_blocks_for(request.num_computed_tokens)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Copy the blocks of ``request``'s computed tokens to host blocks and free all its
        device blocks (S1); returns the (device id, host id) pairs to copy, or None (and
        changes nothing) when there is nothing to copy or the host tier lacks room (S3)."""
        num_blocks = self.num_blocks_to_swap(request)
        if num_blocks == 0 or num_blocks > self.host_pool.num_free_blocks:
            return None
        held = self.req_to_blocks[request.request_id]
        host_ids = self.host_pool.allocate(num_blocks)
        pairs = [(held[i].block_id, host_ids[i]) for i in range(num_blocks)]
        self.free(request)
        self.req_to_host_blocks[request.request_id] = host_ids
        self.num_swapped_out_blocks += num_blocks
        return pairs

    def swap_in(self, request: Request,
                num_new_tokens: int) -> tuple[list[tuple[int, int]], list[KVBlock]] | None:
        """Bring a swapped request back (S2): new device blocks for its host blocks, plus
        slots for its next ``num_new_tokens``; all or nothing. Returns the (device id,
        host id) pairs to copy and every device block it now holds."""
        host_ids = self.req_to_host_blocks[request.request_id]
        num_slots = request.num_computed_tokens + num_new_tokens
        num_needed = max(self.num_blocks_for(num_slots), len(host_ids))
        if num_needed > self.pool.num_free_blocks:
            return None
        del self.req_to_host_blocks[request.request_id]
        held = self.pool.allocate(num_needed)
        self.req_to_blocks[request.request_id] = held
        self._num_cached_blocks[request.request_id] = 0
        pairs = [(held[i].block_id, host_id) for i, host_id in enumerate(host_ids)]
        self._host_blocks_being_read += host_ids
        self.num_swapped_in_blocks += len(host_ids)
        if self.enable_caching:  # E5 for every block full once the step's tokens are in
            self._cache_full_blocks(request, held, min(num_slots, request.num_tokens))
        return pairs, held

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (G6): queries in tokens, hits in tokens; those of a
        request back from a preemption apart (it re-hits its own blocks, no caching
        benefit), as vLLM counts them."""
        if not self.enable_caching:
            return
        if request.num_preemptions:
            self.prefix_cache_preempted_queries += request.num_tokens
            self.prefix_cache_preempted_hits += num_hit_tokens
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
