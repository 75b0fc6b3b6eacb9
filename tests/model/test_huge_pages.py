"""kvserve.model.huge_pages: tensors on transparent huge pages, and the switch that turns them
off."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import huge_pages


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next((int(line.split()[1]) for line in rollup
                     if line.startswith("AnonHugePages:")), 0)


def test_zeros_are_zeros_of_the_shape_and_dtype_asked_for():
    for dtype in (torch.float32, torch.bfloat16):
        t = huge_pages.zeros((3, 5, 7), dtype)
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
        assert torch.count_nonzero(t) == 0
        t.fill_(1.5)
        assert float(t.float().sum()) == 1.5 * 105


def test_gather_copies_each_tensor_to_a_cache_line_of_one_arena():
    tensors = [torch.arange(n, dtype=dtype).reshape(-1, 1)
               for n, dtype in ((5, torch.float32), (7, torch.bfloat16), (33, torch.int8))]
    copies = huge_pages.gather(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert torch.equal(copy, tensor)
        assert copy.data_ptr() % huge_pages.ALIGN == 0
    if huge_pages.available():  # one arena: the copies' storages are one
        assert len({copy.untyped_storage().data_ptr() for copy in copies}) == 1
    assert huge_pages.gather([]) == []


def test_the_switch_turns_huge_pages_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.available()
    tensors = [torch.ones(4)]
    assert huge_pages.gather(tensors)[0] is tensors[0]  # no arena: the tensors themselves
    assert torch.equal(huge_pages.zeros((2, 2), torch.float32), torch.zeros(2, 2))


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here")
def test_a_large_tensor_lands_on_huge_pages():
    before = anon_huge_kib()
    t = huge_pages.zeros((64 << 20,), torch.uint8)  # 64 MiB, committed
    assert anon_huge_kib() - before >= 2048  # at least one 2 MiB page
    del t
