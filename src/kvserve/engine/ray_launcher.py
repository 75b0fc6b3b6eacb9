"""Engine replicas as Ray actors (``kvserve serve --data-parallel-backend ray``).

Each replica is one actor, on the cluster ``RAY_ADDRESS`` names or, when it names none, on a
Ray instance started here (no dashboard). The actor connects back to the server over TCP
(``multiprocessing.connection`` with a random key) and then speaks exactly the engine
process's protocol (:func:`kvserve.engine.engine_process.engine_main`), so the server side is
the same :class:`ProcessEngine` as for a local process. Launching a replica again after its
actor died asks Ray for a new actor in its place (Ray's own actor restart would run the
restarted actor's methods only after the one that died with it, which never returns here).

Ray is an optional dependency (``pip install 'kvserve[ray]'``); it is imported only here.
"""

from __future__ import annotations

import os
import secrets
import threading
from multiprocessing.connection import Connection, Listener
from typing import Any

from kvserve.engine.engine_process import EngineSpec, EngineStartError, engine_main
from kvserve.ray_tasks import RayUnavailable, connect


class _EngineActor:
    """The Ray actor: runs one engine process's loop on request."""

    def serve(self, address: tuple[str, int], authkey: bytes, spec: EngineSpec) -> None:
        from multiprocessing.connection import Client

        engine_main(Client(address, authkey=authkey), spec)


def ensure_ray() -> Any:
    """Ray, connected (kvserve.ray_tasks.connect): to ``RAY_ADDRESS`` when set, else to a
    local instance started now."""
    try:
        return connect("--data-parallel-backend ray")
    except RayUnavailable as error:
        raise EngineStartError(str(error)) from None


class RayLauncher:
    """Replica ``index`` as a Ray actor holding ``spec.threads`` CPUs (1 if unset) and
    ``num_gpus`` GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES to its own)."""

    def __init__(self, index: int, num_gpus: int = 0, on_this_machine: bool = False) -> None:
        self.name = f"kvserve-engine-{index}"
        self.index = index
        self.num_gpus = num_gpus
        # on a Ray instance started here: the replicas share this machine's cores
        self.on_this_machine = on_this_machine
        self.actor: Any = None
        self.ref: Any = None

    def launch(self, spec: EngineSpec, timeout: float) -> Connection:
        ray = ensure_ray()
        self.close()  # a relaunch replaces the dead actor with a new one
        self.actor = ray.remote(_EngineActor).options(
            num_cpus=spec.threads or 1, num_gpus=self.num_gpus, max_restarts=0,
            runtime_env={"env_vars": spec.environment()}).remote()
        # The actor connects back: to this node's address when the cluster is elsewhere
        host = "127.0.0.1" if not os.environ.get("RAY_ADDRESS") else \
            ray.util.get_node_ip_address()
        authkey = secrets.token_bytes(32)
        with Listener((host, 0), authkey=authkey) as listener:
            accepted: list[Connection] = []
            errors: list[BaseException] = []

            def accept() -> None:
                try:
                    accepted.append(listener.accept())
                except BaseException as error:  # closed, or a bad key
                    errors.append(error)
            thread = threading.Thread(target=accept, daemon=True)
            thread.start()
            self.ref = self.actor.serve.remote(listener.address, authkey, spec)
            thread.join(timeout)
            if not accepted:
                done, _ = ray.wait([self.ref], timeout=0)
                reason = "" if not done else f": {_failure(ray, self.ref)}"
                raise EngineStartError(f"the Ray actor for replica {self.index} did not "
                                       f"connect{reason}")
        return accepted[0]

    def alive(self) -> bool:
        if self.ref is None:
            return False
        import ray
        done, _ = ray.wait([self.ref], timeout=0)
        return not done

    def kill(self) -> None:
        if self.actor is not None:
            import ray
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float) -> None:
        if self.ref is not None:
            import ray
            ray.wait([self.ref], timeout=timeout)

    def close(self) -> None:
        if self.actor is not None:
            import ray
            ray.kill(self.actor, no_restart=True)
            self.actor = self.ref = None

    def death(self) -> str:
        return f"the Ray actor of replica {self.index} died"


def _failure(ray: Any, ref: Any) -> str:
    try:
        ray.get(ref, timeout=0)
    except Exception as error:
        return str(error).splitlines()[0]
    return "it returned"
