"""Steps far slower than the engine's usual: the stall an operator otherwise sees only as a
throughput line falling to a few tokens/s (QA: 1.2 s decode steps, back to back, against a
usual 10 ms, while other processes took the CPU; nothing in the logs said why).

A step with tokens is slow when it takes more than ``FACTOR`` times the median of the
engine's last ``WINDOW`` steps, and ``FACTOR`` times their median per token, and at least
``FLOOR`` seconds (a 2 ms step taking 30 ms is noise; a long prompt's prefill takes its
tokens' time, not a stall's: QA, a 907-token prefill of 2.7 s against 9 ms decodes was
called slow). Each one counts in ``kvserve:slow_steps_total``; the log says so at once, then at
most once per ``EVERY`` seconds with what came in between, with the machine's load average,
which tells a shared CPU apart from a scheduler that chose a big batch (the step's size is in
the line too). docs/engine-process.md, "Slow steps".
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger("kvserve.server")

WINDOW = 256  # recent steps the median is taken over
MIN_STEPS = 32  # before this many, no median to compare with
FACTOR = 10.0
FLOOR = 0.25  # seconds
EVERY = 10.0  # seconds between log lines


@dataclass
class SlowSteps:
    """One engine's slow steps (the engine thread calls :meth:`observe`)."""

    engine: int = 0
    replicas: int = 1  # data-parallel: every line names its replica, the first's too (QA)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    per_token: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _pending: int = 0  # slow steps not in a log line yet
    _slowest: tuple[float, int, int] = (0.0, 0, 0)  # seconds, sequences, tokens
    _median: float = 0.0
    _last_line: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock)  # engine thread, log loop

    def observe(self, seconds: float, num_tokens: int, num_sequences: int,
                now: float | None = None) -> bool:
        """Whether this step was slow (counted, and logged as :data:`EVERY` allows)."""
        if num_tokens <= 0:
            return False
        slow = False
        if seconds >= FLOOR and len(self.recent) >= MIN_STEPS:
            median = statistics.median(self.recent)  # only for a step past the floor
            slow = seconds > FACTOR * median and \
                seconds / num_tokens > FACTOR * statistics.median(self.per_token)
        self.recent.append(seconds)
        self.per_token.append(seconds / num_tokens)
        if not slow:
            return False
        with self._lock:
            self._pending += 1
            self._median = median
            if seconds > self._slowest[0]:
                self._slowest = (seconds, num_sequences, num_tokens)
        self.flush(now)
        return True

    def flush(self, now: float | None = None) -> None:
        """Log the slow steps not told yet, where :data:`EVERY` seconds have passed since
        the last line (the periodic stats loop calls it too: a burst's last steps)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._pending and now - self._last_line >= EVERY:
                self._log(now)

    def _log(self, now: float) -> None:
        seconds, sequences, tokens = self._slowest
        where = f"replica {self.engine}: " if self.replicas > 1 else ""
        since = "" if self._last_line == float("-inf") else \
            f" in the last {now - self._last_line:.0f} s"
        logger.warning(
            "%s%d engine step(s)%s took over %.0fx the median step (%.1f ms), also per token, "
            "the slowest %.2f s (%d sequence(s), %d token(s)); %s: a step is the model's and "
            "the sampler's work, so a CPU shared with other processes (or fewer cores than "
            "threads) is the usual cause, not the scheduler", where, self._pending, since,
            FACTOR, 1000 * self._median, seconds, sequences, tokens, load_line())
        self._pending, self._slowest, self._last_line = 0, (0.0, 0, 0), now


def load_line() -> str:
    """The machine's load average against its CPUs (where the OS tells it)."""
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):
        return "load average unknown"
    return f"load average {one_minute:.2f} on {os.cpu_count() or 1} CPUs"
