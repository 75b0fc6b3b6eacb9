"""Spec E1-E5: all-or-nothing allocation with the watermark and the full-sequence gate."""

import pytest

from kvserve.core.config import PREFIX_CACHING_HASH_ALGOS, CacheConfig
from kvserve.core.kv_cache_manager import KVCacheManager
from tests.conftest import make_request


def make_kv(num_blocks=10, block_size=4, watermark=0.0, caching=True, max_model_len=1000):
    return KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching), max_model_len, watermark)


def snapshot(kv):
    return ([b.ref_cnt for b in kv.pool.blocks], kv.pool.free_queue.block_ids(),
            dict(kv.req_to_blocks))


def test_decode_allocates_only_when_a_block_fills():  # E1, E5; vLLM test_decode
    kv = make_kv()
    request = make_request("a", prompt_token_ids=list(range(6)))  # blocks: 4 + 2
    assert len(kv.allocate_slots(request, 6)) == 2
    request.num_computed_tokens = 6
    for token in (6, 7):
        request.output_token_ids.append(token)
        assert kv.allocate_slots(request, 1) == []  # fills slots 6, 7 of block 1
        request.num_computed_tokens += 1
    assert kv.pool.blocks[1].block_hash is not None  # block 1 just became full
    request.output_token_ids.append(8)
    assert [b.block_id for b in kv.allocate_slots(request, 1)] == [2]
    assert kv.pool.blocks[2].block_hash is None


def test_growing_inside_the_last_block_without_filling_it_changes_nothing():  # E1, E5
    # The running pass skips grow_slots in exactly this case (scheduler._schedule_running).
    for caching in (True, False):
        kv = make_kv(block_size=4, caching=caching)
        request = make_request("a", prompt_token_ids=list(range(13)))
        kv.allocate_slots(request, 13)  # blocks 0-3; the last holds token 12 only
        request.num_computed_tokens = 13
        hashes = list(request.block_hashes)
        before = (snapshot(kv), kv.get_block_ids("a"))
        for num_new in (1, 2):  # slots 13 and 14 of the last block; 15 would fill it
            request.output_token_ids = list(range(num_new))
            assert kv.grow_slots(request, num_new) == []
            assert (snapshot(kv), kv.get_block_ids("a")) == before
            assert request.block_hashes == hashes
        request.output_token_ids = [0, 1, 2]
        assert kv.grow_slots(request, 3) == []  # fills the block: registered if caching
        assert (kv.pool.blocks[3].block_hash is not None) == caching


def test_free_hits_consume_free_capacity():  # E1
    kv = make_kv(num_blocks=4)
    tokens = list(range(9))  # 2 full blocks + 1
    owner = make_request("owner", prompt_token_ids=tokens)
    kv.allocate_slots(owner, 9)
    kv.free(owner)  # all 3 blocks free; 2 still cached
    probe = make_request("p", prompt_token_ids=tokens)
    hits, num_hit_tokens = kv.get_computed_blocks(probe)
    assert num_hit_tokens == 8
    # 1 new block + 2 free hits = 3 of the 4 free blocks
    assert len(kv.allocate_slots(probe, 1, hits)) == 1
    assert kv.num_free_blocks == 1


def test_watermark_applies_only_when_asked():  # E2
    kv = make_kv(num_blocks=10, watermark=0.25)  # int(0.25 * 10) = 2 blocks
    assert kv.watermark_blocks == 2
    big = make_request("big", prompt_token_ids=list(range(36)))  # 9 blocks
    assert kv.allocate_slots(big, 36, apply_watermark=True) is None
    assert len(kv.allocate_slots(big, 36, apply_watermark=False)) == 9


def test_full_sequence_gate_reserves_the_whole_prompt_not_the_future():  # E3
    kv = make_kv(num_blocks=5)
    held = make_request("held", prompt_token_ids=list(range(8)))
    kv.allocate_slots(held, 8)  # 2 blocks held, 3 free
    long = make_request("long", prompt_token_ids=list(range(100, 116)))  # 4 blocks
    assert kv.allocate_slots(long, 4, full_sequence_must_fit=True) is None
    assert len(kv.allocate_slots(long, 4, full_sequence_must_fit=False)) == 1


def test_failed_allocation_changes_nothing():  # E4; vLLM O.11
    kv = make_kv(num_blocks=5)
    tokens = list(range(13))
    owner = make_request("owner", prompt_token_ids=tokens)
    kv.allocate_slots(owner, 13)
    kv.free(owner)  # 3 cached-free blocks at the tail
    filler = make_request("filler", prompt_token_ids=list(range(500, 504)))
    kv.allocate_slots(filler, 4)  # free queue [3, 4, 2, 1, 0]: takes hashless block 3
    probe = make_request("p", prompt_token_ids=[*tokens, 1, 2, 3, 4, 5, 6, 7, 8])
    hits, _ = kv.get_computed_blocks(probe)
    assert len(hits) == 3
    before = snapshot(kv)
    assert kv.allocate_slots(probe, 9, hits) is None  # needs 3 new + 3 free hits > 4 free
    assert snapshot(kv) == before


def test_new_blocks_never_evict_the_blocks_just_hit():  # E5; vLLM O.7
    kv = make_kv(num_blocks=4)
    tokens = list(range(9))
    owner = make_request("owner", prompt_token_ids=tokens)
    kv.allocate_slots(owner, 9)
    kv.free(owner)  # free queue [2 (hashless), 3, 1, 0 (cached)]
    probe = make_request("p", prompt_token_ids=[*tokens[:8], 50, 51, 52, 53, 54])
    hits, _ = kv.get_computed_blocks(probe)
    new = kv.allocate_slots(probe, 5, hits)
    assert {b.block_id for b in new}.isdisjoint(b.block_id for b in hits)
    assert all(b.block_hash is not None for b in hits)


def test_reused_block_loses_its_old_hash():  # E5; vLLM O.6
    kv = make_kv(num_blocks=2)
    a = make_request("a", prompt_token_ids=list(range(8)))
    kv.allocate_slots(a, 8)
    old = {b.block_hash for b in kv.pool.blocks}
    kv.free(a)
    b = make_request("b", prompt_token_ids=list(range(50, 58)))
    kv.allocate_slots(b, 8)
    assert old.isdisjoint(kv.pool.cached)
    assert kv.get_computed_blocks(make_request("a2", prompt_token_ids=list(range(9)))) == ([], 0)


def test_duplicate_hash_leaves_the_second_block_unhashed():  # [kvserve] G3 note
    kv = make_kv()
    tokens = list(range(8))  # exactly two blocks: a twin hits only the first (G4)
    kv.allocate_slots(make_request("a", prompt_token_ids=tokens), 8)
    twin = make_request("b", prompt_token_ids=tokens)
    hits, _ = kv.get_computed_blocks(twin)
    new = kv.allocate_slots(twin, 4, hits)
    assert new[0].block_hash is None and len(kv.pool.cached) == 2


def test_usage_and_prefix_stats():  # G6, G7
    kv = make_kv(num_blocks=8)
    request = make_request("a", prompt_token_ids=list(range(9)))
    kv.allocate_slots(request, 9)
    assert kv.usage() == 3 / 8
    kv.record_prefix_cache_stats(request, 4)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 4)
    off = make_kv(caching=False)
    off.record_prefix_cache_stats(request, 0)
    assert off.prefix_cache_queries == 0


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_hash_ahead_gives_the_hashes_the_tokens_give_as_they_arrive(algo):  # G3, E5
    kv = KVCacheManager(CacheConfig(num_blocks=10, block_size=4, prefix_caching_hash_algo=algo),
                        1000)
    prompt, answer = list(range(100, 110)), [7, 8, 9, 10, 11, 12, 2]
    ahead = make_request("a", prompt_token_ids=prompt, cache_salt="s")
    kv.hash_ahead(ahead, answer)
    assert ahead.output_token_ids == [] and len(ahead.block_hashes) == 4  # 17 tokens
    arriving = make_request("b", prompt_token_ids=prompt, cache_salt="s")
    kv.allocate_slots(arriving, 10)
    arriving.num_computed_tokens = 10
    for token in answer:  # decode, registering each block as it fills (E5)
        arriving.output_token_ids.append(token)
        kv.grow_slots(arriving, 1)
        arriving.num_computed_tokens += 1
    assert ahead.block_hashes == arriving.block_hashes
    assert [kv.pool.cached[h].block_id for h in arriving.block_hashes] == [0, 1, 2, 3]
    kv.hash_ahead(arriving, [1, 2, 3, 4])  # has output already: nothing to do
    assert len(arriving.block_hashes) == 4
    off = make_kv(caching=False)
    fresh = make_request("c", prompt_token_ids=prompt)
    off.hash_ahead(fresh, answer)
    assert fresh.block_hashes == []


def test_hashes_known_ahead_are_read_only_up_to_the_tokens_in():  # G4, E5
    kv = make_kv(block_size=4)
    owner = make_request("a", prompt_token_ids=list(range(8)))
    kv.hash_ahead(owner, [8, 9, 10, 11, 12])  # three blocks hashed, two of them in
    kv.allocate_slots(owner, 8)
    assert len(kv.pool.cached) == 2  # block 2's hash is known, its tokens are not in
    twin = make_request("b", prompt_token_ids=list(range(13)))
    assert kv.get_computed_blocks(twin)[1] == 8
