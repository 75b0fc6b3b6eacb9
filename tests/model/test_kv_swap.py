"""The host KV tier's copies (issue 12; docs/preemption.md): every layer's K and V of each
named block moves exactly, swap-outs run before swap-ins (the preemption contract), and bad
ids fail loudly instead of copying the wrong block."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from kvserve.model.kv_swap import HostKVCache, bytes_per_block, measure_copy_bandwidth
from tests.model.reference import TINY

NUM_BLOCKS, BLOCK_SIZE = 8, 4


def filled_caches(dtype=torch.float32):
    caches = allocate_kv_cache(TINY, NUM_BLOCKS, BLOCK_SIZE, dtype)
    generator = torch.Generator().manual_seed(0)
    for key, value in caches:
        key.copy_(torch.randn(key.shape, generator=generator))
        value.copy_(torch.randn(value.shape, generator=generator))
    return caches


def snapshot(caches, block_id):
    return [(k[block_id].clone(), v[block_id].clone()) for k, v in caches]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b, strict=True)
               for x, y in zip(pa, pb, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_then_in_restores_every_layer_exactly(dtype):
    caches = filled_caches(dtype)
    host = HostKVCache(caches, num_host_blocks=4)
    before = {b: snapshot(caches, b) for b in (3, 5)}
    host.swap_out([(3, 0), (5, 2)])
    assert same(snapshot(host.host_caches, 0), before[3])
    assert same(snapshot(host.host_caches, 2), before[5])
    for key, value in caches:  # the device blocks are reused by someone else meanwhile
        key[[3, 5]] = 0
        value[[3, 5]] = 0
    host.swap_in([(6, 0), (1, 2)])  # back into newly allocated device blocks
    assert same(snapshot(caches, 6), before[3]) and same(snapshot(caches, 1), before[5])
    assert (host.num_swapped_out, host.num_swapped_in) == (2, 2)


def test_a_step_copies_out_before_in_so_a_freed_block_can_be_refilled():
    # Device block 2 is swapped out and, in the same step, receives host block 1's KV.
    caches = filled_caches()
    host = HostKVCache(caches, num_host_blocks=2)
    host.swap_out([(4, 1)])
    parked = snapshot(caches, 4)
    outgoing = snapshot(caches, 2)
    host.run(swap_out=[(2, 0)], swap_in=[(2, 1)])
    assert same(snapshot(host.host_caches, 0), outgoing)
    assert same(snapshot(caches, 2), parked)


def test_a_host_block_written_and_read_in_one_step_is_refused():
    host = HostKVCache(filled_caches(), num_host_blocks=2)
    with pytest.raises(RuntimeError, match=r"host blocks \[1\] are both swapped out and"):
        host.run(swap_out=[(0, 1)], swap_in=[(3, 1)])


def test_ids_outside_either_cache_are_refused():
    host = HostKVCache(filled_caches(), num_host_blocks=2)
    with pytest.raises(IndexError, match="host block 2 is outside the host KV cache of 2"):
        host.swap_out([(0, 2)])
    with pytest.raises(IndexError, match="device block 8 is outside the device KV cache of 8"):
        host.swap_in([(8, 0)])
    assert (host.num_swapped_out, host.num_swapped_in) == (0, 0)
    with pytest.raises(ValueError, match="at least one block"):
        HostKVCache(filled_caches(), num_host_blocks=0)


def test_block_bytes_and_a_measured_bandwidth():
    caches = filled_caches()
    # 2 (K, V) x 3 layers x 4 tokens x 2 KV heads x 16 x 4 B = 3,072 B per block.
    assert bytes_per_block(caches) == 3072 == \
        kv_cache_bytes_per_block(TINY, BLOCK_SIZE, torch.float32)
    host = HostKVCache(caches, num_host_blocks=4)
    assert measure_copy_bandwidth(host, num_blocks=4, repeats=2) > 0
    assert (host.num_swapped_out, host.num_swapped_in) == (0, 0)  # probes are not counted
