"""Deterministic synthetic token ids: a stream of ids per key, the same at every length.

``stream_token(key, p)`` is a pure function of (seed, key, position), so the first n ids of
a stream never depend on how many are drawn. That is what lets requests share a prefix
(same key for the first ``prefix_len`` positions) and lets a conversation's next turn contain
the previous turn's prompt and answer token for token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

EOS_TOKEN_ID = 2
FIRST_TOKEN_ID = 3  # 0..2 are reserved (padding, BOS, EOS)
VOCAB_SIZE = 32000

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_SPAN = VOCAB_SIZE - FIRST_TOKEN_ID
_U_GOLDEN, _U_M1, _U_M2 = np.uint64(_GOLDEN), np.uint64(_M1), np.uint64(_M2)
_U_SPAN, _U_FIRST = np.uint64(_SPAN), np.uint64(FIRST_TOKEN_ID)
_U27, _U30, _U31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _finish_in_place(z: np.ndarray) -> None:
    """The finaliser of :func:`stream_token`, on a uint64 array of ``(position + 1) * golden +
    key`` values, in place: splitmix64's mixing, then the token range."""
    t = z >> _U30
    z ^= t
    z *= _U_M1
    np.right_shift(z, _U27, out=t)
    z ^= t
    z *= _U_M2
    np.right_shift(z, _U31, out=t)
    z ^= t
    z %= _U_SPAN
    z += _U_FIRST


def stream_key(seed: int, key: str) -> int:
    """A stable 64-bit key for ``key`` under ``seed`` (no salted ``hash()``)."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def stream_token(key: int, position: int) -> int:
    """splitmix64 of (key + position * golden); never EOS."""
    z = (key + (position + 1) * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    z ^= z >> 31
    return FIRST_TOKEN_ID + z % _SPAN


def stream_ranges(keys: Sequence[int], starts: Sequence[int],
                  ends: Sequence[int]) -> np.ndarray:
    """``stream_tokens(keys[i], starts[i], ends[i])`` for every i, one after another, as
    int64 (the layout of ``array("q", ids)``), in one vectorised pass for all of them."""
    lengths = np.subtract(ends, starts, dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 0:
        raise ValueError("every range needs start <= end")
    offsets = np.cumsum(lengths) - lengths  # where each range begins in the result
    shift = np.asarray(starts, dtype=np.int64) + 1 - offsets
    z = np.arange(int(lengths.sum()), dtype=np.int64)
    z += np.repeat(shift, lengths)  # position + 1, range by range
    z = z.view(np.uint64)
    z *= _U_GOLDEN
    z += np.repeat(np.array(keys, dtype=np.uint64), lengths)
    _finish_in_place(z)
    return z.view(np.int64)


def stream_tokens(key: int, start: int, end: int) -> list[int]:
    """``[stream_token(key, p) for p in range(start, end)]``, vectorised (in place: this runs
    once per simulated prompt and answer)."""
    if end <= start:
        return []
    z = np.arange(start + 1, end + 1, dtype=np.uint64)
    z *= _U_GOLDEN
    z += np.uint64(key)
    _finish_in_place(z)
    return z.tolist()
