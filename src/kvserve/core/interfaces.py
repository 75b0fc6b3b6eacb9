"""The two protocols the core is driven through (docs/architecture.md, "The one seam: Executor").

One step, in the engine and in the simulator alike::

    output = scheduler.schedule(clock())
    model_output = executor.execute(output)
    request_outputs = scheduler.update(output, model_output, clock())

Call ``update`` after every ``schedule``, even when nothing was scheduled: it delivers the
outputs of requests the scheduler finished on its own (queue timeouts).
"""

from __future__ import annotations

from typing import Protocol

from kvserve.core.outputs import ModelOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run one step and return, per request id, the sampled token ids.

        Contract: a request whose scheduled tokens end before the end of its current
        sequence (a mid-prompt chunk) gets no entry or an empty list; a request whose chunk
        reaches the end gets one sampled token (a model's executor), or several in order (a
        speculative one's): the scheduler appends each and drops those after a stop (H2).
        The scheduler refuses a token for a mid-prompt chunk and no token at the end.
        ``scheduled_new_reqs`` are requests the executor has no state for (new or resumed);
        ``finished_req_ids`` and ``preempted_req_ids`` name state it may drop.
        """
        ...


class Clock(Protocol):
    """Where time comes from: ``clock()`` is seconds from any fixed origin (``time.monotonic``
    in the engine; a run-relative clock in the trace runner; the simulator passes virtual
    times to the scheduler directly). The core never reads a clock: it is given ``now``."""

    def __call__(self) -> float:
        ...
