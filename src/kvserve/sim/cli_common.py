"""Pieces shared by the sim subcommands: deployment flags and error mapping."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from kvserve.flags import CLIError

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_HARDWARE = "h100-sxm"


RECORDED_COST_MODEL = ("replay of its step times, or, with any scheduler or cache flag "
                       "given, calibrated: fitted on its steps")


def seed(text: str) -> int:
    """A simulation's seed: an integer >= 0, as ``workload gen`` takes it (numpy's
    generators take no negative seed), so one seed names one trace and its run."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_deployment_flags(parser: argparse.ArgumentParser, *, cost_model: bool = True,
                         recordings: bool = False,
                         recorded_cost_model: str = RECORDED_COST_MODEL) -> None:
    """The deployment flags; ``recordings``: the command takes a recording, whose model and
    step times (``recorded_cost_model`` says how) are the defaults."""
    from kvserve.sim.presets import HARDWARE, KV_CACHE_DTYPES, MODELS, WEIGHT_DTYPES

    group = parser.add_argument_group("deployment")
    group.add_argument("--model", default=None if recordings else DEFAULT_MODEL,
                       help=f"model preset: {', '.join(MODELS)} (default {DEFAULT_MODEL}"
                            + ("; for a recording, the preset of the model it recorded"
                               if recordings else "") + ")")
    group.add_argument("--hardware", default=None,
                       help=f"hardware preset: {', '.join(HARDWARE)} (default h100-sxm; "
                            "cpu-local: this machine's matmul rate and bandwidth, measured "
                            "once per CPU and cached)")
    group.add_argument("--dtype", default="auto",
                       help=f"weights and activations: {', '.join(WEIGHT_DTYPES)} (default "
                            "auto: the presets' own, bfloat16)")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help=f"KV cache: {', '.join(KV_CACHE_DTYPES)} (default auto: as "
                            "--dtype)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="devices one replica's weights and KV are split over (the "
                            "planned GPUs'; the engine here has none)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of device memory for weights, activations and KV")
    if cost_model:
        from kvserve.sim.deployment import COST_MODELS

        group.add_argument("--cost-model", default=None if recordings else "roofline",
                           choices=COST_MODELS,
                           help="how long a step takes (default roofline; for a recording, "
                                f"{recorded_cost_model})" if recordings else None)
        group.add_argument("--calibration", metavar="PATH.json",
                           help="coefficients for --cost-model calibrated (kvserve calibrate); "
                                "implies it")
        group.add_argument("--replay-step-times", metavar="LOG.jsonl",
                           help="replay the step times an engine measured (its step log); "
                                "implies --cost-model replay")


def add_cluster_flags(parser: argparse.ArgumentParser, *, size: bool = True) -> None:
    """The cluster flags; ``size=False`` for `kvserve plan`, which searches the size (and
    has no recording's placement to follow)."""
    from kvserve.core.router import DEFAULT_IMBALANCE_BOUND, ROUTER_POLICIES
    from kvserve.sim.cluster import SIM_ROUTERS

    group = parser.add_argument_group("data parallel (docs/scale-out.md)")
    if size:
        group.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                           help="replicas, each with its own scheduler and KV pool "
                                "(default 1; for a recording, as many as it recorded)")
    group.add_argument("--router", choices=SIM_ROUTERS if size else ROUTER_POLICIES,
                       default=None,
                       help="how arrivals are spread over the replicas (default "
                            "least-loaded" + ("; for a recording of replicas, recorded: "
                                              "each request where the server placed it, "
                                              "or with a setting changed, the server's "
                                              "router" if size else "") + ")")
    group.add_argument("--router-imbalance-bound", type=int, default=None,
                       metavar="SCORE", help="prefix-affinity leaves a replica whose load "
                       "score exceeds the least-loaded one's by more than this "
                       f"(default {DEFAULT_IMBALANCE_BOUND})")
    group.add_argument("--data-parallel-lockstep", action="store_true",
                       help="replicas step together, each step as long as the slowest "
                            "(data-parallel attention with MoE)")
    group.add_argument("--prefill-schedule-interval", type=int, default=1, metavar="K",
                       help="in lockstep, prefills run only every K-th step on ranks that "
                            "have decodes (the DP prefill throttle; default 1: off)")


def cluster_from_args(args: argparse.Namespace,  # type: ignore[no-untyped-def]
                      replicas: int | None = None):
    """The cluster the flags describe, of ``replicas`` replicas where the caller knows them
    (plan of a recording: those recorded), else ``--data-parallel-size``'s."""
    from kvserve.core.router import DEFAULT_IMBALANCE_BOUND
    from kvserve.sim.cluster import ClusterOptions

    size = replicas if replicas is not None else getattr(args, "data_parallel_size", None)
    bound = args.router_imbalance_bound
    alone = (size or 1) == 1 and not getattr(args, "max_replicas", None)
    # plan has no --data-parallel-size: it plans replicas with --max-replicas
    more = "--data-parallel-size N" if hasattr(args, "data_parallel_size") else \
        "--max-replicas M to plan replicas"
    if alone and args.router not in (None, "recorded"):  # QA: silently ignored
        print(f"note: --router {args.router} spreads arrivals over replicas; with one "
              f"replica it changes nothing (give {more})", file=sys.stderr)
    if alone and args.data_parallel_lockstep:  # QA: taken silently
        print("note: --data-parallel-lockstep steps replicas together; with one replica it "
              f"changes nothing (give {more})", file=sys.stderr)
    return ClusterOptions(data_parallel_size=1 if size is None else size,
                          router=args.router or "least-loaded",
                          lockstep=args.data_parallel_lockstep,
                          prefill_schedule_interval=args.prefill_schedule_interval,
                          imbalance_bound=DEFAULT_IMBALANCE_BOUND if bound is None else bound)


def calibration_implies_its_model(args: argparse.Namespace) -> None:
    """``--calibration FILE`` implies ``--cost-model calibrated``, as ``--replay-step-times``
    implies replay; with another cost model named, a ValueError (it used to be ignored).
    Each command calls it first, before it chooses a default cost model."""
    if getattr(args, "calibration", None) is None:
        return
    if args.cost_model not in (None, "calibrated"):
        raise ValueError(f"--calibration gives --cost-model calibrated its coefficients; it "
                         f"cannot be used with --cost-model {args.cost_model}")
    if getattr(args, "replay_step_times", None):  # the calibration pass: taken, unused
        raise ValueError("--calibration gives --cost-model calibrated its coefficients; it "
                         "cannot be used with --replay-step-times (the replay cost model)")
    args.cost_model = "calibrated"


def deployment_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvserve.sim.deployment import Deployment
    from kvserve.sim.machine import calibration_cpu_warning, local_hardware
    from kvserve.sim.presets import weights_dtype

    calibration = getattr(args, "calibration", None)
    warning = calibration_cpu_warning(calibration) if calibration else None
    if warning:
        print(warning, file=sys.stderr)
    recording = getattr(args, "recording", None)
    # A recording's own pool ran on its own machine: the default preset's memory is no limit
    # on it (a --hardware named is).
    check_pool_fits = recording is None or args.hardware is not None
    # cpu-local is this machine: its peaks measured (once per CPU, then cached), not the
    # figures of the machine the preset was written on.
    args.hardware = args.hardware or DEFAULT_HARDWARE
    measured = local_hardware() if args.hardware == "cpu-local" else None
    if args.model is None:
        args.model = recorded_model(recording)
    if calibration:
        from kvserve.sim.calibration import fitted_on_warning, poor_fit_warning
        from kvserve.sim.cost_models import CalibratedCostModel
        from kvserve.sim.presets import get_model

        CalibratedCostModel.load(calibration)  # a bad file is the one line (QA: after a
        # warning on the model it was fitted on), named with its path
        for warning in (fitted_on_warning(calibration, get_model(args.model), args.hardware),
                        poor_fit_warning(calibration)):
            if warning:
                print(warning, file=sys.stderr)
    deployment = Deployment(
        model=args.model, hardware=args.hardware, hardware_spec=measured,
        dtype=weights_dtype(args.dtype), kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cost_model="replay" if getattr(args, "replay_step_times", None)
        else getattr(args, "cost_model", None) or "roofline",
        calibration=calibration, replay_log=getattr(args, "replay_step_times", None),
        recording=recording, check_pool_fits=check_pool_fits)
    if deployment.cost_model == "calibrated" and calibration is None and recording is not None:
        # Fitted here, once: the runs in worker processes get the fit, and a poor fit's
        # warning is said once (it was said again by every run of a plan, QA).
        recording.fitted_cost_model()
    return deployment


def note_recorded_steps_price(args: argparse.Namespace, cost_model: str) -> None:
    """On a recording, --model and --hardware price only what its steps cannot, unless the
    roofline prices the steps: said once (whatif; simulate too, the simulator pass: it said
    nothing, while plan with the same flags plans that deployment)."""
    named = [flag for flag, value in (("--model", args.model), ("--hardware", args.hardware))
             if value]
    if named and cost_model != "roofline":  # docs/recording.md: the recorded steps price
        verb = "price" if len(named) > 1 else "prices"
        print(f"note: {' and '.join(named)} {verb} only what the recorded steps cannot "
              f"(a preemption's recompute against its swap) under the {cost_model} cost "
              "model; give --cost-model roofline to price the steps by them (plan prices "
              "that deployment)", file=sys.stderr)


def recorded_model(recording: Any) -> str:
    """The model preset a run takes without --model: the recorded model's preset, else the
    default (with a warning when the recording names a model no preset describes). On a
    replay the preset prices only what the recorded steps cannot: a preemption's recompute
    against its swap, and the host tier's blocks (docs/recording.md)."""
    if recording is None:
        return DEFAULT_MODEL
    preset = recording.model_preset()
    if preset is None and recording.model:
        print(f"warning: {recording.path.name} recorded model {recording.model!r}, which no "
              f"model preset describes; preemptions are priced as {DEFAULT_MODEL}'s (give "
              "--model)", file=sys.stderr)
    return preset or DEFAULT_MODEL


def simulate_with_progress(deployment: Any, trace: Any, settings: dict[str, Any],
                           label: str, **kwargs: Any) -> Any:
    """``deployment.simulate`` with a progress bar on a terminal once it runs over 1 s."""
    from kvserve.sim.table import Progress

    progress = Progress(len(trace), label)
    try:
        return deployment.simulate(trace, settings, progress=progress, **kwargs)
    finally:
        progress.close()


class ShowProgress:
    """A deployment whose every simulation shows progress, labelled ``label``, else by its
    max_num_seqs."""

    def __init__(self, deployment: Any, label: str | None = None) -> None:
        self.deployment = deployment
        self.label = label

    def simulate(self, trace: Any, settings: dict[str, Any], **kwargs: Any) -> Any:
        label = self.label or f"max_num_seqs={settings.get('max_num_seqs', 'default')}"
        return simulate_with_progress(self.deployment, trace, settings, label, **kwargs)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Bad input (a ValueError from any layer: trace, preset, config, workload) becomes a
    one-line CLIError; bugs (anything else) keep their traceback."""
    try:
        yield
    except CLIError:
        raise
    except ValueError as error:
        raise CLIError(str(error)) from None
    except BrokenPipeError:  # standard output's reader left: kvserve.cli.main's to end
        raise
    except OSError as error:
        # no file name: standard output or a pipe ("error: : No space left on device")
        where = error.filename or "writing the output"
        raise CLIError(f"{where}: {error.strerror or error}") from None
