"""Stable chained block hashes and the longest-prefix lookup (spec G3-G5).

A block's hash is a BLAKE2b digest of (parent hash or a fixed seed, the block's token ids,
extra keys such as the cache salt on the first block). Chaining makes one hash name the whole
prefix up to and including its block. The digest depends only on its inputs: stable across
processes and runs, unlike Python's salted ``hash()`` of strings and bytes.

``prefix_caching_hash_algo`` (vLLM's ``--prefix-caching-hash-algo``) picks the function:
``blake2b`` (the default: the digests above, collision resistant) or ``builtin``, a 64-bit
non-cryptographic hash computed in C, several times cheaper, that the simulator uses
(docs/scheduler.md, G3; :func:`extend_builtin_block_hashes`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from itertools import accumulate, count
from operator import add

from kvserve.core.block_pool import BlockPool, KVBlock
from kvserve.core.request import Request

ROOT_HASH = hashlib.blake2b(b"kvserve/prefix-cache/v1", digest_size=16).digest()
# A block hash: BLAKE2b's 16 bytes, or the builtin algorithm's int.
BlockHash = bytes | int


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_key: str | None = None) -> bytes:
    return _hash_block_bytes(parent_hash, array("q", token_ids).tobytes(), extra_key)


def _hash_block_bytes(parent_hash: bytes | None, data: bytes,
                      extra_key: str | None = None) -> bytes:
    """hash_block_tokens of the block whose ids' int64 bytes are ``data``."""
    h = hashlib.blake2b(parent_hash if parent_hash is not None else ROOT_HASH, digest_size=16)
    h.update(data)
    if extra_key is not None:
        encoded = extra_key.encode()
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    return h.digest()


def first_block_key(request: Request, tenant_scoped: bool) -> str | None:
    """The extra key of a request's first block: its cache salt, and under the tenant
    prefix-cache scope its tenant too, so that no two tenants ever share (or can probe) a
    cached block, whatever salts they choose. Length-prefixed, so no choice of tenant and
    salt can spell another pair."""
    params = request.sampling_params
    if not tenant_scoped:
        return params.cache_salt
    tenant = params.tenant
    key = f"tenant:{len(tenant)}:{tenant}"
    return key if params.cache_salt is None else f"{key}|salt:{params.cache_salt}"


def extend_block_hashes(request: Request, block_size: int, num_tokens: int,
                        tenant_scoped: bool = False) -> list[BlockHash]:
    """Make ``request.block_hashes`` cover every full block within the first ``num_tokens``.

    The digests are those of chaining :func:`hash_block_tokens` block by block. Many new
    blocks at once (a prompt's first lookup hashes dozens) take a faster path: the tokens
    become bytes in one conversion, and each block is one BLAKE2b call over parent hash +
    block bytes, which equals hashing the parent and then updating with the block's bytes.
    """
    hashes = request.block_hashes
    index = len(hashes)
    num_full = num_tokens // block_size
    if index == 0 and num_full > 0:  # the first block has no parent and carries the salt
        hashes.append(hash_block_tokens(None, request.token_slice(0, block_size),
                                        first_block_key(request, tenant_scoped)))
        index = 1
    if index + 1 == num_full:  # one more block, as when decoding fills one
        hashes.append(hashlib.blake2b(hashes[-1] + array("q", request.token_slice(
            index * block_size, num_full * block_size)).tobytes(), digest_size=16).digest())
    elif index < num_full:
        data = array("q", request.token_slice(index * block_size,
                                              num_full * block_size)).tobytes()
        block_bytes = 8 * block_size  # "q": 8 bytes per token id
        parent = hashes[-1]
        blake2b = hashlib.blake2b
        for start in range(0, len(data), block_bytes):
            parent = blake2b(parent + data[start:start + block_bytes], digest_size=16).digest()
            hashes.append(parent)
    return hashes


def extend_builtin_block_hashes(request: Request, block_size: int, num_tokens: int,
                                tenant_scoped: bool = False) -> list[BlockHash]:
    """:func:`extend_block_hashes` with the ``builtin`` algorithm: block i's hash is its
    parent's plus ``hash((i, *its token ids))``, the first block's parent being its extra key
    as a 64-bit int (0 without one), so a hash names the whole prefix up to its block.

    Python's ``hash`` of a tuple of ints is not salted (only str and bytes are): the same
    in every process and run on 64-bit CPython (3.8 on), and computed in C, as are the
    tuples (``zip`` over one iterator), the hashes (``map``) and the running sum
    (``accumulate``). It is not collision resistant: two prefixes collide with a chance of
    about 2**-64, and someone who can choose prompts can make them collide on purpose
    (docs/scheduler.md, G3): the engine's default stays ``blake2b``.
    """
    hashes = request.block_hashes
    index = len(hashes)
    num_full = num_tokens // block_size
    if index >= num_full:
        return hashes
    ids = request.token_slice(index * block_size, num_full * block_size)
    if index:
        if index + 1 == num_full:  # one more block, as when decoding fills one
            hashes.append(hashes[-1] + hash((index, *ids)))
            return hashes
        parent = hashes[-1]
    else:
        parent = _builtin_key(first_block_key(request, tenant_scoped))
    sums = accumulate(map(hash, zip(count(index), *[iter(ids)] * block_size)), add,
                      initial=parent)
    next(sums)  # the parent itself
    hashes.extend(sums)
    return hashes


def _builtin_key(extra_key: str | None) -> int:
    """An extra key as a stable 64-bit int (``hash`` of a str is salted per process)."""
    if extra_key is None:
        return 0
    return int.from_bytes(hashlib.blake2b(extra_key.encode(), digest_size=8).digest(),
                          "little")


BLOCK_HASHERS: dict[str, Callable[[Request, int, int, bool], list[BlockHash]]] = {
    "blake2b": extend_block_hashes,  # type: ignore[dict-item]
    "builtin": extend_builtin_block_hashes,
}


def prompt_bytes_block_hashes(data: bytes, block_size: int,
                              extra_key: str | None = None) -> list[bytes]:
    """The chained hashes of every full block of a prompt given as its ids' int64 bytes
    (``array("q", token_ids).tobytes()``), the first block carrying ``extra_key``: what
    :func:`extend_block_hashes` computes for a fresh request with that prompt."""
    block_bytes = 8 * block_size  # "q": 8 bytes per token id
    if len(data) < block_bytes:
        return []
    parent = _hash_block_bytes(None, data[:block_bytes], extra_key)
    hashes = [parent]
    blake2b = hashlib.blake2b
    for start in range(block_bytes, len(data) - block_bytes + 1, block_bytes):
        parent = blake2b(parent + data[start:start + block_bytes], digest_size=16).digest()
        hashes.append(parent)
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids``: the digests the prefix cache
    gives a request with this prompt and ``cache_salt`` (what a router matches on, R4)."""
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    hashes = [hash_block_tokens(None, token_ids[:block_size], salt)]
    data = array("q", token_ids[block_size:num_full * block_size]).tobytes()
    block_bytes = 8 * block_size  # "q": 8 bytes per token id
    parent = hashes[0]
    blake2b = hashlib.blake2b
    for start in range(0, len(data), block_bytes):
        parent = blake2b(parent + data[start:start + block_bytes], digest_size=16).digest()
        hashes.append(parent)
    return hashes


def find_longest_cache_hit(pool: BlockPool, block_hashes: Sequence[BlockHash],
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
