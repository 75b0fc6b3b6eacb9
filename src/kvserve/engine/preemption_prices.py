"""The engine's prices for ``--preemption-mode auto`` (core's ``PreemptionPrices``): what a
recompute and a swap cost on this machine, measured once when the engine starts.

- ``swap_seconds(n)``: n blocks x bytes per block / the host tier's copy bandwidth, measured
  by timing the tier's own copies (:func:`kvserve.model.kv_swap.measure_copy_bandwidth`).
- ``recompute_seconds(n)``: a prefill of n tokens, ``overhead + n x seconds per token``, a
  line through two timed prefill steps of the runner (the step it would really run, on
  scattered blocks, as ``kvserve calibrate`` times them).

The probes write into the first blocks of the pool, so they run before the engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.kv_swap import HostKVCache, measure_copy_bandwidth
from kvserve.model.runner import ModelRunner


@dataclass(frozen=True)
class MeasuredPreemptionPrices:
    copy_bytes_per_s: float  # one direction
    bytes_per_block: int
    prefill_seconds_per_token: float
    prefill_overhead_s: float

    def recompute_seconds(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + num_tokens * self.prefill_seconds_per_token

    def swap_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.bytes_per_block / self.copy_bytes_per_s

    @property
    def prefill_tok_s(self) -> float:
        return 1.0 / self.prefill_seconds_per_token

    def describe(self) -> str:
        """One line for the boot log."""
        return (f"preemption prices (auto): host copy {self.copy_bytes_per_s / 1e9:.1f} GB/s "
                f"per direction ({self.bytes_per_block:,} B per block), prefill "
                f"{self.prefill_tok_s:,.0f} tok/s + {self.prefill_overhead_s * 1e3:.1f} ms")


def measure_prices(runner: ModelRunner, host: HostKVCache, num_blocks: int,
                   probe_tokens: tuple[int, int] = (32, 256)) -> MeasuredPreemptionPrices:
    """Time the tier's copies and two prefill steps (``probe_tokens``, capped by the pool)."""
    from kvserve.engine.calibrate import StepShape, measure

    bandwidth = measure_copy_bandwidth(host)
    capacity = num_blocks * runner.block_size
    small, large = (min(n, capacity) for n in probe_tokens)

    def prefill(num_tokens: int) -> float:
        shape = StepShape(prefills=((0, num_tokens),), block_size=runner.block_size)
        return measure(runner, shape, num_blocks, warmup=1, repeats=3)

    t_small = prefill(small)
    if large <= small:
        return MeasuredPreemptionPrices(bandwidth, host.bytes_per_block, t_small / small, 0.0)
    t_large = prefill(large)
    # The slope, kept above a quarter of the mean rate should timing noise flatten it.
    per_token = max((t_large - t_small) / (large - small), t_large / large / 4)
    overhead = max(0.0, t_small - small * per_token)
    return MeasuredPreemptionPrices(bandwidth, host.bytes_per_block, per_token, overhead)
