"""``kvserve info``: the CPU, its instruction sets, and the kernel each op of the model uses."""

from __future__ import annotations

import argparse
import json
from typing import Any

DESCRIPTION = ("Show this machine's CPU model and instruction sets, whether the C++ kernels "
               "are built (building them on first use), what --dtype auto loads a 16-bit or "
               "quantized checkpoint in here, what --device auto runs on, and the kernel each "
               "op of the model runs in float32 and in bfloat16.")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("info", description=DESCRIPTION,
                                   help="show the CPU, its ISA flags and the kernel each op uses")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.flags import CLIError, configure_logging
    from kvserve.model.kernel_info import describe_quantization, kernel_report
    from kvserve.model.quantization import QUANTIZATIONS, unavailable_reason

    # the first run on a machine builds the kernels: minutes, said on stderr (QA: silent)
    configure_logging("%(levelname)s %(name)s: %(message)s")
    try:
        report = kernel_report().as_dict()
    except ValueError as error:  # KVSERVE_PROJECTIONS or _PREFILL_ATTENTION asks for too much
        raise CLIError(str(error)) from None
    refusals = [ops["refused"] for ops in report["ops"].values() if "refused" in ops]
    if len(refusals) == len(report["ops"]):  # no dtype can run what was asked
        raise CLIError(refusals[0])
    report["quantization"] = {name: unavailable_reason(name) or describe_quantization(name)
                              for name in QUANTIZATIONS}
    report["dtype_auto"] = dtype_auto()
    report["device_auto"] = device_auto()
    print(json.dumps(report, indent=1) if args.json else text(report))
    return 0


def dtype_auto() -> dict[str, str]:
    """What ``--dtype auto`` loads a 16-bit (or quantized) checkpoint in here, such as the
    bundled model, and why (docs/dtype.md); a float32 checkpoint stays float32."""
    from kvserve.model.dtype import resolve_dtype

    dtype, why = resolve_dtype("auto", "16-bit or quantized")
    return {"dtype": str(dtype).removeprefix("torch."), "why": why}


def device_auto() -> dict[str, str]:
    """What ``--device auto`` runs on here, and why (docs/device.md)."""
    from kvserve.model.device import resolve_device

    device, why = resolve_device("auto")
    return {"device": str(device), "why": why}


def text(report: dict[str, Any]) -> str:
    """The report as aligned text, one fact a line."""
    cpu, torch_info, extension = report["cpu"], report["torch"], report["extension"]
    found = [flag for flag, present in cpu["isa"].items() if present]
    missing = [flag for flag, present in cpu["isa"].items() if not present]
    if extension["built"]:
        built = "built, compiled for " + (" ".join(extension["compiled_isa"]) or "baseline")
    else:
        built = f"not built: {extension['error']}"
    lines = [f"CPU          {cpu['name']} ({cpu['logical_cpus']} logical CPUs)",
             f"ISA found    {' '.join(found) or '-'}",
             f"not found    {' '.join(missing) or '-'}",
             f"torch        {torch_info['version']}, ATen CPU capability "
             f"{torch_info['aten_cpu_capability']}, {torch_info['threads']} threads, oneDNN "
             f"bf16: {'yes' if torch_info['onednn_bf16'] else 'no'}",
             f"C++ kernels  {built}",
             "AMX          where the CPU has the tiles and Linux grants them: bf16 "
             "projections of up to 512 rows and bf16 prefill attention on kvserve's own "
             "AMX-BF16 tiles (larger projections on oneDNN's), --quantization int8 on "
             "AMX-INT8 tiles"]
    lines += [f"{'quantization':<13}{kernel}" for kernel in report.get("quantization", {}).values()]
    if "dtype_auto" in report:
        auto = report["dtype_auto"]
        lines.append(f"dtype auto   {auto['dtype']} ({auto['why'].removeprefix('auto: ')}; a "
                     "float32 checkpoint stays float32)")
    if "device_auto" in report:
        auto = report["device_auto"]
        lines.append(f"device auto  {auto['device']} ({auto['why'].removeprefix('auto: ')}; "
                     "the kernels below are the CPU's)")
    for dtype, ops in report["ops"].items():
        lines += ["", f"{dtype}:"]
        lines += [f"  {op:<14} {kernel}" for op, kernel in ops.items()]
    return "\n".join(lines)
