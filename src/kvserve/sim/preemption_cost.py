"""The economics of one preemption victim: swap its KV to host memory and back, or drop it
and recompute (``kvserve plan --preemption-cost``; docs/preemption.md works an example).

For a victim of S tokens on a model of N parameters, L layers and model dimension d::

    bytes_per_token     = 2 (K, V) x L x KV heads x head_dim x dtype bytes (whole replica)
    swap_one_way_s      = S x bytes_per_token / link bandwidth
    swap_round_trip_s   = 2 x swap_one_way_s               (out now, back in on resume)
    F                   = 2 N S + 2 L S^2 d                (prefill FLOPs, causal attention)
    recompute_cold_s    = F / achieved prefill FLOP/s      (nothing survives in the cache)
    swap_advantage      = recompute_cold_s / swap_round_trip_s
    crossover_prefill   = S / swap_round_trip_s            (tokens/s at which they tie)
    survival_threshold  = max(0, 1 - 1 / swap_advantage)

If a fraction f of the victim's sequence survives as a reusable cached prefix, recompute
costs about (1 - f) x recompute_cold_s; it beats the round trip once f exceeds the survival
threshold. With tensor parallelism each device moves its share over its own link and
computes its share of F, so both the link and the FLOP/s scale with the device count.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from kvserve.sim.capacity import kv_bytes_per_token
from kvserve.sim.presets import get_hardware, get_model

# The achieved fraction of peak FLOP/s assumed for a long prefill when --prefill-flops is not
# given: large-batch prefill on Hopper-class parts commonly reaches 35-50% MFU; 0.4 is the
# middle (and puts H100 bf16 at 396 TFLOP/s, near the 400e12 example).
DEFAULT_PREFILL_MFU = 0.4


@dataclass(frozen=True)
class PreemptionCost:
    model: str
    hardware: str
    dtype: str
    tensor_parallel_size: int
    seq_len: int
    link_bandwidth: float  # bytes/s per direction per device
    link_bandwidth_source: str
    prefill_flops: float  # achieved FLOP/s per device
    prefill_flops_source: str
    prefill_flop_count: float  # F for the whole sequence
    bytes_per_token: int
    swap_one_way_s: float
    swap_round_trip_s: float
    recompute_cold_s: float
    swap_advantage: float
    crossover_prefill_tok_s: float
    survival_threshold: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def prefill_flop_count(num_params: int, num_layers: int, hidden_size: int,
                       seq_len: int) -> float:
    """F = 2 N S + 2 L S^2 d: the weight matmuls, plus QK^T and AV over the causal half."""
    return 2.0 * num_params * seq_len + 2.0 * num_layers * seq_len * seq_len * hidden_size


def preemption_cost(model: str, seq_len: int, *, hardware: str = "h100-sxm",
                    dtype: str = "bf16", tensor_parallel_size: int = 1,
                    link_bandwidth: float | None = None,
                    prefill_flops: float | None = None,
                    kv_dtype: str | None = None) -> PreemptionCost:
    """One victim of ``seq_len`` tokens; ``link_bandwidth`` (bytes/s per direction) and
    ``prefill_flops`` (achieved FLOP/s) default to the hardware preset's host link and
    :data:`DEFAULT_PREFILL_MFU` of its peak; ``kv_dtype`` (default: ``dtype``) sizes the KV
    that is swapped. Raises ValueError on bad input."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    for name, value in (("link-bandwidth", link_bandwidth), ("prefill-flops", prefill_flops)):
        if value is not None and not value > 0:
            raise ValueError(f"--{name} must be > 0, got {value:g}")
    spec, device = get_model(model), get_hardware(hardware)
    per_token = kv_bytes_per_token(spec, kv_dtype or dtype, tensor_parallel_size)
    if link_bandwidth is None:
        link_bandwidth, link_source = device.host_link_bandwidth, f"{hardware} preset"
    else:
        link_source = "--link-bandwidth"
    if prefill_flops is None:
        prefill_flops = device.flops_for(dtype) * DEFAULT_PREFILL_MFU
        flops_source = f"{DEFAULT_PREFILL_MFU:.0%} MFU of {hardware} {dtype} peak"
    else:
        flops_source = "--prefill-flops"
    tp = tensor_parallel_size
    one_way = seq_len * per_token / (link_bandwidth * tp)
    flops = prefill_flop_count(spec.num_params, spec.num_layers, spec.hidden_size, seq_len)
    cold = flops / (prefill_flops * tp)
    advantage = cold / (2 * one_way)
    return PreemptionCost(
        model=model, hardware=hardware, dtype=dtype, tensor_parallel_size=tp,
        seq_len=seq_len, link_bandwidth=link_bandwidth, link_bandwidth_source=link_source,
        prefill_flops=prefill_flops, prefill_flops_source=flops_source,
        prefill_flop_count=flops, bytes_per_token=per_token, swap_one_way_s=one_way,
        swap_round_trip_s=2 * one_way, recompute_cold_s=cold, swap_advantage=advantage,
        crossover_prefill_tok_s=seq_len / (2 * one_way),
        survival_threshold=max(0.0, 1.0 - 1.0 / advantage))


def parse_bandwidth(text: str) -> float:
    """'64GB/s', '25 GiB/s', '6.4e10' -> bytes per second."""
    from kvserve.flags import parse_bytes

    raw = str(text).strip()
    body = raw[:-2] if raw.lower().endswith("/s") else raw
    if re.search(r"[kKmMgGtTpP]i?b$", body):  # QA: 64Gb/s was read as 64 GB/s, 8x off
        raise ValueError(f"--link-bandwidth {raw!r}: a lowercase b is bits; write the "
                         "rate in bytes, e.g. 8GB/s for 64Gb/s")
    try:
        value = float(body)
    except ValueError:
        try:
            value = float(parse_bytes(body))
        except Exception:  # argparse.ArgumentTypeError
            raise ValueError(f"--link-bandwidth {raw!r} is not a rate like 64GB/s or "
                             "6.4e10") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"--link-bandwidth must be a finite rate > 0, got {raw!r}")
    if value < 1e6:  # no host link is this slow: a unit left out (10 meant 10GB/s)
        raise ValueError(f"--link-bandwidth {raw!r} is {value:g} bytes/s; write the unit, "
                         "e.g. 64GB/s")
    return value
