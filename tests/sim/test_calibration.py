"""Fitting a calibrated cost model recovers the coefficients that made the step times."""

import numpy as np
import pytest

from kvserve.sim.calibration import fit, save
from kvserve.sim.cost_models import CalibratedCostModel
from kvserve.sim.executor import BatchView

TRUE = {"fixed_s": 0.004, "per_token_s": 2e-5, "per_seq_s": 0.0, "per_sampled_s": 1e-5,
        "per_context_token_s": 3e-8, "per_attention_pair_s": 1e-9}


def _views(n: int, seed: int = 0) -> list[BatchView]:
    rng = np.random.default_rng(seed)
    views = []
    for _ in range(n):
        seqs = int(rng.integers(1, 128))
        prefill = int(rng.integers(0, 2048))
        context = int(rng.integers(0, 4000)) * seqs
        views.append(BatchView(seqs, seqs + prefill, seqs, seqs, context,
                               context + prefill * (prefill + 1) // 2))
    return views


def test_fit_recovers_known_coefficients_from_noisy_steps(tmp_path):
    views = _views(400)
    truth = CalibratedCostModel(dict(TRUE))
    rng = np.random.default_rng(1)
    seconds = [truth.step_time(None, v) * (1 + rng.normal(0, 0.005)) for v in views]  # type: ignore[arg-type]
    model = fit(views, seconds, source="synthetic")
    for term in ("fixed_s", "per_token_s", "per_context_token_s", "per_attention_pair_s"):
        assert model.coefficients[term] == pytest.approx(TRUE[term], rel=0.1), term
    assert all(value >= 0 for value in model.coefficients.values())
    assert "fitted on 400 steps" in model.source
    path = tmp_path / "cm.json"
    save(model, path)
    assert CalibratedCostModel.load(path) == model


def test_a_term_that_would_fit_negative_is_dropped():
    # Times that fall with batch size cannot be a per-sequence cost: that term goes to 0.
    views = [BatchView(s, 64, 1, 0, 0, 64 * 65 // 2) for s in range(1, 50)]
    seconds = [0.01 - 0.0001 * v.num_seqs for v in views]
    model = fit(views, seconds)
    assert model.coefficients["per_seq_s"] == 0.0
    assert model.coefficients["fixed_s"] > 0


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="at least 6"):
        fit(_views(3), [0.1, 0.1, 0.1])
