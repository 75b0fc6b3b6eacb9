"""Independent simulations on every core (``simulate --sweep``, ``kvserve plan``).

A simulation is deterministic and shares nothing with another, so a sweep's runs go to a
pool of worker processes and come back in submission order: the output is byte-identical
to the serial run's whatever the worker count (docs/simulator-speed.md). Workers are
spawned, not forked, so a worker never inherits a parent's threads or open progress bar.

The capacity search is a sequence of decisions, each on the result of the run before. With
more than one worker it runs ahead: the rates the search could ask for next (breadth first
over both answers to each pending question) are simulated at once, and the search itself,
unchanged, reads them from a table. It probes the same rates in the same order as the
serial search; the extra runs are speculation whose results it never reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Any, TypeVar

from kvserve.sim.table import Progress

T = TypeVar("T")


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_workers(workers: int) -> None:
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")


class Workers:
    """Up to ``workers`` processes, started on first use and kept for the next map (a
    capacity search maps a few runs at a time); ``with Workers(n) as pool:`` stops them."""

    def __init__(self, workers: int) -> None:
        check_workers(workers)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]],
            label: str = "") -> list[T]:
        """``[fn(*job) for job in jobs]`` in that order; ``fn`` and the jobs must pickle
        (module-level functions, plain data). A job's exception is raised here, as the
        serial loop would raise it. ``label`` begins the progress bar's ("N runs on K
        workers")."""
        if self.workers <= 1 or len(jobs) <= 1:
            return [fn(*job) for job in jobs]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers,
                                             mp_context=get_context("spawn"))
        futures = [self._pool.submit(fn, *job) for job in jobs]
        # the runs' own bars stay in the workers (no terminal there): one bar over the runs
        progress = Progress(len(futures), f"{label}{': ' if label else ''}{len(futures)} "
                                          f"runs on {self.workers} workers")
        try:
            for done, _ in enumerate(as_completed(futures), 1):
                progress.update(done)
        finally:
            progress.close()
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_ordered(fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]],
                workers: int) -> list[T]:
    """One map on a pool of at most ``workers`` processes (:meth:`Workers.map`)."""
    with Workers(min(workers, max(len(jobs), 1))) as pool:
        return pool.map(fn, jobs)


class _Pending(Exception):
    """A search asked about a rate whose answer is not known yet."""

    def __init__(self, qps: float) -> None:
        super().__init__(qps)
        self.qps = qps


def next_questions(search: Callable[[Callable[[float], bool]], Any],
                   known: dict[float, bool], limit: int) -> list[float]:
    """Up to ``limit`` rates ``search`` may ask about next, given the answers in ``known``:
    the first one it asks, then breadth first the ones it would ask after either answer.
    ``search`` must be a pure function of its answers (it is replayed)."""

    def first_unknown(answers: dict[float, bool]) -> float | None:
        def ask(qps: float) -> bool:
            if qps in answers:
                return answers[qps]
            raise _Pending(qps)

        try:
            search(ask)
        except _Pending as pending:
            return pending.qps
        return None

    found: list[float] = []
    frontier = [dict(known)]
    replays = 0
    while frontier and len(found) < limit and replays < 4 * limit + 8:
        replays += 1
        answers = frontier.pop(0)
        qps = first_unknown(answers)
        if qps is None:
            continue
        if qps not in found:
            found.append(qps)
        frontier.extend({**answers, qps: answer} for answer in (True, False))
    return found
