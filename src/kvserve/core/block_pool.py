"""KV blocks, their reference counts, and the free queue that doubles as the LRU (spec G1-G7).

Free queue order, head first::

    head -> [blocks without a hash, most recently freed first]
            [hashed blocks, least recently freed first]  <- tail

Allocation pops from the head, so hashless blocks are reused first and, among blocks that
still carry a prefix-cache hash, the least recently freed is evicted first (LRU). Eviction is
lazy: a freed hashed block stays findable by its hash until it is popped for reuse (G2).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    """One block of ``block_size`` token slots; links thread it through the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | int | None = None  # int: the builtin hash algorithm
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={hashed})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, push and removal from the middle."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never allocated
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        head = self._head
        block = head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        following = block.next_free
        assert following is not None
        head.next_free = following
        following.prev_free = head
        block.prev_free = block.next_free = None
        self.num_free -= 1
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft_many(self, count: int) -> list[KVBlock]:
        """The first ``count`` blocks, unlinked in one pass: the same as ``count`` popleft()
        calls without a call per block (allocation takes dozens of blocks per prompt)."""
        if count > self.num_free:
            raise IndexError(f"{count} blocks asked for, {self.num_free} free")
        if count == 1:  # a decode crossing into its next block: the usual case
            block = self._head.next_free
            assert block is not None
            following = block.next_free
            assert following is not None
            self._head.next_free = following
            following.prev_free = self._head
            block.prev_free = block.next_free = None
            self.num_free -= 1
            return [block]
        blocks = []
        block = self._head.next_free
        for _ in range(count):
            assert block is not None
            blocks.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block = following
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= count
        return blocks

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """append() each block in order, linking them in one pass (a finished request
        returns dozens of blocks)."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free += len(blocks)

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def extendleft(self, blocks: list[KVBlock]) -> None:
        """appendleft() each block in order (so the last ends up first), linking them in one
        pass: without prefix caching every block a finished request frees goes here."""
        if not blocks:
            return
        first = self._head.next_free
        assert first is not None
        following = first
        for block in blocks:
            block.next_free = following
            following.prev_free = block
            following = block
        self._head.next_free = following
        following.prev_free = self._head
        self.num_free += len(blocks)

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """All KV blocks, the free queue, and the prefix-cache map from block hash to block.

    Every one of ``num_blocks`` blocks is usable (A3: no null block).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes | int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by a request; cached-but-free blocks count as free (G7)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_cached_block(self, block_hash: bytes | int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evicting any hash they carry."""
        if num_blocks > self.free_queue.num_free:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {self.free_queue.num_free} free"
            )
        if num_blocks == 1:
            return [self.allocate_one()]
        # popleft_many's unlinking and the eviction in one pass over the blocks (a prompt
        # takes dozens): the free queue's head is this module's own.
        queue = self.free_queue
        cached = self.cached
        blocks = []
        head = queue._head
        block = head.next_free
        for _ in range(num_blocks):
            assert block is not None
            blocks.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block_hash = block.block_hash
            if block_hash is not None:  # evicted only now (G2); most reused blocks carry one
                # A block carries a hash only while the cache maps that hash to it
                # (cache_blocks never hashes a duplicate; invariant I1 checks it).
                del cached[block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block = following
        assert block is not None
        head.next_free = block
        block.prev_free = head
        queue.num_free -= num_blocks
        return blocks

    def allocate_one(self) -> KVBlock:
        """``allocate(1)[0]``, without the lists (a decode crossing into its next block)."""
        queue = self.free_queue
        if queue.num_free == 0:
            raise ValueError("cannot allocate 1 block: none free")
        block = queue.popleft()
        block_hash = block.block_hash
        if block_hash is not None:  # evicted only now (G2), as in allocate()
            del self.cached[block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail first)."""
        queue = self.free_queue
        # Hashed blocks go to the tail, linked as they come (with prefix caching nearly every
        # block a request frees is hashed); hashless ones to the head, each side in the order
        # given, so the two never interleave.
        to_head = []
        tail = queue._tail
        last = tail.prev_free
        assert last is not None
        num_to_tail = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    to_head.append(block)
                else:
                    last.next_free = block
                    block.prev_free = last
                    last = block
                    num_to_tail += 1
        if num_to_tail:
            last.next_free = tail
            tail.prev_free = last
            queue.num_free += num_to_tail
        queue.extendleft(to_head)

    def cache_block(self, block: KVBlock, block_hash: bytes | int) -> None:
        """Register a newly full block under its hash (see :meth:`cache_blocks`)."""
        cached = self.cached
        if block_hash not in cached:
            block.block_hash = block_hash
            cached[block_hash] = block

    def cache_blocks(self, blocks: Iterable[KVBlock], block_hashes: Iterable[bytes | int]) -> None:
        """Register newly full blocks, each under its hash.

        [kvserve] If another block already holds this hash (two requests computed the same
        prefix, e.g. the last prompt block, which is never a hit), the new block stays
        unhashed: one copy is findable, and the duplicate is reused first when freed.
        """
        cached = self.cached
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take these blocks' hashes out of the cache (blocks registered for KV that was
        never written); a block whose hash maps to another block keeps nothing."""
        cached = self.cached
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                if cached.get(block_hash) is block:
                    del cached[block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
