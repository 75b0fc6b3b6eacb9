"""The value predicates every layer's checks share (standard library only): an integer or a
real number as JSON, Python and argparse give them, where ``True`` is an ``int`` to Python
and never a count or a time to kvserve. Each caller words its own message."""

from __future__ import annotations

import math
from typing import Any


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An ``int`` or a ``float`` that is not a ``bool`` (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A real number that is neither NaN nor infinite (an int of any size is)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def is_one_of(value: Any, values: tuple[Any, ...]) -> bool:
    """``value`` equals one of ``values``, a bool only a bool (True is no 1, 0 no False): a
    neutral value of a field kvserve takes from vLLM without implementing it."""
    return any(isinstance(value, bool) == isinstance(v, bool) and value == v for v in values)
