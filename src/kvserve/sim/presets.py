"""Model, hardware and dtype presets for the roofline cost model and the capacity planner.

Figures are restated from public sources in our own numbers (cited per entry); efficiency
factors and fixed overheads are our assumptions, not vendor claims. ``cpu-local`` is this
development machine, measured with torch (../shared/WORKLOADS.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 1 << 30


class PresetError(ValueError):
    """An unknown preset name, or a preset combination that does not exist."""


MODEL_SHAPE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder: enough to count FLOPs, weight and KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    # The longest sequence it was trained for (its config's max_position_embeddings): vLLM
    # refuses a longer --max-model-len, and so do the simulator and the planner.
    max_context: int | None = None

    def shape(self) -> dict[str, int]:
        """What its step times depend on, under the names of the engine's ModelConfig (a
        calibration file records the shape it was fitted on in ``meta.model_shape``)."""
        return {name: getattr(self, name) for name in MODEL_SHAPE}

    @property
    def params_per_layer(self) -> int:
        """Attention projections (q, k, v, o), the gated MLP (gate, up, down), two norms."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return attention + mlp + 2 * h

    @property
    def num_params(self) -> int:
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embedding
        return self.num_layers * self.params_per_layer + embedding + lm_head + self.hidden_size

    @property
    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies through (layers only; the LM head runs per
        sampled token, the embedding is a lookup)."""
        return self.num_layers * (self.params_per_layer - 2 * self.hidden_size)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_elements_per_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V, every layer, every KV head, summed over the devices of one replica.

        Tensor parallelism splits the KV heads; with more devices than KV heads each device
        keeps a copy of one head (as vLLM does), so the replica stores more than one copy."""
        tp = tensor_parallel_size
        heads_per_device = -(-self.num_kv_heads // tp)
        return 2 * self.num_layers * heads_per_device * tp * self.head_dim


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: dense peak FLOP/s per dtype, memory, and our efficiency guesses."""

    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (no structured sparsity)
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    interconnect_bandwidth: float  # bytes/s per direction between devices, for TP all-reduce
    # bytes/s per direction between device memory and host memory (the host KV tier's link:
    # what one swap-out or swap-in of KV blocks moves at)
    host_link_bandwidth: float
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s in matmuls
    memory_efficiency: float = 0.8  # achieved fraction of peak bandwidth
    step_overhead_s: float = 0.003  # scheduling, input preparation, kernel launches
    allreduce_latency_s: float = 10e-6

    def flops_for(self, dtype: str) -> float:
        """fp8 on a part without fp8 tensor cores computes in bf16 (weight-only fp8)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops["bf16"]


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# The command line speaks vLLM: --dtype in its spellings (``auto`` is the presets' own
# checkpoint dtype, bf16), and fp8 only as --kv-cache-dtype (docs/dtype.md); the short names
# the reports print are taken too (QA: copied from a table, refused).
WEIGHT_DTYPES = {"auto": "bf16", "half": "fp16", "float16": "fp16", "bfloat16": "bf16",
                 "float": "fp32", "float32": "fp32", "bf16": "bf16", "fp16": "fp16",
                 "fp32": "fp32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# Public model configs (Hugging Face config.json of each model; max_context is its
# max_position_embeddings).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # meta-llama/Llama-3.1-8B: 32 layers, 4096 hidden, 32/8 heads, 14336 MLP, 128256 vocab.
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, max_context=131072),
        # meta-llama/Llama-3.1-70B: 80 layers, 8192 hidden, 64/8 heads, 28672 MLP.
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, max_context=131072),
        # Qwen/Qwen2.5-7B: 28 layers, 3584 hidden, 28/4 heads, 18944 MLP, 152064 vocab
        # (its q/k/v biases are a rounding error here and are left out).
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, max_context=131072),
        # mistralai/Mistral-7B-v0.3: 32 layers, 4096 hidden, 32/8 heads, 14336 MLP, 32768 vocab.
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, max_context=32768),
        # HuggingFaceTB/SmolLM2-135M-Instruct: 30 layers, 576 hidden, 9/3 heads of 64,
        # 1536 MLP, 49152 vocab, tied embeddings (docs/architecture.md, "The default model").
        ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True,
                  max_context=8192),
    )
}

_T = 1e12
# NVIDIA datasheets (dense figures, i.e. half the "with sparsity" numbers). Memory is not the
# datasheet's decimal "80 GB" but the total CUDA reports for the part
# (torch.cuda.mem_get_info()[1], the "total capacity" of torch's out-of-memory message): the
# figure vLLM's --gpu-memory-utilization is a fraction of. It is about 0.5 GiB below
# nvidia-smi's total (the driver's reservation), e.g. H100 SXM 81,559 MiB in nvidia-smi,
# 79.2 GiB in CUDA.
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        # H100 SXM5 80GB: BF16/FP16 989 TFLOP/s, FP8 1979, TF32 495; HBM3 3.35 TB/s;
        # NVLink 4 900 GB/s total (450 per direction); host link PCIe Gen5 x16, 64 GB/s
        # per direction (32 GT/s x 16 lanes, before protocol overhead). Memory: nvidia-smi
        # 81,559 MiB, CUDA 79.2 GiB.
        HardwareSpec("h100-sxm", {"fp32": 495 * _T, "bf16": 989 * _T, "fp16": 989 * _T,
                                  "fp8": 1979 * _T}, 3.35e12, int(79.2 * GiB), 450e9, 64e9),
        # H200 SXM: H100's compute; HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 x16.
        # Memory: nvidia-smi 143,771 MiB, CUDA 139.8 GiB.
        HardwareSpec("h200", {"fp32": 495 * _T, "bf16": 989 * _T, "fp16": 989 * _T,
                              "fp8": 1979 * _T}, 4.8e12, int(139.8 * GiB), 450e9, 64e9),
        # A100 SXM 80GB: BF16/FP16 312 TFLOP/s, TF32 156, no FP8; HBM2e 2.039 TB/s;
        # NVLink 3 600 GB/s total; host link PCIe Gen4 x16, 32 GB/s per direction. Memory:
        # nvidia-smi 81,920 MiB, CUDA 79.2 GiB.
        HardwareSpec("a100-80gb", {"fp32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
                     2.039e12, int(79.2 * GiB), 300e9, 32e9),
        # L4: BF16/FP16 121 TFLOP/s, FP8 242.5, TF32 60; GDDR6 24 GB at 300 GB/s; PCIe 4 x16
        # (32 GB/s per direction: both its device-to-device and its host link). Memory:
        # nvidia-smi 23,034 MiB, CUDA 22.0 GiB.
        HardwareSpec("l4", {"fp32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T,
                            "fp8": 242.5 * _T}, 300e9, int(22.0 * GiB), 32e9, 32e9),
        # This machine (2 cores, torch 2.13 CPU), measured by benchmarks/machine_peaks.py
        # (docs/fidelity.md, "This machine"): matmul bf16 408 GFLOP/s, fp32 190 (fp16
        # unmeasured: taken as fp32), copy bandwidth 48.6 GB/s; 24 GiB RAM. The figures are
        # achieved rates, so efficiency is 1.0 and no overhead is added: the plain roofline,
        # whose error against the engine docs/fidelity.md shows beside the calibrated model.
        # The host tier is the same RAM, so its "link" is the copy bandwidth.
        HardwareSpec("cpu-local", {"fp32": 190e9, "bf16": 408e9, "fp16": 190e9}, 48.6e9,
                     24 * GiB, 48.6e9, 48.6e9, compute_efficiency=1.0, memory_efficiency=1.0,
                     step_overhead_s=0.0),
        # GH200 Grace Hopper (96 GB): H100's compute; HBM3 96 GB at 4.0 TB/s; NVLink 4 to
        # other GPUs, 450 GB/s per direction; the host (Grace's LPDDR5X) over NVLink-C2C,
        # 900 GB/s total, 450 per direction: the link where a host KV tier is cheapest.
        # Memory (the GPU's HBM only): nvidia-smi 97,871 MiB, CUDA 95.0 GiB.
        HardwareSpec("gh200", {"fp32": 495 * _T, "bf16": 989 * _T, "fp16": 989 * _T,
                               "fp8": 1979 * _T}, 4.0e12, int(95.0 * GiB), 450e9, 450e9),
    )
}


# The word CUDA's name for each preset's GPU carries (torch.cuda.get_device_name: "NVIDIA H100
# 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"): a calibration file names its device so.
CUDA_NAMES = {"h100-sxm": "H100", "h200": "H200", "a100-80gb": "A100", "l4": "L4",
              "gh200": "GH200"}


def model_preset_for(name: str) -> str | None:
    """The model preset a model's name describes (``SmolLM2-135M-Instruct`` or
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` -> ``smollm2-135m``: the preset's name, its size
    included, begins the model's), or None when no preset names it."""
    base = name.rsplit("/", 1)[-1].lower()
    matches = [preset for preset in MODELS if base.startswith(preset)]
    return max(matches, key=len) if matches else None


def hardware_preset_for(device: str) -> str | None:
    """The hardware preset of a device as the engine names it: ``cpu`` (``cpu-local``), or
    a GPU's CUDA name, index and all ("NVIDIA H200 (cuda:0)" -> ``h200``); None when no
    preset describes it."""
    if device == "cpu":
        return "cpu-local"
    words = set(re.split(r"[^A-Z0-9]+", device.upper()))
    return next((preset for preset, word in CUDA_NAMES.items() if word in words), None)


def _lookup(kind: str, table: dict, name: str):  # type: ignore[no-untyped-def]
    try:
        return table[name]
    except KeyError:
        raise PresetError(f"unknown {kind} {name!r}; known: {', '.join(table)}") from None


def get_model(name: str) -> ModelSpec:
    return _lookup("model", MODELS, name)


def get_hardware(name: str) -> HardwareSpec:
    return _lookup("hardware", HARDWARE, name)


def dtype_bytes(dtype: str) -> int:
    return _lookup("dtype", DTYPE_BYTES, dtype)


def weights_dtype(spelling: str) -> str:
    """``--dtype`` (vLLM's spellings) -> the presets' dtype name."""
    if spelling.startswith("fp8"):
        raise PresetError(f"--dtype {spelling}: fp8 is a KV cache dtype here; give "
                          f"--kv-cache-dtype {spelling}")
    return _lookup("dtype", WEIGHT_DTYPES, spelling)


def kv_dtype(weights: str, kv_cache_dtype: str) -> str:
    """The presets' dtype name of the KV cache: the weights' (``auto``) or fp8."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PresetError(f"unknown kv cache dtype {kv_cache_dtype!r}; known: "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    return weights if kv_cache_dtype == "auto" else "fp8"
