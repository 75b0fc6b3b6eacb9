"""``--device``: where the model's weights, its KV cache and each step's tensors live
(docs/device.md).

``cpu`` runs kvserve's own kernels (C++ paged attention, packed projections; docs/kernels.md).
``cuda`` (or ``cuda:N``) runs the same model in plain torch ops on an NVIDIA GPU: cuBLAS
projections, attention by scaled_dot_product_attention over the blocks each request's table
names, sampling on the device. ``auto`` (the default) is ``cuda`` where this torch sees a
CUDA device, else ``cpu``. The scheduler, the server and everything above the Executor seam
are the same on both.
"""

from __future__ import annotations

import os

import torch

from kvserve.flags import DEVICES, is_device_name


def resolve_device(name: str | torch.device) -> tuple[torch.device, str]:
    """The torch device for ``--device name`` and why; ValueError naming what is wrong
    (an unknown name, or a CUDA device this torch does not see)."""
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device must be a name such as 'cpu' or 'cuda', got {name!r}")
    if not is_device_name(name):
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} "
                         "(or cuda:N)")
    kind, _, index = name.partition(":")
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "auto: this torch sees a CUDA device"
        return torch.device("cpu"), "auto: no CUDA device (a CPU build of torch, or no GPU)"
    if kind == "cpu":
        return torch.device("cpu"), "--device cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA "
                         "device (a CPU build, or no GPU); give --device cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device(name), f"--device {name}"


def replica_gpus(num_replicas: int, name: str) -> list[str] | None:
    """Each local data-parallel replica's GPU (its ``CUDA_VISIBLE_DEVICES``, so it sees one
    as ``cuda``), as vLLM gives each data-parallel rank its own: None where the replicas run
    on the CPU, or where ``name`` names one device (``cuda:0``: all share it). ValueError
    where there are fewer GPUs than replicas."""
    if num_replicas < 2 or name not in ("cuda", "auto") or not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [gpu.strip() for gpu in visible.split(",") if gpu.strip()] if visible else \
        [str(index) for index in range(torch.cuda.device_count())]
    if len(gpus) < num_replicas:
        raise ValueError(f"--data-parallel-size {num_replicas} on --device {name} gives each "
                         f"replica a GPU of its own, and this machine has {len(gpus)}; give "
                         "--device cuda:0 to run every replica on one GPU")
    return gpus[:num_replicas]


def check_device_options(device: torch.device, batch_invariant: bool = False,
                         quantization: str | None = None) -> None:
    """ValueError where an option needs kvserve's CPU kernels and ``device`` is not the CPU."""
    if device.type == "cpu":
        return
    if batch_invariant:
        raise ValueError(f"--batch-invariant needs the CPU kernels (docs/tenants.md); it does "
                         f"not run on --device {device.type}")
    if quantization is not None:
        raise ValueError(f"--quantization {quantization} runs on the CPU kernels "
                         f"(docs/quantization.md); not on --device {device.type}")


def describe(device: torch.device) -> str:
    """One boot-log line on a non-CPU device: its name, torch's version and what runs there."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return (f"device {device}: {name}, torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}); projections by torch (cuBLAS), attention by "
            "scaled_dot_product_attention over gathered KV blocks, sampling on the device")
