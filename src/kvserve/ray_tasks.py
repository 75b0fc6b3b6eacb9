"""Ray, connected once per process, and Ray as a task runner for work that fans out over a
cluster (`kvserve plan --ray`); the server's Ray replicas (engine/ray_launcher.py) connect
through :func:`connect` too.

Kept out of kvserve.sim, which depends on numpy alone: Ray is the optional extra
``kvserve[ray]``, imported only when asked for.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any


class RayUnavailable(Exception):
    """Ray is not installed, or the cluster cannot be reached: one line says which."""


def connect(what: str) -> Any:
    """Ray, connected: to the instance already started in this process, else the cluster
    ``RAY_ADDRESS`` names (RayUnavailable at once where it does not answer: Ray would retry
    for minutes, QA), else a local instance started now, without a dashboard. ``what``
    names the flag that asked for Ray, in the error."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"{what} needs Ray: pip install 'kvserve[ray]'") from None
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        _check_reachable(address)
    # Ray's driver sets its own SIGTERM handler (exit status 15): the server's stop, ended
    # by the signal after its drain, must end the same with either backend (QA)
    main = threading.current_thread() is threading.main_thread()
    handlers = {signum: signal.getsignal(signum)
                for signum in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        # without RAY_ADDRESS, a local instance of its own (Ray's None joins the cluster a
        # `ray start` on this machine left named in its temp dir: QA, the head of a
        # multi-node cluster, whose actors elsewhere were told to connect to 127.0.0.1)
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = f"the Ray cluster at RAY_ADDRESS={address}" if address else \
            "a local Ray instance"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if address and not os.environ.get("RAY_AUTH_MODE"):  # QA: Ray's line says nothing
            reason += ("; a cluster with Ray's token authentication (`ray start` says so) "
                       "needs RAY_AUTH_MODE=token here too")
        raise RayUnavailable(f"cannot start on {where}: {reason}") from None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return ray


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A ``host:port`` RAY_ADDRESS answers a TCP connection within ``timeout`` seconds, or
    RayUnavailable says so. ``auto``, ``local`` and ``ray://`` client addresses are left to
    Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise RayUnavailable(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: "
                             f"{error.strerror or error}") from None


def map_on_ray(fn: Callable[..., Any], jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``[fn(*job) for job in jobs]``, each call a Ray task, results in job order, on the
    Ray :func:`connect` joins (ValueError, one line, where it cannot)."""
    try:
        ray = connect("--ray")
    except RayUnavailable as error:
        raise ValueError(str(error)) from None
    remote = ray.remote(fn)
    return ray.get([remote.remote(*job) for job in jobs])
