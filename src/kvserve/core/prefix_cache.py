"""Stable chained block hashes and the longest-prefix lookup (spec G3-G5).

A block's hash is a BLAKE2b digest of (parent hash or a fixed seed, the block's token ids,
extra keys such as the cache salt on the first block). Chaining makes one hash name the whole
prefix up to and including its block. The digest depends only on its inputs: stable across
processes and runs, unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.request import Request

ROOT_HASH = hashlib.blake2b(b"kvserve/prefix-cache/v1", digest_size=16).digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_key: str | None = None) -> bytes:
    h = hashlib.blake2b(parent_hash if parent_hash is not None else ROOT_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        encoded = extra_key.encode()
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    return h.digest()


def extend_block_hashes(request: Request, block_size: int, num_tokens: int) -> list[bytes]:
    """Make ``request.block_hashes`` cover every full block within the first ``num_tokens``."""
    hashes = request.block_hashes
    num_full = num_tokens // block_size
    while len(hashes) < num_full:
        index = len(hashes)
        start = index * block_size
        parent = hashes[-1] if hashes else None
        extra = request.sampling_params.cache_salt if index == 0 else None
        hashes.append(hash_block_tokens(parent, request.token_slice(start, start + block_size),
                                        extra))
    return hashes


def find_longest_cache_hit(pool: BlockPool, block_hashes: Sequence[bytes],
                           max_blocks: int) -> list[KVBlock]:
    """Blocks for the longest run of leading hashes present in the cache, at most max_blocks.

    A hit counts whether the block is held by another request or sits free (G5).
    """
    hits = []
    cached = pool.cached
    for block_hash in block_hashes[:max_blocks]:
        block = cached.get(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits
