"""Cluster-sized plans: how many replicas a trace needs to meet a latency SLO
(``kvserve plan --max-replicas M --slo-ttft-p99 S --slo-itl-p99 S``).

Each candidate replica count is one cluster simulation of the whole trace. Candidates are
independent, so they run in parallel: in local worker processes (``--workers K``) or as Ray
tasks (``--ray``, on the cluster ``RAY_ADDRESS`` names or a local Ray instance). A candidate's
row holds only simulated figures, and rows come back in candidate order, so the plan is
byte-identical however and wherever it ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from kvserve.sim.cluster import ClusterOptions
from kvserve.sim.report import aggregate
from kvserve.sim.trace import TraceRequest

ROW_FIGURES = ("num_finished", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "queue_p99",
               "throughput_output_tok_s", "num_preemptions", "prefix_hit_rate",
               "kv_usage_mean")


def replica_candidates(max_replicas: int) -> list[int]:
    """1, 2, 4, ... up to ``max_replicas``, and ``max_replicas`` itself."""
    if max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {max_replicas}")
    values, n = [], 1
    while n < max_replicas:
        values.append(n)
        n *= 2
    return [*values, max_replicas]


def simulate_candidate(deployment: Any, trace: Sequence[TraceRequest],
                       settings: dict[str, Any], options: ClusterOptions,
                       seed: int) -> dict[str, Any]:
    """One candidate's row: the replica count and the cluster's headline figures."""
    _, result = deployment.simulate(trace, settings, seed=seed, cluster=options)
    figures = aggregate(result)
    return {"replicas": options.data_parallel_size,
            **{name: figures[name] for name in ROW_FIGURES}}


def run_candidates(deployment: Any, trace: Sequence[TraceRequest], settings: dict[str, Any],
                   options: ClusterOptions, candidates: Sequence[int], *, seed: int = 0,
                   workers: int = 1, use_ray: bool = False) -> list[dict[str, Any]]:
    """Every candidate's row, in candidate order."""
    jobs = [(deployment, trace, settings,
             dataclasses.replace(options, data_parallel_size=n), seed) for n in candidates]
    if use_ray:
        from kvserve.ray_tasks import map_on_ray  # the optional extra, outside this layer

        return map_on_ray(simulate_candidate, jobs)
    if workers <= 1 or len(jobs) == 1:
        return [simulate_candidate(*job) for job in jobs]
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)),
                             mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(simulate_candidate, *job) for job in jobs]
        return [future.result() for future in futures]


def recommend_replicas(rows: Sequence[dict[str, Any]], slo_ttft_p99: float | None,
                       slo_itl_p99: float | None) -> dict[str, Any]:
    """The fewest replicas whose run met every SLO given (None: no candidate did)."""

    def meets(row: dict[str, Any]) -> bool:
        for figure, target in (("ttft_p99", slo_ttft_p99), ("itl_p99", slo_itl_p99)):
            if target is not None and (row[figure] is None or row[figure] > target):
                return False
        return True

    passing = [row["replicas"] for row in rows if meets(row)]
    if slo_ttft_p99 is None and slo_itl_p99 is None:  # nothing to meet: no recommendation
        passing = []
    return {"replicas_recommended": min(passing) if passing else None,
            "slo_ttft_p99_s": slo_ttft_p99, "slo_itl_p99_s": slo_itl_p99,
            "replicas_meeting_slo": passing}
