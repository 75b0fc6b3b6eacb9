"""Scheduler and cache configuration (spec A1-A4, K1-K4).

Both objects are frozen dataclasses validated in ``__post_init__`` without any I/O. A bad value
raises :class:`ConfigError` naming the field, the value and the allowed range; ``from_dict``
also rejects unknown keys. Derived values are properties, never fields patched in later.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.core.checks import is_int, is_real
from kvserve.core.errors import ConfigError

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm", "dfs-weight")
DEFAULT_SESSION_TTL_S = 30.0  # seconds a finished turn's KV is held (U6)
MAX_SESSION_TTL_S = 86400.0  # a day: a longer hold is a typo
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")  # orders that read the prefix cache (C4, C5)
# orders whose queues take schedule_aging_s (C7): another order refuses it (a new order that
# can starve adds its name here once its queue ages; fcfs cannot starve)
AGING_POLICIES = ("priority", *CACHE_AWARE_POLICIES)
DEFAULT_LPM_MAX_QUEUE = 128  # SGLang's bound: a longer queue is served FCFS (C6)
VICTIM_POLICIES = ("vllm", "sglang", "least-computed")
ADMISSION_POLICIES = ("optimistic", "reserve", "adaptive")
PREFIX_CACHE_SCOPES = ("global", "tenant")
TENANT_FAIRNESS = ("off", "vtc")
DEFAULT_BLOCK_SIZE = 16  # token slots per KV block, everywhere a block size is not given
PREEMPTION_MODES = ("recompute", "swap", "auto")
# Q1: what one step may hold. "mixed" (vLLM V1): decodes and prefills share every step;
# "prefill-first" (SGLang's default, vLLM V0's without chunked prefill): while prefill work
# is pending, a step runs prefills only and the decodes wait.
STEP_MIXES = ("mixed", "prefill-first")
PREFIX_CACHING_HASH_ALGOS = ("blake2b", "builtin")  # kvserve.core.prefix_cache.BLOCK_HASHERS
# Largest host tier accepted: far beyond any machine's memory, so a bigger one is a typo.
MAX_HOST_BLOCKS = 1 << 31
# The device pool's blocks are objects made up front (about 120 bytes each in the simulator):
# 2^24 of them (268M token slots at 16 a block) take about 2 GB; 10^12 took the machine's
# memory and the process was killed with no message.
MAX_BLOCKS = 1 << 24

_T = TypeVar("_T")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if not is_int(value):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}={value} is out of range: must be {allowed}")


def _check_optional_int(name: str, value: Any, lo: int) -> None:
    if value is not None:
        _check_int(name, value, lo)


def _check_float(name: str, value: Any, lo: float, hi: float, *, hi_open: bool = False,
                 lo_open: bool = False) -> None:
    if not is_real(value) or math.isnan(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < lo or value > hi or (hi_open and value == hi) or (lo_open and value == lo):
        interval = ("(" if lo_open else "[") + f"{lo}, {hi}" + (")" if hi_open else "]")
        raise ConfigError(f"{name}={value} is out of range: must be in {interval}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")


def _from_dict(cls: type[_T], data: Mapping[str, Any]) -> _T:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown {cls.__name__} key(s): {', '.join(unknown)}; known keys: "
            f"{', '.join(sorted(known))}"
        )
    return cls(**data)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots (A1, A3).

    Every block is usable: unlike vLLM there is no reserved null block (A3).
    """

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    # The host KV tier (K3): blocks a swap-mode victim's KV is copied to; 0 = no host tier.
    num_host_blocks: int = 0
    # How full blocks are hashed for the prefix cache (G3): "blake2b", collision resistant,
    # or "builtin", a cheaper 64-bit hash (vLLM's --prefix-caching-hash-algo).
    prefix_caching_hash_algo: str = "blake2b"

    def __post_init__(self) -> None:
        _check_int("num_blocks", self.num_blocks, 1, MAX_BLOCKS)
        _check_int("block_size", self.block_size, 1, 1024)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_int("num_host_blocks", self.num_host_blocks, 0, MAX_HOST_BLOCKS)
        _check_choice("prefix_caching_hash_algo", self.prefix_caching_hash_algo,
                      PREFIX_CACHING_HASH_ALGOS)

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may do in one step and which policies it follows.

    Defaults are vLLM V1's (A1, A2). Policies (K1-K4) are chosen by name here and built by
    :mod:`kvserve.core.policies`.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    watermark: float = 0.0
    reserve_full_sequence: bool = True
    victim_policy: str = "vllm"
    admission_policy: str = "optimistic"
    preemption_mode: str = "recompute"
    # M1-M3: an urgent arrival (priority policy only) preempts running requests whose
    # priority value exceeds its own by more than the threshold (SGLang's default 10).
    enable_priority_preemption: bool = False
    priority_preemption_threshold: int = 10
    # P1: a request preempted this many times is no longer a victim; None: no limit.
    max_preemptions_per_request: int | None = None
    # K2 "adaptive" (SGLang's new_token_ratio): start, floor, and steps to decay from one to
    # the other; after a preemption the ratio is re-estimated assuming `retract_decode_steps`
    # more tokens per running request.
    adaptive_init_ratio: float = 0.7
    adaptive_min_ratio: float = 0.1
    adaptive_decay_steps: int = 600
    adaptive_retract_decode_steps: int = 20
    # K4 overload: None means unlimited.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    max_queue_delay: float | None = None
    # Tenants (SamplingParams.tenant): a per-tenant waiting-queue limit (None: unlimited);
    # "tenant" scope hashes each tenant's blocks apart (first_block_key); "vtc" orders the
    # waiting queue by each tenant's weighted service (core/fairness.py), where a prompt
    # token costs vtc_prompt_token_price, an output token vtc_output_token_price, divided by
    # the tenant's weight (1.0 unless listed in tenant_weights as (tenant, weight) pairs).
    max_num_queued_reqs_per_tenant: int | None = None
    prefix_cache_scope: str = "global"
    tenant_fairness: str = "off"
    vtc_prompt_token_price: float = 1.0
    vtc_output_token_price: float = 2.0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # The waiting side (C4-C7): a cache-aware order ("lpm", "dfs-weight") sorts only a queue
    # of at most lpm_max_queue requests (longer: FCFS); schedule_aging_s (None: off) lifts a
    # waiting request by one rank class per that many seconds waited.
    lpm_max_queue: int = DEFAULT_LPM_MAX_QUEUE
    schedule_aging_s: float | None = None
    # Sessions (U1-U8): a finished turn's KV stays held for its session's next turn, up to
    # max_session_kv (a fraction of the pool's blocks; 0: sessions off) for session_ttl_s
    # seconds unless the request names its own ttl.
    max_session_kv: float = 0.0
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    # L6: at most this many held turns admitted ahead of a waiting ordinary request before
    # it is served (0: no bound, L1 as is).
    max_held_first: int = 0
    # Q1-Q3: prefill-first steps, and at most this many of them in a row before a mixed step
    # (0: no bound, as SGLang).
    step_mix: str = "mixed"
    max_prefill_only_steps: int = 0

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_float("watermark", self.watermark, 0.0, 1.0, hi_open=True)
        _check_bool("reserve_full_sequence", self.reserve_full_sequence)
        _check_choice("victim_policy", self.victim_policy, VICTIM_POLICIES)
        _check_choice("admission_policy", self.admission_policy, ADMISSION_POLICIES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_bool("enable_priority_preemption", self.enable_priority_preemption)
        _check_int("priority_preemption_threshold", self.priority_preemption_threshold, 0)
        _check_optional_int("max_preemptions_per_request", self.max_preemptions_per_request, 1)
        _check_float("adaptive_init_ratio", self.adaptive_init_ratio, 0.0, 1.0)
        _check_float("adaptive_min_ratio", self.adaptive_min_ratio, 0.0, self.adaptive_init_ratio)
        _check_int("adaptive_decay_steps", self.adaptive_decay_steps, 1)
        _check_int("adaptive_retract_decode_steps", self.adaptive_retract_decode_steps, 0)
        _check_optional_int("max_num_queued_reqs", self.max_num_queued_reqs, 1)
        _check_optional_int("max_num_queued_tokens", self.max_num_queued_tokens, 1)
        if self.max_queue_delay is not None:
            _check_float("max_queue_delay", self.max_queue_delay, 0.0, math.inf, hi_open=True,
                         lo_open=True)  # 0 could only time out
        self._check_tenancy()
        self._check_waiting_order()
        _check_float("max_session_kv", self.max_session_kv, 0.0, 1.0)
        _check_float("session_ttl_s", self.session_ttl_s, 0.0, MAX_SESSION_TTL_S, lo_open=True)
        _check_int("max_held_first", self.max_held_first, 0)
        _check_choice("step_mix", self.step_mix, STEP_MIXES)
        _check_int("max_prefill_only_steps", self.max_prefill_only_steps, 0)
        self._check_relations()

    @property
    def bounds_queue(self) -> bool:
        """Whether any K4 limit bounds the waiting queue (else nothing is refused for room)."""
        return self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None \
            or self.max_num_queued_reqs_per_tenant is not None

    def _check_tenancy(self) -> None:
        _check_optional_int("max_num_queued_reqs_per_tenant",
                            self.max_num_queued_reqs_per_tenant, 1)
        _check_choice("prefix_cache_scope", self.prefix_cache_scope, PREFIX_CACHE_SCOPES)
        _check_choice("tenant_fairness", self.tenant_fairness, TENANT_FAIRNESS)
        _check_float("vtc_prompt_token_price", self.vtc_prompt_token_price, 0.0, 1e6)
        _check_float("vtc_output_token_price", self.vtc_output_token_price, 0.0, 1e6)
        if not isinstance(self.tenant_weights, tuple):
            object.__setattr__(self, "tenant_weights", tuple(
                tuple(pair) for pair in self.tenant_weights))  # from JSON: lists
        for pair in self.tenant_weights:
            if len(pair) != 2 or not isinstance(pair[0], str):
                raise ConfigError(f"tenant_weights must be (tenant, weight) pairs, got {pair!r}")
            _check_float(f"tenant_weights[{pair[0]!r}]", pair[1], 1e-6, 1e6)

    def _check_waiting_order(self) -> None:
        _check_int("lpm_max_queue", self.lpm_max_queue, 0)
        if self.schedule_aging_s is not None:
            _check_float("schedule_aging_s", self.schedule_aging_s, 0.0, math.inf, hi_open=True)
            if self.schedule_aging_s <= 0:
                raise ConfigError(f"schedule_aging_s={self.schedule_aging_s} is out of range: "
                                  "must be > 0 (leave it unset to turn aging off)")
            if self.scheduling_policy not in AGING_POLICIES:
                raise ConfigError(f"schedule_aging_s needs an order that can starve and ages: "
                                  f"scheduling_policy {', '.join(AGING_POLICIES)}, not "
                                  f"{self.scheduling_policy}")
            if self.tenant_fairness == "vtc" and self.scheduling_policy == "priority":
                raise ConfigError("schedule_aging_s with scheduling_policy='priority' and "
                                  "tenant_fairness='vtc' is not supported: VTC keeps one "
                                  "queue per fixed priority level")
            if self.enable_priority_preemption:
                raise ConfigError("schedule_aging_s with enable_priority_preemption=True is not "
                                  "supported: urgent preemption (M1-M3) compares fixed "
                                  "priorities, aging changes them while a request waits")

    def _check_relations(self) -> None:
        if self.max_prefill_only_steps and self.step_mix != "prefill-first":
            raise ConfigError(
                f"max_prefill_only_steps={self.max_prefill_only_steps} bounds prefill-first "
                f"steps: it needs step_mix='prefill-first', not {self.step_mix!r}"
            )
        if self.max_held_first and not self.max_session_kv:
            raise ConfigError(
                f"max_held_first={self.max_held_first} bounds session turns that hold KV: "
                "sessions are off (give max_session_kv, --max-session-kv)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when chunked prefill is disabled, "
                "or a long prompt could never be scheduled"
            )
        if self.enable_priority_preemption and self.scheduling_policy != "priority":
            raise ConfigError(
                "enable_priority_preemption=True needs scheduling_policy='priority' "
                f"(got {self.scheduling_policy!r}): only priorities make an arrival urgent"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold > 0:
            raise ConfigError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} needs "
                "chunked prefill: enable it or set the threshold to 0"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SchedulerConfig:
        """Settings by name; with chunked prefill off and no budget given, the budget is the
        default raised to max_model_len, as vLLM raises it (a whole prompt must fit one
        step; the flags pass: --no-enable-chunked-prefill alone was refused)."""
        if data.get("enable_chunked_prefill") is False and \
                data.get("max_num_batched_tokens") is None and \
                isinstance(data.get("max_model_len"), int):
            data = {**data, "max_num_batched_tokens": max(cls.max_num_batched_tokens,
                                                          data["max_model_len"])}
        return _from_dict(cls, data)


def swaps(settings: dict[str, Any]) -> bool:
    """Whether these scheduler settings' preemption mode may swap a victim to the host KV
    tier, its only user (K3): all but recompute, the default, which never does."""
    return settings.get("preemption_mode", "recompute") != "recompute"
