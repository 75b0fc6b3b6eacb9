"""``kvserve simulate``: replay a trace against a planned deployment."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from kvserve.flags import (
    add_command,
    add_scheduler_flags,
    finite_float,
    parse_sweep,
    settings_from_args,
)
from kvserve.sim.cli_common import (
    add_cluster_flags,
    add_deployment_flags,
    calibration_implies_its_model,
    cli_errors,
    cluster_from_args,
    deployment_from_args,
    note_recorded_steps_price,
    seed,
    simulate_with_progress,
)
from kvserve.sim.parallel import Workers, check_workers, default_workers
from kvserve.sim.simulator import BATCHING_MODES

SUMMARY = "replay a trace through the real scheduler on a virtual clock"
DESCRIPTION = ("Replay a JSONL trace through kvserve's scheduler with a cost model "
               "instead of a model, and report latency, throughput, preemptions and KV "
               "usage.")


def add_parser(subparsers: Any) -> None:
    parser = add_command(subparsers, "simulate", run, SUMMARY, DESCRIPTION)
    parser.add_argument("--trace", required=True,
                        help="JSONL trace (kvserve workload gen), a server's recording "
                             "directory (kvserve serve --record DIR: its recorded settings, "
                             "then any flag given), or - for standard input")
    add_deployment_flags(parser, recordings=True)
    parser.add_argument("--gpu-memory-gib", type=finite_float, metavar="GIB",
                        help="the device's memory, for a device no --hardware preset names "
                             "(its speed: the preset's, or --calibration's); default: the "
                             "preset's, as kvserve plan takes it")
    add_cluster_flags(parser)
    parser.add_argument("--batching", choices=BATCHING_MODES,
                        help="continuous (default), static batches, or serial")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed for synthetic token ids (>= 0)")
    parser.add_argument("--report", metavar="PATH.json", help="write the JSON report")
    parser.add_argument("--html", metavar="PATH.html", help="write the HTML report")
    parser.add_argument("--events", metavar="PATH.jsonl", help="write the scheduling events")
    parser.add_argument("--sweep", metavar="NAME=V1,V2,...", action="append",
                        help="one run per value of a flag, e.g. max_num_seqs=64,128,256 "
                             "(one --sweep: a sweep varies one setting)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="K",
                        help="a sweep's runs simulated at once in local processes (default: "
                             "one per CPU; the report is the same)")
    parser.add_argument("--check", action="store_true",
                        help="check the scheduler's invariants after every step (slow)")
    parser.add_argument("--quiet", action="store_true", help="print no table")
    add_scheduler_flags(parser)
    parser.add_argument("--tenant-weight", action="append", default=[],
                        metavar="TENANT=WEIGHT",
                        help="a tenant's share under --tenant-fairness vtc, as the keys "
                             "file's weight field gives it to kvserve serve (2: twice the "
                             "service; default 1); repeat for each tenant")


def run(args: argparse.Namespace) -> int:
    with cli_errors():
        from kvserve.sim.trace import read_trace

        if args.sweep and len(args.sweep) > 1:
            raise ValueError(f"--sweep is given {len(args.sweep)} times: a sweep varies one "
                             "setting (run one simulate per setting, or fix the others with "
                             "their flags)")
        args.sweep = args.sweep[0] if args.sweep else None
        check_workers(args.workers)  # named whether or not a sweep would use it
        calibration_implies_its_model(args)
        settings = settings_from_args(args)
        sweep = parse_sweep(args.sweep) if args.sweep is not None else None  # "" too (QA)
        _check_pool_sweep(sweep, settings)
        recording = None
        if args.trace != "-" and Path(args.trace).is_dir():
            from kvserve.sim.recording import check_pool_setting

            check_pool_setting([*settings, *(sweep[:1] if sweep else ())])
            recording, settings = recorded_run(args, settings)
        elif args.cost_model is None:
            args.cost_model = "roofline"
        args.recording = recording
        named = argparse.Namespace(model=args.model, hardware=args.hardware)  # as given:
        deployment = deployment_from_args(args)  # this sets the default hardware
        if recording is not None:  # after a bad --model is named (the review)
            note_recorded_steps_price(named, args.cost_model)
        hardware_named = named.hardware is not None
        if args.gpu_memory_gib is not None:
            if not args.gpu_memory_gib > 0:
                raise ValueError(f"--gpu-memory-gib must be > 0, got {args.gpu_memory_gib:g}")
            if recording is not None and not hardware_named:
                raise ValueError("--gpu-memory-gib sizes a planned device's memory; a "
                                 "recording's pool is its blocks (give --num-kv-blocks; "
                                 "plan --trace with --model and --hardware plans another "
                                 "deployment for its requests)")
            deployment = dataclasses.replace(deployment, gpu_memory_gib=args.gpu_memory_gib)
        if args.tenant_weight:
            if settings.get("tenant_fairness") != "vtc" and \
                    not (sweep and sweep[0] == "tenant_fairness"):
                raise ValueError("--tenant-weight needs --tenant-fairness vtc: weights only "
                                 "price the fair share")
            settings["tenant_weights"] = parse_tenant_weights(args.tenant_weight)
        if sweep and args.events:
            raise ValueError("--events records one run; it cannot be combined with --sweep")
        trace = recording.trace if recording is not None else read_trace(args.trace)
        if args.tenant_weight:
            tenants = {r.tenant for r in trace}
            absent = [t for t, _ in settings["tenant_weights"] if t not in tenants]
            if absent:
                print(f"warning: --tenant-weight names {', '.join(map(repr, absent))}, which "
                      "no request of the trace is from", file=sys.stderr)
        if sweep:
            _run_sweep(args, deployment, settings, trace, *sweep)
        else:
            _run_one(args, deployment, settings, trace)
    return 0


_POOL_FLAGS = {"num_kv_blocks": "--num-kv-blocks", "kv_cache_memory": "--kv-cache-memory"}


def _check_pool_sweep(sweep: tuple[str, list[Any]] | None, settings: dict[str, Any]) -> None:
    """Sweeping one of the KV pool's sizes with the other given: every row ran at the
    given one and was labelled with the swept value (it was the other way round for
    num_kv_blocks, which wins): refused, as both flags are for one run."""
    if sweep is not None and sweep[0] in settings:  # QA: the flag was dropped, silently
        flag = "--" + sweep[0].replace("_", "-")
        raise ValueError(f"--sweep {sweep[0]} sets what {flag} sets: give one (drop {flag})")
    if sweep is None or sweep[0] not in _POOL_FLAGS:
        return
    other = next(name for name in _POOL_FLAGS if name != sweep[0])
    if other in settings:
        raise ValueError(f"--sweep {sweep[0]} sizes the KV pool, which {_POOL_FLAGS[other]} "
                         f"also sizes: give one (drop {_POOL_FLAGS[other]})")


def parse_tenant_weights(specs: list[str]) -> tuple[tuple[str, float], ...]:
    """``["team-a=2", "team-b=0.5"]`` -> SchedulerConfig's ``tenant_weights`` pairs; a
    malformed, repeated or out-of-range entry is a ValueError naming it."""
    weights: dict[str, float] = {}
    for spec in specs:
        tenant, eq, text = spec.rpartition("=")
        try:
            weight = float(text)
        except ValueError:
            weight = None
        if not eq or not tenant or weight is None:
            raise ValueError(f"--tenant-weight {spec!r}: write TENANT=WEIGHT, e.g. team-a=2")
        if not 0 < weight <= 1e6:  # NaN fails too
            raise ValueError(f"--tenant-weight {spec!r}: the weight must be in (0, 1e6]")
        if tenant in weights:
            raise ValueError(f"--tenant-weight: tenant {tenant!r} is given twice")
        weights[tenant] = weight
    return tuple(sorted(weights.items()))


def recorded_run(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A recording's trace, and its recorded settings under the flags given; the cost model
    defaults to the recorded step times when no setting changes, else to a model fitted on
    them; a recording of replicas replays as a cluster of as many, each request on the
    replica the server placed it on when it replays, else behind the recorded router
    (docs/recording.md)."""
    from kvserve.sim.recording import load_recording, pool_at_block_size

    recording = load_recording(args.trace)
    recorded = recording.settings
    size = recorded.pop("data_parallel_size", 1)
    router = recorded.pop("router", None)
    bound = recorded.pop("router_imbalance_bound", None)
    if getattr(args, "data_parallel_size", None) is None:  # as recorded unless given
        args.data_parallel_size = size
    if args.router_imbalance_bound is None:
        args.router_imbalance_bound = bound
    if args.router == "recorded" and args.data_parallel_size != size:
        raise ValueError(f"--router recorded replays the {size} recorded replicas; give "
                         f"--data-parallel-size {size} or leave it out")
    placed = size == 1 or all(r.replica is not None for r in recording.trace)
    # a flag given at its recorded value changes nothing (the sim-agreement pass: the
    # recorded --max-num-seqs 6 given took the fitted model)
    changed = {k for k, v in settings.items() if k not in recorded or recorded[k] != v}
    same = not changed and not args.sweep and size == args.data_parallel_size and placed \
        and args.router in (None, "recorded") and not args.data_parallel_lockstep
    if args.cost_model == "replay" and not same:
        raise ValueError("--cost-model replay replays the recorded run only: its step times "
                         "are the recorded settings' steps, placed as the server placed "
                         "them; with a setting, the cluster or the router changed, leave "
                         "--cost-model out (a model fitted on those steps)")
    if args.router is None and size > 1:
        args.router = "recorded" if same and args.cost_model in (None, "replay") else router
    if args.cost_model is None:
        args.cost_model = "replay" if same else "calibrated"
        args.replay_by_default = same
    pool = pool_at_block_size(recorded, settings)
    if pool:
        print(f"note: --block-size {settings['block_size']} keeps the recorded pool's memory: "
              f"{pool['num_kv_blocks']:,} blocks of {settings['block_size']} (it recorded "
              f"{recorded['num_kv_blocks']:,} of {recorded.get('block_size', 16)}); give "
              "--num-kv-blocks to size it otherwise", file=sys.stderr)
    return recording, {**recorded, **settings, **pool}


def _run_one(args: argparse.Namespace, deployment: Any, settings: dict[str, Any],
             trace: list[Any]) -> None:
    from kvserve.sim import report as reports
    from kvserve.sim.cluster_report import add_cluster_sections
    from kvserve.sim.recording import replay_or_fitted
    from kvserve.sim.table import print_aggregate

    # A run priced by the model fitted on a recording's steps: where its time went against
    # the shapes the recording has (docs/fidelity.md, "Shapes the recording lacks").
    tally = None
    if args.recording is not None and deployment.cost_model == "calibrated" and \
            deployment.calibration is None:
        from kvserve.sim.whatif import ShapeTally, off_record, recorded_shapes

        tally = ShapeTally()

    def simulate(chosen: Any) -> Any:
        return simulate_with_progress(chosen, trace, settings, "simulating", seed=args.seed,
                                      record_events=bool(args.events), check=args.check,
                                      cluster=cluster_from_args(args),
                                      observe=tally.add if tally is not None else None)

    # The recorded step times by default; an inexact recording's may not replay (--cost-model
    # replay, asked for, fails instead).
    if getattr(args, "replay_by_default", False):
        echo, result = replay_or_fitted(simulate, deployment)
    else:
        echo, result = simulate(deployment)
    if tally is not None:
        note = off_record(tally, recorded_shapes(args.recording.step_shapes()[0])).note(
            "this run")
        if note:
            print(f"warning: {note}", file=sys.stderr)
    report = add_cluster_sections(reports.build_report(echo, result), result)
    if args.report:
        _write(args.report, reports.dumps(report))
    if args.events:
        _write(args.events, reports.events_jsonl(result))
    if args.html:
        from kvserve.sim.html import render_report

        _write(args.html, render_report(report, result.itl_samples))
    if not args.quiet:
        per_replica = " per replica" if "data_parallel" in echo else ""
        title = (f"{Path(args.trace).name}: {echo['cost_model']['name']} cost model, "
                 f"max_num_seqs {echo['scheduler']['max_num_seqs']}, "
                 f"{echo['cache']['num_blocks']} KV blocks{per_replica}, "
                 f"{echo['batching']} batching")
        if "data_parallel" in echo:
            dp = echo["data_parallel"]
            title += (f", {dp['size']} replicas ({dp['router']}"
                      f"{', lockstep' if dp['lockstep'] else ''})")
        print_aggregate(report["aggregate"], title, wall_seconds=result.wall_seconds)
        if "replicas" in report:
            from kvserve.sim.cluster_report import print_replicas

            print_replicas(report)
    refused = [r for r in report["requests"] if r["finish_reason"] in ("rejected", "queue_full")]
    if refused:
        print(f"warning: {len(refused)} request(s) refused, e.g. {refused[0]['stop_reason']}",
              file=sys.stderr)
    cut = cut_short(report["requests"], trace, echo["scheduler"]["max_model_len"])
    if cut:
        print(f"warning: {cut} request(s) cut short by max_model_len "
              f"{echo['scheduler']['max_model_len']}: their context ran out before their "
              "max_tokens or their end (finish_reason length); give a larger "
              "--max-model-len to let them finish", file=sys.stderr)
    from kvserve.core.stop import DISPLACED

    displaced = sum(1 for r in report["requests"] if r["stop_reason"] == DISPLACED)
    if displaced:  # K5: counted under abort, said here
        print(f"warning: {displaced} waiting request(s) displaced by more urgent arrivals "
              "(the queue was full; a server answers them 503)", file=sys.stderr)


def cut_short(rows: list[dict[str, Any]], trace: list[Any], max_model_len: int) -> int:
    """Requests that stopped because their sequence reached max_model_len, not at their
    max_tokens (finish_reason "length" either way) nor for the whole pool (``kv_capacity``,
    J2): a table counted them under "length" with no word, where refusals get one."""
    max_tokens = {request.request_id: request.max_tokens for request in trace}
    return sum(1 for row in rows if row["finish_reason"] == "length"
               and row["stop_reason"] is None
               and row["prompt_tokens"] + row["output_tokens"] >= max_model_len
               and (max_tokens.get(row["request_id"]) or max_model_len) > row["output_tokens"])


def _run_sweep(args: argparse.Namespace, deployment: Any, settings: dict[str, Any],
               trace: list[Any], name: str, values: list[Any]) -> None:
    from kvserve.sim import report as reports
    from kvserve.sim.table import print_sweep

    check_workers(args.workers)
    for value in values:  # every value before any run (the simulator pass: the last one
        deployment.check({**settings, name: value})  # was refused after the others ran)
    jobs = [(deployment, trace, {**settings, name: value}, args.seed, args.check,
             cluster_from_args(args), f"{name}={value}" if args.workers <= 1 else None)
            for value in values]
    with Workers(args.workers) as pool:
        runs = pool.map(sweep_run, jobs)
    rows = [(value, echo["cache"]["num_blocks"], figures)
            for value, (echo, figures) in zip(values, runs, strict=True)]
    echo = runs[-1][0]
    # What varies from row to row lives in the rows; the echo keeps what they share.
    echo["scheduler"].pop(name, None)
    echo["cache"].pop(name, None)
    echo["cache"].pop("num_blocks")
    if name == "batching":
        echo.pop("batching")
    report = reports.build_sweep_report(echo, name, rows)
    if args.report:
        _write(args.report, reports.dumps(report))
    if args.html:
        from kvserve.sim.html import render_sweep

        _write(args.html, render_sweep(report))
    if not args.quiet:
        print_sweep(name, [(v, a) for v, _, a in rows],
                    f"{Path(args.trace).name}: sweep of {name}")


def sweep_run(deployment: Any, trace: list[Any], settings: dict[str, Any], seed: int,
              check: bool, cluster: Any, label: str | None,
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of a sweep: its echo and aggregate figures (a progress bar if ``label``)."""
    from kvserve.sim import report as reports

    if label is None:
        echo, result = deployment.simulate(trace, settings, seed=seed, check=check,
                                           cluster=cluster)
    else:
        echo, result = simulate_with_progress(deployment, trace, settings, label, seed=seed,
                                              check=check, cluster=cluster)
    return echo, reports.aggregate(result)


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)
