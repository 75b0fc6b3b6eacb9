"""Fit a calibrated cost model from measured steps (for the engine's self-measurement).

Each sample is one executed step: its batch shape (:class:`BatchView`) and the seconds it
took. The fit is least squares on the calibrated model's terms, constrained to
non-negative coefficients (a term with a negative fitted cost is dropped and the rest
refitted, until none is negative), so the result is a valid ``kvserve-cost-model/1`` file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvserve.sim.cost_models import CALIBRATED_FORMAT, CALIBRATED_TERMS, CalibratedCostModel
from kvserve.sim.executor import BatchView


def features(view: BatchView) -> list[float]:
    """The calibrated model's terms, in CALIBRATED_TERMS order."""
    return [1.0, view.num_tokens, view.num_seqs, view.num_sampled, view.context_tokens,
            view.attention_pairs]


def fit(views: Sequence[BatchView], seconds: Sequence[float],
        source: str = "") -> CalibratedCostModel:
    if len(views) != len(seconds) or len(views) < len(CALIBRATED_TERMS):
        raise ValueError(f"need as many step times as batch shapes, and at least "
                         f"{len(CALIBRATED_TERMS)} of them; got {len(views)} and {len(seconds)}")
    x = np.asarray([features(v) for v in views], dtype=float)
    y = np.asarray(seconds, dtype=float)
    active = list(range(x.shape[1]))
    coefficients = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        del active[int(np.argmin(solution))]
    predicted = x @ coefficients
    error = np.abs(predicted - y) / np.maximum(y, 1e-12)
    note = f"fitted on {len(y)} steps; mean abs error {100 * error.mean():.1f}%"
    return CalibratedCostModel.from_dict({
        "format": CALIBRATED_FORMAT,
        "coefficients": {t: float(c) for t, c in zip(CALIBRATED_TERMS, coefficients,
                                                       strict=True)},
        "source": f"{source}; {note}" if source else note,
    })


def save(model: CalibratedCostModel, path: str | Path) -> None:
    data = {"format": CALIBRATED_FORMAT, "source": model.source,
            "coefficients": model.coefficients}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
