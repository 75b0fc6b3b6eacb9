"""The machine-peaks measurement (``kvserve.engine.machine_peaks``) that ``--hardware
cpu-local`` runs on first use: it must finish in seconds on any CPU, including one that
computes a dtype only by emulation."""

from __future__ import annotations

import torch

from kvserve.engine import machine_peaks


def test_a_dtype_too_slow_for_the_budget_is_measured_once_at_the_smallest_size(monkeypatch):
    sizes_run: list[int] = []
    real_matmul = torch.matmul
    now = [0.0]  # a fake clock: each product takes 0.02 s of it

    def slow_matmul(a, b, out=None):
        sizes_run.append(a.shape[0])
        now[0] += 0.02  # an emulated dtype: one product eats the whole budget
        return real_matmul(a, b, out=out)

    monkeypatch.setattr(machine_peaks.torch, "matmul", slow_matmul)
    flops = machine_peaks.matmul_flops(torch.float32, sizes=(32, 2048), budget_s=0.03,
                                       clock=lambda: now[0])
    assert sizes_run == [32]  # the larger size, slower still, never ran
    assert flops == 2 * 32 ** 3 / 0.02  # the one product, timed by the clock


def test_a_fast_dtype_is_the_median_of_repeats_at_every_size(monkeypatch):
    sizes_run: list[int] = []
    real_matmul = torch.matmul

    def counted(a, b, out=None):
        sizes_run.append(a.shape[0])
        return real_matmul(a, b, out=out)

    monkeypatch.setattr(machine_peaks.torch, "matmul", counted)
    flops = machine_peaks.matmul_flops(torch.float32, sizes=(16, 32), budget_s=5.0)
    assert flops > 0
    assert sizes_run.count(16) >= 5 and sizes_run.count(32) >= 5
