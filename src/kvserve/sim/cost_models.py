"""Cost models: how long one scheduler step takes, from the batch's shape alone.

One protocol, ``step_time(scheduler_output, view) -> seconds``; the simulator's clock
advances by that much per step. ``unit`` counts steps; ``roofline`` prices FLOPs and bytes
on a hardware preset; ``calibrated`` reads coefficients measured on a real engine. A model
that also prices where the KV blocks lie (the view's ``scattered_context_tokens``) says so
with a true ``needs_block_layout`` attribute; the simulator tracks the layout only then
(:func:`needs_block_layout`). A model may also have ``step_start(now) -> seconds``, the
earliest time the next step may start (a replayed engine log holds each step until the
engine's logged start); the simulator calls it before every step, so a model wrapping
another must pass it on, as it must ``starts`` (the replayed steps' logged starts, or None:
:func:`holds_recorded_steps`, which times a recording's arrivals by them).

A new named model (``--cost-model NAME``): its class here, its name in
:data:`kvserve.sim.deployment.COST_MODELS` and a branch in ``Deployment.build_cost_model``,
and whether a swap's block copies add time to its steps (``TIMELESS_COPIES`` there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvserve.core import SchedulerOutput
from kvserve.core.checks import is_finite, is_int
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import HardwareSpec, ModelSpec, dtype_bytes


class CostModelError(ValueError):
    """A cost model that cannot be built: bad parameters or a bad coefficients file."""


class CostModel(Protocol):
    name: str

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        """Seconds the step takes on the modelled hardware."""
        ...

    def describe(self) -> dict[str, Any]:
        """The model and its parameters, echoed in the report."""
        ...


def needs_block_layout(model: CostModel) -> bool:
    """Whether ``model`` reads ``BatchView.scattered_context_tokens``. An optional attribute
    rather than part of the protocol, so a model that does not price the layout (every one
    but a calibrated model with a layout coefficient) needs nothing new."""
    return bool(getattr(model, "needs_block_layout", False))


class ObservedCostModel:
    """A cost model that also hands each step it prices to ``observe`` (the step's shape and
    its seconds): ``kvserve whatif`` tallies where a change's time went by shape."""

    def __init__(self, inner: CostModel, observe: Callable[[BatchView, float], None]) -> None:
        self.inner = inner
        self.observe = observe
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:  # prices, step_start, needs_block_layout, ...
        return getattr(self.inner, name)

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        seconds = self.inner.step_time(scheduler_output, view)
        self.observe(view, seconds)
        return seconds

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class UnitCostModel:
    """Every step costs exactly 1.0 s, so simulated seconds count steps."""

    name = "unit"

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        return 1.0

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


@dataclass(frozen=True)
class RooflineCostModel:
    """step = max(compute, memory) + fixed overhead (+ tensor-parallel all-reduces).

    compute: 2 FLOPs per weight per token through the layers, the LM head per sampled token,
        and 4 * layers * heads * head_dim per causal (query, key) pair of attention;
    memory: every weight once per step, every scheduled sequence's cached KV read once,
        the new tokens' KV written once.
    With tensor parallelism of degree tp, FLOPs and bytes split across tp devices and each
    layer adds two ring all-reduces of the step's activations.
    """

    model: ModelSpec
    hardware: HardwareSpec
    dtype: str = "bf16"
    tensor_parallel_size: int = 1
    name: str = "roofline"
    kv_dtype: str | None = None  # the KV cache's, when not the weights' (fp8)

    # The terms that do not depend on the batch, computed once (the simulator prices every
    # step): each is the left part of its expression below, so every float is the same.
    _terms: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        dtype_bytes(self.kv_dtype or self.dtype)
        if self.tensor_parallel_size < 1:
            raise CostModelError("tensor_parallel_size must be >= 1")
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        object.__setattr__(self, "_terms", (
            2.0 * m.matmul_params_per_token, 2.0 * m.lm_head_params,
            4.0 * m.num_layers * m.num_heads * m.head_dim,
            m.num_params * dtype_bytes(self.dtype),
            m.kv_elements_per_token(tp) * dtype_bytes(self.kv_dtype or self.dtype),
            hw.flops_for(self.dtype) * hw.compute_efficiency * tp,
            hw.memory_bandwidth * hw.memory_efficiency * tp))

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        """``max(compute_time, memory_time) + overhead + allreduce_time``, inline."""
        num_tokens = view.num_tokens
        if num_tokens == 0:
            return 0.0
        per_token, per_sampled, per_pair, weights, kv_per_token, peak, bandwidth = \
            self._terms
        compute = (per_token * num_tokens + per_sampled * view.num_sampled
                   + per_pair * view.attention_pairs) / peak
        memory = (weights + kv_per_token * (view.context_tokens + num_tokens)) / bandwidth
        return (max(compute, memory) + self.hardware.step_overhead_s
                + self.allreduce_time(view))

    def flops(self, view: BatchView) -> float:
        m = self.model
        return (2.0 * m.matmul_params_per_token * view.num_tokens
                + 2.0 * m.lm_head_params * view.num_sampled
                + 4.0 * m.num_layers * m.num_heads * m.head_dim * view.attention_pairs)

    def bytes_moved(self, view: BatchView) -> float:
        size = dtype_bytes(self.dtype)
        kv_per_token = self.model.kv_elements_per_token(self.tensor_parallel_size) * \
            dtype_bytes(self.kv_dtype or self.dtype)
        return (self.model.num_params * size
                + kv_per_token * (view.context_tokens + view.num_tokens))

    def compute_time(self, view: BatchView) -> float:
        hw = self.hardware
        peak = hw.flops_for(self.dtype) * hw.compute_efficiency * self.tensor_parallel_size
        return self.flops(view) / peak

    def memory_time(self, view: BatchView) -> float:
        hw = self.hardware
        bandwidth = hw.memory_bandwidth * hw.memory_efficiency * self.tensor_parallel_size
        return self.bytes_moved(view) / bandwidth

    def allreduce_time(self, view: BatchView) -> float:
        tp = self.tensor_parallel_size
        if tp == 1:
            return 0.0
        message = view.num_tokens * self.model.hidden_size * dtype_bytes(self.dtype)
        ring = 2.0 * (tp - 1) / tp * message / self.hardware.interconnect_bandwidth
        return 2 * self.model.num_layers * (ring + self.hardware.allreduce_latency_s)

    def describe(self) -> dict[str, Any]:
        out = {"name": self.name, "model": self.model.name, "hardware": self.hardware.name,
               "dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size}
        if self.kv_dtype is not None:
            out["kv_dtype"] = self.kv_dtype
        return out


CALIBRATED_FORMAT = "kvserve-cost-model/1"
LAYOUT_TERM = "per_scattered_context_token_s"
# The step-kind term: what a step carrying prefill chunks costs beyond a decode-only step of
# the same shape (docs/fidelity.md, "Step kinds").
KIND_TERMS = ("per_prefill_step_s",)
CALIBRATED_TERMS = ("fixed_s", "per_token_s", "per_seq_s", "per_sampled_s",
                    "per_context_token_s", "per_attention_pair_s", LAYOUT_TERM, *KIND_TERMS)
# Terms a file may leave out (written before they existed): they load as 0, and a model
# with them at 0 prices and describes itself exactly as one without them.
OPTIONAL_TERMS = (LAYOUT_TERM, *KIND_TERMS)


@dataclass(frozen=True)
class CalibratedCostModel:
    """A linear model in the batch's shape, with coefficients measured on a real engine::

        step = fixed_s + per_token_s * max(tokens, min_tokens) + per_seq_s * seqs
               + per_sampled_s * sampled + per_context_token_s * context_tokens
               + per_attention_pair_s * pairs
               + per_scattered_context_token_s * scattered_context_tokens
               + per_prefill_step_s * (1 if the step carries a prefill chunk else 0)

    ``min_tokens`` is the knee of small steps: below it a step costs about the same however
    few tokens it has, because streaming the weights, not arithmetic, bounds it.

    ``per_scattered_context_token_s`` is the optional layout term: the extra cost of a context
    token whose block does not follow the request's previous block by id + 1
    (:mod:`kvserve.sim.layout`). When it is > 0, ``needs_block_layout`` is true and the
    simulator tracks block tables to supply the count; at 0 (a file without the key) the
    model prices the batch's shape alone, describes itself without the term and simulates
    exactly as before the term existed.

    ``per_prefill_step_s`` is the optional step-kind term: the fixed cost of a step that
    carries a prefill chunk (any sequence that is not a one-token decode after cached
    context, ``num_tokens > num_decode_seqs``) beyond a decode-only step's ``fixed_s``;
    such a step takes the engine runner's mixed path (prefill attention per chunk, chunk
    rows packed after the decodes). Chunk tokens already have a slope of their own: on a
    decode-only step tokens = seqs = sampled, so decodes are priced by per_token_s +
    per_seq_s + per_sampled_s and chunk tokens by per_token_s alone. At 0 (a file without
    it) the model is the six-term one, bit for bit.

    File format (JSON): {"format": "kvserve-cost-model/1", "coefficients": {term: seconds},
    optional "min_tokens" (default 0), "source": free text, "meta" and "samples" from
    kvserve calibrate}. Terms are the eight in CALIBRATED_TERMS; missing terms are 0
    (so files written before the layout or kind terms load unchanged); unknown keys are
    errors.
    :func:`kvserve.sim.calibration.fit` makes one from measured (batch shape, seconds) steps.
    """

    coefficients: dict[str, float]
    source: str = ""
    min_tokens: int = 0
    name: str = "calibrated"

    def __post_init__(self) -> None:
        missing = [term for term in OPTIONAL_TERMS if term not in self.coefficients]
        if missing:  # built in code before the terms existed
            object.__setattr__(self, "coefficients",
                               {**self.coefficients, **dict.fromkeys(missing, 0.0)})

    @property
    def needs_block_layout(self) -> bool:
        return self.coefficients[LAYOUT_TERM] > 0

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        c = self.coefficients
        tokens = view.num_tokens if view.num_tokens > self.min_tokens else self.min_tokens
        # The optional terms are added last: at 0 each adds exactly 0.0, so prices (and
        # reports) of a model without them are bit-for-bit those of the six-term model.
        return (c["fixed_s"] + c["per_token_s"] * tokens
                + c["per_seq_s"] * view.num_seqs + c["per_sampled_s"] * view.num_sampled
                + c["per_context_token_s"] * view.context_tokens
                + c["per_attention_pair_s"] * view.attention_pairs
                + c[LAYOUT_TERM] * view.scattered_context_tokens
                + (c["per_prefill_step_s"] if view.num_tokens > view.num_decode_seqs
                   else 0.0))

    def describe(self) -> dict[str, Any]:
        coefficients = dict(self.coefficients)
        for term in OPTIONAL_TERMS:
            if not coefficients[term]:
                del coefficients[term]  # unused: the report reads as it did without it
        return {"name": self.name, "coefficients": coefficients,
                "min_tokens": self.min_tokens, "source": self.source}

    @classmethod
    def from_dict(cls, data: Any) -> CalibratedCostModel:
        if not isinstance(data, dict):
            raise CostModelError("a calibrated cost model must be a JSON object")
        # "meta" (machine, model, fit quality) and "samples" (the measured steps) are written
        # by kvserve calibrate for people; the model itself reads only the coefficients.
        unknown = sorted(set(data) - {"format", "coefficients", "min_tokens", "source", "meta",
                                      "samples"})
        if unknown:
            raise CostModelError(f"unknown key(s) in cost model: {', '.join(unknown)}")
        if data.get("format") != CALIBRATED_FORMAT:
            raise CostModelError(f"cost model format must be {CALIBRATED_FORMAT!r}, "
                                 f"got {data.get('format')!r}")
        given = data.get("coefficients")
        if not isinstance(given, dict) or not given:
            raise CostModelError("cost model needs a non-empty 'coefficients' object")
        unknown = sorted(set(given) - set(CALIBRATED_TERMS))
        if unknown:
            raise CostModelError(f"unknown coefficient(s) {', '.join(unknown)}; known: "
                                 f"{', '.join(CALIBRATED_TERMS)}")
        coefficients = {}
        for term in CALIBRATED_TERMS:
            value = given.get(term, 0.0)
            if not is_finite(value) or not 0 <= value <= MAX_COEFFICIENT_S:
                raise CostModelError(f"coefficient {term} must be a number of seconds in "
                                     f"[0, {MAX_COEFFICIENT_S:g}], got {value!r}")
            coefficients[term] = float(value)
        if coefficients["fixed_s"] + coefficients["per_token_s"] <= 0:
            raise CostModelError("fixed_s or per_token_s must be > 0, or time never advances")
        min_tokens = data.get("min_tokens", 0)
        if not is_int(min_tokens) or not 0 <= min_tokens <= MAX_MIN_TOKENS:  # QA: 10**30
            raise CostModelError(f"min_tokens must be an integer in [0, {MAX_MIN_TOKENS:,}] "
                                 f"(a step's tokens), got {min_tokens!r}")  # priced 1e28 s
        return cls(coefficients, str(data.get("source", "")), min_tokens)

    @classmethod
    def load(cls, path: str | Path) -> CalibratedCostModel:
        try:
            # utf-8-sig: a BOM is taken, as in traces and step logs (QA: refused here alone)
            data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        except OSError as error:
            raise CostModelError(f"cannot read cost model {path}: {error.strerror}") from None
        except UnicodeDecodeError:  # the simulator pass: the codec's words, no file named
            raise CostModelError(f"{path}: not a cost model: it is not UTF-8 text (a cost "
                                 "model is JSON, kvserve calibrate's)") from None
        except json.JSONDecodeError as error:
            raise CostModelError(f"{path}: not valid JSON: {error.msg} "
                                 f"(line {error.lineno})") from None
        try:
            return cls.from_dict(data)
        except CostModelError as error:  # which file (QA: the coefficient alone was named)
            raise CostModelError(f"{path}: {error}") from None


# A coefficient's ceiling: an hour a step, token or pair is no measurement, and past it a
# run's clock reached inf (QA: fixed_s 1.7e308 printed "simulated time inf s", exit 0).
MAX_COEFFICIENT_S = 3600.0
MAX_MIN_TOKENS = 1_000_000  # the small-step knee: far above any step's token budget


def holds_recorded_steps(cost_model: object) -> bool:
    """Whether ``cost_model`` replays an engine's steps each held to its logged start: then
    a recorded request reaches the scheduler when that engine took it (between the same two
    steps); under any other model, when the server received it (TraceRequest.at_receipt)."""
    return getattr(cost_model, "starts", None) is not None


class ReplayCostModel:
    """Step times measured on a real engine, replayed in order (``kvserve simulate
    --replay-step-times LOG``, the step log of :mod:`kvserve.engine.trace_runner`).

    With the same trace and flags the simulator then makes the engine's decisions exactly;
    each step's token count is checked against the log, and a divergence is an error naming
    the step.

    With the logged ``starts`` the simulator also holds each step until the time the engine
    decided it (:meth:`step_start`): the engine's loop reads its clock a little after the
    arrival that woke it, and an arrival in between is one the engine admitted at once and
    a replay starting at the first arrival would admit a step later.
    """

    name = "replay"

    def __init__(self, durations: list[float], num_tokens: list[int], source: str = "",
                 starts: list[float] | None = None) -> None:
        if starts is not None and len(starts) != len(durations):
            raise ValueError("one start per step")
        self.durations = durations
        self.num_tokens = num_tokens
        self.starts = starts
        self.source = source
        self.index = 0

    def step_start(self, now: float) -> float:
        """The earliest time the next step may start: the engine's logged start, if known."""
        starts, index = self.starts, self.index
        if starts is None or index >= len(starts) or starts[index] <= now:
            return now
        return starts[index]

    def step_time(self, scheduler_output: SchedulerOutput, view: BatchView) -> float:
        index = self.index
        if index >= len(self.durations):
            raise CostModelError(f"replay log has {len(self.durations)} steps; the simulation "
                                 "scheduled more")
        scheduled = scheduler_output.total_num_scheduled_tokens
        if scheduled != self.num_tokens[index]:
            raise CostModelError(f"replay diverged at step {index}{self._where()}: the engine "
                                 f"scheduled {self.num_tokens[index]} tokens, the simulator "
                                 f"{scheduled}")
        self.index += 1
        return self.durations[index]

    def _where(self) -> str:
        """Which log, when it is one engine of several: " of ... (engine 1)"."""
        return f" of {self.source}" if "(engine " in self.source else ""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "num_steps": len(self.durations),
                "held_to_logged_starts": self.starts is not None}

    @classmethod
    def load(cls, path: str | Path) -> ReplayCostModel:
        durations: list[float] = []
        num_tokens: list[int] = []
        starts: list[float] = []
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise CostModelError(f"cannot read step log {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise CostModelError(f"{path}: not a step log: it is not UTF-8 text (a step log "
                                 "is JSON lines)") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise CostModelError(f"{path}:{number}: not valid JSON: {error.msg}") from None
            if not isinstance(row, dict) or row.get("type") != "step":
                continue
            duration, tokens = row.get("duration"), row.get("num_scheduled_tokens")
            if not isinstance(duration, (int, float)) or isinstance(duration, bool) \
                    or not math.isfinite(duration) or duration < 0 \
                    or not isinstance(tokens, int) or tokens < 1:
                raise CostModelError(f"{path}:{number}: a step needs duration >= 0 and "
                                     "num_scheduled_tokens >= 1")
            durations.append(float(duration))
            num_tokens.append(tokens)
            start = row.get("start")
            if start is not None:
                if not isinstance(start, (int, float)) or isinstance(start, bool) \
                        or not math.isfinite(start):
                    raise CostModelError(f"{path}:{number}: start must be a number")
                starts.append(float(start))
        if not durations:
            raise CostModelError(f"{path}: no step lines (is it a step log from the engine?)")
        if starts and len(starts) != len(durations):
            raise CostModelError(f"{path}: {len(starts)} of {len(durations)} steps have a "
                                 "start: give every step one, or none")
        # The engine's logs carry starts; a log without them replays by durations alone.
        return cls(durations, num_tokens, str(path), starts or None)
