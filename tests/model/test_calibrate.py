"""Issue 6: kvserve calibrate measures real steps and writes a loadable cost model."""

from __future__ import annotations

import json

from kvserve.engine import calibrate
from kvserve.engine.llm import build_engine
from kvserve.model.config import ModelConfig
from kvserve.sim.cost_models import CalibratedCostModel

TINY = ModelConfig(name="tiny", vocab_size=2048, hidden_size=32, intermediate_size=64,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                   max_position_embeddings=1024)


def test_shape_views_count_tokens_context_and_attention_pairs():
    shape = calibrate.StepShape(decode_contexts=(10, 20), prefills=((4, 3),))
    view = shape.view()
    assert (view.num_seqs, view.num_tokens, view.num_decode_seqs) == (3, 5, 2)
    assert view.context_tokens == 34
    # decodes: 1 x 10 + 1 + 1 x 20 + 1; prefill: 3 x 4 + 3 x 4 / 2
    assert view.attention_pairs == 11 + 21 + 12 + 6


def test_calibration_on_a_real_runner_writes_a_usable_model(tmp_path):
    engine = build_engine(TINY, num_kv_blocks=64, detokenize=False)
    shapes = calibrate.grid(quick=True)
    model, seconds = calibrate.calibrate(engine.executor, 64, shapes, warmup=1, repeats=2)
    assert len(seconds) == len(shapes) and all(s > 0 for s in seconds)
    assert engine.executor.requests == {}  # nothing left behind in the runner
    path = tmp_path / "cost.json"
    path.write_text(calibrate.to_json(model, shapes, seconds, {"model": "tiny"}))
    data = json.loads(path.read_text())
    assert data["meta"]["model"] == "tiny" and len(data["samples"]) == len(shapes)
    assert {"mean_abs_error", "r2", "machine", "torch"} <= set(data["meta"])
    loaded = CalibratedCostModel.load(path)
    assert loaded.coefficients == model.coefficients
    calibrate.plot(tmp_path / "fit.svg", shapes, seconds, model)
    assert (tmp_path / "fit.svg").read_text().startswith("<svg")
