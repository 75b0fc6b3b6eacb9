"""Hand the C heap's freed memory back to the system when the process has grown by more than
a slack since the last time.

A step's activations are allocated and freed by size (a 2,048-row prefill step's gate_up
output alone is 12.6 MB in bf16), and glibc's malloc keeps what is freed inside its heap:
it serves allocations of more than its mmap threshold from fresh mappings, but raises that
threshold to the size of each such block freed (up to 32 MiB), so after the first big step
the activations come from the heap, and only the heap's top is ever given back on its own.
On the AMX Xeon an engine replaying W3 (bf16, 1 GiB of KV cache) went from 1.76 GiB resident
after its load to 2.43-2.46 GiB, and ``malloc_trim`` gave 0.53 GiB of that back; a fixed low mmap
threshold (``MALLOC_MMAP_THRESHOLD_``) kept it at 1.91 GiB but maps and zeroes every big
activation afresh: 69-74 s for the replay against 43-65 s without, in the same hour
(docs/kernels.md, "The C heap between steps").

:class:`HeapTrimmer` reads the resident size after each step (``/proc/self/statm``, a few
microseconds) and calls glibc's ``malloc_trim(0)`` when it has grown by more than
``slack`` bytes since the last trim (6-27 ms each on that heap). The default, 128 MiB, is
a trade: in that replay (two requests added a step) 64 MiB trimmed 47-50 times for a peak of
1.96-1.98 GiB, 128 MiB 19 times for 2.03 GiB; with no trims the peak was 2.43-2.45 GiB.
Where either is missing (not Linux, not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

TRIM_SLACK_BYTES = 128 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def resident_bytes() -> int | None:
    """This process's resident set size, or None where /proc has no statm."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Calls ``trim`` (default: glibc's ``malloc_trim(0)``) from :meth:`after_step` when the
    resident size (``resident``) exceeds the one after the last trim (or the first reading)
    by more than ``slack`` bytes."""

    def __init__(self, slack: int = TRIM_SLACK_BYTES, *,
                 trim: Callable[[int], int] | None = None,
                 resident: Callable[[], int | None] = resident_bytes) -> None:
        self.slack = slack
        self._trim = trim or _malloc_trim()
        self._resident = resident
        # None: nothing to trim with, or no /proc (after_step then does nothing)
        self.baseline = resident() if self._trim is not None else None
        self.trims = 0

    def after_step(self) -> None:
        if self.baseline is None:
            return
        now = self._resident()
        if now is None or now <= self.baseline + self.slack:
            return
        assert self._trim is not None
        self._trim(0)
        self.trims += 1
        self.baseline = self._resident() or now
