"""Prompts drawn ahead in batches (kvserve.sim.prompt_draws) are the ids each request draws
alone, and the prompt bytes they carry give the prefix cache the hashes the ids give."""

from __future__ import annotations

from array import array

import pytest

from kvserve.core import CacheConfig, Request, SamplingParams
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.prefix_cache import extend_block_hashes
from kvserve.sim.prompt_draws import PromptDraws
from kvserve.sim.tokens import stream_ranges, stream_tokens
from kvserve.sim.trace import TraceRequest

from .helpers import req


def test_stream_ranges_are_the_ranges_drawn_one_by_one():
    keys, starts, ends = [7, 2**64 - 1, 3, 9], [0, 40, 5, 0], [30, 40, 100, 1]
    ids = stream_ranges(keys, starts, ends)
    expected = [t for k, a, b in zip(keys, starts, ends, strict=True)
                for t in stream_tokens(k, a, b)]
    assert ids.tolist() == expected
    assert ids.tobytes() == array("q", expected).tobytes()
    with pytest.raises(ValueError, match="every range needs start <= end"):
        stream_ranges([1], [5], [4])


def test_drawn_ahead_or_alone_every_request_gets_its_own_ids():
    trace = [req(f"r{i}", 10 + 3 * i, i % 4, arrival=0.1 * i) for i in range(10)]
    trace[3] = TraceRequest("p3", 0.3, 2, prompt_len=20, prefix_id="sys", prefix_len=8)
    trace[6] = TraceRequest("g6", 0.6, 2, prompt_token_ids=(4, 5, 6))
    draws = PromptDraws(trace, seed=5, with_bytes=True, batch=4)
    # taken out of order, one skipped (a cancelled request is never taken)
    for request in [trace[i] for i in (0, 2, 1, 3, 5, 4, 6, 8, 9)]:
        prompt, answer, prompt_bytes = draws.take(request)
        alone_prompt, alone_answer = request.synthesise_with_answer(5)
        assert prompt == alone_prompt and answer == alone_answer
        plain = request.prefix_id is None and request.prompt_token_ids is None
        assert prompt_bytes == (array("q", prompt).tobytes() if plain else None)
        assert answer is None or len(answer) == request.output_len
    assert len(draws._drawn) <= 4  # what was drawn ahead and not taken is bounded


def test_prompt_bytes_give_the_hashes_the_ids_give():  # G3
    prompt = stream_tokens(11, 0, 70)
    for scoped, tenant in ((False, ""), (True, "acme")):
        kv = KVCacheManager(CacheConfig(num_blocks=20, block_size=16), max_model_len=200,
                            tenant_scoped=scoped)
        params = SamplingParams(tenant=tenant)
        from_ids, from_bytes = Request("a", list(prompt), params), Request("b", list(prompt),
                                                                          params)
        kv.hash_prompt(from_bytes, array("q", prompt).tobytes())
        assert from_bytes.block_hashes == extend_block_hashes(from_ids, 16, 70, scoped)
        assert len(from_bytes.block_hashes) == 4
    with pytest.raises(ValueError, match="request c: 8 bytes for 70 prompt tokens"):
        kv.hash_prompt(Request("c", list(prompt)), b"\0" * 8)
    off = KVCacheManager(CacheConfig(num_blocks=20, block_size=16,
                                     enable_prefix_caching=False), max_model_len=200)
    untouched = Request("d", list(prompt))
    off.hash_prompt(untouched, array("q", prompt).tobytes())
    assert untouched.block_hashes == []
