"""KV-cache capacity arithmetic, shared by ``kvserve simulate`` (to size the pool) and
``kvserve plan``.

    kv_bytes_per_token = 2 (K and V) x layers x KV heads x head_dim x dtype bytes
                         (x tp / KV heads when tp > KV heads: heads are replicated)
    pool   = gpu_memory x utilization x tp - weights - activation reserve x tp
             (or given directly)
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
                 num_blocks: int | None = None, kv_dtype: str | None = None) -> KVPool:
    """The KV pool of one replica (all ``tensor_parallel_size`` devices together).
    ``num_blocks`` gives the pool as a block count (vLLM's --num-gpu-blocks-override): no
    memory arithmetic, the rest is reported alongside. ``kv_dtype`` is the KV cache's dtype
    when it is not the weights' (fp8)."""
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
    if num_blocks is not None:
        if num_blocks < 1:
            raise CapacityError(f"num_blocks must be >= 1, got {num_blocks}")
        return KVPool(per_token, weights, reserve, num_blocks * block_size * per_token,
                      block_size, num_blocks)
    if kv_pool_gib is not None:
        if kv_pool_gib <= 0:
            raise CapacityError(f"kv_pool_gib must be > 0, got {kv_pool_gib}")
        pool = int(kv_pool_gib * GiB)
    else:
        if gpu_memory_gib is not None:
            if gpu_memory_gib <= 0:
                raise CapacityError(f"gpu_memory_gib must be > 0, got {gpu_memory_gib}")
            memory = gpu_memory_gib * GiB
        elif hardware is not None:
            memory = hardware.memory_bytes
        else:
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
