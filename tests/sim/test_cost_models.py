"""Cost models: units worked by hand, monotonicity, tensor parallelism, the calibrated
file format."""

import argparse
import dataclasses
import json
import re

import pytest

from kvserve.sim.cost_models import (
    CalibratedCostModel,
    CostModelError,
    RooflineCostModel,
    UnitCostModel,
)
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import HARDWARE, MODELS, PresetError, get_hardware, get_model


def prefill(n: int, context: int = 0) -> BatchView:
    return BatchView(1, n, 1, 0, context, n * context + n * (n + 1) // 2)


def decode(batch: int, context: int) -> BatchView:
    return BatchView(batch, batch, batch, batch, batch * context, batch * (context + 1))


def llama8b_h100(tp: int = 1) -> RooflineCostModel:
    return RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), "bf16", tp)


def test_unit_model_is_one_second_per_step():
    assert UnitCostModel().step_time(None, decode(64, 1000)) == 1.0  # type: ignore[arg-type]


def test_presets_match_public_parameter_counts():
    # Llama-3.1-8B: 32 x 218,112,000 (layer) + 2 x 525,336,576 (embedding, LM head)
    # + 4,096 (final norm) = 8,030,261,248 parameters.
    assert get_model("llama-3.1-8b").num_params == 8_030_261_248
    # SmolLM2-135M: 269 MFLOP of matmuls per token (../shared/WORKLOADS.md):
    # 2 x (30 layers x 3,537,792 + 28,311,552 tied LM head) = 268,959,744.
    smol = get_model("smollm2-135m")
    assert 2 * (smol.matmul_params_per_token + smol.lm_head_params) == 268_959_744
    assert set(MODELS) >= {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "mistral-7b",
                           "smollm2-135m"}
    assert set(HARDWARE) >= {"h100-sxm", "h200", "a100-80gb", "l4", "cpu-local"}


def test_single_decode_is_memory_bound_by_hand():
    # One sequence, empty context, one token (llama-3.1-8b, bf16, H100 SXM):
    # bytes = 16,060,522,496 (weights) + 131,072 (one token's KV written) = 16,060,653,568
    # memory = bytes / (3.35e12 B/s x 0.8) = 5.9928 ms; compute is ~25 us; + 3 ms overhead.
    cost = llama8b_h100()
    view = decode(1, 0)
    assert cost.bytes_moved(view) == 16_060_653_568
    assert cost.memory_time(view) == pytest.approx(16_060_653_568 / 2.68e12)
    assert cost.step_time(None, view) == pytest.approx(0.0059928 + 0.003, rel=1e-4)


def test_long_prefill_is_compute_bound_by_hand():
    # 2,048 prompt tokens: 2 x 6,979,321,856 x 2048 (layers) + 2 x 525,336,576 (LM head,
    # one sampled token) + 4 x 32 layers x 32 heads x 128 x 2,098,176 causal pairs
    # = 29,688,401,494,016 FLOPs; / (989e12 x 0.6) = 50.03 ms; + 3 ms.
    cost = llama8b_h100()
    view = prefill(2048)
    assert cost.flops(view) == 29_688_401_494_016
    assert cost.step_time(None, view) == pytest.approx(0.05003101 + 0.003, rel=1e-6)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_a_longer_prefill_never_costs_less(model, hardware):
    cost = RooflineCostModel(get_model(model), get_hardware(hardware))
    times = [cost.step_time(None, prefill(n)) for n in (1, 16, 128, 512, 1024, 2048, 4096)]
    assert times == sorted(times)
    for n in (64, 512, 2048):
        assert cost.step_time(None, prefill(2 * n)) >= cost.step_time(None, prefill(n))
    # The quadratic term: prefilling after a long cached context costs more.
    assert cost.step_time(None, prefill(512, 8192)) > cost.step_time(None, prefill(512, 0))


def test_decode_cost_grows_with_batch_and_context():
    cost = llama8b_h100()
    by_batch = [cost.step_time(None, decode(b, 1000)) for b in (1, 8, 64, 256)]
    assert by_batch == sorted(by_batch) and by_batch[-1] > by_batch[0]
    by_context = [cost.step_time(None, decode(64, c)) for c in (0, 512, 4096, 32768)]
    assert by_context == sorted(by_context) and by_context[-1] > by_context[0]
    # Reading 256 x 4k tokens of KV (~137 GB) dominates the 16 GB of weights.
    assert cost.memory_time(decode(256, 4096)) > 5 * cost.memory_time(decode(1, 0))


def test_tensor_parallel_splits_work_and_adds_allreduce():
    one, two = llama8b_h100(1), llama8b_h100(2)
    view = prefill(2048)
    assert two.compute_time(view) == pytest.approx(one.compute_time(view) / 2)
    assert two.allreduce_time(view) > 0 == one.allreduce_time(view)
    assert two.step_time(None, view) < one.step_time(None, view)


def test_cpu_local_uses_the_measured_rates():
    # SmolLM2 prefill of 2,048 tokens: 2 x 106,168,320 x 2048 (layers) + 2 x 28,311,552
    # (LM head) + 4 x 30 x 9 x 64 x 2,098,176 (attention) = 579,947,986,944 FLOPs,
    # at 408 GFLOP/s (bf16, measured; efficiency 1.0, no overhead) = 1.42144 s.
    cpu = RooflineCostModel(get_model("smollm2-135m"), get_hardware("cpu-local"), "bf16")
    assert cpu.flops(prefill(2048)) == 579_947_986_944
    assert cpu.step_time(None, prefill(2048)) == pytest.approx(1.42144, rel=1e-4)
    fp32 = RooflineCostModel(get_model("smollm2-135m"), get_hardware("cpu-local"), "fp32")
    assert fp32.compute_time(prefill(2048)) > 2 * cpu.compute_time(prefill(2048))


def test_unknown_presets_list_the_known_ones():
    with pytest.raises(PresetError, match=re.escape("unknown model 'gpt-5'; known: llama-3.1-8b")):
        get_model("gpt-5")
    known = "known: h100-sxm, h200, a100-80gb, l4, cpu-local"
    with pytest.raises(PresetError, match=re.escape(known)):
        get_hardware("tpu")


def test_calibrated_model_is_linear_in_its_terms(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps({"format": "kvserve-cost-model/1", "source": "test",
                                "coefficients": {"fixed_s": 0.002, "per_token_s": 1e-5,
                                                 "per_context_token_s": 1e-8}}))
    cost = CalibratedCostModel.load(path)
    # 0.002 + 64 x 1e-5 + 64 x 1000 x 1e-8 = 0.002 + 0.00064 + 0.00064 = 0.00328
    assert cost.step_time(None, decode(64, 1000)) == pytest.approx(0.00328)
    assert cost.describe()["coefficients"]["per_seq_s"] == 0.0


@pytest.mark.parametrize("data, message", [
    ({"format": "other", "coefficients": {"fixed_s": 1}}, "format must be"),
    ({"format": "kvserve-cost-model/1", "coefficients": {"per_flop": 1}},
     "unknown coefficient(s) per_flop"),
    ({"format": "kvserve-cost-model/1", "coefficients": {"fixed_s": -1}},
     "fixed_s must be a number of seconds in [0, 3600], got -1"),
    # QA (CLI fuzz): 1.7e308 ran a simulation to "simulated time inf s", exit 0
    ({"format": "kvserve-cost-model/1", "coefficients": {"fixed_s": 1.7e308}},
     "fixed_s must be a number of seconds in [0, 3600], got 1.7e+308"),
    ({"format": "kvserve-cost-model/1", "coefficients": {"per_seq_s": 1}}, "never advances"),
    ({"format": "kvserve-cost-model/1", "coefficients": {"fixed_s": 1}, "x": 1}, "unknown key"),
])
def test_calibrated_model_rejects_bad_files(data, message, tmp_path):
    with pytest.raises(CostModelError, match=re.escape(message)):
        CalibratedCostModel.from_dict(data)
    path = tmp_path / "c.json"  # loaded from a file, the file is named too
    path.write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=re.escape(f"{path}: ") + ".*" +
                       re.escape(message)):
        CalibratedCostModel.load(path)


def test_a_cost_model_file_may_start_with_a_byte_order_mark(tmp_path):
    """As traces and step logs may (QA: refused here alone)."""
    path = tmp_path / "bom.json"
    path.write_text("\ufeff" + json.dumps({"format": "kvserve-cost-model/1",
                                            "coefficients": {"fixed_s": 0.01}}),
                    encoding="utf-8")
    assert CalibratedCostModel.load(path).coefficients["fixed_s"] == 0.01


def test_a_file_without_the_layout_term_loads_with_it_at_zero(tmp_path):
    # Files written before the layout term existed have six coefficients.
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "kvserve-cost-model/1", "min_tokens": 4,
                                "coefficients": {"fixed_s": 0.01, "per_token_s": 5e-4,
                                                 "per_seq_s": 1e-4, "per_sampled_s": 1e-4,
                                                 "per_context_token_s": 1e-6,
                                                 "per_attention_pair_s": 5e-7}}))
    cost = CalibratedCostModel.load(path)
    assert cost.coefficients["per_scattered_context_token_s"] == 0.0
    assert not cost.needs_block_layout
    # ... and describes itself as it did: the unused term is not echoed into reports
    assert "per_scattered_context_token_s" not in cost.describe()["coefficients"]
    scattered = dataclasses.replace(decode(8, 400), scattered_context_tokens=3000)
    assert cost.step_time(None, scattered) == cost.step_time(None, decode(8, 400))


def test_the_layout_term_prices_scattered_context_tokens():
    cost = CalibratedCostModel.from_dict({
        "format": "kvserve-cost-model/1",
        "coefficients": {"fixed_s": 0.002, "per_context_token_s": 1e-8,
                         "per_scattered_context_token_s": 4e-9}})
    assert cost.needs_block_layout
    # 8 decodes at 1,000 tokens, 6,000 of the 8,000 in scattered blocks:
    # 0.002 + 8,000 x 1e-8 + 6,000 x 4e-9 = 0.002 + 0.00008 + 0.000024 = 0.002104
    view = dataclasses.replace(decode(8, 1000), scattered_context_tokens=6000)
    assert cost.step_time(None, view) == pytest.approx(0.002104)
    assert cost.describe()["coefficients"]["per_scattered_context_token_s"] == 4e-9
    unknown = re.escape("unknown coefficient(s) per_scattered_block_s")
    with pytest.raises(CostModelError, match=unknown):
        CalibratedCostModel.from_dict({"format": "kvserve-cost-model/1", "coefficients": {
            "fixed_s": 0.002, "per_scattered_block_s": 1e-6}})


def mixed(batch: int, context: int, chunk: int) -> BatchView:
    """``batch`` decodes at ``context`` and one fresh prompt chunk of ``chunk`` tokens."""
    return BatchView(batch + 1, batch + chunk, batch + 1, batch, batch * context,
                     batch * (context + 1) + chunk * (chunk + 1) // 2)


SIX_TERMS = {"fixed_s": 0.01, "per_token_s": 5e-4, "per_seq_s": 1e-4, "per_sampled_s": 1e-4,
             "per_context_token_s": 1e-6, "per_attention_pair_s": 5e-7}


def test_a_file_without_the_kind_term_prices_every_step_as_the_six_term_model(tmp_path):
    # Files written before the step-kind term existed: it loads at 0, the mixed step
    # costs what the six terms say, bit for bit, and the report does not echo them.
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "kvserve-cost-model/1", "coefficients": SIX_TERMS}))
    cost = CalibratedCostModel.load(path)
    assert cost.coefficients["per_prefill_step_s"] == 0.0
    assert set(cost.describe()["coefficients"]) == set(SIX_TERMS)
    c, view = SIX_TERMS, mixed(8, 400, 100)
    six = (c["fixed_s"] + c["per_token_s"] * 108 + c["per_seq_s"] * 9 + c["per_sampled_s"] * 9
           + c["per_context_token_s"] * 3200 + c["per_attention_pair_s"] * view.attention_pairs)
    assert cost.step_time(None, view) == six
    assert CalibratedCostModel(dict(SIX_TERMS)).step_time(None, view) == six


def test_the_kind_term_prices_steps_with_prefill_chunks_only():
    cost = CalibratedCostModel.from_dict({"format": "kvserve-cost-model/1", "coefficients": {
        **SIX_TERMS, "per_prefill_step_s": 0.003}})
    six = CalibratedCostModel(dict(SIX_TERMS))
    # a decode-only step carries no chunk: the term adds nothing
    assert cost.step_time(None, decode(32, 500)) == six.step_time(None, decode(32, 500))
    # 8 decodes + one 100-token chunk, and two prompts packed in one step: + 0.003 each,
    # once per step however many chunks it carries
    packed = BatchView(2, 300, 2, 0, 0, 2 * 150 * 151 // 2)
    for view in (mixed(8, 400, 100), packed, prefill(1)):
        assert cost.step_time(None, view) == pytest.approx(six.step_time(None, view) + 0.003)
    assert cost.describe()["coefficients"]["per_prefill_step_s"] == 0.003
    assert not cost.needs_block_layout


def test_every_listed_cost_model_builds_and_one_without_a_branch_is_refused(monkeypatch):
    """Contributor pass: a name added to COST_MODELS without its branch in build_cost_model
    was priced as roofline, silently; --cost-model's choices are the same list."""
    from kvserve.sim import deployment
    from kvserve.sim.cli_common import add_deployment_flags
    from kvserve.sim.cost_models import CostModelError

    parser = argparse.ArgumentParser()
    add_deployment_flags(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "cost_model")
    assert tuple(choices) == deployment.COST_MODELS
    assert deployment.Deployment(cost_model="unit").build_cost_model().name == "unit"
    assert deployment.Deployment(cost_model="roofline").build_cost_model().name == "roofline"
    monkeypatch.setattr(deployment, "COST_MODELS", (*deployment.COST_MODELS, "constant"))
    with pytest.raises(CostModelError, match="'constant' has no branch"):
        deployment.Deployment(cost_model="constant").build_cost_model()
