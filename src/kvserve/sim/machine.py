"""Which CPU this is, and its measured peaks: what makes a calibration or the ``cpu-local``
roofline belong to one machine.

A calibration's step times and a roofline's peaks describe the CPU they were measured on.
``kvserve calibrate`` records :func:`cpu_identity` in its file's ``meta.cpu``, and the
simulator warns when a calibration made on another CPU prices this run
(:func:`calibration_cpu_warning`). ``--hardware cpu-local`` prices steps with this machine's
own matmul rate and copy bandwidth (:func:`local_hardware`), measured once per CPU by
:mod:`kvserve.engine.machine_peaks` (torch, in a child process: the simulator itself does not
import torch) and cached under ``$KVSERVE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/kvserve`` or ``~/.cache/kvserve``) as ``machine-peaks/<cpu key>.json``.

Two CPUs are the same when their model name and their instruction-set extensions that
change matmul speed (:data:`ISA_FLAGS`) are the same; the core count is recorded too, since
the peaks are measured with every core.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvserve.cpu_name import read_cpuinfo, with_generation
from kvserve.flags import write_file_atomically
from kvserve.sim.presets import GiB, HardwareSpec, get_hardware

# Extensions a CPU matmul or copy kernel dispatches on (x86 and Arm spellings of
# /proc/cpuinfo): two CPUs that differ here run the same step at different speeds.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "asimddp", "bf16", "i8mm", "sve", "sve2", "sme")
PEAKS_FORMAT = "kvserve-machine-peaks/1"


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model and its :data:`ISA_FLAGS` from /proc/cpuinfo's text (the first
    processor's entry; x86 says ``model name`` and ``flags``, Arm ``Features``), and on x86
    its ``family``: a bare "AMD EPYC" with AVX512-BF16 is a Zen 4 (25) or a Zen 5 (26), whose
    extensions this list does not tell apart."""
    cpu = read_cpuinfo(text)
    identity: dict[str, Any] = {"model": cpu.model,
                                "isa": [flag for flag in ISA_FLAGS if flag in cpu.flags]}
    if cpu.family is not None:
        identity["family"] = cpu.family
    if cpu.model_number is not None:
        identity["model_number"] = cpu.model_number
    return identity


def cpu_identity() -> dict[str, Any]:
    """This machine's CPU: ``{"model", "isa", "logical_cpus"}``."""
    try:
        identity = parse_cpuinfo(Path("/proc/cpuinfo").read_text(encoding="utf-8",
                                                                  errors="replace"))
    except OSError:  # not Linux: the platform's own name, no extension list
        identity = {"model": "", "isa": []}
    if not identity["model"]:
        identity["model"] = platform.processor() or platform.machine() or "unknown"
    return {**identity, "logical_cpus": os.cpu_count() or 1}


def describe_cpu(identity: dict[str, Any]) -> str:
    isa = ", ".join(identity.get("isa") or []) or "no extensions listed"
    name = with_generation(identity.get("model", "unknown"), identity.get("family"),
                           identity.get("isa") or [], identity.get("model_number"))
    return f"{name} ({isa}; {identity.get('logical_cpus', '?')} CPUs)"


def same_cpu(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same model, extensions and (where both say it: a calibration from before it was
    recorded does not) x86 family and model number."""
    return a.get("model") == b.get("model") and \
        sorted(a.get("isa") or []) == sorted(b.get("isa") or []) and \
        all(key not in a or key not in b or a[key] == b[key]
            for key in ("family", "model_number"))


def cpu_key(identity: dict[str, Any]) -> str:
    """A file name for this CPU: its model, readable, and a hash of everything that
    identifies it."""
    slug = re.sub(r"[^a-z0-9]+", "-", str(identity.get("model", "")).lower()).strip("-")
    digest = hashlib.sha256(json.dumps(
        [identity.get("model"), sorted(identity.get("isa") or []),
         identity.get("logical_cpus"), identity.get("family")]).encode()).hexdigest()[:12]
    return f"{slug[:40] or 'cpu'}-{digest}"


def cache_dir() -> Path:
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve"


def peaks_path(identity: dict[str, Any]) -> Path:
    return cache_dir() / "machine-peaks" / f"{cpu_key(identity)}.json"


def measure_in_child() -> dict[str, Any]:
    """This machine's peaks, measured by :mod:`kvserve.engine.machine_peaks` in a child
    process (it needs torch, which the simulator does not import)."""
    command = [sys.executable, "-m", "kvserve.engine.machine_peaks", "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise ValueError(f"--hardware cpu-local: cannot measure this machine's peaks: "
                         f"{error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError("--hardware cpu-local measures this machine's peaks with torch "
                         f"(pip install 'kvserve[engine]'), and the measurement failed: {last}")
    return json.loads(done.stdout)


def local_peaks(measure: Callable[[], dict[str, Any]] = measure_in_child
                ) -> dict[str, Any]:
    """This CPU's measured peaks: from the cache, or measured now and cached."""
    identity = cpu_identity()
    path = peaks_path(identity)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") == PEAKS_FORMAT and same_cpu(data.get("cpu", {}), identity):
            return data
    except (OSError, json.JSONDecodeError):
        pass  # none yet (or unreadable): measure
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = f"; the load average is {load:.1f}, so the figures will be low" if \
        load is not None and load > 0.5 * (os.cpu_count() or 1) else ""
    print(f"--hardware cpu-local: measuring this machine's matmul and copy peaks (about 10 s, "
          f"once per CPU), cached in {path}{busy}; delete that file to measure again on a "
          "quiet machine", file=sys.stderr)
    data = {"format": PEAKS_FORMAT, "cpu": identity, **measure()}
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: two simulations measuring at once both read a whole file
    write_file_atomically(path, json.dumps(data, indent=1) + "\n")
    return data


def local_hardware(measure: Callable[[], dict[str, Any]] = measure_in_child) -> HardwareSpec:
    """The ``cpu-local`` preset with this machine's measured figures: bf16 and fp32 matmul
    FLOP/s and copy bandwidth (fp16 taken as fp32, as in the preset), its RAM, efficiency
    1.0 and no fixed overhead (the plain roofline)."""
    peaks = local_peaks(measure)
    flops = {"fp32": float(peaks["fp32_flops"]), "bf16": float(peaks["bf16_flops"]),
             "fp16": float(peaks["fp32_flops"])}
    bandwidth = float(peaks["memory_bandwidth"])
    memory = int(peaks.get("memory_bytes") or 24 * GiB)
    return replace(get_hardware("cpu-local"), peak_flops=flops, memory_bandwidth=bandwidth,
                   memory_bytes=memory, interconnect_bandwidth=bandwidth,
                   host_link_bandwidth=bandwidth)


def calibration_cpu_warning(path: str | Path) -> str | None:
    """A one-line warning when the calibration file at ``path`` was measured on another
    CPU than this one (``meta.cpu``, written by ``kvserve calibrate``); None when it is this
    CPU or the file does not say (files from before the CPU was recorded)."""
    from kvserve.sim.calibration import calibration_meta

    meta = calibration_meta(path) or {}  # (a bad file: the cost model's loading says so)
    recorded, device = meta.get("cpu"), meta.get("device")
    if isinstance(device, str) and not device.startswith("cpu"):
        return None  # a GPU's step times: not this CPU's to compare (the calibration pass;
        # the device check names a device that differs)
    isa = recorded.get("isa") if isinstance(recorded, dict) else None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("model"), str) or \
            not isinstance(isa or [], list) or not all(isinstance(f, str) for f in isa or ()):
        return None  # a meta.cpu of other shapes (edited by hand) says nothing (the
        # calibration pass: a traceback)
    here = cpu_identity()
    if same_cpu(recorded, here):
        return None
    return (f"warning: {path} was calibrated on {describe_cpu(recorded)}; this machine is "
            f"{describe_cpu(here)}: its step times describe the other CPU")
