"""Spec A: defaults and validation of the frozen config objects."""

import dataclasses

import pytest

from kvserve.core import CacheConfig, ConfigError, SchedulerConfig


def test_defaults_follow_vllm_v1():  # A1, A2
    config = SchedulerConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    assert config.enable_chunked_prefill and config.reserve_full_sequence
    assert (config.scheduling_policy, config.watermark) == ("fcfs", 0.0)
    assert config.long_prefill_token_threshold == 0
    assert (config.victim_policy, config.admission_policy) == ("vllm", "optimistic")
    cache = CacheConfig(num_blocks=10)
    assert (cache.block_size, cache.enable_prefix_caching) == (16, True)


def test_every_block_is_usable():  # A3
    assert CacheConfig(num_blocks=11, block_size=16).num_token_slots == 176


def test_configs_are_frozen():  # A4
    config = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 3  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_num_seqs", 0, "max_num_seqs=0 is out of range: must be >= 1"),
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer, got 2.5"),
    ("max_num_seqs", True, "max_num_seqs must be an integer, got True"),
    ("watermark", 1.0, "watermark=1.0 is out of range: must be in [0.0, 1.0)"),
    ("watermark", -0.1, "watermark=-0.1 is out of range"),
    ("scheduling_policy", "lifo", "scheduling_policy='lifo' is not one of fcfs, priority"),
    ("victim_policy", "random", "victim_policy='random' is not one of vllm, sglang"),
    ("admission_policy", "greedy", "admission_policy='greedy' is not one of optimistic"),
    ("preemption_mode", "migrate", "preemption_mode='migrate' is not one of recompute"),
    ("priority_preemption_threshold", -1, "priority_preemption_threshold=-1 is out of range"),
    ("max_preemptions_per_request", 0, "max_preemptions_per_request=0 is out of range"),
    ("enable_priority_preemption", 1, "enable_priority_preemption must be true or false"),
    ("max_num_queued_reqs", 0, "max_num_queued_reqs=0 is out of range"),
    ("max_queue_delay", -1.0, "max_queue_delay=-1.0 is out of range"),
    ("session_ttl_s", 0, "session_ttl_s=0 is out of range: must be in (0.0, 86400.0]"),
    ("session_ttl_s", -1, "session_ttl_s=-1 is out of range: must be in (0.0, 86400.0]"),
    ("enable_chunked_prefill", "yes", "enable_chunked_prefill must be true or false"),
])
def test_bad_values_name_the_field_and_range(field, value, message):  # A4
    with pytest.raises(ConfigError) as error:
        SchedulerConfig(**{field: value})
    assert message in str(error.value)


def test_budget_must_cover_max_num_seqs():  # A2
    with pytest.raises(ConfigError, match="max_num_batched_tokens=64 must be >= max_num_seqs=128"):
        SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64)


def test_chunked_prefill_off_needs_budget_for_max_model_len():  # A2
    with pytest.raises(ConfigError, match="must be >= max_model_len=4096 when chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_model_len=4096)
    with pytest.raises(ConfigError, match="must be >= max_model_len=4096 when chunked prefill"):
        SchedulerConfig.from_dict({"enable_chunked_prefill": False, "max_model_len": 4096,
                                   "max_num_batched_tokens": 2048})  # a budget given


def test_settings_with_chunked_prefill_off_and_no_budget_raise_it_to_max_model_len():
    """As vLLM raises it (the flags pass: --no-enable-chunked-prefill alone was refused)."""
    raised = SchedulerConfig.from_dict({"enable_chunked_prefill": False, "max_model_len": 4096})
    assert raised.max_num_batched_tokens == 4096
    short = SchedulerConfig.from_dict({"enable_chunked_prefill": False, "max_model_len": 512})
    assert short.max_num_batched_tokens == SchedulerConfig.max_num_batched_tokens
    config = SchedulerConfig(enable_chunked_prefill=False, max_model_len=2048)
    assert config.max_num_batched_tokens == 2048


def test_threshold_needs_chunked_prefill():
    with pytest.raises(ConfigError, match="long_prefill_token_threshold=64 needs chunked"):
        SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=64)


def test_from_dict_rejects_unknown_keys():  # A4
    with pytest.raises(ConfigError, match=r"unknown SchedulerConfig key.*max_num_sequences"):
        SchedulerConfig.from_dict({"max_num_sequences": 4})
    with pytest.raises(ConfigError, match=r"unknown CacheConfig key.*blocks"):
        CacheConfig.from_dict({"blocks": 4})
    assert SchedulerConfig.from_dict({"max_num_seqs": 4}).max_num_seqs == 4


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_blocks", 0, "num_blocks=0 is out of range: must be in [1, 16777216]"),
    ("block_size", 0, "block_size=0 is out of range: must be in [1, 1024]"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be true or false"),
])
def test_bad_cache_values(field, value, message):
    kwargs = {"num_blocks": 10, field: value}
    with pytest.raises(ConfigError) as error:
        CacheConfig(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize("limit", ["max_num_queued_reqs", "max_num_queued_tokens",
                                   "max_num_queued_reqs_per_tenant"])
def test_any_queue_limit_bounds_the_queue(limit):  # K4: one flag the server and scheduler ask
    assert not SchedulerConfig().bounds_queue
    assert SchedulerConfig(**{limit: 4}).bounds_queue
