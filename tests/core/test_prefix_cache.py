"""Spec G3-G5: stable chained block hashes and the longest-prefix lookup."""

import hashlib
import os
import subprocess
import sys

import pytest

from kvserve.core.config import PREFIX_CACHING_HASH_ALGOS, CacheConfig
from kvserve.core.errors import ConfigError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.prefix_cache import (
    BLOCK_HASHERS,
    extend_block_hashes,
    extend_builtin_block_hashes,
    hash_block_tokens,
)
from tests.conftest import make_request

PINNED = "from kvserve.core.prefix_cache import hash_block_tokens as h; " \
         "print(h(h(None, [1, 2, 3, 4], 'salt'), [5, 6, 7, 8]).hex())"


def test_hash_is_stable_across_processes():  # G3: no salted hash()
    digests = {
        subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True,
                       check=True, env={"PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    local = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], "salt"), [5, 6, 7, 8])
    assert digests == {local.hex()}


def test_hash_chains_parent_tokens_and_extra_key():  # G3
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 4], "tenant-a") != root
    assert hash_block_tokens(None, [1, 2, 3, 4], "") != root
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root


def test_only_full_blocks_are_hashed_and_salt_only_on_the_first():  # G3
    request = make_request("a", prompt_token_ids=list(range(10)), cache_salt="s")
    hashes = extend_block_hashes(request, 4, request.num_tokens)
    assert len(hashes) == 2  # 10 tokens: two full blocks, a partial one is never hashed
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], "s")
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    request.output_token_ids += [10, 11]  # output completes the third block
    assert len(extend_block_hashes(request, 4, request.num_tokens)) == 3


def test_extending_in_steps_gives_the_block_by_block_chain():  # G3
    prompt = list(range(1000, 1037))  # 9 full blocks of 4, the 10th completed by output
    request = make_request("a", prompt_token_ids=prompt, cache_salt="s")
    sequence = [*prompt, 7, 8, 9]
    expected = [hash_block_tokens(None, sequence[:4], "s")]
    for start in range(4, 40, 4):
        expected.append(hash_block_tokens(expected[-1], sequence[start:start + 4]))
    assert extend_block_hashes(request, 4, 1) == []
    assert extend_block_hashes(request, 4, 4) == expected[:1]
    assert extend_block_hashes(request, 4, 27) == expected[:6]  # five at once
    assert extend_block_hashes(request, 4, 28) == expected[:7]  # one more
    request.output_token_ids += [7, 8, 9]
    assert extend_block_hashes(request, 4, request.num_tokens) == expected


BUILTIN_PINNED = "from kvserve.core.prefix_cache import extend_builtin_block_hashes as h; " \
    "from kvserve.core.request import Request, SamplingParams; " \
    "print(h(Request('a', [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(cache_salt='salt')), 4, 8))"


def test_builtin_hash_is_stable_across_processes():  # G3: ints hash unsalted
    outputs = {
        subprocess.run([sys.executable, "-c", BUILTIN_PINNED], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    request = make_request("a", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8], cache_salt="salt")
    assert outputs == {str(extend_builtin_block_hashes(request, 4, 8))}


def test_builtin_hash_is_a_running_sum_of_position_tagged_tuple_hashes():  # G3
    # 64-bit CPython's tuple hash of these ints: pinned, so a change of it shows here.
    assert hash((0, 1, 2, 3, 4)) == 891674017800185211
    salt = int.from_bytes(hashlib.blake2b(b"s", digest_size=8).digest(), "little")
    prompt = list(range(1000, 1037))  # 9 full blocks of 4, the 10th completed by output
    request = make_request("a", prompt_token_ids=prompt, cache_salt="s")
    sequence = [*prompt, 7, 8, 9]
    expected = [salt + hash((0, *sequence[:4]))]
    for index in range(1, 10):
        expected.append(expected[-1] + hash((index, *sequence[4 * index:4 * index + 4])))
    assert extend_builtin_block_hashes(request, 4, 1) == []
    assert extend_builtin_block_hashes(request, 4, 4) == expected[:1]
    assert extend_builtin_block_hashes(request, 4, 27) == expected[:6]  # five at once
    assert extend_builtin_block_hashes(request, 4, 28) == expected[:7]  # one more
    request.output_token_ids += [7, 8, 9]
    assert extend_builtin_block_hashes(request, 4, request.num_tokens) == expected
    unsalted = make_request("b", prompt_token_ids=prompt)
    assert extend_builtin_block_hashes(unsalted, 4, 8) == [
        hash((0, *prompt[:4])), hash((0, *prompt[:4])) + hash((1, *prompt[4:8]))]


def test_hash_algos_are_the_configs_choices_and_others_are_refused():  # G3
    assert tuple(BLOCK_HASHERS) == PREFIX_CACHING_HASH_ALGOS == ("blake2b", "builtin")
    assert CacheConfig(num_blocks=1).prefix_caching_hash_algo == "blake2b"
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo='sha256' is not one of "
                                          "blake2b, builtin"):
        CacheConfig(num_blocks=1, prefix_caching_hash_algo="sha256")


def cached_manager(tokens, num_blocks=10, block_size=4, algo="blake2b"):
    kv = KVCacheManager(CacheConfig(num_blocks=num_blocks, block_size=block_size,
                                    prefix_caching_hash_algo=algo),
                        max_model_len=1000)
    owner = make_request("owner", prompt_token_ids=tokens)
    kv.allocate_slots(owner, len(tokens))
    return kv, owner


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_last_token_is_never_a_hit(algo):  # G4
    tokens = list(range(12))  # exactly three full blocks of 4
    kv, _ = cached_manager(tokens, algo=algo)
    twin = make_request("twin", prompt_token_ids=tokens)
    hits, num_hit_tokens = kv.get_computed_blocks(twin)
    assert (len(hits), num_hit_tokens) == (2, 8)
    longer = make_request("longer", prompt_token_ids=[*tokens, 99])
    assert kv.get_computed_blocks(longer)[1] == 12


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_lookup_stops_at_the_first_miss(algo):  # G4
    kv, _ = cached_manager(list(range(16)), algo=algo)
    # block 1 differs, so block 2 cannot hit even though its tokens match
    probe = make_request("p", prompt_token_ids=[0, 1, 2, 3, 0, 0, 0, 0, *range(8, 16), 1])
    hits, num_hit_tokens = kv.get_computed_blocks(probe)
    assert ([b.block_id for b in hits], num_hit_tokens) == ([0], 4)


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_hits_count_for_held_and_for_free_blocks(algo):  # G5
    tokens = list(range(9))
    kv, owner = cached_manager(tokens, algo=algo)
    probe = make_request("p", prompt_token_ids=tokens)
    assert kv.get_computed_blocks(probe)[1] == 8  # held by owner (ref 1)
    kv.free(owner)
    hits, num_hit_tokens = kv.get_computed_blocks(probe)
    assert num_hit_tokens == 8 and all(b.ref_cnt == 0 for b in hits)  # free, still cached


@pytest.mark.parametrize("algo", PREFIX_CACHING_HASH_ALGOS)
def test_salted_requests_do_not_share(algo):  # G3 extra keys
    tokens = list(range(9))
    kv, _ = cached_manager(tokens, algo=algo)
    salted = make_request("s", prompt_token_ids=tokens, cache_salt="tenant-b")
    assert kv.get_computed_blocks(salted) == ([], 0)


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(CacheConfig(num_blocks=10, block_size=4, enable_prefix_caching=False),
                        max_model_len=1000)
    tokens = list(range(9))
    kv.allocate_slots(make_request("a", prompt_token_ids=tokens), 9)
    assert kv.get_computed_blocks(make_request("b", prompt_token_ids=tokens)) == ([], 0)
    assert not kv.pool.cached


def test_reset_is_refused_while_blocks_are_held_then_forgets_everything():  # O.12
    from tests.conftest import FakeExecutor, make_scheduler, run_to_completion, step
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 9, max_tokens=4, ignore_eos=True))
    step(scheduler, FakeExecutor(block_size=4), 0.0)  # its prompt's two blocks written
    assert not scheduler.reset_prefix_cache()
    scheduler.abort("a")
    assert scheduler.kv.pool.cached and scheduler.reset_prefix_cache()
    assert not scheduler.kv.pool.cached
    assert all(b.block_hash is None for b in scheduler.kv.pool.blocks)
    run_to_completion(scheduler, [make_request("a2", prompt_token_ids=list(range(9)))])


def test_a_request_asking_prompt_logprobs_is_sorted_as_no_hit():  # C4 C5 G8
    """QA (spec pass): lpm and dfs-weight counted the cached blocks of a request that
    computes its whole prompt (G8), so it went ahead of real hits as a 10-block one."""
    from tests.conftest import FakeExecutor, make_scheduler, step

    scheduler = make_scheduler(64, 4)
    executor = FakeExecutor(block_size=4)
    prompt = list(range(1000, 1041))
    scheduler.add_request(make_request("warm", prompt_token_ids=prompt, max_tokens=1))
    while scheduler.has_unfinished_requests():
        step(scheduler, executor, 0.0)
    plain = make_request("plain", prompt_token_ids=prompt, max_tokens=1)
    asking = make_request("asking", prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=1)
    assert len(scheduler.kv.cached_prefix_hashes(plain)) == 10
    assert scheduler.kv.cached_prefix_hashes(asking) == []
