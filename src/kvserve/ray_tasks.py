"""Ray as a task runner, for work that fans out over a cluster (`kvserve plan --ray`).

Kept out of kvserve.sim, which depends on numpy alone: Ray is the optional extra
``kvserve[ray]``, imported only when asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any


def map_on_ray(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``[fn(*job) for job in jobs]``, each call a Ray task, results in job order. Joins
    the Ray instance already started in this process, else the cluster ``RAY_ADDRESS``
    names, else starts a local one."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvserve[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
    remote = ray.remote(fn)
    return ray.get([remote.remote(*job) for job in jobs])
