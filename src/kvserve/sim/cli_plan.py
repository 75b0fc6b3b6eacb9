"""``kvserve plan``: KV capacity, sustainable concurrency, and (with a trace) the
max_num_seqs to pick and the QPS a deployment sustains."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvserve.flags import (
    add_command,
    add_scheduler_flags,
    finite_float,
    scheduler_config,
    settings_from_args,
)
from kvserve.sim.cli_common import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    ShowProgress,
    add_cluster_flags,
    add_deployment_flags,
    calibration_implies_its_model,
    cli_errors,
    cluster_from_args,
    deployment_from_args,
    seed,
)
from kvserve.sim.parallel import Workers, check_workers, default_workers
from kvserve.sim.presets import kv_dtype

SUMMARY = "capacity planning: KV pool, concurrency, max_num_seqs, capacity QPS"
DESCRIPTION = ("KV bytes per token, the KV pool and the sequences it holds; with "
               "--trace, simulate a sweep of max_num_seqs and search the capacity QPS.")
DEFAULT_CANDIDATES = "16,32,64,128,256,512,1024"
DEFAULT_QUEUE_DELAY_P99 = 5.0  # seconds: the bound that defines capacity


def add_parser(subparsers: Any) -> None:
    parser = add_command(subparsers, "plan", run, SUMMARY, DESCRIPTION)
    add_deployment_flags(parser, recordings=True,
                         recorded_cost_model="calibrated: fitted on its steps")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--gpu-memory-gib", type=finite_float,
                        help="device memory (default: the hardware preset's)")
    memory.add_argument("--kv-pool-gib", type=finite_float,
                        help="the KV pool, given directly: the replica's whole pool, all "
                             "its tensor-parallel devices together (--kv-cache-memory is "
                             "per device)")
    memory.add_argument("--activation-reserve-gib", type=finite_float,
                        help="activation reserve per device (default: estimated)")
    load = parser.add_argument_group("load")
    load.add_argument("--prompt-len", type=int, help="tokens per prompt")
    load.add_argument("--output-len", type=int, help="tokens generated per request")
    load.add_argument("--trace", help="a JSONL trace (its p95 length, and simulations), or "
                                      "a recording directory: the recorded server planned "
                                      "as it ran (its settings and KV pool, step times "
                                      "fitted on its steps), or with --model, --hardware "
                                      "or --cost-model, that deployment for its requests")
    load.add_argument("--ttft-p99", type=finite_float, metavar="SECONDS",
                      help="p99 TTFT target for the throughput recommendation")
    load.add_argument("--queue-delay-p99", type=finite_float, metavar="SECONDS",
                      help="p99 queue-delay bound that defines capacity (default "
                           f"{DEFAULT_QUEUE_DELAY_P99:g})")
    load.add_argument("--candidates",
                      help=f"max_num_seqs values to simulate (default {DEFAULT_CANDIDATES})")
    load.add_argument("--no-capacity-search", action="store_true",
                      help="skip the capacity QPS search")
    preempt = parser.add_argument_group(
        "preemption cost (docs/preemption.md): swap a victim's KV or recompute it")
    preempt.add_argument("--preemption-cost", action="store_true",
                         help="price one preemption victim of --seq-len tokens instead of a "
                              "capacity plan")
    preempt.add_argument("--seq-len", type=int, help="the victim's tokens")
    preempt.add_argument("--link-bandwidth", metavar="RATE",
                         help="host link per direction, e.g. 64GB/s (default: the hardware "
                              "preset's)")
    preempt.add_argument("--prefill-flops", type=finite_float, metavar="FLOP/S",
                         help="achieved prefill FLOP/s, e.g. 400e12 (default: 40%% of the "
                              "preset's peak)")
    replicas = parser.add_argument_group(
        "replicas (with --trace: how many data-parallel replicas meet the SLO)")
    replicas.add_argument("--max-replicas", type=int, metavar="M",
                          help="the fewest replicas up to M meeting the SLO, searched by "
                               "simulating 1, 2, 4, ... until one meets it, then bisecting "
                               "(without an SLO: 1, 2, 4, ... M simulated); instead of the "
                               "max_num_seqs sweep")
    replicas.add_argument("--slo-ttft-p99", type=finite_float, metavar="SECONDS",
                          help="the p99 time to first token a replica count must meet")
    replicas.add_argument("--slo-itl-p99", type=finite_float, metavar="SECONDS",
                          help="the p99 inter-token latency a replica count must meet")
    replicas.add_argument("--workers", type=int, default=default_workers(), metavar="K",
                          help="simulations run at once in local processes: the "
                               "max_num_seqs sweep, the capacity search and the replica "
                               "sweep (default: one per CPU; the plan is the same)")
    replicas.add_argument("--ray", action="store_true",
                          help="with --max-replicas: simulate the replica counts as Ray "
                               "tasks on the cluster RAY_ADDRESS names (a local Ray "
                               "instance if unset)")
    add_cluster_flags(parser, size=False)
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed for synthetic token ids (>= 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_scheduler_flags(parser)


def run(args: argparse.Namespace) -> int:
    if args.preemption_cost:
        return _run_preemption_cost(args)
    with cli_errors():
        for flag in ("seq_len", "link_bandwidth", "prefill_flops"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is for --preemption-cost")
        result = make_plan(args)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            _print(result)
    return 0


def _run_preemption_cost(args: argparse.Namespace) -> int:
    from kvserve.sim.preemption_cost import parse_bandwidth, preemption_cost
    from kvserve.sim.presets import kv_dtype, weights_dtype

    with cli_errors():
        for flag in ("trace", "prompt_len", "output_len"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--preemption-cost takes --seq-len, not "
                                 f"--{flag.replace('_', '-')}")
        if args.seq_len is None:
            raise ValueError("--preemption-cost needs --seq-len (the victim's tokens)")
        if args.max_model_len is not None and args.seq_len > args.max_model_len:
            raise ValueError(f"--seq-len {args.seq_len} is longer than --max-model-len "
                             f"{args.max_model_len}: no sequence grows that long")
        args.model = args.model or DEFAULT_MODEL
        args.hardware = args.hardware or DEFAULT_HARDWARE
        link = None if args.link_bandwidth is None else parse_bandwidth(args.link_bandwidth)
        dtype = weights_dtype(args.dtype)
        cost = preemption_cost(args.model, args.seq_len, hardware=args.hardware, dtype=dtype,
                               kv_dtype=kv_dtype(dtype, args.kv_cache_dtype),
                               tensor_parallel_size=args.tensor_parallel_size,
                               link_bandwidth=link, prefill_flops=args.prefill_flops)
    if args.json:
        print(json.dumps(cost.to_json(), indent=1))
    else:
        _print_preemption_cost(cost)
    return 0


def _print_preemption_cost(cost: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one preemption victim of {cost.seq_len:,} tokens: {cost.model} "
                        f"({cost.dtype}) on {cost.hardware} x{cost.tensor_parallel_size}",
                  show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("KV bytes per token", f"{cost.bytes_per_token:,} B"),
        ("KV of the victim", f"{cost.bytes_per_token * cost.seq_len / (1 << 30):.3f} GiB"),
        (f"host link ({cost.link_bandwidth_source})",
         f"{cost.link_bandwidth / 1e9:g} GB/s per direction"),
        ("swap one way", f"{cost.swap_one_way_s * 1e3:.2f} ms"),
        ("swap round trip (out + in)", f"{cost.swap_round_trip_s * 1e3:.2f} ms"),
        (f"prefill FLOP/s ({cost.prefill_flops_source})", f"{cost.prefill_flops:.4g}"),
        ("prefill FLOPs F = 2NS + 2LS^2d", f"{cost.prefill_flop_count:.4g}"),
        ("recompute, cold", f"{cost.recompute_cold_s * 1e3:.2f} ms"),
        ("swap advantage (cold recompute / round trip)", f"{cost.swap_advantage:.2f}x"),
        ("prefill rate at which they tie", f"{cost.crossover_prefill_tok_s:,.0f} tok/s"),
        ("recompute wins once the cached prefix exceeds",
         f"{cost.survival_threshold:.1%} of the sequence"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(width=110, highlight=False).print(table)


def _headline_pool(args: argparse.Namespace, deployment: Any, settings: dict[str, Any],
                   sweeps: bool) -> tuple[Any, Any]:
    """The scheduler config and KV pool the headline figures describe: at the max_num_seqs
    set, else the default (each candidate of a sweep gets its own pool, as `kvserve simulate
    --max-num-seqs N` sizes it: the reserve grows with max_num_seqs). With no max_num_seqs
    set and a sweep to run, at the largest candidate whose pool fits where the default's does
    not, or is above the token budget given (QA: the default, a value never asked for, ended
    the plan on a tight device whose candidates fit)."""
    from kvserve.core import ConfigError
    from kvserve.sim import plan
    from kvserve.sim.capacity import CapacityError

    values: list[int | None] = [None]  # None: as set, or the default
    if sweeps and "max_num_seqs" not in settings:
        values += sorted(_candidates(args.candidates), reverse=True)
    for tried, value in enumerate(values, 1):
        try:
            headline = settings if value is None else plan.with_max_num_seqs(settings, value)
            config = scheduler_config(headline)
            deployment.check_context(config)
            return config, deployment.kv_pool(headline, config)
        except (CapacityError, ConfigError, plan.BudgetError):
            if tried == len(values):  # the smallest candidate's reason, or the default's
                raise
    raise AssertionError("not reached: the last value tried returns or raises")


def _check_servable_share(trace: list[Any], max_model_len: int) -> None:
    """A trace's prompts that max_model_len refuses (J1) are refused at every rate: a
    warning naming how many, and an error when every one is (plan then recommended settings
    from rows that served nothing)."""
    refused = sum(1 for r in trace if r.num_prompt_tokens >= max_model_len)
    if refused == len(trace):
        raise ValueError(f"every request of the trace has a prompt of max_model_len "
                         f"{max_model_len} tokens or more, which is refused: give "
                         "--max-model-len")
    if refused:
        print(f"warning: {refused} of {len(trace)} requests have prompts of max_model_len "
              f"{max_model_len} tokens or more and are refused at every rate (give "
              "--max-model-len to plan for them)", file=sys.stderr)


def _check_served(rows: list[dict[str, Any]], trace: list[Any], max_model_len: int) -> None:
    """Prompts a candidate's KV pool cannot hold are refused at every rate (J2): a warning
    naming how many where every candidate refuses some, an error where no candidate served
    anything (QA: plan recommended settings, and a capacity, from rows that served 1 of 60
    requests, or none)."""
    num_requests = len(trace)
    fitting = [row for row in rows if row.get("error") is None]
    if not fitting:
        return  # the sweep's rows say why each does not fit
    if max(row["num_finished"] for row in fitting) == 0:
        refused = min(row["num_rejected"] for row in fitting) == num_requests
        if not refused and all(r.cancel_time is not None for r in trace):  # the record ->
            # replay pass: a recording whose stop cut every request (the review: a trace of
            # client timeouts refused by a small pool is the pool's)
            raise ValueError(f"no candidate served any of the trace's {num_requests} "
                             "requests: every one was cancelled, or cut by the recording's "
                             "stop, before it finished; record until some finish")
        raise ValueError(f"no candidate served any of the trace's {num_requests} requests "
                         "(each refused or shed them all): give a larger KV pool "
                         "(--num-kv-blocks, --gpu-memory-gib) or --max-model-len")
    too_long = sum(1 for r in trace if r.num_prompt_tokens >= max_model_len)  # warned of
    refused = min(row["num_rejected"] for row in fitting) - too_long
    if refused > 0:
        print(f"warning: {refused} of {num_requests} requests have prompts no candidate's KV "
              "pool holds and are refused at every rate: the rows cover the rest (give a "
              "larger pool to plan for them)", file=sys.stderr)


def _positive(name: str, value: float | None) -> None:
    if value is not None and not 0 < value < math.inf:  # QA: inf was taken
        raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got "
                         f"{value}")


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.sim import plan
    from kvserve.sim.trace import read_trace

    for name in ("prompt_len", "output_len", "ttft_p99", "queue_delay_p99", "slo_ttft_p99",
                 "slo_itl_p99"):
        _positive(name, getattr(args, name))
    if args.max_replicas is not None:
        from kvserve.sim.replica_plan import check_max_replicas

        check_max_replicas(args.max_replicas)
    _check_sweep_flags(args)
    if args.candidates is None:  # "" is refused, not the default (the review)
        args.candidates = DEFAULT_CANDIDATES
    if args.queue_delay_p99 is None:
        args.queue_delay_p99 = DEFAULT_QUEUE_DELAY_P99
    _candidates(args.candidates)  # before the trace's warnings (QA: two lines, not one)
    check_workers(args.workers)
    calibration_implies_its_model(args)
    if args.kv_pool_gib is not None:  # it replaces the memory arithmetic the others feed
        for flag, value in (("--gpu-memory-gib", args.gpu_memory_gib),
                            ("--activation-reserve-gib", args.activation_reserve_gib),
                            # QA: these two won, silently
                            ("--kv-cache-memory", getattr(args, "kv_cache_memory", None)),
                            ("--num-kv-blocks", getattr(args, "num_kv_blocks", None))):
            if value is not None:
                raise ValueError(f"--kv-pool-gib gives the pool directly, so {flag} would "
                                 "size nothing: give one of them")
    is_recording = bool(args.trace) and args.trace != "-" and Path(args.trace).is_dir()
    cluster_flags = [] if is_recording else [  # a recording of replicas runs as a cluster
        ("--router", args.router), ("--router-imbalance-bound", args.router_imbalance_bound),
        ("--data-parallel-lockstep", args.data_parallel_lockstep or None),
        ("--prefill-schedule-interval", None if args.prefill_schedule_interval == 1 else 1)]
    replica_flags = [flag for flag, value in (
        ("--max-replicas", args.max_replicas), ("--slo-ttft-p99", args.slo_ttft_p99),
        ("--slo-itl-p99", args.slo_itl_p99), *cluster_flags,
        ("--ray", args.ray or None)) if value is not None]
    if replica_flags and (args.max_replicas is None or not args.trace):
        missing = " and ".join(flag for flag, given in (
            ("--max-replicas M", args.max_replicas is not None), ("--trace", args.trace))
            if not given)
        raise ValueError(f"{replica_flags[0]} plans replicas: give {missing}")
    settings = settings_from_args(args)
    trace, recording = None, None
    if is_recording:
        from kvserve.sim.recording import load_recording

        recording = load_recording(args.trace)
        trace = recording.trace
    elif args.trace:
        trace = read_trace(args.trace)
    as_recorded = recording is not None and all(
        value is None for value in (args.model, args.hardware, args.cost_model,
                                    args.calibration))
    if as_recorded:
        settings = _recorded_settings(args, recording, settings)
    elif recording is not None:  # another deployment for its requests: the model as recorded
        args.recording = recording
    deployment = dataclasses.replace(
        deployment_from_args(args), gpu_memory_gib=args.gpu_memory_gib,
        kv_pool_gib=args.kv_pool_gib, activation_reserve_gib=args.activation_reserve_gib)
    config, pool = _headline_pool(args, deployment, settings, sweeps=trace is not None
                                  and args.max_replicas is None)
    if args.prompt_len is not None and args.output_len is not None:
        seq_len, source = args.prompt_len + args.output_len, "prompt_len + output_len"
        if seq_len > config.max_model_len:
            raise ValueError(f"--prompt-len + --output-len = {seq_len} tokens is longer than "
                             f"max_model_len {config.max_model_len}: such a request is "
                             "refused (give --max-model-len)")
    elif trace is not None:
        _check_servable_share(trace, config.max_model_len)
        seq_len, source = plan.trace_seq_len_p95(trace, config.max_model_len), "trace p95"
    else:
        raise ValueError("give --prompt-len and --output-len, or --trace")
    out: dict[str, Any] = {
        "model": args.model, "hardware": deployment.hardware, "dtype": deployment.dtype,
        "kv_cache_dtype": kv_dtype(deployment.dtype, deployment.kv_cache_dtype),
        "tensor_parallel_size": args.tensor_parallel_size,
        **plan.kv_summary(pool, seq_len), "seq_len_source": source,
        "pool_max_num_seqs": config.max_num_seqs,
    }
    if as_recorded:  # no preset's hardware: the recorded steps price the steps
        out["hardware"] = None
        del out["activation_reserve_bytes"]
        out["recorded"] = {"recording": str(recording.path), "model": recording.model,
                           "num_steps": sum(len(log.fit_steps)
                                            for log in recording.engines.values()),
                           "data_parallel_size": args.recorded_size}
        if args.recorded_size > 1:
            out["recorded"]["router"] = args.router or "least-loaded"
    if trace is None:
        return out
    if args.max_replicas is not None:
        out.update(_replica_plan(args, deployment, trace, settings))
        return out
    candidates = _candidates(args.candidates)  # (checked before the trace was read too)
    runs_on: Any = deployment
    if as_recorded:
        # the recorded max_num_seqs is always a row; replicas run as the recorded cluster
        candidates = sorted({*candidates, config.max_num_seqs})
        cluster = cluster_from_args(args, args.recorded_size)  # notes a lone one's --router
        if args.recorded_size > 1:
            runs_on = InCluster(deployment, cluster)
    # One progress bar per run on a terminal, serially; over a pool, one bar over its runs.
    runner = ShowProgress(runs_on) if args.workers <= 1 else runs_on
    shapes = None
    if recording is not None and deployment.cost_model == "calibrated" and \
            deployment.calibration is None:  # priced by the model fitted on its steps
        from kvserve.sim.whatif import recorded_shapes

        shapes = recorded_shapes(recording.step_shapes()[0])
    with Workers(args.workers) as pool:
        rows = plan.sweep_max_num_seqs(runner, trace, settings, candidates, args.seed, pool,
                                       shapes)
        _warn_off_record(rows, args.no_capacity_search)
        if "max_num_batched_tokens" not in settings:
            _note_raised_budgets(rows)
        _check_served(rows, trace, config.max_model_len)
        out["sweep"] = rows
        out.update(plan.recommend(rows, args.ttft_p99))
        if not args.no_capacity_search:
            out.update(_capacity(args, runs_on, trace, settings, out, pool))
    return out


def _note_raised_budgets(rows: list[dict[str, Any]]) -> None:
    """Candidates above the default token budget ran with it raised to them (no budget was
    given), which serve and simulate refuse without the flag: said once."""
    from kvserve.sim.plan import DEFAULT_BUDGET

    raised = [row["max_num_seqs"] for row in rows  # that ran: not those that did not fit
              if row["max_num_batched_tokens"] > DEFAULT_BUDGET and not row.get("error")]
    if raised:
        print(f"note: max_num_seqs {', '.join(map(str, raised))} ran with "
              "max_num_batched_tokens raised to match (a step schedules a token per sequence "
              "at least); serve and simulate them with --max-num-batched-tokens N as well",
              file=sys.stderr)


def _warn_off_record(rows: list[dict[str, Any]], no_capacity_search: bool) -> None:
    """The simulator pass: simulate and whatif warn of a run priced on step shapes the
    recording barely has; plan showed the same rows and a capacity with no caveat. Said
    once, for the row with the largest share."""
    from kvserve.sim.whatif import OffRecord

    shares = [row for row in rows if row.get("off_record")]
    if not shares:
        return
    worst = max(shares, key=lambda row: row["off_record"]["share"])
    note = OffRecord.from_json(worst["off_record"]).note(f"max_num_seqs={worst['max_num_seqs']}")
    if note:
        probes = "" if no_capacity_search else \
            "; the capacity search's faster probes are priced the same way"
        print(f"warning: {note}{probes}", file=sys.stderr)


def _recorded_settings(args: argparse.Namespace, recording: Any,
                       given: dict[str, Any]) -> dict[str, Any]:
    """The recorded server as it ran: its settings (the flags given over them) and its pool
    in blocks, priced by a cost model fitted on its steps; its router for a replica plan."""
    from kvserve.sim.recording import check_pool_setting

    check_pool_setting(given)
    for flag in ("gpu_memory_gib", "kv_pool_gib", "activation_reserve_gib"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} sizes a planned device's memory; a "
                             "recording's pool is its blocks (give --num-kv-blocks, or "
                             "--model and --hardware to plan another deployment)")
    settings = recording.settings
    args.recorded_size = settings.pop("data_parallel_size", 1)
    router = settings.pop("router", None)
    bound = settings.pop("router_imbalance_bound", None)
    args.router = args.router or router
    if args.router_imbalance_bound is None:
        args.router_imbalance_bound = bound
    args.recording, args.cost_model = recording, "calibrated"
    return {**settings, **given}


@dataclasses.dataclass(frozen=True)
class InCluster:
    """A deployment whose every simulation runs as the recorded cluster of replicas (the
    max_num_seqs sweep and the capacity search of a recording of replicas)."""

    deployment: Any
    cluster: Any

    def simulate(self, trace: Any, settings: dict[str, Any], **kwargs: Any) -> Any:
        return self.deployment.simulate(trace, settings, cluster=self.cluster, **kwargs)


def _replica_plan(args: argparse.Namespace, deployment: Any, trace: list[Any],
                  settings: dict[str, Any]) -> dict[str, Any]:
    from kvserve.sim import replica_plan

    options = cluster_from_args(args)
    if args.slo_ttft_p99 is None and args.slo_itl_p99 is None:  # nothing to search for
        rows = replica_plan.run_candidates(
            deployment, trace, settings, options,
            replica_plan.replica_candidates(args.max_replicas), seed=args.seed,
            workers=args.workers, use_ray=args.ray)
    else:
        rows = replica_plan.search_replicas(
            deployment, trace, settings, options, args.max_replicas, args.slo_ttft_p99,
            args.slo_itl_p99, seed=args.seed, workers=args.workers, use_ray=args.ray)
    return {"router": options.router, "replica_sweep": rows,
            **replica_plan.recommend_replicas(rows, args.slo_ttft_p99, args.slo_itl_p99)}


def _check_sweep_flags(args: argparse.Namespace) -> None:
    """The max_num_seqs sweep's flags where no such sweep runs (no trace, or a replica
    sweep instead): refused, as the replica sweep's are without --max-replicas (the
    simulator pass: taken and ignored, exit 0)."""
    given = [flag for flag, value in (
        ("--candidates", args.candidates), ("--ttft-p99", args.ttft_p99),
        ("--queue-delay-p99", args.queue_delay_p99),
        ("--no-capacity-search", args.no_capacity_search or None)) if value is not None]
    if not given:
        return
    if not args.trace:  # QA: --ttft-p99 was ignored, silently
        raise ValueError(f"{given[0]} is for the max_num_seqs sweep over a trace: it needs "
                         "--trace")
    if args.max_replicas is not None:
        raise ValueError(f"{given[0]} is for the max_num_seqs sweep, which --max-replicas "
                         "replaces with a sweep of replica counts (its targets: "
                         "--slo-ttft-p99, --slo-itl-p99)")


def _candidates(text: str) -> list[int]:
    from kvserve.flags import comma_values

    items = comma_values(text, f"--candidates {text!r}")
    try:
        values = sorted({int(v) for v in items})
    except ValueError:
        raise ValueError(f"--candidates {text!r}: write integers, e.g. 64,128,256") from None
    if not values:
        raise ValueError(f"--candidates {text!r}: give at least one value, e.g. 64,128,256")
    if values[0] < 1:
        raise ValueError(f"--candidates {text!r}: values must be >= 1")
    return values


def _capacity(args: argparse.Namespace, deployment: Any, trace: list[Any],
              settings: dict[str, Any], out: dict[str, Any], pool: Workers,
              ) -> dict[str, Any]:
    from kvserve.sim import plan

    if not out.get("num_candidates_fitting", 1) and not settings.get("max_num_seqs"):
        return {"capacity_qps": None,  # QA: searched at 256, no candidate
                "capacity_note": "no candidate max_num_seqs fits: no capacity to search",
                "queue_delay_p99_bound_s": args.queue_delay_p99}
    # (with none set, some candidate fits: checked above)
    max_num_seqs = (settings.get("max_num_seqs") or out["max_num_seqs_best_throughput"]
                    or out["max_num_seqs_no_preemption"]
                    or max(r["max_num_seqs"] for r in out["sweep"] if r.get("error") is None))
    start = plan.trace_rate(trace)
    if start is None:
        return {"capacity_qps": None,
                "capacity_note": "the trace's arrivals span no time: no rate to scale",
                "queue_delay_p99_bound_s": args.queue_delay_p99}
    run_settings = plan.with_max_num_seqs(settings, max_num_seqs)

    # Progress as the sweep's: a bar per run in this process (serially, and the floor's
    # run), one over the runs of each round on a pool.
    def queue_p99(qps: float) -> float | None:
        labelled = ShowProgress(deployment, f"capacity search at {qps:.4g} QPS")
        return queue_p99_at(labelled, trace, run_settings, args.seed, qps)

    def run_many(rates: list[float]) -> list[float | None]:
        if len(rates) == 1:  # a pool runs one job here, without its bar
            return [queue_p99(rates[0])]
        return pool.map(queue_p99_at, [(deployment, trace, run_settings, args.seed, qps)
                                       for qps in rates], label="capacity search")

    qps, probes = plan.capacity_qps(queue_p99, start, args.queue_delay_p99,
                                    run_many=run_many, workers=args.workers)
    # significant digits, not decimals (the simulator pass: 9.9e-05 read as 0.0001, the rate
    # of a probe that failed, and 2e-07 as 0.0)
    found = {"capacity_qps": None if qps is None else float(f"{qps:.4g}"),
             "capacity_max_num_seqs": max_num_seqs,
             "queue_delay_p99_bound_s": args.queue_delay_p99, "capacity_probes": probes}
    if qps is not None and all(p["queue_p99"] is not None and
                               p["queue_p99"] <= args.queue_delay_p99 for p in probes):
        # Never past the bound: at the fastest rate tried the whole trace arrives at once
        # and still drains within it, so this is a lower bound, set by the trace's length.
        found["capacity_is_lower_bound"] = True
        found["capacity_note"] = (
            f"the p99 queue delay stayed within {args.queue_delay_p99:g} s at every rate "
            f"tried, up to {qps:.4g} QPS: this trace ({len(trace)} requests) is too short "
            "to queue past the bound at any rate, so the capacity is at least that; give "
            "a longer trace to measure it")
        return found
    if qps is not None:
        floor, note = plan.capacity_floor(queue_p99, qps, args.queue_delay_p99)
        found["queue_p99_floor_s"] = floor
        if note:
            found["capacity_note"] = note
    else:
        slowest = min((p["qps"] for p in probes if p["qps"]), default=start)
        found["capacity_note"] = (
            f"the p99 queue delay exceeded {args.queue_delay_p99:g} s, or the waiting queue "
            "shed requests (a queue limit or deadline refused or timed them out; such a "
            f"probe's queue_p99 is null), at every rate tried, down to {slowest:.3g} QPS: "
            "slowing the arrivals does not spread this trace's requests out enough (they "
            "come in bursts that stay bursts at any rate, e.g. a trace recorded behind a "
            "client's concurrency limit), or one request alone waits longer than the bound")
    return found


def queue_p99_at(deployment: Any, trace: list[Any], settings: dict[str, Any], seed: int,
                 qps: float) -> float | None:
    """The p99 queue delay of ``trace`` replayed at ``qps`` (one probe of the search); None
    (past any bound) where the waiting queue shed a request: refused it as full, timed it
    out or displaced it (``--max-num-queued-*``, ``--max-queue-delay``). A shed request
    never waits past the bound, so with shedding on every rate passed and plan reported
    capacities of tens of thousands of QPS."""
    from kvserve.sim import plan
    from kvserve.sim.report import aggregate

    _, result = deployment.simulate(plan.scale_rate(trace, qps), settings, seed=seed)
    if any(plan.shed(record) for record in result.records):
        return None
    return aggregate(result)["queue_p99"]


def _with_budget(result: dict[str, Any], key: str, none: str) -> str:
    """A recommended max_num_seqs, with the token budget its row ran with where that is
    above the default (serve and simulate refuse it without the flag)."""
    from kvserve.sim.plan import DEFAULT_BUDGET

    value = result[key]
    if value is None:
        return none
    budget = next((row.get("max_num_batched_tokens") for row in result["sweep"]
                   if row["max_num_seqs"] == value), None)
    return f"{value} (with --max-num-batched-tokens {budget})" \
        if budget is not None and budget > DEFAULT_BUDGET else str(value)


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = 1 << 30
    recorded = result.get("recorded")
    kv = result.get("kv_cache_dtype")
    dtypes = result["dtype"] if kv in (None, result["dtype"]) else \
        f"{result['dtype']}, KV cache {kv}"
    title = f"{result['model']} ({dtypes}) on {result['hardware']} " \
        f"x{result['tensor_parallel_size']}" if recorded is None else \
        f"{recorded['recording']}: {recorded['model'] or result['model']} as recorded " \
        f"({_replicas(recorded)}step times fitted on its {recorded['num_steps']:,} steps)"
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("KV bytes per token", f"{result['kv_bytes_per_token']:,} B"),
        ("weights", f"{result['weight_bytes'] / gib:.2f} GiB"),
        *([] if recorded else [("activation reserve",
                                f"{result['activation_reserve_bytes'] / gib:.2f} GiB")]),
        (f"KV pool (at max_num_seqs {result['pool_max_num_seqs']})",
         f"{result['pool_bytes'] / gib:.2f} GiB = {result['num_blocks']:,} blocks"
         f" of {result['block_size']}"),
        ("max live tokens", f"{result['max_live_tokens']:,}"),
        (f"max concurrency at {result['seq_len']} tokens ({result['seq_len_source']})",
         f"{result['max_concurrency']:,}"),
    ]
    if "sweep" in result:
        # QA: with no candidate that fits, "every candidate preempts" and "no candidate
        # meets the TTFT target" (none was given)
        none_fit = result.get("num_candidates_fitting", 1) == 0
        rows += [
            ("largest max_num_seqs without preemption",
             _with_budget(result, "max_num_seqs_no_preemption",
                          "no candidate fits" if none_fit else "every candidate preempts")),
            ("best-throughput max_num_seqs" + (
                f" (TTFT p99 <= {result['ttft_p99_target_s']} s)"
                if result["ttft_p99_target_s"] is not None else ""),
             _with_budget(result, "max_num_seqs_best_throughput",
                          "no candidate fits" if none_fit else
                          "no candidate meets the TTFT target")),
        ]
    if "replica_sweep" in result:
        slo = [f"{name} p99 <= {result[key]} s" for name, key in (
            ("TTFT", "slo_ttft_p99_s"), ("ITL", "slo_itl_p99_s")) if result[key] is not None]
        if slo:
            rows.append((f"fewest replicas ({result['router']}) meeting {', '.join(slo)}",
                         str(result["replicas_recommended"] or "none of " + ", ".join(
                             str(row["replicas"]) for row in result["replica_sweep"])
                             + _why_none(result))))
        else:
            rows.append((f"fewest replicas ({result['router']})",
                         "no SLO to meet: give --slo-ttft-p99 or --slo-itl-p99"))
    if "capacity_qps" in result:
        qps = result["capacity_qps"]
        shown = "none" if qps is None else f"{qps:.4g}"
        at = result.get("capacity_max_num_seqs")
        rows.append(("capacity QPS" + (f" at max_num_seqs {at}" if at else "") +
                     f" (queue p99 <= {result.get('queue_delay_p99_bound_s')} s)",
                     f">= {shown} (the trace is too short to say more)"
                     if result.get("capacity_is_lower_bound") else shown))
    if result.get("queue_p99_floor_s") is not None:
        from kvserve.sim.plan import FLOOR_SHARE

        rows.append((f"queue p99 at {FLOOR_SHARE:.0%} of that rate",
                     f"{result['queue_p99_floor_s']:.3f} s"))
    for name, value in rows:
        table.add_row(name, value)
    console = Console(width=110, highlight=False)
    console.print(table)
    if result.get("capacity_note"):
        console.print(f"[bold yellow]note:[/] {result['capacity_note']}")
    if "replica_sweep" in result:
        _print_replica_sweep(console, result["replica_sweep"])
    if "sweep" in result:
        from kvserve.sim.table import fmt_pct, fmt_s

        sweep = Table(title="max_num_seqs sweep", title_justify="left")
        for column in ("max_num_seqs", "KV blocks", "served", "refused", "shed", "preempt",
                       "wasted", "out tok/s", "TTFT p99", "queue p99", "stall"):
            sweep.add_column(column, justify="right")
        for r in result["sweep"]:
            if r.get("error"):
                sweep.add_row(str(r["max_num_seqs"]), "does not fit", *[""] * 9)
                continue
            sweep.add_row(str(r["max_num_seqs"]), f"{r['num_kv_blocks']:,}",
                          str(r["num_finished"]), str(r["num_rejected"]), str(r["num_shed"]),
                          str(r["num_preemptions"]),
                          fmt_pct(r["wasted_fraction"]),
                          f"{r['throughput_output_tok_s']:.1f}", fmt_s(r["ttft_p99"]),
                          fmt_s(r["queue_p99"]), fmt_s(r["longest_stall_s"]))
        console.print(sweep)
        for r in result["sweep"]:
            if r.get("error"):
                console.print(f"max_num_seqs {r['max_num_seqs']}: {r['error']}")


def _replicas(recorded: dict[str, Any]) -> str:
    size = recorded.get("data_parallel_size", 1)
    return "" if size == 1 else f"{size} replicas behind {recorded.get('router')}, the KV " \
        "figures per replica; "


def _why_none(result: dict[str, Any]) -> str:
    """Why no replica count met the SLO: too few tried, or a target below what more replicas
    reach (the last doubling gained under 5% on a figure that misses; QA: a 1 ms TTFT target
    was told to raise --max-replicas)."""
    rows = result["replica_sweep"]
    if rows and rows[-1].get("num_shed"):
        return (f" (even {rows[-1]['replicas']} shed requests by a queue limit or deadline: "
                "raise --max-replicas or loosen the limit)")
    if len(rows) < 2:
        return " (raise --max-replicas)"
    before, last = rows[-2], rows[-1]
    floors = []
    for name, figure, key in (("TTFT", "ttft_p99", "slo_ttft_p99_s"),
                              ("ITL", "itl_p99", "slo_itl_p99_s")):
        target, now, then = result[key], last[figure], before[figure]
        if target is None or now is None or now <= target or then is None:
            continue
        if then <= 0 or (then - now) / then < 0.05:
            floors.append(f"{name} p99 {now:.3g} s at {last['replicas']} replicas, "
                          f"{then:.3g} s at {before['replicas']}")
    if floors:
        return (f" (more replicas barely help: {'; '.join(floors)}; the target is below "
                "what a request takes with the pool to itself: a faster GPU or model, or a "
                "looser target)")
    return " (raise --max-replicas)"


def _print_replica_sweep(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from kvserve.sim.table import fmt_pct, fmt_s

    table = Table(title="replica sweep", title_justify="left")
    for column in ("replicas", "served", "shed", "TTFT p50", "TTFT p99", "ITL p99",
                   "queue p99", "out tok/s", "preempt", "prefix hits", "KV mean"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["replicas"]), str(r["num_finished"]), str(r.get("num_shed", 0)),
                      fmt_s(r["ttft_p50"]), fmt_s(r["ttft_p99"]),
                      fmt_s(r["itl_p99"]), fmt_s(r["queue_p99"]),
                      f"{r['throughput_output_tok_s']:,.1f}", str(r["num_preemptions"]),
                      fmt_pct(r["prefix_hit_rate"]), fmt_pct(r["kv_usage_mean"]))
    console.print(table)
