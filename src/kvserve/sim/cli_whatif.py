"""``kvserve whatif DIR --set NAME=VALUE``: a recording replayed as it ran and under each
change, side by side (docs/recording.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.core.checks import is_int
from kvserve.core.config import MAX_BLOCKS, swaps
from kvserve.flags import TOKEN_KEYS, comma_values, parse_token_count, parse_value, sweep_key
from kvserve.sim.cli_common import (
    add_deployment_flags,
    calibration_implies_its_model,
    cli_errors,
    deployment_from_args,
    note_recorded_steps_price,
    seed,
)

SUMMARY = "replay a server's recording under changed settings, side by side"
DESCRIPTION = ("Replay a recording (kvserve serve --record DIR) as it ran, with the "
               "server's step times, and under each --set change; print the aggregate "
               "figures side by side and the requests whose latency moved most, each with "
               "the first scheduling decision that differed.")


def add_parser(subparsers: Any) -> None:
    from kvserve.flags import add_command

    parser = add_command(subparsers, "whatif", run, SUMMARY, DESCRIPTION)
    parser.add_argument("recording", metavar="DIR", help="a recording directory")
    parser.add_argument("--set", dest="changes", action="append", default=[],
                        metavar="NAME=VALUE", required=True,
                        help="a run with a changed setting, e.g. max_num_seqs=64, "
                             "scheduling_policy=lpm, or for a recording of replicas "
                             "data_parallel_size=4 or router=prefix-affinity; "
                             "max_num_seqs=32,64 is a run per value; settings apart by "
                             "spaces change together in one run ('max_num_seqs=64 "
                             "num_kv_blocks=4096'); repeat for more runs")
    parser.add_argument("--top", type=int, default=5,
                        help="requests shown per change (default 5)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed for synthetic token ids (>= 0)")
    parser.add_argument("--html", metavar="PATH.html", help="write the HTML report")
    parser.add_argument("--report", metavar="PATH.json", help="write the JSON report")
    add_deployment_flags(parser, recordings=True, recorded_cost_model=(
        "calibrated: fitted on its steps, for the changed runs; the recorded run is replayed "
        "as the model check"))


# The cluster's settings a change may name, beside the scheduler's and the cache's.
CLUSTER_KEYS = ("data_parallel_size", "router")


def parse_change(text: str) -> list[dict[str, Any]]:
    """One --set as the runs it asks for, each the settings it changes: ``NAME=VALUE`` one
    run, ``NAME=V1,V2`` a run per value (as --sweep), ``A=1 B=2`` one run changing both."""
    pairs = text.split()
    if len(pairs) < 2:
        name, _, values = text.partition("=")
        return [dict([parse_setting(text, f"{name}={value}")])
                for value in (comma_values(values, f"--set {text!r}") if "," in values
                              else [values])]
    changes: dict[str, Any] = {}
    for pair in pairs:
        if "," in pair:
            raise ValueError(f"--set {text!r}: settings changed together take one value "
                             "each; give a --set per run")
        name, value = parse_setting(text, pair)
        if name in changes:
            raise ValueError(f"--set {text!r}: {name} is given twice")
        changes[name] = value
    return [changes]


def parse_setting(text: str, pair: str) -> tuple[str, Any]:
    """``NAME=VALUE`` (part of the --set ``text``) as a setting and its value."""
    name, eq, value = pair.partition("=")
    if not eq or not value.strip():
        raise ValueError(f"--set {text!r}: write NAME=VALUE, e.g. max_num_seqs=64")
    key = name.strip().lstrip("-").replace("-", "_")
    if key in CLUSTER_KEYS:
        return key, _cluster_value(text, key, value.strip())
    try:
        key = sweep_key(name, "set")
    except ValueError as error:
        raise ValueError(f"{error}, {', '.join(CLUSTER_KEYS)}") from None
    if key == "num_kv_blocks":  # named as the setting (the pool's check says num_blocks)
        blocks = parse_value(value)
        if not is_int(blocks) or \
                not 1 <= blocks <= MAX_BLOCKS:
            raise ValueError(f"--set {text!r}: num_kv_blocks must be an integer in "
                             f"[1, {MAX_BLOCKS}]")
        return key, blocks
    if key in ("kv_cache_memory", "swap_space"):
        from kvserve.flags import parse_bytes, parse_gib

        try:
            return key, (parse_bytes if key == "kv_cache_memory" else parse_gib)(value)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--set {text!r}: {error}") from None
    if key in TOKEN_KEYS:  # 4k, 32K as the flags read them
        try:
            return key, parse_token_count(value)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--set {text!r}: {error}") from None
    return key, parse_value(value)


# The model check's duration, or else a latency median, this far from the recording's gets
# a note under the table.
MODEL_CHECK_GAP = 0.25


def model_check_gap(recorded: Any, check: Any) -> tuple[str, float] | None:
    """What the model check gives that is furthest past MODEL_CHECK_GAP from the recorded
    run: its duration, else its TTFT or ITL median; (the words, the gap as a fraction), or
    None (QA: 15 s against 36 s, said nowhere; then a TTFT p50 79% off with the duration
    within 3%)."""
    def gap(key: str) -> tuple[float, float, float] | None:
        ran, priced = recorded.aggregate.get(key), check.aggregate.get(key)
        if not ran or priced is None or abs(priced / ran - 1) <= MODEL_CHECK_GAP:
            return None
        return priced, ran, priced / ran - 1

    duration = gap("duration_s")
    if duration is not None:
        return (f"runs the recorded settings in {duration[0]:.1f} s against the recording's "
                f"{duration[1]:.1f} s", duration[2])
    latencies = [(name, found) for name, found in (("TTFT", gap("ttft_p50")),
                                                   ("ITL", gap("itl_p50"))) if found]
    if not latencies:
        return None
    name, (priced, ran, off) = max(latencies, key=lambda item: abs(item[1][2]))
    return (f"gives the recorded settings {'an' if name == 'ITL' else 'a'} {name} p50 of "
            f"{priced * 1e3:.0f} ms against the recording's {ran * 1e3:.0f} ms", off)


def model_gap_cause(model: str, off: float, calibration: str | None) -> str:
    """The likely cause of the model check's gap, by the model, where it came from and the
    gap's sign (the calibration pass: one fixed cause, a quiet machine's calibration, was
    given for a model fitted on the recording that priced steps high)."""
    if model != "calibrated":
        return f"the {model} model prices steps from a preset's figures, not measured ones"
    if calibration is None:
        return ("the model is fitted on this recording's steps; a fit on a noisy machine's "
                "steps prices single steps poorly")
    machine = "a quiet machine pricing a busy one's" if off < 0 else \
        "a busy machine pricing a quiet one's"
    return f"a calibration measured on {machine} steps {'low' if off < 0 else 'high'}"


def _cluster_value(text: str, key: str, value: str) -> Any:
    from kvserve.core.router import ROUTER_POLICIES

    if key == "router":
        if value not in ROUTER_POLICIES:
            raise ValueError(f"--set {text!r}: choose a router from "
                             f"{', '.join(ROUTER_POLICIES)}")
        return value
    size = parse_value(value)
    if not is_int(size) or size < 1:
        raise ValueError(f"--set {text!r}: data_parallel_size must be an integer >= 1")
    return size


def _recorded_cluster(settings: dict[str, Any], trace: list[Any]) -> tuple[Any, Any]:
    """The recorded cluster, taken out of ``settings``: (its size and router, for the model
    check and the changes; the same with each request where the server placed it, for the
    recorded run, or None for an older recording of replicas that does not say)."""
    from kvserve.core.router import DEFAULT_IMBALANCE_BOUND
    from kvserve.sim.cluster import ClusterOptions

    recorded = ClusterOptions(settings.pop("data_parallel_size", 1),
                              settings.pop("router", "least-loaded"),
                              imbalance_bound=settings.pop("router_imbalance_bound",
                                                           DEFAULT_IMBALANCE_BOUND))
    if recorded.data_parallel_size == 1:
        return recorded, recorded
    if any(r.replica is None for r in trace):
        return recorded, None
    return recorded, dataclasses.replace(recorded, router="recorded")


def run(args: argparse.Namespace) -> int:
    with cli_errors():
        from kvserve.sim.cluster import ClusterOptions
        from kvserve.sim.recording import (
            check_pool_setting,
            load_recording,
            pool_at_block_size,
            replay_or_fitted,
        )
        from kvserve.sim.whatif import (
            SAME_DECISIONS,
            ShapeTally,
            latency_text,
            make_run,
            moved,
            nothing_moved,
            off_record,
            recorded_shapes,
            table,
            to_json,
        )

        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        if getattr(args, "replay_step_times", None):  # QA: taken, and nothing changed
            raise ValueError("--replay-step-times is for simulate: whatif replays the "
                             "recording's own steps, and prices the changes with --cost-model "
                             "or --calibration")
        changes = [change for text in args.changes for change in parse_change(text)]
        runs_asked = [" ".join(f"{k}={v}" for k, v in change.items()) for change in changes]
        twice = next((run for i, run in enumerate(runs_asked) if run in runs_asked[:i]), None)
        if twice is not None:  # two columns of one run, and one of them lost in the report
            raise ValueError(f"--set asks for the run {twice} twice")
        check_pool_setting([name for change in changes for name in change])
        recording = load_recording(args.recording)
        args.recording_dir, args.recording = args.recording, recording
        calibration_implies_its_model(args)  # the changes' model
        chosen = args.cost_model or "calibrated"
        named = argparse.Namespace(model=args.model, hardware=args.hardware)
        args.cost_model = "replay"
        replay = deployment_from_args(args)  # a bad --model is named before any note (QA)
        note_recorded_steps_price(named, chosen)
        other = dataclasses.replace(replay, cost_model=chosen)
        settings = recording.settings
        trace = recording.trace
        recorded, as_placed = _recorded_cluster(settings, trace)
        placed = as_placed is not None

        # Under the model fitted on the recorded steps, where each run's time went against
        # the shapes the recording has (whatif.py: "unrecorded shapes").
        shapes = recorded_shapes(recording.step_shapes()[0]) \
            if chosen == "calibrated" and other.calibration is None else None

        def simulate(deployment: Any, values: dict[str, Any],
                     cluster: ClusterOptions = recorded, observe: Any = None) -> Any:
            return deployment.simulate(trace, values, seed=args.seed, record_events=True,
                                       cluster=cluster, observe=observe)[1]

        def priced(label: str, values: dict[str, Any], cluster: ClusterOptions = recorded,
                   change: dict[str, Any] | None = None) -> Any:
            """A run under the changes' model, with its unrecorded shapes where fitted."""
            if shapes is None:
                return make_run(label, simulate(other, values, cluster), change)
            tally = ShapeTally()
            result = simulate(other, values, cluster, tally.add)
            return make_run(label, result, change, off_record(tally, shapes))

        def variant(change: dict[str, Any]) -> tuple[dict[str, Any], ClusterOptions]:
            cluster = {k: v for k, v in change.items() if k in CLUSTER_KEYS}
            return ({**settings, **implied(change),
                     **{k: v for k, v in change.items() if k not in CLUSTER_KEYS}},
                    dataclasses.replace(recorded, **cluster))

        def implied(change: dict[str, Any]) -> dict[str, Any]:
            """What a change implies that it does not give, which its label says: a block
            size keeps the recorded pool's memory (:func:`pool_at_block_size`); swap or
            auto preemption on a recording without a host tier runs with one as large as
            the device pool (it could not run at all)."""
            extra: dict[str, Any] = dict(pool_at_block_size(settings, change))
            if swaps(change) and \
                    "num_host_blocks" not in change and "swap_space" not in change and \
                    not settings.get("num_host_blocks") and settings.get("num_kv_blocks"):
                extra["num_host_blocks"] = change.get(
                    "num_kv_blocks", extra.get("num_kv_blocks", settings["num_kv_blocks"]))
            return extra

        def change_label(change: dict[str, Any]) -> str:
            return " ".join([*(f"{k}={v}" for k, v in change.items()),
                             *(f"+{k}={v}" for k, v in implied(change).items())])

        for change in changes:  # a bad value is named before anything runs
            other.configs(variant(change)[0])
            cluster = variant(change)[1]
            if "router" in change and cluster.data_parallel_size == 1:  # as simulate says
                print(f"note: router={change['router']} spreads arrivals over replicas; with "
                      "one replica it changes nothing (set data_parallel_size=N with it)",
                      file=sys.stderr)
        if placed:
            fell_back: list[str] = []

            def warn(message: str) -> None:  # the replay diverged: the fitted model runs it
                fell_back.append(message)
                print(f"warning: {message}", file=sys.stderr)

            result = replay_or_fitted(lambda d: simulate(d, settings, as_placed), replay,
                                      warn)
            label = "recorded (replay diverged: fitted model" + \
                (", as placed)" if recorded.data_parallel_size > 1 else ")") \
                if fell_back else "recorded"
            runs = [make_run(label, result)]
        else:  # an older recording of replicas: where the server placed requests is unknown
            print("warning: this recording of replicas does not say where the server placed "
                  f"each request; its run is simulated under the {chosen} model behind the "
                  f"{recorded.router} router", file=sys.stderr)
            runs = []
        if chosen != "replay" or not placed:
            runs.append(priced(f"recorded ({chosen} model)", settings))
        for change in changes:
            runs.append(priced(change_label(change), *variant(change),
                               {**change, **implied(change)}))
        changed = [r for r in runs if r.change is not None]
        # Each change against the recorded settings under the same model and router (the
        # model check, when there is one): what moved is the change's doing, not the model's
        # error or the simulated router's placement.
        base = runs[-len(changed) - 1]
        movers = {r.label: moved(base, r, args.top) for r in changed}
        still = {r.label: nothing_moved(base, r) for r in changed if not movers[r.label]}
        print(f"{Path(args.recording_dir).name}: {len(trace)} requests; changes priced by the "
              f"{chosen} cost model")
        print(table(runs))
        off = model_check_gap(runs[0], base) if base is not runs[0] else None
        if off is not None:
            print(f"note: the {chosen} model {off[0]} ({off[1]:+.0%}): read each change "
                  f"against the \"{base.label}\" column, not against the recording "
                  f"({model_gap_cause(chosen, off[1], args.calibration)})")
        for run in changed:
            extrapolated = run.off_record and run.off_record.note(run.label)
            if extrapolated:
                print(f"note: {extrapolated}")
        for label, rows in movers.items():
            print(f"\nmoved most with {label}:")
            for row in rows:
                diff = row["first_difference"]
                where = "; ".join(f"{k}: {v}" for k, v in diff.items()) if diff else \
                    SAME_DECISIONS
                ttft = (f"{latency_text(row['ttft_before_s'])} -> "
                        f"{latency_text(row['ttft_after_s'])}")
                print(f"  {row['request_id']}: e2e {row['e2e_before_s']:.3f} s -> "
                      f"{row['e2e_after_s']:.3f} s ({row['delta_s']:+.3f} s), TTFT {ttft}; "
                      f"{where}")
            if not rows:
                print(f"  {still[label]}")
        if args.report:
            _write(args.report, json.dumps(to_json(runs, movers), indent=1) + "\n")
        if args.html:
            from kvserve.sim.whatif_html import render_whatif

            _write(args.html, render_whatif(Path(args.recording_dir).name, runs, movers,
                                            still))
    return 0


def _write(path: str, text: str) -> None:
    """A file written, said on stderr as simulate says it (QA: silent); a path that cannot
    be written is one line."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror}") from None
    print(f"wrote {path}", file=sys.stderr)
