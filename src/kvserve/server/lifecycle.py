"""The server's life under signals: a SIGTERM or Ctrl-C while it starts stops the engines
already started and ends the process by that signal; while it serves, the shutdown drains
(the requests under way get ``--shutdown-timeout`` seconds, then are aborted with an answer
saying so; a second signal aborts them at once); a single engine that dies stops the server
with status 1, for its supervisor to start it again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("kvserve.server")


def end_by(signum: int) -> None:
    """End this process by ``signum``'s default action: a parent (a shell, systemd) sees
    the signal that stopped it, as it does for SIGTERM."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class _Interrupted(BaseException):
    """SIGTERM or SIGINT while the server starts."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interruptible_start() -> Iterator[None]:
    """SIGTERM or Ctrl-C while the model loads: the engine processes already started are
    stopped (their builders' cleanup runs as the exception passes), one line says so, and
    the server ends by that signal, as a stop while serving does (QA: a SIGTERM mid-load
    killed the server at once and left a replica loading; Ctrl-C printed a traceback)."""

    def interrupted(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    caught = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, interrupted) for signum in caught}
    try:
        yield
    except _Interrupted as stop:
        name = signal.Signals(stop.signum).name
        logger.warning("%s while starting: the engine processes were stopped; exiting", name)
        for signum in caught:
            signal.signal(signum, signal.SIG_DFL)
        end_by(stop.signum)
        raise  # not reached
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupted:
                signal.signal(signum, handler)


def draining_server(uvicorn: Any, config: Any, state: Any, timeout: float | None) -> Any:
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) aborts the requests still under
    way ``timeout`` seconds after it began (vLLM's --shutdown-timeout), so their clients get
    an answer that says so (finish_reason abort) and the server exits; with no timeout it
    waits for them all, as uvicorn does. A second SIGTERM or Ctrl-C aborts them at once (QA:
    a second SIGTERM did nothing, a second Ctrl-C cut every connection with tracebacks); a
    third Ctrl-C is uvicorn's forced exit."""

    class DrainingServer(uvicorn.Server):  # type: ignore[misc, name-defined]
        abort_asked = False  # a second signal came
        stop_signal: int | None = None  # the first signal, which the server ends by
        _now: asyncio.Event | None = None  # set by it, once the shutdown began
        _loop: asyncio.AbstractEventLoop | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.stop_signal = self.stop_signal or sig
            if not self.should_exit or self.abort_asked:
                super().handle_exit(sig, frame)
                return
            self.abort_asked = True
            logger.warning("a second %s: aborting the requests still under way",
                           _signal_name(sig))
            if self._loop is not None and self._now is not None:
                self._loop.call_soon_threadsafe(self._now.set)

        async def shutdown(self, sockets: Any = None) -> None:
            state.shutting_down = True  # a request read from now on is a 503
            self._loop, self._now = asyncio.get_running_loop(), asyncio.Event()
            if self.abort_asked:  # before this began
                self._now.set()
            aborter = asyncio.ensure_future(_abort_after(state, timeout, self._now))
            try:
                await _drain_background(state)
                await super().shutdown(sockets)
            finally:
                aborter.cancel()

    return DrainingServer(config)


async def _drain_background(state: Any) -> None:
    """Wait for the Responses API's background responses (no connection waits for them, so
    uvicorn did not, and the engine stopped under them; QA), while new requests are 503s;
    the shutdown timeout aborts them as it aborts the others."""
    tasks = [task for _, task in list(getattr(state, "background", {}).values())]
    if tasks:
        logger.info("waiting for %d background response(s) to finish", len(tasks))
        await asyncio.gather(*tasks, return_exceptions=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


async def _abort_after(state: Any, timeout: float | None, now: asyncio.Event) -> None:
    """After ``timeout`` (None: never), or once ``now`` is set, abort every live request,
    and again each moment after, for a request that was still being read or tokenized when
    the first round went by."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(now.wait(), timeout)
    state.abort_body_reads()
    logged = False
    while True:
        live = list(state.groups.values())
        if live and not logged:
            if now.is_set():
                logger.warning("aborting the %d request(s) still under way", len(live))
            else:
                logger.warning("shutdown timeout (%gs): aborting the %d request(s) still "
                               "under way", timeout, len(live))
            logged = True
        for stream in live:
            stream.abort(None)
        await asyncio.sleep(0.2)


def exit_when_the_engine_dies(server: Any, engine: Any) -> threading.Event:
    """A single engine that dies is not started again (data-parallel replicas are): the
    server then stops, status 1, so that its supervisor (systemd, Kubernetes) starts it
    again, as vLLM's server does, instead of answering 503 for ever (QA). Set when it did."""
    from kvserve.engine.data_parallel import DataParallelEngine

    died = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            # the shutdown stops the engine only after should_exit: read it again after
            if server.started and not engine.is_running and not server.should_exit:
                why = getattr(engine, "error", None) or "it stopped"
                logger.error("the engine died (%s): the server stops with status 1 so that "
                             "its supervisor starts it again", why)
                died.set()
                server.should_exit = True
                return
            time.sleep(0.25)

    if not isinstance(engine, DataParallelEngine):
        threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    return died
