"""The runner gives the C heap's freed memory back past a slack (kvserve.model.host_heap)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from kvserve.core import SamplingParams
from kvserve.engine.llm import LLM
from kvserve.model import host_heap
from kvserve.model.host_heap import HeapTrimmer, resident_bytes
from tests.model.reference import TINY

MiB = 1 << 20


def test_it_trims_only_past_the_slack_and_measures_again_after():
    readings = iter([100 * MiB,  # the baseline
                     150 * MiB, 164 * MiB,  # within 64 MiB of it: nothing
                     165 * MiB, 120 * MiB,  # past it: trimmed, and 120 is the new baseline
                     184 * MiB, 185 * MiB, 130 * MiB])
    calls: list[int] = []
    trimmer = HeapTrimmer(64 * MiB, trim=lambda pad: calls.append(pad) or 1,
                          resident=lambda: next(readings))
    assert trimmer.baseline == 100 * MiB
    for _ in range(3):
        trimmer.after_step()
    assert calls == [0] and trimmer.baseline == 120 * MiB
    trimmer.after_step()  # 184: within 64 of 120
    assert calls == [0]
    trimmer.after_step()  # 185: past it
    assert calls == [0, 0] and trimmer.trims == 2 and trimmer.baseline == 130 * MiB


def test_without_a_resident_size_it_does_nothing():
    calls: list[int] = []
    trimmer = HeapTrimmer(trim=calls.append, resident=lambda: None)
    trimmer.after_step()
    assert trimmer.baseline is None and calls == []


@pytest.mark.skipif(host_heap._malloc_trim() is None or resident_bytes() is None,
                    reason="glibc's malloc_trim and /proc/self/statm")
def test_freed_heap_memory_goes_back_to_the_system():
    """200 MB of 64 KiB blocks (below glibc's mmap threshold: from the heap), written, then
    freed but for the last, which holds the heap's top: the freed memory stays resident until
    the trimmer sees the growth and trims."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    trimmer = HeapTrimmer(64 * MiB)
    blocks = [libc.malloc(64 << 10) for _ in range(3200)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:
        libc.free(block)
    before = resident_bytes()
    assert before is not None and before > trimmer.baseline + 150 * MiB
    trimmer.after_step()
    libc.free(blocks[-1])
    assert trimmer.trims == 1 and trimmer.baseline < before - 150 * MiB


def test_the_runner_checks_the_heap_after_every_step(monkeypatch):
    checks: list[int] = []
    monkeypatch.setattr(HeapTrimmer, "after_step", lambda self: checks.append(1))
    llm = LLM(TINY, num_kv_blocks=16)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(checks) == llm.engine.scheduler.stats().num_steps == 4
