"""The host KV tier: a second set of KV tensors, allocated once, that a preempted request's
blocks are copied into (swap-out) and back from (swap-in) — ``--swap-space``,
``--preemption-mode swap|auto`` (docs/preemption.md).

Each layer keeps K and V of shape ``[num_host_blocks, block_size, kv_heads, head_dim]``, the
device cache's shape with the host block count. A copy moves one block of every layer's K
and V; the scheduler names the blocks as (device block id, host block id) pairs in
``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``.

Order within a step (the preemption contract): every swap-out first, then every swap-in,
then the forward. A device block freed by a swap-out may be the target of a swap-in or a
new request in the same step; the copy out has read it before anything writes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
BlockPairs = Sequence[tuple[int, int]]


class HostKVCache:
    """The host tier for ``device_caches`` (the runner's per-layer K and V), with
    ``num_host_blocks`` blocks. On a CUDA device the host tensors are pinned, so copies can
    run at the link's rate; on the CPU engine the tier is a second region of the same RAM."""

    def __init__(self, device_caches: KVCaches, num_host_blocks: int) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_host_blocks}")
        if not device_caches:
            raise ValueError("a host KV tier needs the device KV caches to mirror")
        self.device_caches = device_caches
        self.num_blocks = num_host_blocks
        key = device_caches[0][0]
        shape = (num_host_blocks, *key.shape[1:])
        pin = key.device.type == "cuda"
        self.host_caches: KVCaches = [
            (torch.zeros(shape, dtype=key.dtype, pin_memory=pin),
             torch.zeros(shape, dtype=key.dtype, pin_memory=pin))
            for _ in device_caches]
        self.bytes_per_block = bytes_per_block(device_caches)
        self.num_swapped_out = 0  # blocks, cumulative
        self.num_swapped_in = 0

    def swap_out(self, pairs: BlockPairs) -> None:
        """Copy device blocks to host blocks, every layer's K and V."""
        if pairs:
            self._copy(pairs, to_host=True)
            self.num_swapped_out += len(pairs)

    def swap_in(self, pairs: BlockPairs) -> None:
        """Copy host blocks back to device blocks, every layer's K and V."""
        if pairs:
            self._copy(pairs, to_host=False)
            self.num_swapped_in += len(pairs)

    def run(self, swap_out: BlockPairs, swap_in: BlockPairs) -> None:
        """One step's copies in the contract's order: all out, then all in.

        A host block may not be both written and read in one step: the scheduler never
        reuses a host block freed by this step's swap-in for this step's swap-out."""
        if swap_out and swap_in:
            overlap = {h for _, h in swap_out} & {h for _, h in swap_in}
            if overlap:
                raise RuntimeError(f"host blocks {sorted(overlap)} are both swapped out and "
                                   "swapped in in one step")
        self.swap_out(swap_out)
        self.swap_in(swap_in)

    def _copy(self, pairs: BlockPairs, *, to_host: bool) -> None:
        device_ids, host_ids = zip(*pairs, strict=True)
        for name, ids, size in (("device", device_ids, self.device_caches[0][0].shape[0]),
                                ("host", host_ids, self.num_blocks)):
            low, high = min(ids), max(ids)
            if low < 0 or high >= size:
                raise IndexError(f"{name} block {high if high >= size else low} is outside "
                                 f"the {name} KV cache of {size} blocks")
        device_index = torch.tensor(device_ids, dtype=torch.long)
        host_index = torch.tensor(host_ids, dtype=torch.long)
        if not to_host:
            device_index = device_index.to(self.device_caches[0][0].device)
        with torch.inference_mode():
            for (dev_k, dev_v), (host_k, host_v) in zip(self.device_caches, self.host_caches,
                                                        strict=True):
                if to_host:
                    host_k[host_index] = dev_k[device_index.to(dev_k.device)].to("cpu")
                    host_v[host_index] = dev_v[device_index.to(dev_v.device)].to("cpu")
                else:
                    dev_k[device_index] = host_k[host_index].to(dev_k.device)
                    dev_v[device_index] = host_v[host_index].to(dev_v.device)


def bytes_per_block(caches: KVCaches) -> int:
    """Bytes one block holds over every layer's K and V."""
    total = 0
    for key, value in caches:
        total += key[0].numel() * key.element_size() + value[0].numel() * value.element_size()
    return total


def measure_copy_bandwidth(host: HostKVCache, num_blocks: int = 32, repeats: int = 5
                           ) -> float:
    """Bytes per second of one direction of the tier's copies, as the engine runs them: the
    median over ``repeats`` of a swap-out and a swap-in of ``num_blocks`` blocks (block ids
    from 0, so run it before the engine serves: it overwrites those blocks' contents)."""
    count = max(1, min(num_blocks, host.num_blocks, host.device_caches[0][0].shape[0]))
    pairs = [(i, i) for i in range(count)]
    times = []
    out_before, in_before = host.num_swapped_out, host.num_swapped_in
    for _ in range(repeats + 1):  # the first round warms the allocator and the caches
        start = time.perf_counter()
        host.swap_out(pairs)
        host.swap_in(pairs)
        times.append((time.perf_counter() - start) / 2)
    host.num_swapped_out, host.num_swapped_in = out_before, in_before
    times = sorted(times[1:])
    return count * host.bytes_per_block / max(times[len(times) // 2], 1e-9)
