"""kvserve's simulator: the real scheduler (kvserve.core) driven on a virtual clock with a
cost model in place of the model. Standard library + numpy only (docs/architecture.md, "Layers")."""

from kvserve.sim.cost_models import (
    CalibratedCostModel,
    CostModel,
    RooflineCostModel,
    UnitCostModel,
)
from kvserve.sim.deployment import Deployment
from kvserve.sim.executor import BatchView, SimExecutor
from kvserve.sim.simulator import SimResult, Simulator
from kvserve.sim.trace import TraceError, TraceRequest, read_trace, write_trace
from kvserve.sim.workloads import WorkloadSpec, generate

__all__ = [
    "BatchView",
    "CalibratedCostModel",
    "CostModel",
    "Deployment",
    "RooflineCostModel",
    "SimExecutor",
    "SimResult",
    "Simulator",
    "TraceError",
    "TraceRequest",
    "UnitCostModel",
    "WorkloadSpec",
    "generate",
    "read_trace",
    "write_trace",
]
