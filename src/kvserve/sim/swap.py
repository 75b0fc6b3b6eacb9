"""The host KV tier in the simulator: what a swap costs and where that time goes (K3, S4).

:class:`SimPreemptionPrices` implements the core's ``PreemptionPrices`` from the
deployment: a recompute of N tokens is the cost model's price of a prefill step of N tokens;
one direction of a swap of B blocks is their bytes over the hardware preset's host link::

    swap_seconds(B) = B x block_size x kv_bytes_per_token / (tp x host_link_bandwidth)

(with tensor parallelism each device copies its share over its own link). The same prices
serve ``auto``'s choice per victim and the copy time in the step.

:class:`WithSwapCopies` wraps a cost model: a step's duration gains the time of its block
copies, swap-outs then swap-ins, which run before the forward pass (the executor contract).
Exceptions: under the ``unit`` cost model (simulated seconds count steps) copies take no
time and a swap has no price; a ``replay`` of engine step times already contains the
engine's copies, so its steps gain none, yet ``auto`` still prices each victim's swap by the
host link against its recompute by the roofline of the deployment's presets (``--hardware``;
the sim-agreement pass: a replay priced every swap at 0 s, so auto swapped every victim).
A step that schedules no token runs no model and takes no time, its copies included (it is
rare: a lone victim's own preemption).
"""

from __future__ import annotations

from typing import Any

from kvserve.core import CachedRequestData, SchedulerOutput
from kvserve.sim.capacity import kv_bytes_per_token
from kvserve.sim.cost_models import CostModel
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import HardwareSpec, ModelSpec


def prefill_view(num_tokens: int) -> BatchView:
    """One request's cold prefill of ``num_tokens`` tokens, sampling one token."""
    return BatchView(1, num_tokens, 1, 0, 0, num_tokens * (num_tokens + 1) // 2)


class SimPreemptionPrices:
    """``PreemptionPrices`` from a cost model and the deployment's presets."""

    def __init__(self, cost_model: CostModel, model: ModelSpec, hardware: HardwareSpec,
                 dtype: str, tensor_parallel_size: int, block_size: int,
                 copies_take_time: bool = True, swaps_priced: bool = True) -> None:
        self.cost_model = cost_model
        self.bytes_per_block = kv_bytes_per_token(model, dtype, tensor_parallel_size) \
            * block_size
        self.link_bandwidth = hardware.host_link_bandwidth * tensor_parallel_size
        self.copies_take_time = copies_take_time  # a step gains its copies' time
        self.swaps_priced = swaps_priced  # auto's choice sees a swap's price (not unit time)

    def recompute_seconds(self, num_tokens: int) -> float:
        return self.cost_model.step_time(_NO_OUTPUT, prefill_view(num_tokens))

    def swap_seconds(self, num_blocks: int) -> float:
        if not self.swaps_priced:
            return 0.0
        return num_blocks * self.bytes_per_block / self.link_bandwidth

    def describe(self) -> dict[str, Any]:
        return {"bytes_per_block": self.bytes_per_block,
                "host_link_bandwidth": self.link_bandwidth,
                "copies_take_time": self.copies_take_time,
                "swaps_priced": self.swaps_priced}


class WithSwapCopies:
    """A cost model whose steps also pay for their KV block copies (see the module)."""

    def __init__(self, inner: CostModel, prices: SimPreemptionPrices) -> None:
        self.inner = inner
        self.prices = prices
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:  # step_start, needs_block_layout, ...
        return getattr(self.inner, name)

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        seconds = self.inner.step_time(scheduler_output, view)
        num_copied = len(scheduler_output.blocks_to_swap_out) + \
            len(scheduler_output.blocks_to_swap_in)
        if num_copied and self.prices.copies_take_time:
            seconds += self.prices.swap_seconds(num_copied)
        return seconds

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "swap": self.prices.describe()}


# recompute_seconds asks for the price of a step that is not scheduled: no output to read.
_NO_OUTPUT = SchedulerOutput([], CachedRequestData(), {}, 0, [], [])
