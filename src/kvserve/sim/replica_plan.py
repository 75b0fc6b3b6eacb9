"""Cluster-sized plans: how many replicas a trace needs to meet a latency SLO
(``kvserve plan --max-replicas M --slo-ttft-p99 S --slo-itl-p99 S``).

Each candidate replica count is one cluster simulation of the whole trace. The fewest count
in [1, M] meeting the SLO is searched for (:func:`fewest_replicas`: doubling from 1 to
bracket it, then bisection), assuming that more replicas never do worse. Simulations are
independent, so they run in parallel: in local worker processes (``--workers K``) or as Ray
tasks (``--ray``, on the cluster ``RAY_ADDRESS`` names or a local Ray instance); the search
runs ahead over them as the capacity search does (kvserve.sim.parallel). A candidate's row
holds only simulated figures, and rows come back in replica order, so the plan is
byte-identical however and wherever it ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.sim.cluster import MAX_REPLICAS, ClusterOptions
from kvserve.sim.parallel import Workers, map_ordered, next_questions
from kvserve.sim.plan import shed
from kvserve.sim.report import aggregate
from kvserve.sim.trace import TraceRequest

ROW_FIGURES = ("num_finished", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "queue_p99",
               "throughput_output_tok_s", "num_preemptions", "prefix_hit_rate",
               "kv_usage_mean")


def check_max_replicas(max_replicas: int) -> None:
    if max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {max_replicas}")
    if max_replicas > MAX_REPLICAS:  # QA: minutes into gigabytes, silent
        raise ValueError(f"--max-replicas {max_replicas}: at most {MAX_REPLICAS} replicas "
                         "are simulated (each holds its own scheduler and KV pool)")


def replica_candidates(max_replicas: int) -> list[int]:
    """1, 2, 4, ... up to ``max_replicas``, and ``max_replicas`` itself."""
    check_max_replicas(max_replicas)
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
            **{name: figures[name] for name in ROW_FIGURES},
            "num_shed": sum(1 for record in result.records if shed(record))}


def run_candidates(deployment: Any, trace: Sequence[TraceRequest], settings: dict[str, Any],
                   options: ClusterOptions, candidates: Sequence[int], *, seed: int = 0,
                   workers: int = 1, use_ray: bool = False,
                   pool: Workers | None = None) -> list[dict[str, Any]]:
    """Every candidate's row, in candidate order (on ``pool`` when given, else on at most
    ``workers`` processes started for these)."""
    jobs = [(deployment, trace, settings,
             dataclasses.replace(options, data_parallel_size=n), seed) for n in candidates]
    if use_ray:
        from kvserve.ray_tasks import map_on_ray  # the optional extra, outside this layer

        return map_on_ray(simulate_candidate, jobs)
    if pool is not None:
        return pool.map(simulate_candidate, jobs)
    return map_ordered(simulate_candidate, jobs, workers)


def fewest_replicas(meets: Callable[[int], bool], max_replicas: int) -> int | None:
    """The fewest replica count in [1, ``max_replicas``] that ``meets`` the SLO (None: not
    even ``max_replicas``), assuming more replicas never do worse: 1, 2, 4, ... (``max_replicas``
    the last) until one meets it, then bisection between the last that did not and that one.
    A pure function of the answers (kvserve.sim.parallel.next_questions replays it)."""
    failed, count = 0, 1
    while not meets(count):
        if count == max_replicas:
            return None
        failed, count = count, min(2 * count, max_replicas)
    while count - failed > 1:
        middle = (failed + count) // 2
        if meets(middle):
            count = middle
        else:
            failed = middle
    return count


def search_replicas(deployment: Any, trace: Sequence[TraceRequest], settings: dict[str, Any],
                    options: ClusterOptions, max_replicas: int, slo_ttft_p99: float | None,
                    slo_itl_p99: float | None, *, seed: int = 0, workers: int = 1,
                    use_ray: bool = False) -> list[dict[str, Any]]:
    """The rows of the counts :func:`fewest_replicas` asked about, in replica order. With more
    than one worker it runs ahead: the counts it may ask next (both answers to each open
    question) are simulated ``workers`` at a time, and only the rows it asked are kept, so
    the rows are the same whatever the worker count."""
    if max_replicas < 1:
        raise ValueError(f"--max-replicas must be >= 1, got {max_replicas}")
    rows: dict[int, dict[str, Any]] = {}
    asked: set[int] = set()

    def search(meets: Callable[[int], bool]) -> int | None:
        return fewest_replicas(meets, max_replicas)

    with Workers(workers) as pool:
        def meets(count: int) -> bool:
            if count not in rows:
                known = {n: meets_slo(row, slo_ttft_p99, slo_itl_p99)
                         for n, row in rows.items()}
                ahead = next_questions(search, known, workers)
                for row in run_candidates(deployment, trace, settings, options, ahead,
                                          seed=seed, use_ray=use_ray, pool=pool):
                    rows[row["replicas"]] = row
            asked.add(count)
            return meets_slo(rows[count], slo_ttft_p99, slo_itl_p99)

        search(meets)
    return [rows[count] for count in sorted(asked)]


def meets_slo(row: dict[str, Any], slo_ttft_p99: float | None,
              slo_itl_p99: float | None) -> bool:
    """Whether a candidate's run met every SLO given: one that shed requests (a queue limit
    or deadline) did not, whatever the p99s of those it served (QA: 118 of 200 aborted by
    the queue deadline, and 1 replica "met" a TTFT target that needs 3); an ITL with no
    inter-token gap to measure (every answer a token long) breaks no ITL bound."""
    if row.get("num_shed") or row.get("num_finished") == 0:
        return False
    if slo_ttft_p99 is not None and (row["ttft_p99"] is None
                                     or row["ttft_p99"] > slo_ttft_p99):
        return False
    return slo_itl_p99 is None or row["itl_p99"] is None or row["itl_p99"] <= slo_itl_p99


def recommend_replicas(rows: Sequence[dict[str, Any]], slo_ttft_p99: float | None,
                       slo_itl_p99: float | None) -> dict[str, Any]:
    """The fewest replicas whose run met every SLO given (None: no candidate did)."""
    passing = [row["replicas"] for row in rows if meets_slo(row, slo_ttft_p99, slo_itl_p99)]
    if slo_ttft_p99 is None and slo_itl_p99 is None:  # nothing to meet: no recommendation
        passing = []
    return {"replicas_recommended": min(passing) if passing else None,
            "slo_ttft_p99_s": slo_ttft_p99, "slo_itl_p99_s": slo_itl_p99,
            "replicas_meeting_slo": passing}
