"""Fit a calibrated cost model from measured steps (for the engine's self-measurement).

Each sample is one executed step: its batch shape (:class:`BatchView`) and the seconds it
took. The fit minimises the squared *relative* error on the calibrated model's terms (a
10 ms decode step counts as much as a 2 s prefill: most steps of an online workload are
small, and inter-token latency is one step), constrained to non-negative coefficients (a
term with a negative fitted cost is dropped and the rest refitted, until none is
negative), so the result is a valid ``kvserve-cost-model/1`` file. The knee
``min_tokens`` is chosen from :data:`KNEES` by the lowest mean relative error.

The layout term (``per_scattered_context_token_s``) is fitted only when asked
(``layout_term``), and can only be separated from the per context token cost if the samples
include the same shapes with consecutive and with scattered blocks (``kvserve calibrate
--layout-term`` measures both). Off, the model is shape-only: on this machine the term
fixed a batch workload's error but made Poisson workloads' worse (docs/fidelity.md).

The step-kind term (``per_prefill_step_s``: the fixed cost of a step with prefill chunks
beyond a decode-only one) is fitted only when asked (``kind_term``): in service the six
terms priced small chunk loads low and large ones high (docs/fidelity.md, "Step kinds");
the grid has few mixed shapes to separate it.

``relative_to`` says what a step's error is relative to. ``"measured"`` (the default) is
plain relative least squares, which leans low when the measurements are noisy: a step
measured slow weighs less than one measured fast, so in service, where single steps
scatter by ~10%, the fit under-prices the sum of the noisier (decode-only) steps by ~4%.
``"priced"`` divides by the model's own price instead (iteratively reweighted, the
quasi-likelihood fit for errors proportional to the step's cost), which does not lean.

Samples come from a grid of shapes timed one by one (``kvserve calibrate``) or, in
service, from the steps an engine ran on a trace, each with the shape the engine recorded
(``kvserve calibrate --trace``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.core.checks import is_finite
from kvserve.flags import write_file_atomically
from kvserve.sim.cost_models import (
    CALIBRATED_FORMAT,
    CALIBRATED_TERMS,
    KIND_TERMS,
    LAYOUT_TERM,
    MAX_COEFFICIENT_S,
    CalibratedCostModel,
)
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import ModelSpec, hardware_preset_for, model_preset_for

KNEES = (0, 1, 2, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def features(view: BatchView, min_tokens: int = 0) -> list[float]:
    """The calibrated model's terms, in CALIBRATED_TERMS order."""
    return [1.0, max(view.num_tokens, min_tokens), view.num_seqs, view.num_sampled,
            view.context_tokens, view.attention_pairs, view.scattered_context_tokens,
            1.0 if view.num_tokens > view.num_decode_seqs else 0.0]


POOR_FIT = 0.5  # a mean step error past this prices single steps poorly: say so


def goodness(model: CalibratedCostModel, views: Sequence[BatchView],
             seconds: Sequence[float]) -> dict[str, float]:
    """How well ``model`` prices the measured steps: mean and max relative error, the
    error of the summed time, and R^2."""
    predicted = np.array([model.step_time(None, v) for v in views])  # type: ignore[arg-type]
    measured = np.array(seconds)
    error = np.abs(predicted - measured) / measured
    total = float(((measured - measured.mean()) ** 2).sum()) or 1.0
    return {"mean_abs_error": float(error.mean()), "max_abs_error": float(error.max()),
            "error_of_the_sum": float(predicted.sum() / measured.sum() - 1),
            "r2": 1.0 - float(((measured - predicted) ** 2).sum()) / total}


def poor_fit_note(error: float) -> str | None:
    """A warning's text where a fit's mean step error is past POOR_FIT, else None."""
    if error <= POOR_FIT:
        return None
    return (f"the fit prices single steps poorly (mean step error {100 * error:.0f}%: the "
            "steps' times are noisy, or their shapes vary too little to tell the terms "
            "apart); a run's total duration holds better than per-step figures such as "
            "ITL")


def _nonnegative_relative_fit(x: np.ndarray, y: np.ndarray, active: list[int],
                              scale: np.ndarray | None = None) -> np.ndarray:
    """Coefficients >= 0 for the ``active`` columns (the others stay 0), minimising the
    squared error relative to ``scale`` (default: the measured seconds ``y``)."""
    scale = y if scale is None else scale
    weighted_x, weighted_y = x / scale[:, None], y / scale
    active = list(active)
    coefficients = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(weighted_x[:, active], weighted_y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        del active[int(np.argmin(solution))]
    return coefficients


PRICED_ITERATIONS = 8  # reweightings for relative_to="priced"; the price settles in ~4


def fit(views: Sequence[BatchView], seconds: Sequence[float], source: str = "",
        knees: Sequence[int] = KNEES, layout_term: bool = False, kind_term: bool = False,
        relative_to: str = "measured") -> CalibratedCostModel:
    if relative_to not in ("measured", "priced"):
        raise ValueError(f"relative_to must be 'measured' or 'priced', got {relative_to!r}")
    left_out = ({LAYOUT_TERM} if not layout_term else set()) | \
        (set(KIND_TERMS) if not kind_term else set())
    active = [i for i, term in enumerate(CALIBRATED_TERMS) if term not in left_out]
    if len(views) != len(seconds) or len(views) < len(active):
        raise ValueError(f"need as many step times as batch shapes, and at least "
                         f"{len(active)} of them; got {len(views)} and {len(seconds)}")
    y = np.asarray(seconds, dtype=float)
    if not (y > 0).all():
        raise ValueError("every measured step time must be > 0")
    best: tuple[float, int, np.ndarray] | None = None
    for knee in knees:
        x = np.asarray([features(v, knee) for v in views], dtype=float)
        coefficients = _nonnegative_relative_fit(x, y, active)
        scale = y
        if relative_to == "priced":
            for _ in range(PRICED_ITERATIONS):
                scale = np.maximum(x @ coefficients, y.min() / 10)  # a price is never ~0
                refitted = _nonnegative_relative_fit(x, y, active, scale)
                if refitted[0] + refitted[1] <= 0:  # fixed_s and per_token_s both dropped:
                    break  # a model whose clock cannot advance; keep the last valid one
                coefficients = refitted
            scale = np.maximum(x @ coefficients, y.min() / 10)
        if coefficients[0] + coefficients[1] <= 0:  # fixed_s and per_token_s both 0: a
            continue  # clock a step without attention cannot advance; not a candidate
        score = float((np.abs(x @ coefficients - y) / scale).mean())
        if best is None or score < best[0]:
            best = (score, knee, coefficients)
    if best is None:  # every knee put the whole time on other terms: fit the base two alone
        knee = knees[0]
        x = np.asarray([features(v, knee) for v in views], dtype=float)
        best = (0.0, knee, _nonnegative_relative_fit(x, y, [0, 1]))
    _, knee, coefficients = best
    x = np.asarray([features(v, knee) for v in views], dtype=float)
    error = float((np.abs(x @ coefficients - y) / y).mean())
    note = f"fitted on {len(y)} steps; mean abs error {100 * error:.1f}%"
    return CalibratedCostModel.from_dict({
        "format": CALIBRATED_FORMAT,
        "coefficients": {t: float(c) for t, c in zip(CALIBRATED_TERMS, coefficients,
                                                       strict=True)},
        "min_tokens": knee,
        "source": f"{source}; {note}" if source else note,
    })


def save(model: CalibratedCostModel, path: str | Path) -> None:
    data = {"format": CALIBRATED_FORMAT, "source": model.source,
            "coefficients": model.coefficients, "min_tokens": model.min_tokens}
    write_file_atomically(path, json.dumps(data, indent=1) + "\n")


def read_step_log(path: str | Path) -> tuple[list[BatchView], list[float]]:
    """Each step's recorded shape and measured seconds from an engine's step log (the
    trace runner's JSONL, one ``{"type": "step", ..., "duration", "shape"}`` row a step) or
    a recording directory (every engine's log). Steps without a shape or with no duration
    are skipped; a log with no usable step is an error naming the file."""
    from kvserve.sim.recording import is_recording, load_recording

    if is_recording(path):
        rows = [s for log in load_recording(path, warn=lambda _: None).engines.values()
                for s in log.fit_steps]
    else:
        rows = []
        try:
            lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
        except OSError as error:
            raise ValueError(f"cannot read step log {path}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a step log: it is not UTF-8 text (a step log is "
                             "JSON lines)") from None
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON: {error.msg}") from None
            if isinstance(row, dict) and row.get("type") == "step":
                rows.append(row)
    views, seconds = shaped_steps(rows, str(path))
    if not views:
        raise ValueError(f"{path}: no step with a shape and a duration (is it an engine's "
                         "step log or a recording?)")
    return views, seconds


# The largest count a logged step may hold, and its longest duration (MAX_COEFFICIENT_S, an
# hour): past these a line is corrupt (the calibration pass: an Infinity blamed the fit,
# 1e300 wrote "r2": NaN)
MAX_SHAPE_COUNT = 1 << 53  # (attention pairs of a long-context chunk pass 2^31: the review)


def shaped_steps(rows: Sequence[dict], where: str) -> tuple[list[BatchView], list[float]]:
    """The fittable steps of logged step rows: those with a shape and a duration > 0 (a
    duration or a count past what a step can take is a ValueError naming it)."""
    views, seconds = [], []
    for row in rows:
        shape, duration = row.get("shape"), row.get("duration")
        if isinstance(duration, (int, float)) and not isinstance(duration, bool) and \
                duration > 0 and not duration <= MAX_COEFFICIENT_S:  # inf too
            raise ValueError(f"{where}: a step's duration is {duration!r} s; a step takes "
                             f"at most {MAX_COEFFICIENT_S:.0f} s")
        if isinstance(shape, dict) and isinstance(duration, (int, float)) and duration > 0:
            try:
                views.append(BatchView(**shape))
            except TypeError:
                raise ValueError(f"{where}: a step's shape has fields {sorted(shape)}, not "
                                 "a batch shape's") from None
            bad = next(((k, v) for k, v in shape.items() if isinstance(v, bool)
                        or not isinstance(v, int) or not 0 <= v <= MAX_SHAPE_COUNT), None)
            if bad is not None:  # QA: num_tokens -5 was fitted on
                raise ValueError(f"{where}: a step's shape has {bad[0]} {bad[1]!r:.40}; a "
                                 "shape counts requests and tokens (integers from 0 to "
                                 f"{MAX_SHAPE_COUNT})")
            seconds.append(float(duration))
    return views, seconds


def calibration_meta(path: str | Path) -> dict[str, Any] | None:
    """A calibration file's ``meta``; None where it has none, or the file is bad (the cost
    model's own loading reports a bad file)."""
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8-sig")).get("meta")  # a BOM too
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return meta if isinstance(meta, dict) else None


def poor_fit_warning(path: str | Path) -> str | None:
    """A one-line warning where the calibration file at ``path`` records a poor fit (its
    ``meta.mean_abs_error``, written by ``kvserve calibrate --trace`` and ``--step-logs``):
    said where it is used, not only where it was made (the calibration pass: a 550% fit
    priced plans without a word, as a recording's own fit would have warned)."""
    meta = calibration_meta(path)
    if meta is not None and meta.get("quick") is True:  # (the calibration pass: unsaid)
        return (f"warning: {path} was made with calibrate --quick, a machine check of 10 "
                "shapes, not a model to simulate with (run the full grid or --trace)")
    error = None if meta is None else meta.get("mean_abs_error")
    note = poor_fit_note(error) if is_finite(error) else None
    return None if note is None else f"warning: {path}: {note}"


def fitted_on_warning(path: str | Path, model: ModelSpec, hardware: str) -> str | None:
    """A one-line warning where the calibration file at ``path`` was fitted on another model
    than ``model`` (``meta.model_shape``; in files without it, the preset ``meta.model``
    names) or on another device than the ``hardware`` preset (``meta.device``). None when
    they match, or where the file does not say (older files have no shape or device, and a
    fit on step logs no device, and a model only by its recordings' name): then nothing
    can be checked. Which CPU
    it was is :func:`kvserve.sim.machine.calibration_cpu_warning`'s."""
    meta = calibration_meta(path)
    if meta is None:
        return None
    name, shape, device = meta.get("model"), meta.get("model_shape"), meta.get("device")
    differences = []
    if isinstance(shape, dict) and shape:
        if any(shape.get(key, value) != value for key, value in model.shape().items()):
            differences.append(f"model {name or 'unnamed'} ({_describe_shape(shape)}), not "
                               f"this run's {model.name}")
    elif isinstance(name, str) and model_preset_for(name) not in (None, model.name):
        differences.append(f"model {name}, not this run's {model.name}")
    if isinstance(device, str) and device and hardware_preset_for(device) != hardware:
        differences.append(f"device {device}, not this run's {hardware}")
    if not differences:
        return None
    return (f"warning: {path} was calibrated on {' and on '.join(differences)}: its step "
            "times are of what it was calibrated on (give --model and --hardware as "
            "calibrated, or calibrate on this deployment)")


def _describe_shape(shape: dict[str, Any]) -> str:
    return f"{shape.get('num_layers', '?')} layers, hidden {shape.get('hidden_size', '?')}"
