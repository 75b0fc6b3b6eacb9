"""A planned deployment: model, hardware, dtype and cost model, plus the scheduler flags.

It turns user settings into the core's SchedulerConfig and CacheConfig (sizing the KV pool
from memory when no block count is given) and runs a trace through the simulator. Both
``kvserve simulate`` and ``kvserve plan`` go through :meth:`Deployment.simulate`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.core import CacheConfig, SchedulerConfig
from kvserve.core.checks import is_int
from kvserve.core.config import MAX_BLOCKS
from kvserve.flags import (
    CACHE_KEYS,
    SCHEDULER_KEYS,
    SIM_HASH_ALGO,
    cache_config,
    num_host_blocks,
    scheduler_config,
)
from kvserve.sim.capacity import KVPool, kv_bytes_per_token, plan_kv_pool
from kvserve.sim.cluster import ClusterOptions, ClusterSimulator, check_recorded_placement
from kvserve.sim.cost_models import (
    CalibratedCostModel,
    CostModel,
    CostModelError,
    ObservedCostModel,
    ReplayCostModel,
    RooflineCostModel,
    UnitCostModel,
)
from kvserve.sim.executor import BatchView
from kvserve.sim.presets import HardwareSpec, dtype_bytes, get_hardware, get_model, kv_dtype
from kvserve.sim.simulator import BATCHING_MODES, ProgressFn, SimResult, Simulator
from kvserve.sim.swap import SimPreemptionPrices, WithSwapCopies
from kvserve.sim.trace import TraceRequest, dump_trace

# The cost models by name (--cost-model's choices): a new one adds its name here, a branch in
# Deployment.build_cost_model, and decides whether it goes in TIMELESS_COPIES.
COST_MODELS = ("unit", "roofline", "calibrated", "replay")
# those whose steps a swap's block copies add no time to: unit time prices no hardware, and
# replayed steps already hold what their copies took
TIMELESS_COPIES = ("unit", "replay")


@dataclass(frozen=True)
class Deployment:
    model: str = "llama-3.1-8b"
    hardware: str = "h100-sxm"
    dtype: str = "bf16"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    cost_model: str = "roofline"
    calibration: str | None = None
    replay_log: str | None = None
    # `kvserve plan`'s memory what-ifs (None: the hardware preset's memory, an estimated
    # activation reserve, a pool sized from both).
    gpu_memory_gib: float | None = None
    kv_pool_gib: float | None = None
    activation_reserve_gib: float | None = None
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype: the weights' dtype, or fp8
    # A server's recording (kvserve.sim.recording.Recording): replay reads its step times,
    # calibrated without a file is fitted on its steps.
    recording: Any = dataclasses.field(default=None, compare=False)
    # Measured figures standing in for the named preset's (``--hardware cpu-local``: this
    # machine's peaks, kvserve.sim.machine.local_hardware); the report echoes them.
    hardware_spec: HardwareSpec | None = None
    # A KV pool given outright (--num-kv-blocks, --kv-cache-memory, plan's --kv-pool-gib) must
    # fit in the hardware's memory beside the weights; False for a recording's own pool on
    # the default hardware (it ran on the machine it ran on, which no preset names).
    check_pool_fits: bool = True

    def __post_init__(self) -> None:
        model = get_model(self.model)
        tp = self.tensor_parallel_size
        if not is_int(tp) or tp < 1:
            raise CostModelError(f"--tensor-parallel-size must be an integer >= 1, got {tp!r}")
        if model.num_heads % tp:  # vLLM refuses it too: the heads split evenly
            raise CostModelError(f"--tensor-parallel-size {tp}: {model.name}'s "
                                 f"{model.num_heads} attention heads do not divide evenly "
                                 "among the devices")
        get_hardware(self.hardware)
        dtype_bytes(self.dtype)
        kv_dtype(self.dtype, self.kv_cache_dtype)
        if self.cost_model not in COST_MODELS:
            raise CostModelError(f"unknown cost model {self.cost_model!r}; known: "
                                 f"{', '.join(COST_MODELS)}")
        if self.cost_model == "calibrated" and not (self.calibration or self.recording):
            raise CostModelError("--cost-model calibrated needs --calibration FILE.json")
        if self.cost_model == "replay" and not (self.replay_log or self.recording):
            raise CostModelError("--cost-model replay needs --replay-step-times LOG.jsonl")
        if self.hardware_spec is not None and self.hardware_spec.name != self.hardware:
            raise CostModelError(f"hardware_spec is {self.hardware_spec.name!r}, not the "
                                 f"named {self.hardware!r}")

    @property
    def hardware_applies(self) -> bool:
        """Whether the hardware preset figures in a run: it limits the pool or prices the
        steps. A recording simulated without ``--hardware`` uses neither (its own pool, its
        steps replayed or fitted), so its report names no preset (as plan's)."""
        return self.check_pool_fits or self.cost_model == "roofline"

    def hardware_preset(self) -> HardwareSpec:
        """The hardware's figures: measured ones when given, else the named preset's."""
        return self.hardware_spec or get_hardware(self.hardware)

    def build_cost_model(self, engine: int = 0) -> CostModel:
        """The step prices of one engine (``engine``: the replica, whose own step log a
        recording's replay reads)."""
        if self.cost_model == "unit":
            return UnitCostModel()
        if self.cost_model == "calibrated":
            if self.calibration is None:
                return self.recording.fitted_cost_model()
            return CalibratedCostModel.load(self.calibration)
        if self.cost_model == "replay":
            if self.replay_log is None:
                return self.recording.replay_cost_model(engine)
            if engine:
                raise CostModelError("--replay-step-times is one engine's step log: it "
                                     "cannot price replicas")
            return ReplayCostModel.load(self.replay_log)
        if self.cost_model == "roofline":
            return RooflineCostModel(get_model(self.model), self.hardware_preset(),
                                     self.dtype, self.tensor_parallel_size,
                                     kv_dtype=self._kv_dtype_if_other())
        raise CostModelError(f"cost model {self.cost_model!r} has no branch in "
                             "Deployment.build_cost_model")  # a listed name never built

    def _kv_dtype_if_other(self) -> str | None:
        """The KV cache's dtype where it is not the weights' (so default reports keep their
        shape)."""
        kv = kv_dtype(self.dtype, self.kv_cache_dtype)
        return None if kv == self.dtype else kv

    def kv_pool(self, settings: dict[str, Any], config: SchedulerConfig) -> KVPool:
        """The KV pool a run with these flags gets: ``num_kv_blocks`` or ``kv_cache_memory``
        when given, else sized from memory for this configuration (its activation reserve
        grows with max_num_seqs and the token budget, as vLLM's profiling run does)."""
        block_size = cache_config(settings, 1).block_size  # the cache flags, checked
        model = get_model(self.model)
        num_blocks = settings.get("num_kv_blocks")
        if num_blocks is None and settings.get("kv_cache_memory") is not None:
            per_block = kv_bytes_per_token(model, kv_dtype(self.dtype, self.kv_cache_dtype),
                                           self.tensor_parallel_size) * block_size
            pool = int(settings["kv_cache_memory"]) * self.tensor_parallel_size  # per device
            num_blocks = pool // per_block
            if num_blocks < 1:  # as kvserve generate / serve refuse it
                raise ValueError(f"kv cache memory of {settings['kv_cache_memory']} bytes "
                                 f"holds no block: one block of {block_size} tokens needs "
                                 f"{per_block // self.tensor_parallel_size} bytes per device")
        return plan_kv_pool(model, self.dtype, block_size, hardware=self.hardware_preset(),
                            gpu_memory_gib=self.gpu_memory_gib,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            tensor_parallel_size=self.tensor_parallel_size,
                            activation_reserve_gib=self.activation_reserve_gib,
                            kv_pool_gib=self.kv_pool_gib,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs,
                            num_blocks=None if num_blocks is None else int(num_blocks),
                            kv_dtype=self._kv_dtype_if_other(),
                            check_fits=self.check_pool_fits)

    def num_kv_blocks(self, settings: dict[str, Any], config: SchedulerConfig) -> int:
        """The pool's blocks; ValueError naming the setting where they are none or more
        than the scheduler takes (QA: "num_blocks must be >= 1" for --sweep
        num_kv_blocks=0, "num_blocks=4607... is out of range" for --gpu-memory-gib 1e23)."""
        num_blocks = self.kv_pool(settings, config).num_blocks
        if not 1 <= num_blocks <= MAX_BLOCKS:
            given = "num_kv_blocks" if "num_kv_blocks" in settings else \
                "kv_cache_memory" if "kv_cache_memory" in settings else \
                "gpu_memory_gib" if self.gpu_memory_gib is not None else "the device's memory"
            raise ValueError(f"{given} makes a KV pool of {num_blocks:,} blocks; the "
                             f"scheduler takes 1 to {MAX_BLOCKS:,}")
        return num_blocks

    def check_context(self, config: SchedulerConfig) -> None:
        """ValueError where max_model_len is longer than the model's context, as vLLM
        refuses it (the engine here too)."""
        context = get_model(self.model).max_context
        if context is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len:,} is longer than "
                             f"{self.model}'s context ({context:,} tokens, its "
                             "max_position_embeddings)")

    def check(self, settings: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
        """The configs ``settings`` make here; ValueError (CapacityError for a pool that
        does not fit) naming what would refuse the run, before any simulating (a sweep
        asks it of every value first)."""
        unknown = sorted(set(settings) - {*SCHEDULER_KEYS, *CACHE_KEYS, "batching"})
        if unknown:  # QA: a misspelt key (max_num_seq) ran at the default, silently
            raise ValueError(f"unknown setting(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join((*SCHEDULER_KEYS, *CACHE_KEYS, 'batching'))}")
        batching = settings.get("batching", "continuous")
        if batching not in BATCHING_MODES:  # the review: a sweep's was refused at its run
            raise ValueError(f"batching {batching!r} is not one of {', '.join(BATCHING_MODES)}")
        return self.configs(settings)

    def configs(self, settings: dict[str, Any]) -> tuple[SchedulerConfig, CacheConfig]:
        config = scheduler_config(settings)
        self.check_context(config)
        block_size = cache_config(settings, 1).block_size
        per_block = kv_bytes_per_token(get_model(self.model), self.dtype,
                                       self.tensor_parallel_size) * block_size
        host_blocks = num_host_blocks(settings, per_block, self.tensor_parallel_size)
        return config, cache_config(settings, self.num_kv_blocks(settings, config),
                                    host_blocks)

    def preemption_prices(self, cost_model: CostModel, block_size: int) -> SimPreemptionPrices:
        """What recomputing and swapping cost here (S4; :mod:`kvserve.sim.swap`)."""
        if self.cost_model == "replay":  # measured steps price no hypothetical prefill
            cost_model = RooflineCostModel(get_model(self.model), self.hardware_preset(),
                                           self.dtype, self.tensor_parallel_size)
        return SimPreemptionPrices(cost_model, get_model(self.model),
                                   self.hardware_preset(), self.dtype,
                                   self.tensor_parallel_size, block_size,
                                   copies_take_time=self.cost_model not in TIMELESS_COPIES,
                                   swaps_priced=self.cost_model != "unit")

    def simulate(self, trace: Sequence[TraceRequest], settings: dict[str, Any], *,
                 seed: int = 0, record_events: bool = False, check: bool = False,
                 progress: ProgressFn | None = None,
                 cluster: ClusterOptions | None = None,
                 fast_forward: bool = True,
                 observe: Callable[[BatchView, float], None] | None = None
                 ) -> tuple[dict[str, Any], SimResult]:
        """Run ``trace``; returns the config echo for the report and the result. With
        ``cluster`` of more than one replica (or in lockstep), a ClusterResult. ``observe``
        is handed every step priced (its shape and seconds, any replica's)."""
        config, cache = self.check(settings)
        batching = settings.get("batching", "continuous")
        cost_model = self._cost_model(config, cache, observe=observe)
        prices = getattr(cost_model, "prices", None)
        simulator = Simulator(config, cache, cost_model, seed=seed, batching=batching,
                              record_events=record_events, check=check,
                              preemption_prices=prices, fast_forward=fast_forward)
        if cluster is not None and cluster.router == "recorded":  # one replica too
            check_recorded_placement(trace, cluster.data_parallel_size)
        if cluster is not None and (cluster.data_parallel_size > 1 or cluster.lockstep):
            cost_models = [cost_model] + [self._cost_model(config, cache, engine, observe)
                                          for engine in range(1, cluster.data_parallel_size)]
            result = ClusterSimulator(simulator, cluster, cost_models).run(trace, progress)
        else:
            result = simulator.run(trace, progress)
            cluster = None
        echo = {
            "scheduler": _scheduler_echo(config),
            "cache": _cache_echo(cache),
            "cost_model": cost_model.describe(),
            "deployment": {"model": self.model,
                           "hardware": self.hardware if self.hardware_applies else None,
                           "dtype": self.dtype,
                           "tensor_parallel_size": self.tensor_parallel_size,
                           "gpu_memory_utilization": self.gpu_memory_utilization},
            "batching": batching,
            "seed": seed,
            "trace": {"num_requests": len(trace), "digest": trace_digest(trace)},
        }
        if cluster is not None and self.cost_model == "replay" and self.recording is not None:
            echo["cost_model"]["source"] = (f"{self.recording.path} (engines 0-"
                                            f"{cluster.data_parallel_size - 1}, each "
                                            "replica its own)")
            echo["cost_model"]["num_steps"] = sum(len(log.steps) for log in
                                                  self.recording.engines.values())
        if self.kv_cache_dtype != "auto":
            echo["deployment"]["kv_cache_dtype"] = self.kv_cache_dtype
        if self.hardware_spec is not None:
            hardware = self.hardware_spec
            echo["deployment"]["hardware_measured"] = {
                "peak_flops": dict(hardware.peak_flops),
                "memory_bandwidth": hardware.memory_bandwidth,
                "memory_bytes": hardware.memory_bytes}
        if cluster is not None:
            echo["data_parallel"] = cluster.describe()
        return echo, result


    def _cost_model(self, config: SchedulerConfig, cache: CacheConfig, engine: int = 0,
                    observe: Callable[[BatchView, float], None] | None = None) -> CostModel:
        """The step prices; with a host tier in use, they include the block copies."""
        cost_model = self.build_cost_model(engine)
        if config.preemption_mode != "recompute":
            cost_model = WithSwapCopies(cost_model,
                                        self.preemption_prices(cost_model, cache.block_size))
        return cost_model if observe is None else ObservedCostModel(cost_model, observe)


# Fields added after report version 1 (issue 12), echoed only when one of them is set, so a
# report with default flags stays byte-identical to one written before they existed.
_LATER_FIELDS = {"num_host_blocks": 0, "enable_priority_preemption": False,
                 "priority_preemption_threshold": 10, "max_preemptions_per_request": None}


def _fields(obj: Any) -> dict[str, Any]:
    fields = {name: getattr(obj, name) for name in obj.__dataclass_fields__}
    later = [name for name in _LATER_FIELDS if name in fields]
    if all(fields[name] == _LATER_FIELDS[name] for name in later):
        for name in later:
            del fields[name]
    return fields


def _cache_echo(cache: CacheConfig) -> dict[str, Any]:
    """The cache's fields; the block hash algorithm only when it is not the simulator's
    own (it decides nothing but equality: docs/scheduler.md, G3)."""
    fields = _fields(cache)
    if fields["prefix_caching_hash_algo"] == SIM_HASH_ALGO:
        del fields["prefix_caching_hash_algo"]
    return fields


# Scheduler fields newer than report version 1, echoed only when they differ from their
# defaults, so that a report with default flags stays byte-identical.
_ECHOED_WHEN_SET = ("max_num_queued_reqs_per_tenant", "prefix_cache_scope", "tenant_fairness",
                    "vtc_prompt_token_price", "vtc_output_token_price", "tenant_weights",
                    "lpm_max_queue", "schedule_aging_s", "max_session_kv", "session_ttl_s")


def _scheduler_echo(config: SchedulerConfig) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return {name: value for name, value in _fields(config).items()
            if name not in _ECHOED_WHEN_SET or value != defaults[name]}


def trace_digest(trace: Sequence[TraceRequest]) -> str:
    """A short stable digest of the trace's content (not its path)."""
    return hashlib.sha256(dump_trace(trace).encode()).hexdigest()[:16]
