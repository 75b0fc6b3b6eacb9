"""kvserve's scheduler core: pure standard library (docs/architecture.md, "Layers").

The simulator, the engine and the server all drive these objects unchanged.
"""

from kvserve.core.config import CacheConfig, SchedulerConfig
from kvserve.core.errors import (
    ConfigError,
    InvariantError,
    QueueFullError,
    RequestError,
    RequestRejected,
)
from kvserve.core.interfaces import Clock, Executor
from kvserve.core.invariants import check_empty, check_invariants
from kvserve.core.outputs import (
    CachedRequestData,
    ModelOutput,
    NewRequestData,
    RequestMetrics,
    RequestOutput,
    SchedulerEvent,
    SchedulerOutput,
    SchedulerStats,
)
from kvserve.core.policies import VictimPolicy
from kvserve.core.queues import WaitingQueue
from kvserve.core.request import EventType, Request, RequestStatus, SamplingParams
from kvserve.core.scheduler import Scheduler

__all__ = [
    "CacheConfig",
    "CachedRequestData",
    "Clock",
    "ConfigError",
    "EventType",
    "Executor",
    "InvariantError",
    "ModelOutput",
    "NewRequestData",
    "QueueFullError",
    "Request",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerEvent",
    "SchedulerOutput",
    "SchedulerStats",
    "VictimPolicy",
    "WaitingQueue",
    "check_empty",
    "check_invariants",
]
