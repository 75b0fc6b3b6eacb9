"""``kvserve whatif DIR --set NAME=VALUE``: a server's recording replayed as it ran and
under each change, side by side (docs/recording.md).

The recorded run is the replay of the recorded step times (the server's own decisions and
times); each change runs the same requests with one setting changed, priced by the changes'
cost model (default: fitted on the recorded steps). When that model is not the replay, the
recorded settings also run under it ("model check"), so a change's effect can be read apart
from the cost model's error.

For the requests whose end-to-end latency moved most against the recorded settings under
the same cost model (the model check, or the recorded run when the changes are priced by the
replay itself), the first scheduling decision that differed: each run's events of that
request (admitted, preempted, resumed, finished), each placed at the step it happened
before (the number of steps that started earlier; in a cluster of replicas, the number of
any replica's steps that ended earlier, and the replica is named), compared in order; the
first pair that differs in kind or replica, or in step at another time, is the one shown
(the same decision taken at the same moment is the same, however the steps before it
numbered).

Under the cost model fitted on the recorded steps, each run also says how much of its step
time went to step shapes the recording has fewer than SHAPE_SUPPORT steps of ("unrecorded
shapes"; a shape is whether the step carries prefill, and its requests to the octave): the
fit extrapolates there (docs/fidelity.md, "Shapes the recording lacks").

A recording of replicas runs as a cluster: the recorded run with each request on the replica
the server placed it on, the model check and the changes behind the server's router, and a
change may name the cluster's size or router (``data_parallel_size``, ``router``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvserve.runs import SimResult
from kvserve.sim.executor import BatchView
from kvserve.sim.report import aggregate, request_latencies

DECISIONS = ("admitted", "preempted", "resumed", "finished")


@dataclasses.dataclass(frozen=True)
class Decision:
    kind: str
    step: int
    time: float
    replica: int | None = None  # in a cluster: the replica that decided it

    def describe(self) -> str:
        where = "" if self.replica is None else f" on replica {self.replica}"
        return f"{self.kind}{where} at step {self.step} ({self.time:.3f} s)"


@dataclasses.dataclass
class Run:
    label: str
    result: SimResult
    aggregate: dict[str, Any]
    change: dict[str, Any] | None = None  # the settings changed; None: recorded settings
    off_record: OffRecord | None = None  # under the fitted model: its unrecorded shapes


def make_run(label: str, result: SimResult, change: dict[str, Any] | None = None,
             off_record: OffRecord | None = None) -> Run:
    figures = aggregate(result)
    # requests that never got a first token (refused, or cut or aborted in the queue): no
    # TTFT or queue figure counts them, so a change that strands more can read better (the
    # dashboard pass: queue p99 0.653 s -> 0 s where two requests waited 4 s, then aborted)
    figures["no_first_token"] = sum(request_latencies(r)["ttft"] is None
                                    for r in result.records)
    if off_record is not None:
        figures["off_record_share"] = off_record.share
        figures["off_record"] = off_record.to_json()
    return Run(label, result, figures, change, off_record)


SHAPE_SUPPORT = 5  # a shape the recording has fewer steps of is extrapolated (module doc)
OFF_RECORD_NOTE = 0.2  # a change with this share of its step time there gets a note


def shape_bin(view: BatchView) -> tuple[bool, int]:
    """A step's shape as the support check sorts it: whether it carries prefill (more tokens
    than decode rows), and its requests' octave (1, 2-3, 4-7, ...)."""
    return view.num_tokens > view.num_decode_seqs, view.num_seqs.bit_length()


def describe_bin(shape: tuple[bool, int]) -> str:
    prefill, octave = shape
    low, high = 1 << max(octave - 1, 0), (1 << octave) - 1
    rows = "1 request" if high <= 1 else f"{low}-{high} requests"
    return f"{'steps with prefill' if prefill else 'decode-only steps'} of {rows}"


class ShapeTally:
    """Seconds priced per shape (:func:`shape_bin`): an ``observe`` for
    ``Deployment.simulate``."""

    def __init__(self) -> None:
        self.seconds: Counter[tuple[bool, int]] = Counter()

    def add(self, view: BatchView, seconds: float) -> None:
        self.seconds[shape_bin(view)] += seconds


@dataclasses.dataclass(frozen=True)
class OffRecord:
    """The share of a run's priced step time in shapes the recording has fewer than
    SHAPE_SUPPORT steps of, and those shapes (description, seconds, recorded steps),
    most seconds first."""

    share: float
    shapes: tuple[tuple[str, float, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"share": self.share, "support_steps": SHAPE_SUPPORT,
                "shapes": [{"shape": shape, "seconds": seconds, "recorded_steps": steps}
                           for shape, seconds, steps in self.shapes]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OffRecord:
        return cls(data["share"], tuple((s["shape"], s["seconds"], s["recorded_steps"])
                                        for s in data["shapes"]))

    def note(self, label: str) -> str | None:
        """The warning where the share is OFF_RECORD_NOTE or more, else None."""
        if self.share < OFF_RECORD_NOTE:
            return None
        top = "; ".join(f"{shape}: {seconds:.1f} s, {steps} recorded"
                        for shape, seconds, steps in self.shapes[:3])
        return (f"{self.share:.0%} of {label}'s step time went to step shapes the recording "
                f"has fewer than {SHAPE_SUPPORT} steps of ({top}); the cost model fitted on "
                "the recorded steps prices those by extrapolation, which has put tails "
                "15-40% off (docs/fidelity.md, \"Shapes the recording lacks\"): to check, "
                "record a run under a setting that makes such steps")


def recorded_shapes(views: Iterable[BatchView]) -> Counter[tuple[bool, int]]:
    """How many recorded steps each shape has."""
    return Counter(shape_bin(view) for view in views)


def off_record(tally: ShapeTally, recorded: Counter[tuple[bool, int]]) -> OffRecord:
    total = sum(tally.seconds.values())
    thin = sorted(((seconds, shape) for shape, seconds in tally.seconds.items()
                   if recorded[shape] < SHAPE_SUPPORT), reverse=True)
    return OffRecord(sum(seconds for seconds, _ in thin) / total if total > 0 else 0.0,
                     tuple((describe_bin(shape), seconds, recorded[shape])
                           for seconds, shape in thin))


def decisions(result: SimResult) -> dict[str, list[Decision]]:
    """Each request's scheduling decisions in order, placed at steps (module docstring)."""
    starts = list(result.steps.time)
    replica_of = getattr(result, "replica_of", {})
    out: dict[str, list[Decision]] = {}
    for event in result.events:
        kind = str(getattr(event.kind, "value", event.kind))
        if kind in DECISIONS:
            out.setdefault(event.request_id, []).append(
                Decision(kind, bisect.bisect_left(starts, event.time), event.time,
                         replica_of.get(event.request_id)))
    return out


def first_difference(base: Sequence[Decision], other: Sequence[Decision]
                     ) -> tuple[Decision | None, Decision | None] | None:
    """The first pair of decisions that differ in kind or replica, or in step at another
    time (None for a missing one), or None if the two lists agree. One taken at the same
    moment is the same decision, whatever the steps before it numbered (QA: the same
    admission at 6.911 s was shown as a difference, at step 203 against 198)."""
    for index in range(max(len(base), len(other))):
        a = base[index] if index < len(base) else None
        b = other[index] if index < len(other) else None
        if a is None or b is None or (a.kind, a.replica) != (b.kind, b.replica) or \
                (a.step != b.step and abs(a.time - b.time) > 1e-9):
            return a, b
    return None


# a request whose own decisions are all the same in both runs (its first difference None)
SAME_DECISIONS = "its own decisions alike; the steps around them took another time"


def latency_text(value: float | None) -> str:
    """A moved row's latency as printed ("none": no first token in that run)."""
    return "none" if value is None else f"{value:.3f} s"


def moved(base: Run, other: Run, top: int) -> list[dict[str, Any]]:
    """The ``top`` requests whose end-to-end latency moved most (absolute change), with their
    time to first token before and after (an incident is often a TTFT one; QA) and the first
    decision of theirs that differed."""
    base_latencies = {r.request_id: request_latencies(r) for r in base.result.records}
    base_decisions, other_decisions = decisions(base.result), decisions(other.result)
    rows = []
    for record in other.result.records:
        latencies = request_latencies(record)
        before = base_latencies.get(record.request_id, {}).get("e2e")
        after = latencies["e2e"]
        if before is None or after is None:
            continue
        rows.append({"request_id": record.request_id, "e2e_before_s": before,
                     "e2e_after_s": after, "delta_s": after - before,
                     "ttft_before_s": base_latencies[record.request_id]["ttft"],
                     "ttft_after_s": latencies["ttft"]})
    rows.sort(key=lambda r: (-abs(r["delta_s"]), r["request_id"]))
    for row in rows[:top]:
        pair = first_difference(base_decisions.get(row["request_id"], []),
                                other_decisions.get(row["request_id"], []))
        row["first_difference"] = None if pair is None else {
            base.label: pair[0].describe() if pair[0] else "none",
            other.label: pair[1].describe() if pair[1] else "none"}
    return [row for row in rows[:top] if abs(row["delta_s"]) > 0]


def nothing_moved(base: Run, other: Run) -> str:
    """What to say where :func:`moved` found no request: that none moved, or that none
    finished in both runs to compare (every request refused, say)."""
    finished = {r.request_id for r in base.result.records
                if request_latencies(r)["e2e"] is not None}
    both = sum(1 for r in other.result.records
               if r.request_id in finished and request_latencies(r)["e2e"] is not None)
    if not both:
        return "no request finished in both runs, so none to compare (see 'not finished')"
    return f"no request's latency moved (of {both:,} that finished in both runs)"


ROWS = (
    ("requests finished", "num_finished", "{:,}"),
    ("not finished", "not_finished", "{}"),  # refused, aborted, timed out: by reason
    ("duration", "duration_s", "{:.3f} s"),
    ("output tok/s", "throughput_output_tok_s", "{:,.1f}"),
    ("TTFT p50", "ttft_p50", "{:.3f} s"), ("TTFT p99", "ttft_p99", "{:.3f} s"),
    ("ITL p50", "itl_p50", "{:.4f} s"), ("ITL p99", "itl_p99", "{:.4f} s"),
    ("E2E p50", "e2e_p50", "{:.3f} s"), ("E2E p99", "e2e_p99", "{:.3f} s"),
    ("queue p99", "queue_p99", "{:.3f} s"),
    ("no first token", "no_first_token", "{:,}"),  # left out of TTFT and queue (where any)
    ("preemptions", "num_preemptions", "{:,}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
    ("KV peak", "kv_usage_peak", "{:.1%}"),
    ("steps", "num_steps", "{:,}"),
    ("unrecorded shapes", "off_record_share", "{:.0%}"),  # only under the fitted model
)


def rows_for(runs: Sequence[Run]) -> list[tuple[str, str, str]]:
    """ROWS, less "unrecorded shapes" where no run has it (a model not fitted here) and "no
    first token" where every request of every run got one."""
    return [row for row in ROWS
            if (row[1] != "off_record_share" or
                any(run.aggregate.get("off_record_share") is not None for run in runs))
            and (row[1] != "no_first_token" or
                 any(run.aggregate.get("no_first_token") for run in runs))]


def figure(aggregate_: dict[str, Any], key: str, pattern: str) -> str:
    if key == "not_finished":  # the requests a change refused or ended early, by reason
        reasons = {reason: count for reason, count in aggregate_["finish_reasons"].items()
                   if reason not in ("stop", "length")}
        return ", ".join(f"{count:,} {reason}" for reason, count in reasons.items()) or "0"
    value = aggregate_.get(key)
    return "-" if value is None else pattern.format(value)


def table(runs: Sequence[Run]) -> str:
    """The aggregate figures, one column per run, as plain text."""
    header = ["", *[run.label for run in runs]]
    lines = [[label, *[figure(run.aggregate, key, pattern) for run in runs]]
             for label, key, pattern in rows_for(runs)]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in [header, *lines])


def to_json(runs: Sequence[Run], movers: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {"runs": [{"label": run.label,
                      "change": run.change,
                      "aggregate": run.aggregate} for run in runs],
            "moved": movers}

