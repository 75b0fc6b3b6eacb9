"""``kvserve calibrate``: fit the simulator's calibrated cost model to this machine."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvserve.core.config import DEFAULT_BLOCK_SIZE
from kvserve.flags import (
    CLIError,
    add_command,
    add_model_flags,
    check_output_file,
    engine_args,
    parse_bytes,
    resolve_model_option,
    write_file_atomically,
)
from kvserve.sim.machine import cpu_identity, describe_cpu

SUMMARY = "measure step times on this machine and fit a cost model"
DESCRIPTION = ("Run the engine over a grid of step shapes (prefill chunks, decode "
               "batches at several context lengths, mixed steps, on scattered KV "
               "blocks), take the median of repeated runs, and fit the simulator's "
               "calibrated cost model (kvserve simulate --cost-model calibrated "
               "--calibration FILE). With --trace, run that trace on the engine instead "
               "and fit on the steps it ran (calibration in service).")


def add_parser(subparsers: Any) -> None:
    parser = add_command(subparsers, "calibrate", run, SUMMARY, DESCRIPTION)
    add_model_flags(parser)
    parser.add_argument("--output", "-o", default="cost-model.json", metavar="PATH.json",
                        help="where the fitted model goes (--calibration of simulate, plan, "
                             "whatif)")
    parser.add_argument("--trace", metavar="TRACE.jsonl",
                        help="calibrate in service instead: run this trace on the engine "
                             "(arrivals on the wall clock, default scheduler settings) and "
                             "fit on the steps it ran; not with the grid's --quick, "
                             "--layout-term or --plot")
    parser.add_argument("--step-logs", nargs="+", metavar="LOG",
                        help="fit on steps the engine already ran, pooled: step logs "
                             "(JSONL) or `kvserve serve --record` directories; no model is "
                             "loaded. Pool runs from different times and rates: one run "
                             "carries that moment's machine speed (docs/fidelity.md). The "
                             "file names this machine's CPU: give logs made here")
    parser.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                        help="with --trace: sample at temperature 0, as the grid does "
                             "(--no-greedy: temperature 1, whose sampling cost is then "
                             "in the fit)")
    parser.add_argument("--plot", metavar="PATH.svg",
                        help="measured vs fitted step times of the grid (not with --trace "
                             "or --step-logs)")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs of each shape first")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each shape; their median is its time")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="tokens per KV block of the engine measured")
    parser.add_argument("--layout-term", action="store_true",
                        help="also measure every shape that reads cached KV on consecutive "
                             "blocks and fit per_scattered_context_token_s (on this machine "
                             "it helped batch workloads and hurt Poisson ones: "
                             "docs/fidelity.md)")
    parser.add_argument("--kind-term", action=argparse.BooleanOptionalAction, default=None,
                        help="fit per_prefill_step_s, the fixed cost of a step that carries a "
                             "prefill chunk beyond a decode-only step's (default: on with "
                             "--trace, off with the grid, whose few mixed shapes hardly "
                             "separate it)")
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1GiB"),
                        help="the engine's KV pool while measuring (default 1GiB)")
    _RUN_DEFAULTS.update((dest, parser.get_default(dest)) for dest in _RUN_FLAGS)


# What configures a model run: --step-logs loads no model, so it refuses these where given
# other than their defaults (QA: `--step-logs L --block-size 0` was taken and ignored).
_RUN_FLAGS = {"model": "MODEL", "dtype": "--dtype", "device": "--device",
              "load_format": "--load-format", "seed": "--seed",
              "batch_invariant": "--batch-invariant", "quantization": "--quantization",
              "greedy": "--greedy/--no-greedy", "warmup": "--warmup", "repeats": "--repeats",
              "block_size": "--block-size", "kv_cache_memory": "--kv-cache-memory"}
_RUN_DEFAULTS: dict[str, Any] = {}


def run(args: argparse.Namespace) -> int:
    from kvserve.engine import calibrate
    from kvserve.engine.llm import build_engine

    resolve_model_option(args)
    if args.warmup < 0 or args.repeats < 1:
        raise CLIError("--warmup must be >= 0 and --repeats >= 1")
    check_output_file("--output", args.output)  # before minutes of measuring, not after
    if args.plot:
        check_output_file("--plot", args.plot)
    if args.trace and (args.quick or args.layout_term or args.plot):
        raise CLIError("--quick, --layout-term and --plot describe the grid; --trace fits on "
                       "the steps the trace runs instead")
    if args.step_logs:
        if args.trace or args.quick or args.layout_term or args.plot:
            raise CLIError("--step-logs fits on logged steps: not with --trace, --quick, "
                           "--layout-term or --plot")
        given = [flag for dest, flag in _RUN_FLAGS.items()
                 if getattr(args, dest, None) != _RUN_DEFAULTS.get(dest)]
        if given:
            raise CLIError(f"--step-logs fits on logged steps and runs no model: "
                           f"{', '.join(given)} would change nothing; leave "
                           f"{'it' if len(given) == 1 else 'them'} out")
        return _fit_step_logs(args)
    trace = _read_trace(args.trace) if args.trace else None  # bad input fails before loading
    try:
        engine = build_engine(args.model, detokenize=False, **engine_args(args))
    except (ValueError, FileNotFoundError) as error:
        raise CLIError(str(error).splitlines()[0]) from error
    if trace is not None:
        return _run_in_service(args, engine, trace)
    runner: Any = engine.executor
    num_blocks = engine.scheduler.cache_config.num_blocks
    shapes = calibrate.grid(args.quick, block_size=args.block_size,
                           layout_twins=args.layout_term)
    model, seconds = calibrate.calibrate(runner, num_blocks, shapes, warmup=args.warmup,
                                         repeats=args.repeats, progress=sys.stderr.isatty(),
                                         kind_term=bool(args.kind_term))
    meta = {**calibrate.model_meta(runner.model.config), "dtype": _dtype_name(engine),
            "device": _device_name(engine), "load_format": args.load_format,
            "quantization": args.quantization,  # (the calibration pass: not recorded)
            "block_size": args.block_size,
            "num_samples": len(shapes), "quick": bool(args.quick)}
    write_file_atomically(args.output, calibrate.to_json(model, shapes, seconds, meta))
    quality = calibrate.goodness(model, [s.view() for s in shapes], seconds)
    print(f"wrote {args.output}: {len(shapes)} step shapes, mean error "
          f"{100 * quality['mean_abs_error']:.1f}%, max {100 * quality['max_abs_error']:.1f}%, "
          f"R^2 {quality['r2']:.3f}")
    print(f"  measured on {_measured_on(engine)}")
    width = max(map(len, model.coefficients))
    for term, value in model.coefficients.items():
        print(f"  {term:{width}s} {value:.3e} s")
    print(f"  {'min_tokens':{width}s} {model.min_tokens} (steps with fewer tokens cost as much)")
    if args.quick:
        print(f"note: --quick times {len(shapes)} shapes, enough to check a machine but not to "
              "tell every term apart (terms it cannot separate come out 0 or equal); for a "
              "model to simulate with, run the full grid or --trace")
    if args.plot:
        calibrate.plot(args.plot, shapes, seconds, model)
        print(f"wrote {args.plot}")
    return 0


def _device_name(engine: Any) -> str:
    """Where the engine ran: "cpu", or a GPU's name and index ("NVIDIA H200 (cuda:0)")."""
    device = getattr(engine.executor, "device", None)
    if device is None or device.type != "cuda":
        return "cpu"
    import torch

    return f"{torch.cuda.get_device_name(device)} ({device.type}:{device.index or 0})"


def _measured_on(engine: Any) -> str:
    """The machine a calibration's times are of: the CPU's, or the GPU's and the CPU's."""
    cpu = describe_cpu(cpu_identity())
    device = _device_name(engine)
    return cpu if device == "cpu" else f"{device}, host CPU {cpu}"


def _dtype_name(engine: Any) -> str:
    """The dtype the engine's weights were loaded in (``--dtype auto`` resolved)."""
    return str(engine.executor.model.embed_tokens.weight.dtype).removeprefix("torch.")


def _read_trace(path: str) -> list[Any]:
    from kvserve.sim.trace import read_trace

    try:
        trace = read_trace(path)
    except (OSError, ValueError) as error:
        raise CLIError(str(error).splitlines()[0]) from error
    if not trace:
        raise CLIError(f"{path}: the trace has no requests")
    return trace


def _run_in_service(args: argparse.Namespace, engine: Any, trace: list[Any]) -> int:
    from kvserve.engine import calibrate

    try:
        model, seen = calibrate.calibrate_in_service(
            engine, trace, greedy=args.greedy, kind_term=args.kind_term is not False)
    except ValueError as error:  # too few steps to fit
        raise CLIError(f"{args.trace}: {error}") from error
    meta = {**calibrate.model_meta(engine.executor.model.config), "dtype": _dtype_name(engine),
            "device": _device_name(engine), "load_format": args.load_format,
            "quantization": args.quantization,  # (the calibration pass: not recorded)
            "block_size": args.block_size,
            "trace": str(args.trace), "greedy": args.greedy, **seen}
    write_file_atomically(args.output, calibrate.in_service_json(model, meta))
    print(f"wrote {args.output}: fitted on the {seen['num_steps']} steps run in service; "
          f"mean error {100 * seen['mean_abs_error']:.1f}%, "
          f"error of the sum {100 * seen['error_of_the_sum']:+.1f}%")
    print(f"  measured on {_measured_on(engine)}")
    _warn_if_poor(seen["mean_abs_error"])
    if seen["num_steps"] < MIN_FIT_STEPS:  # (a trace's fit as a step logs' one)
        print(f"warning: fitted on {seen['num_steps']} steps, fewer than {MIN_FIT_STEPS}: its "
              "error says little of the steps it was not fitted on; run a longer trace",
              file=sys.stderr)
    return 0


def _warn_if_poor(error: float) -> None:
    from kvserve.sim.calibration import poor_fit_note

    note = poor_fit_note(error)
    if note:
        print(f"warning: {note}", file=sys.stderr)


# Fewer logged steps than this make a fit whose error says little (the calibration pass: 7
# decode steps of one shape were written as a model, "mean error 13.5%")
MIN_FIT_STEPS = 50


def _warn_if_thin(views: list[Any]) -> None:
    """A warning where the steps fitted on are too few, or none of them prefilled (the
    prefill terms are then unmeasured: a prompt is priced as decode tokens)."""
    if len(views) < MIN_FIT_STEPS:
        print(f"warning: fitted on {len(views)} steps, fewer than {MIN_FIT_STEPS}: its error "
              "says little of the steps it was not fitted on; log more traffic", file=sys.stderr)
    if not any(view.num_tokens > view.num_decode_seqs for view in views):
        print("warning: no step fitted on prefilled a prompt: the prefill terms are "
              "unmeasured, so a simulated prompt is priced as decode tokens", file=sys.stderr)


def _recorded_models(paths: list[str]) -> set[str]:
    """The model ``paths`` were run with, where every one is a recording naming it (a bare
    step log names none, so a fit pooling one names none either: QA, another model's log
    beside a recording was labelled with the recording's model); CLIError where two
    recordings name different models (one fit prices one model's steps)."""
    from kvserve.sim.recording import is_recording, recorded_model

    models = {path: recorded_model(path) if is_recording(path) else "" for path in paths}
    named = {model for model in models.values() if model}
    if len(named) > 1:
        listed = ", ".join(f"{path} ({model})" for path, model in models.items() if model)
        raise CLIError(f"--step-logs are of different models: {listed}; fit each model's "
                       "logs apart")
    return named if all(models.values()) else set()


def _step_files(path: str) -> list[str]:
    """The real paths of the step files ``path`` names: itself, or a recording directory's."""
    if os.path.isdir(path):
        return sorted(os.path.realpath(os.path.join(path, name)) for name in os.listdir(path)
                      if name.startswith("steps-") and name.endswith(".jsonl"))
    return [os.path.realpath(path)]


def _fit_step_logs(args: argparse.Namespace) -> int:
    """Fit one model on the steps of several logs, and say how each log's steps compare
    with the pooled price: the spread is the machine's run-to-run speed."""
    from kvserve.engine import calibrate
    from kvserve.sim.calibration import fit, read_step_log

    seen: dict[str, str] = {}  # a step file's real path -> the argument that named it
    for path in args.step_logs:  # QA: its steps counted twice in the fit; the calibration
        for file in _step_files(path):  # pass: under another spelling, or by its directory
            if file in seen:
                raise CLIError(f"--step-logs names {file} twice ({seen[file]} and {path})"
                               if seen[file] != path else f"--step-logs names {path} twice")
            seen[file] = path
    logs = []
    for path in args.step_logs:
        try:
            logs.append((path, *read_step_log(path)))
        except ValueError as error:
            raise CLIError(str(error).splitlines()[0]) from error
    models = _recorded_models(args.step_logs)  # (read above: they are recordings)
    views = [view for _, log_views, _ in logs for view in log_views]
    seconds = [second for _, _, log_seconds in logs for second in log_seconds]
    try:
        model = fit(views, seconds, source=f"step logs: {len(views)} steps of {len(logs)} "
                    "logs", kind_term=args.kind_term is not False, relative_to="priced")
    except ValueError as error:
        raise CLIError(f"cannot fit on the logged steps: {error}") from error
    per_log = [{"path": str(path), "num_steps": len(log_views),
                "error_of_the_sum": calibrate.goodness(model, log_views,
                                                       log_seconds)["error_of_the_sum"]}
               for path, log_views, log_seconds in logs]
    # the recordings' model, so simulate warns where the file prices another (a plain step
    # log names none)
    meta = {**({"model": models.pop()} if len(models) == 1 else {}),
            # measured where the logs were recorded, not on this machine (the second
            # review: a GPU server's fit was checked against the laptop's CPU)
            "cpu": None,
            "step_logs": per_log, "num_steps": len(views),
            "fit": {"kind_term": args.kind_term is not False, "relative_to": "priced"},
            **calibrate.goodness(model, views, seconds)}
    write_file_atomically(args.output, calibrate.in_service_json(model, meta))
    print(f"wrote {args.output}: fitted on {len(views)} steps of {len(logs)} logs; mean "
          f"error {100 * meta['mean_abs_error']:.1f}%, error of the sum "
          f"{100 * meta['error_of_the_sum']:+.1f}%")
    for row in per_log:
        print(f"  {row['path']}: {row['num_steps']} steps, priced "
              f"{100 * row['error_of_the_sum']:+.1f}% against their measured time")
    _warn_if_poor(meta["mean_abs_error"])
    _warn_if_thin(views)
    if len(per_log) > 1:
        errors = [row["error_of_the_sum"] for row in per_log]
        print(f"  the logs' speeds differ by {100 * (max(errors) - min(errors)):.1f} points: "
              "that is this machine's run-to-run spread, which one run cannot show")
    return 0
