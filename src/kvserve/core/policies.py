"""Strategy objects for the choices that differ between engines (spec K1, K2).

- Victim policies pick which running request to preempt when one cannot grow.
- Admission policies decide how many blocks to keep free for the future growth of running
  requests before a waiting request may be admitted.

A policy of one's own subclasses :class:`VictimPolicy` (exported by :mod:`kvserve.core`) and
is handed to ``Scheduler(victim_policy=...)`` or ``Simulator(victim_policy=...)``; one that
kvserve offers by name is a class here plus its name in :mod:`kvserve.core.config`. The
scheduler's loop does not change either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvserve.core.config import SchedulerConfig
from kvserve.core.errors import ConfigError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.request import Request

# -- K1: victim policies ---------------------------------------------------------------------


class VictimPolicy(ABC):
    """Which running request to preempt when one cannot grow (K1). ``running`` is in
    admission order, earliest first; the request that needs blocks is among them."""

    @abstractmethod
    def select(self, running: Sequence[Request]) -> int:
        """Index in ``running`` of the request to preempt (possibly the requesting one)."""


class NewestFirst(VictimPolicy):
    """vLLM under FCFS: the most recently admitted request (F2)."""

    def select(self, running: Sequence[Request]) -> int:
        return len(running) - 1


class LeastUrgentFirst(VictimPolicy):
    """vLLM under priority: the largest (priority, arrival_time); ties go to the earliest
    position in ``running`` (F2)."""

    def select(self, running: Sequence[Request]) -> int:
        return max(range(len(running)),
                   key=lambda i: (running[i].priority, running[i].arrival_time))


def _newest_least(running: Sequence[Request], key: Callable[[Request], object]) -> int:
    """The index of the least ``key``; of equals, the latest admitted (min keeps the first
    it meets, so the scan runs newest first)."""
    return min(range(len(running) - 1, -1, -1), key=lambda i: key(running[i]))


class LeastGeneratedFirst(VictimPolicy):
    """SGLang: fewest output tokens first, ties to the longest prompt: throw away the least
    generated work for the biggest memory win. Full ties go to the latest admitted, as
    SGLang's retract_decode takes them (QA: ties went to the earliest, which preempted the
    head of the line when requests were alike)."""

    def select(self, running: Sequence[Request]) -> int:
        return _newest_least(running, lambda r: (r.num_output_tokens, -r.num_prompt_tokens))


class LeastComputedFirst(VictimPolicy):
    """Fewest computed tokens first: the cheapest request to recompute; ties to the latest
    admitted."""

    def select(self, running: Sequence[Request]) -> int:
        return _newest_least(running, lambda r: r.num_computed_tokens)


def make_victim_policy(config: SchedulerConfig) -> VictimPolicy:
    if config.victim_policy == "vllm":
        return LeastUrgentFirst() if config.scheduling_policy == "priority" else NewestFirst()
    if config.victim_policy == "sglang":
        return LeastGeneratedFirst()
    if config.victim_policy == "least-computed":
        return LeastComputedFirst()
    raise _unbuilt("victim_policy", config.victim_policy)


# -- K2: admission policies ------------------------------------------------------------------


class AdmissionPolicy:
    """Optimistic (vLLM): reserve nothing beyond the full-sequence gate (E3).

    The waiting pass calls :meth:`start_pass` once, :meth:`reserved_blocks` before each
    admission attempt and :meth:`admitted` after each success; the scheduler calls
    :meth:`end_step` once per step and :meth:`idle` when a request arrives at an engine with
    nothing to do. The queue limits (K4) estimate the next step's admissions by
    :meth:`held_growth` and :meth:`growth_blocks`, and an idle engine's by
    :meth:`idle_ratio`.
    """

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        pass

    @staticmethod
    def idle_ratio(config: SchedulerConfig) -> float:
        """The share of a new request's max_tokens this policy keeps blocks for on an idle
        engine (0: none)."""
        return 0.0

    def start_pass(self, running: Sequence[Request]) -> None:
        pass

    def reserved_blocks(self, request: Request) -> int:
        return 0

    def held_growth(self, request: Request) -> int:
        """The blocks kept for a running ``request``'s future tokens beyond those it holds."""
        return 0

    def growth_blocks(self, request: Request) -> int:
        """The blocks kept for a waiting ``request``'s future tokens once it is admitted."""
        return 0

    def admitted(self, request: Request) -> None:
        pass

    def end_step(self, num_preempted: int, running: Sequence[Request]) -> None:
        pass

    def idle(self) -> None:
        pass


def future_blocks(final_tokens: int, num_blocks_now: int, block_size: int,
                  max_sequence_tokens: int) -> int:
    """The blocks a sequence expected to reach ``final_tokens`` needs beyond
    ``num_blocks_now``: capped where it must stop anyway (max_model_len, or the pool: J2);
    the last token is sampled but never fed back, so it needs no KV slot."""
    final = min(final_tokens, max_sequence_tokens) - 1
    return max(0, -(-final // block_size) - num_blocks_now)


class _ReservingPolicy(AdmissionPolicy):
    """Keeps blocks free for ``ratio`` x the remaining max_tokens of every running request."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.ratio = self.idle_ratio(config)
        self._reserved_for_running = 0

    def expected_final_tokens(self, request: Request) -> int:
        remaining = request.sampling_params.max_tokens - request.num_output_tokens
        return request.num_tokens + int(self.ratio * remaining)

    def _future_blocks(self, request: Request, num_blocks_now: int) -> int:
        return future_blocks(self.expected_final_tokens(request), num_blocks_now,
                             self.kv.block_size, self.kv.max_sequence_tokens)

    def held_growth(self, request: Request) -> int:
        return self._future_blocks(request, self.kv.num_held_blocks(request.request_id))

    def growth_blocks(self, request: Request) -> int:
        return self._future_blocks(request, self.kv.num_blocks_for(request.num_tokens))

    def start_pass(self, running: Sequence[Request]) -> None:
        self._reserved_for_running = sum(self.held_growth(r) for r in running)

    def reserved_blocks(self, request: Request) -> int:
        return self._reserved_for_running + self.growth_blocks(request)

    def admitted(self, request: Request) -> None:
        self._reserved_for_running += self.held_growth(request)


class ReserveMaxTokens(_ReservingPolicy):
    """Reserve prompt + max_tokens for everyone (the whole of what remains: ratio 1): never
    preempts (TensorRT-LLM's GUARANTEED_NO_EVICT)."""

    @staticmethod
    def idle_ratio(config: SchedulerConfig) -> float:
        return 1.0


class AdaptiveReserve(_ReservingPolicy):
    """SGLang's new_token_ratio: reserve ``ratio`` x the remaining max_tokens of each request.

    The ratio starts at ``adaptive_init_ratio`` and decays linearly to its floor on every step
    without a preemption; a preemption re-estimates it from what running requests actually
    decoded, plus ``adaptive_retract_decode_steps`` tokens each. It starts over when a request
    arrives at an idle engine, as SGLang's does when its scheduler finds nothing to run.
    """

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        super().__init__(kv, config)
        self.init_ratio = config.adaptive_init_ratio
        self.min_ratio = config.adaptive_min_ratio
        self.decay = (config.adaptive_init_ratio - config.adaptive_min_ratio) / \
            config.adaptive_decay_steps
        self.retract_decode_steps = config.adaptive_retract_decode_steps

    @staticmethod
    def idle_ratio(config: SchedulerConfig) -> float:
        return config.adaptive_init_ratio

    def idle(self) -> None:
        self.ratio = self.init_ratio

    def end_step(self, num_preempted: int, running: Sequence[Request]) -> None:
        if num_preempted == 0:
            self.ratio = max(self.min_ratio, self.ratio - self.decay)
            return
        decoded = sum(r.num_output_tokens for r in running)
        max_new = sum(r.sampling_params.max_tokens for r in running)
        estimate = (decoded + self.retract_decode_steps * len(running)) / max_new \
            if max_new else 1.0
        self.ratio = min(1.0, max(self.min_ratio, estimate))


def make_admission_policy(config: SchedulerConfig, kv: KVCacheManager) -> AdmissionPolicy:
    return admission_policy_class(config)(kv, config)


def idle_growth_blocks(config: SchedulerConfig, prompt_len: int, max_tokens: int | None,
                       num_blocks: int, block_size: int) -> int:
    """The blocks ``config``'s admission policy keeps for a new request's future tokens on
    an idle engine with a pool of ``num_blocks`` (K4's 400 rules: ``max_tokens`` None is
    what the context leaves, J1)."""
    ratio = admission_policy_class(config).idle_ratio(config)
    if max_tokens is None:
        max_tokens = max(1, config.max_model_len - prompt_len)
    longest = min(config.max_model_len, num_blocks * block_size + 1)  # J2, as the pool caps
    return future_blocks(prompt_len + int(ratio * max_tokens), -(-prompt_len // block_size),
                         block_size, longest)


def admission_policy_class(config: SchedulerConfig) -> type[AdmissionPolicy]:
    """The class of ``config``'s admission policy (K2)."""
    if config.admission_policy == "reserve":
        return ReserveMaxTokens
    if config.admission_policy == "adaptive":
        return AdaptiveReserve
    if config.admission_policy == "optimistic":
        return AdmissionPolicy
    raise _unbuilt("admission_policy", config.admission_policy)


def _unbuilt(field: str, name: str) -> ConfigError:
    """A name kvserve.core.config lists but no factory here builds (a contributor's missing
    branch), named rather than served by another policy (QA: the last branch took it)."""
    return ConfigError(f"{field}={name!r} has no class to build it in kvserve.core.policies")
