"""KV-cache capacity arithmetic, shared by ``kvserve simulate`` (to size the pool) and
``kvserve plan``.

    kv_bytes_per_token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes
                         (x tp / KV heads when tp > KV heads: heads are replicated)
    pool   = gpu_memory x utilization x tp - weights - activation reserve x tp
             (or given directly: then pool + weights + activation reserve x tp must fit in
             gpu_memory x tp, whatever the utilization, as vLLM's --kv-cache-memory-bytes
             bypasses it)
    blocks = floor(pool / (kv_bytes_per_token x block_size)); max_live_tokens = blocks x bs
    concurrency at a sequence length L = floor(blocks / ceil(L / block_size))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvserve.sim.presets import GiB, HardwareSpec, ModelSpec, dtype_bytes


class CapacityError(ValueError):
    """The model does not fit, or a capacity parameter is out of range."""


def kv_bytes_per_token(model: ModelSpec, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Over one replica's devices (KV heads replicated when tp > KV heads)."""
    return model.kv_elements_per_token(tensor_parallel_size) * dtype_bytes(dtype)


def weight_bytes(model: ModelSpec, dtype: str) -> int:
    return model.num_params * dtype_bytes(dtype)


def activation_reserve_bytes(model: ModelSpec, dtype: str, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """Peak activations of one step, per device: the widest step's hidden states, q/k/v
    and MLP intermediates (4 x hidden + 2 x intermediate per token, in dtype), plus fp32
    logits for every sequence. A rough stand-in for vLLM's profiling run."""
    per_token = (4 * model.hidden_size + 2 * model.intermediate_size) * dtype_bytes(dtype)
    return max_num_batched_tokens * per_token + max_num_seqs * model.vocab_size * 4


@dataclass(frozen=True)
class KVPool:
    kv_bytes_per_token: int
    weight_bytes: int
    activation_reserve_bytes: int
    pool_bytes: int
    block_size: int
    num_blocks: int

    @property
    def max_live_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens that fit at once."""
        blocks_per_seq = -(-seq_len // self.block_size)
        return self.num_blocks // blocks_per_seq

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_live_tokens"] = self.max_live_tokens
        return out


def plan_kv_pool(model: ModelSpec, dtype: str, block_size: int, *,
                 hardware: HardwareSpec | None = None, gpu_memory_gib: float | None = None,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                 activation_reserve_gib: float | None = None, kv_pool_gib: float | None = None,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 num_blocks: int | None = None, kv_dtype: str | None = None,
                 check_fits: bool = True) -> KVPool:
    """The KV pool of one replica (all ``tensor_parallel_size`` devices together).
    ``num_blocks`` gives the pool as a block count (vLLM's --num-gpu-blocks-override): no
    memory arithmetic, the rest is reported alongside. ``kv_dtype`` is the KV cache's dtype
    when it is not the weights' (fp8). A pool given outright (``num_blocks``,
    ``kv_pool_gib``) must fit beside the weights and the activation reserve in the devices'
    memory (``gpu_memory_gib``, else the hardware preset's; not checked with neither, or
    with ``check_fits`` False: a recording's pool, which ran on whatever machine it ran on)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise CapacityError(f"gpu_memory_utilization must be in (0, 1], "
                            f"got {gpu_memory_utilization}")
    if tensor_parallel_size < 1:
        raise CapacityError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    tp = tensor_parallel_size
    per_token = kv_bytes_per_token(model, kv_dtype or dtype, tp)
    weights = weight_bytes(model, dtype)
    if activation_reserve_gib is not None:
        if activation_reserve_gib < 0:
            raise CapacityError("activation_reserve_gib must be >= 0")
        reserve = int(activation_reserve_gib * GiB)
    else:
        reserve = activation_reserve_bytes(model, dtype, max_num_batched_tokens, max_num_seqs)
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise CapacityError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
        memory: float | None = gpu_memory_gib * GiB
        device = f"--gpu-memory-gib {gpu_memory_gib:g}"
    elif hardware is not None:
        memory = hardware.memory_bytes
        device = f"the {hardware.name} preset's {memory / GiB:.2f} GiB"
    else:
        memory, device = None, ""
    if num_blocks is not None or kv_pool_gib is not None:
        if num_blocks is not None:
            if num_blocks < 1:
                raise CapacityError(f"num_blocks must be >= 1, got {num_blocks}")
            pool = num_blocks * block_size * per_token
        else:
            if kv_pool_gib <= 0:
                raise CapacityError(f"kv_pool_gib must be > 0, got {kv_pool_gib}")
            pool = int(kv_pool_gib * GiB)
        if check_fits and memory is not None:
            _check_fits(model, dtype, pool, weights, reserve, tp, memory, device)
        if num_blocks is not None:
            return KVPool(per_token, weights, reserve, pool, block_size, num_blocks)
    else:
        if memory is None:
            raise CapacityError("give a hardware preset, gpu_memory_gib or kv_pool_gib")
        pool = int(memory * gpu_memory_utilization * tp) - weights - reserve * tp
        if pool <= 0:
            raise CapacityError(
                f"{model.name} in {dtype} does not fit: {weights / GiB:.2f} GiB of weights + "
                f"{reserve * tp / GiB:.2f} GiB of activations > "
                f"{memory * gpu_memory_utilization * tp / GiB:.2f} GiB usable")
    num_blocks = pool // (per_token * block_size)
    if num_blocks < 1:
        raise CapacityError(f"the KV pool of {pool} bytes holds no block of {block_size} tokens")
    return KVPool(per_token, weights, reserve, pool, block_size, num_blocks)


def _check_fits(model: ModelSpec, dtype: str, pool: int, weights: int, reserve: int, tp: int,
                memory: float, device: str) -> None:
    """CapacityError where a pool given outright, the weights and the activation reserve
    need more than each device's memory (``device`` says whose: a preset's, or
    --gpu-memory-gib's). The pool and the weights split over the ``tp`` devices, the reserve
    is on each, as the sizing counts them."""
    need = (pool + weights) / tp + reserve
    if need <= memory:
        return
    each = " per device" if tp > 1 else ""
    larger = "a larger --gpu-memory-gib" if device.startswith("--") else \
        "another --hardware (a device no preset describes: --gpu-memory-gib)"
    raise CapacityError(
        f"a KV pool of {pool / tp / GiB:.2f} GiB{each} does not fit in {device}: with "
        f"{weights / tp / GiB:.2f} GiB of {model.name} weights ({dtype}){each} and "
        f"{reserve / GiB:.2f} GiB of activations it needs {need / GiB:.2f} GiB{each}; give a "
        f"smaller pool, a larger --tensor-parallel-size or {larger}")
