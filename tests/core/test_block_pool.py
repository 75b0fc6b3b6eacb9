"""Spec G1, G2, G7: the block pool, its free queue and the exact eviction order."""

import pytest

from kvserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvserve.core.config import CacheConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from tests.conftest import make_request


def test_free_queue_starts_in_block_id_order_and_pops_the_head():  # G1
    pool = BlockPool(5)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4]
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert pool.free_queue.block_ids() == [2, 3, 4]


def test_free_queue_removes_from_the_middle():  # G1
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    queue.remove(blocks[1])
    assert queue.block_ids() == [2, 0, 3] and len(queue) == 3
    with pytest.raises(ValueError, match="block 1 is not in the free queue"):
        queue.remove(blocks[1])


def test_free_queue_pops_and_appends_many_as_one_at_a_time():  # G1
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue.popleft_many(3)] == [0, 1, 2]
    assert queue.block_ids() == [3, 4, 5] and len(queue) == 3
    assert blocks[0].prev_free is None and blocks[2].next_free is None
    queue.extend([blocks[1], blocks[0]])
    queue.extend([])
    assert queue.block_ids() == [3, 4, 5, 1, 0] and len(queue) == 5
    assert [b.block_id for b in queue.popleft_many(5)] == [3, 4, 5, 1, 0]
    assert queue.block_ids() == [] and len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft_many(1)


def test_free_queue_extendleft_is_appendleft_one_at_a_time():  # G1
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks[:2])
    queue.extendleft([blocks[2], blocks[3], blocks[4]])  # each to the head in turn
    queue.extendleft([])
    assert queue.block_ids() == [4, 3, 2, 0, 1] and len(queue) == 5
    empty = FreeBlockQueue([])
    empty.extendleft([blocks[5]])
    assert empty.block_ids() == [5] and empty.popleft() is blocks[5]
    queue.remove(blocks[3])  # the back links are whole: removal from the middle works
    assert queue.block_ids() == [4, 2, 0, 1]
    assert [b.block_id for b in queue.popleft_many(4)] == [4, 2, 0, 1]


def test_allocating_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: only 2 free"):
        pool.allocate(3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 1 block: none free"):
        pool.allocate_one()


def test_allocate_one_is_allocate_of_one_block():  # G1, G2
    """The decode path's single block: the head of the free queue, its hash evicted."""
    pools = [BlockPool(4), BlockPool(4)]
    for pool in pools:
        blocks = pool.allocate(3)
        pool.cache_block(blocks[0], b"h0")
        pool.cache_block(blocks[2], b"h0")  # a duplicate stays hashless
        pool.free(reversed(blocks))  # free queue: 1, 2 (hashless), 3, 0 (hashed h0)
    got = [pools[0].allocate_one() for _ in range(4)]
    want = [pools[1].allocate(1)[0] for _ in range(4)]
    assert [b.block_id for b in got] == [b.block_id for b in want] == [1, 2, 3, 0]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
    assert pools[0].cached == pools[1].cached == {}
    assert len(pools[0].free_queue) == 0


def test_free_puts_hashless_blocks_at_head_and_hashed_at_tail():  # G2
    pool = BlockPool(6)
    blocks = pool.allocate(4)  # [0, 1, 2, 3]; free queue [4, 5]
    pool.cache_block(blocks[0], b"h0")
    pool.cache_block(blocks[1], b"h1")
    pool.free(reversed(blocks))  # tail first: 3, 2 (hashless), 1, 0 (hashed)
    # head: 2 then 3 (most recently freed hashless first); tail: 1 then 0 (LRU order)
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]


def test_free_into_an_empty_queue_keeps_hashless_ahead_of_hashed():  # G2
    pool = BlockPool(5)
    blocks = pool.allocate(5)  # the free queue is empty
    pool.cache_blocks(blocks[:3], [b"h0", b"h1", 7])  # an int hash: the builtin algorithm
    pool.free(reversed(blocks))  # tail first: 4, 3 (hashless), 2, 1, 0 (hashed)
    assert pool.free_queue.block_ids() == [3, 4, 2, 1, 0]
    assert [b.block_id for b in pool.free_queue][::-1] == [0, 1, 2, 4, 3]  # links both ways
    assert len(pool.free_queue) == 5


def test_allocating_many_evicts_each_reused_hash_in_queue_order():  # G1, G2
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks[:2], [b"h0", b"h1"])
    pool.free(reversed(blocks))  # free queue: 2, 3 (hashless), 4, 5, 1, 0 (hashed)
    taken = pool.allocate(5)
    assert [b.block_id for b in taken] == [2, 3, 4, 5, 1]
    assert all(b.ref_cnt == 1 and b.block_hash is None for b in taken)
    assert pool.cached == {b"h0": blocks[0]}  # only block 1's hash was evicted
    assert pool.free_queue.block_ids() == [0]
    assert [b.block_id for b in pool.allocate(1)] == [0] and pool.cached == {}


def test_usage_counts_cached_free_blocks_as_free():  # G7
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert pool.usage() == 0.5
    pool.cache_block(blocks[0], b"h")
    pool.free(blocks)
    assert pool.usage() == 0.0 and pool.get_cached_block(b"h") is blocks[0]


def test_golden_free_order_and_eviction_order():  # G1, G2, G4, G5; vLLM test_prefill, O.1
    kv = KVCacheManager(CacheConfig(num_blocks=10, block_size=4), max_model_len=1000)
    common = list(range(100, 108))  # two full blocks shared by A and B
    a = make_request("a", prompt_token_ids=[*common, 1, 2, 3, 4, 5, 6])  # 14 tokens
    b = make_request("b", prompt_token_ids=[*common, 7, 8, 9, 10, 11])  # 13 tokens

    assert kv.get_computed_blocks(a) == ([], 0)
    assert [blk.block_id for blk in kv.allocate_slots(a, 14)] == [0, 1, 2, 3]
    # blocks 0, 1, 2 are full and hashed, 3 holds two tokens and is not
    assert [blk.block_hash is not None for blk in kv.pool.blocks[:4]] == [True, True, True,
                                                                           False]

    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ([blk.block_id for blk in hits], num_hit_tokens) == ([0, 1], 8)
    b.num_computed_tokens = 0
    assert [blk.block_id for blk in kv.allocate_slots(b, 5, hits)] == [4, 5]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:6]] == [2, 2, 1, 1, 1, 1]
    assert kv.pool.free_queue.block_ids() == [6, 7, 8, 9]

    kv.free(a)  # 3 (hashless) to the head; 2 (hashed) to the tail; 1 and 0 still held by B
    assert kv.pool.free_queue.block_ids() == [3, 6, 7, 8, 9, 2]
    kv.free(b)  # 5 (hashless) to the head; 4, 1, 0 (hashed) to the tail, in that order
    assert kv.pool.free_queue.block_ids() == [5, 3, 6, 7, 8, 9, 2, 4, 1, 0]
    assert len(kv.pool.cached) == 4  # lazy eviction: every hash still findable

    c = make_request("c", prompt_token_ids=list(range(500, 540)))  # 10 full blocks
    taken = kv.allocate_slots(c, 40)
    assert [blk.block_id for blk in taken] == [5, 3, 6, 7, 8, 9, 2, 4, 1, 0]
    assert set(kv.pool.cached) == {blk.block_hash for blk in taken}  # old hashes evicted
