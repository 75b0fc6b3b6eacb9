"""ProcessEngine: the engine in a process of its own, as vLLM V1 runs its EngineCore.

::

    server process (event loop, tokenizer)          engine process (scheduler, model)
    --------------------------------------          ---------------------------------
    add_requests() / abort()  -> sender thread  ==> between steps: EngineCore.add / abort /
                                                      finish_stopped
    RequestStream, observers  <- reader thread  <== one message per step: add replies,
      (detokenize, stop strings)                    StepReports (token ids), stats

Both directions carry plain data pickled with protocol 5 over one pipe; the sender sends every
command queued since its last message as one message, the engine sends one message per step
(or per batch of commands applied while idle). The server's event loop and the engine never
share an interpreter lock, so the engine's OpenMP threads may spin
(``OMP_WAIT_POLICY=ACTIVE`` in the engine process only).

Text is the server's work, as in vLLM V1's output processor: the engine process ships token
ids only, and the reader thread detokenizes each request incrementally and matches its stop
strings (:mod:`kvserve.engine.server_text`, by the same code the in-process engine runs).
When a stop string matches before the engine finished the request, the text up to it goes to
the stream at once and the engine is told to finish the request as stopped; its finished
``stop`` chunk (with the request's metrics) ends the stream, and tokens the engine generated
for it meanwhile are dropped.

The process is spawned (never forked: the server may hold OpenMP and torch state), builds its
engine with ``spec.factory`` and answers ``ready`` with its scheduler and cache configuration,
so a ProcessEngine is usable as soon as it is constructed. If the process dies (killed, out of
memory, a crash in a step), every open stream and pending add fails with
:class:`EngineDeadError` at once: no client hangs. The process exits when its pipe closes, so
it never outlives the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvserve.core import ConfigError, RequestError, SamplingParams, SchedulerStats
from kvserve.engine.async_engine import (
    EngineDeadError,
    EngineFigures,
    RequestStream,
    RouterFigures,
    StepReport,
    _put_all,
    notify,
    route_chunks,
    settle,
)
from kvserve.engine.core_loop import AddItem, EngineCore, stalled
from kvserve.engine.engine import CompletionChunk, Engine, EngineInfo, Prompt
from kvserve.engine.server_text import ServerText

logger = logging.getLogger("kvserve.engine")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # kvserve serve's log lines


def _kvserve_log_level() -> int:
    return logging.getLogger("kvserve").getEffectiveLevel()


def _configures_logging() -> bool:
    from kvserve.flags import CLIError, configures_logging

    try:
        return configures_logging()
    except CLIError:  # the command refused it already; a library caller: as by default
        return True

PICKLE_PROTOCOL = 5
JOIN_TIMEOUT_S = 10.0  # a stopping engine process is killed if it has not exited by then
_ENV_LOCK = threading.Lock()  # os.environ is the spawned child's environment while it starts
# libgomp's spin count when no OMP_WAIT_POLICY is set: how long a waiting OpenMP thread of the
# engine spins before it sleeps (EngineSpec.environment).
BRIEF_SPIN_COUNT = "300000"
# The variables that choose kernels (kvserve.model.kernel_info.PROJECTIONS_ENV,
# PREFILL_ATTENTION_ENV and LAYER_STACK_ENV), passed to every engine process and replica as the
# caller set them.
KERNEL_ENVIRONMENT = ("KVSERVE_PROJECTIONS", "KVSERVE_PREFILL_ATTENTION", "KVSERVE_LAYER_STACK")
# `kvserve serve --engine-step-timeout`'s default: seconds without a step, while the engine has
# work, before the server kills the engine process as hung, for each STEP_TIMEOUT_TOKENS of the
# step's token budget (at least once). Far above any step it takes in earnest: one 8,000-token
# prefill step of the bundled model took 13 s in bfloat16 and 32 s in float32 on the 2-core
# Zen 4 machine (docs/engine-process.md, "A hung engine").
DEFAULT_STEP_TIMEOUT = 120.0
STEP_TIMEOUT_TOKENS = 8192


def default_step_timeout(max_num_batched_tokens: int) -> float:
    """The watchdog's default for a step of up to this many tokens: a step's time grows with
    its tokens, so a larger budget waits proportionally longer."""
    return DEFAULT_STEP_TIMEOUT * max(1.0, max_num_batched_tokens / STEP_TIMEOUT_TOKENS)


@dataclass(frozen=True)
class EngineSpec:
    """How an engine process builds its engine. ``factory`` must pickle: a module-level
    function, or a ``functools.partial`` of one with picklable arguments. ``threads``: torch
    intra-op threads in the engine (None: torch's default, one per core). ``wait_policy``:
    the engine's ``OMP_WAIT_POLICY``; None chooses by cores (:meth:`resolved_wait_policy`).
    ``processes``: how many engine processes of this spec share this machine's cores (local
    data-parallel replicas), for the wait policy. ``step_timeout``: seconds the server waits
    for a step while the engine has work before it declares the process hung and kills it
    (the step watchdog, :class:`ProcessEngine`); None: wait for ever. ``detokenize``:
    whether the engine process turns token ids into text itself (a :class:`ProcessEngine`
    with a tokenizer does it in the server's process instead). ``log_level``: the
    ``kvserve`` loggers' level in the engine process, by default the creating process's, so
    the engine's boot log (dtype, CPU, ISA, the kernel of each op) reaches the server's log
    as the in-process engine's does."""

    factory: Callable[[], Engine]
    threads: int | None = None
    wait_policy: str | None = None
    idle_wait: float = 0.005  # seconds to wait after a step that could run nothing
    step_timeout: float | None = None
    processes: int = 1  # engine processes of this spec sharing this machine's cores
    detokenize: bool = True
    log_level: int = field(default_factory=_kvserve_log_level)

    def resolved_wait_policy(self) -> str:
        """ACTIVE (OpenMP threads spin between kernels) only where the engine's threads leave
        a core to the server's process; else PASSIVE. Spinning threads on every core keep
        the server's event loop and reader thread, and so the next step's inputs, off the
        CPU: on 2 cores the engine process measured 45 output tok/s spinning against 141 for
        the engine thread (docs/engine-process.md)."""
        if self.wait_policy is not None:
            return self.wait_policy
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        return "ACTIVE" if cores > (self.threads or cores) * self.processes else "PASSIVE"

    def environment(self) -> dict[str, str]:
        """The engine process's OpenMP settings, and the caller's KERNEL_ENVIRONMENT. Where the
        policy was chosen PASSIVE by cores (not said outright), the threads still spin briefly
        before they sleep:
        GOMP_SPINCOUNT=300000, libgomp's own default when no policy is set (a few
        milliseconds), unless the user set GOMP_SPINCOUNT. A step's kernels follow each other
        within microseconds, so waiting threads catch the next one spinning, and sleep when
        the engine idles or the server needs the core for longer: W3 on the 2-core machine,
        quiet, gave 270-272 output tok/s against 239-249 strictly passive, TTFT p50 1.7-1.9 s
        against 2.8-3.2 s (docs/engine-process.md)."""
        env = {"OMP_WAIT_POLICY": self.resolved_wait_policy()}
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        for name in KERNEL_ENVIRONMENT:  # so a Ray actor on another node runs the same kernels
            if name in os.environ:
                env[name] = os.environ[name]
        if self.wait_policy is None and env["OMP_WAIT_POLICY"] == "PASSIVE" \
                and "GOMP_SPINCOUNT" not in os.environ:
            env["GOMP_SPINCOUNT"] = BRIEF_SPIN_COUNT
        return env


# -- messages (plain data) ---------------------------------------------------------------------

@dataclass
class _Ready:
    info: EngineInfo  # without the tokenizer: the server has its own
    stats: SchedulerStats
    pid: int
    wants_text: bool = True  # the engine was built to detokenize (LLM(detokenize=False): not)


@dataclass
class _Failed:
    message: str


@dataclass
class _Out:
    """One message from the engine: replies to adds (sequence number, error or None), what ran,
    and the counters the server shows."""

    replies: list[tuple[int, BaseException | None]] = field(default_factory=list)
    reports: list[StepReport] = field(default_factory=list)
    stats: SchedulerStats | None = None
    idle_checks: int = 0
    invariant_violations: int = 0


_Command = tuple[str, Any]  # ("add", (seq, items)) | ("abort", ids) | ("stop", None)
#                             | ("finish", [(id, stop string)])
#                             | ("release", (seq, session id, tenant))


# -- the engine process ------------------------------------------------------------------------

def _name_process(name: str) -> None:
    """Show this process as ``name`` (kvserve-engine, kvserve-engine-N) in ps and top, as
    vLLM names its EngineCore: spawned, it read as multiprocessing's ``spawn_main``. The
    kernel's short name (``comm``: top, ``ps -o comm``, ``pgrep``) holds 15 bytes, which cut
    every replica's to ``kvserve-engine-``: it is ``kvs-engine-N`` there. Without
    setproctitle (the server extra installs it) the name stays."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(name)
    setproctitle.setthreadtitle(short_process_name(name))


def short_process_name(name: str) -> str:
    """``name`` within the kernel's 15-byte ``comm``: kvserve-engine-12 -> kvs-engine-12."""
    return name.replace("kvserve-", "kvs-", 1)[:15]


def engine_main(conn: Connection, spec: EngineSpec) -> None:
    """The engine process: build the engine, then serve commands until told to stop or the
    pipe closes."""
    # Ctrl-C in a terminal, `timeout`, or systemd's control-group stop reach the whole
    # process group: the server shuts the engine down in order (or the pipe closes and it
    # exits), so the engine ignores SIGINT and SIGTERM itself. Were it to die of them first,
    # the server would log a crash and restart its replicas while shutting down.
    if threading.current_thread() is threading.main_thread():  # not so in a Ray actor
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _name_process(multiprocessing.current_process().name)
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),),
                         name="kvserve-parent-watch", daemon=True).start()
    os.environ.update(spec.environment())  # before torch is imported here
    # a spawned process starts with no handler (a Ray worker has its own): to stderr, the
    # server's, unless VLLM_CONFIGURE_LOGGING=0 (inherited) leaves logging alone
    if not logging.getLogger().handlers and _configures_logging():
        logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger("kvserve").setLevel(spec.log_level)
    try:
        if spec.threads is not None:  # before the build: its boot line names the threads
            import torch  # (it said the CPUs' count beside the ready line's threads, QA)
            torch.set_num_threads(spec.threads)
        engine = spec.factory()
        wants_text = engine.detokenize
        engine.detokenize = wants_text and spec.detokenize
    except BaseException as error:  # the server reports it and exits
        # A refusal of the settings reads as a message; anything else names its type.
        plain = isinstance(error, (ConfigError, ValueError, FileNotFoundError)) and str(error)
        _send(conn, _Failed(str(error) if plain else f"{type(error).__name__}: {error}"))
        return
    core = EngineCore(engine)
    _send(conn, _Ready(dataclasses.replace(engine.info, tokenizer=None), core.stats,
                       os.getpid(), wants_text))
    try:
        _serve(conn, core, spec.idle_wait)
    except (EOFError, OSError):  # the server went away
        return


def _exit_with_parent(parent: int, every: float = 0.5) -> None:
    """End this engine process once the server that spawned it is gone, loading or not: a
    server killed outright (SIGKILL, or a signal before its handlers are up) cannot stop it,
    and while the model loads the pipe is not read, so its closing goes unseen (QA: a
    replica loading on for its whole load after a SIGTERM, holding its memory)."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


def _apply(core: EngineCore, kind: str, payload: Any, out: _Out) -> bool:
    """One command from the server (:data:`_Command`) applied to ``core``, its answer or
    report in ``out``; False for "stop"."""
    if kind == "stop":
        return False
    if kind == "add":
        seq, items = payload
        out.replies.append((seq, _portable(core.add(items))))
    elif kind == "release":
        seq, session_id, tenant = payload
        error, report = core.release_session(session_id, tenant)
        out.replies.append((seq, _portable(error)))
        if report is not None:
            out.reports.append(report)
    elif kind in ("abort", "finish"):
        report = core.abort(payload) if kind == "abort" else core.finish_stopped(payload)
        if report is not None:
            out.reports.append(report)
    else:
        raise ValueError(f"unknown engine command {kind!r}")
    return True


def _serve(conn: Connection, core: EngineCore, idle_wait: float) -> None:
    wait = 0.0
    while True:
        out = _Out()
        timeout = wait if core.busy else 0.5
        checks = core.idle_checks
        while conn.poll(timeout):
            for kind, payload in pickle.loads(conn.recv_bytes()):
                if not _apply(core, kind, payload, out):
                    return
            timeout = 0.0
        if out.replies:  # the adds answered before the step, which may be long (QA: a full
            _flush(conn, core, out)  # queue's 503 waited for it, and the next one too)
            out = _Out()
        wait = 0.0
        if core.busy:
            report = core.step()
            out.reports.append(report)
            if stalled(report):
                wait = idle_wait
        else:
            released = core.idle()  # sessions whose ttl ran out: their events and stats
            if released is not None:
                out.reports.append(released)
        if out.reports or core.idle_checks != checks:
            _flush(conn, core, out)


def _flush(conn: Connection, core: EngineCore, out: _Out) -> None:
    """Send ``out`` with the counters as they stand."""
    out.stats = core.stats
    out.idle_checks, out.invariant_violations = core.idle_checks, core.invariant_violations
    _send(conn, out)


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling whole, else a RequestError with its message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error, PICKLE_PROTOCOL))
    except Exception:
        return RequestError(str(error))
    return error


def _send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, PICKLE_PROTOCOL))


# -- the server's side -------------------------------------------------------------------------

@dataclass
class _Pending:
    """A command sent whose answer the caller awaits: an add (its requests, and what their
    text streams need) or a session release (none of either)."""

    future: concurrent.futures.Future[None]
    request_ids: list[str]
    texts: list[tuple[str, list[int], SamplingParams]]
    sent: float = field(default_factory=time.monotonic)


def _main_guard_hint() -> str:
    """Why a spawned engine process may die at once when started from a script: the child
    imports the script's main module again, and without ``if __name__ == "__main__":`` it
    runs the script's LLM(...) again, which multiprocessing refuses in a child."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or ""
    if not path.endswith(".py") or "site-packages" in path or \
            path.startswith(os.path.dirname(os.path.dirname(__file__))):
        return ""  # interactive, python -c, or a command (kvserve, pytest) that guards itself
    return (f"; if {path} builds the LLM or server at import, put that under "
            "`if __name__ == \"__main__\":` (engine processes are spawned: each imports "
            "the main module again, as with any Python multiprocessing)")


class EngineStartError(RuntimeError):
    """The engine process could not build its engine, or never said it was ready."""


class Launcher(Protocol):
    """Starts one engine process somewhere and hands back the server's end of its pipe: a
    local spawned process (:class:`LocalLauncher`) or a Ray actor (``RayLauncher``). It may be
    launched again after a death (a restart)."""

    name: str

    def launch(self, spec: EngineSpec, timeout: float) -> Connection: ...
    def alive(self) -> bool: ...
    def kill(self) -> None: ...
    def join(self, timeout: float) -> None: ...
    def death(self) -> str: ...
    def close(self) -> None:
        """The engine was stopped for good: release what the launcher holds."""


class LocalLauncher:
    """The engine in a process spawned on this machine (never forked: the server may hold
    OpenMP and torch state), with ``spec``'s environment."""

    def __init__(self, name: str = "kvserve-engine", gpu: str | None = None) -> None:
        self.name = name
        self.gpu = gpu  # the one GPU this process sees (CUDA_VISIBLE_DEVICES), if any
        self.process: multiprocessing.process.BaseProcess | None = None

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        """The child's environment on top of this process's: ``spec``'s, and its GPU."""
        env = spec.environment()
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env

    def launch(self, spec: EngineSpec, timeout: float) -> Connection:
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, spec), name=self.name,
                                       daemon=True)
        env = self.environment(spec)
        with _ENV_LOCK:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                self.process.start()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
        child.close()
        return conn

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def join(self, timeout: float) -> None:
        if self.process is not None:
            self.process.join(timeout)

    def close(self) -> None:
        pass

    def death(self) -> str:
        assert self.process is not None
        code = self.process.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else _signal_label(-code)
        return f"the engine process (pid {self.process.pid}) died ({how})"


def _signal_label(number: int) -> str:
    """``signal 15, SIGTERM``: what killed a process, as an operator would look it up."""
    try:
        return f"signal {number}, {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


class ProcessEngine:
    """A :class:`~kvserve.engine.async_engine.ServingEngine` whose engine runs in a process of
    its own (``launcher``; default: a local spawned process). Constructing it starts the
    process and waits until the engine is built; call :meth:`start` from the event loop before
    adding requests. ``on_death`` is called (on the reader thread) when the process dies
    without being stopped. With a ``tokenizer`` the output text is made here, on the reader
    thread, not in the engine process (the module's docstring).

    The step watchdog (``spec.step_timeout``): an engine process that is alive but makes no
    progress (stopped, or stuck in a kernel) would hang its requests for ever, since only a
    death ends them. So while the engine has work (its last stats show requests, or an add is
    unanswered), the reader thread expects a message at least every ``step_timeout`` seconds
    (a busy engine sends one per step); it warns at half the timeout and kills the process at
    the timeout, which then fails its requests as any death does (and a replica restarts)."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, *, name: str = "kvserve-engine",
                 launcher: Launcher | None = None, start_timeout: float = 600.0,
                 on_death: Callable[[ProcessEngine], None] | None = None,
                 cancel: threading.Event | None = None) -> None:
        self.spec = dataclasses.replace(spec, detokenize=spec.detokenize and tokenizer is None)
        self.tokenizer = tokenizer
        self.name = name
        self.launcher: Launcher = launcher or LocalLauncher(name)
        self.on_death = on_death
        self.observers: list[Callable[[StepReport], None]] = []
        self.error: BaseException | None = None
        self.idle_checks = self.invariant_violations = 0
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, _Pending] = {}
        self._text = ServerText(tokenizer)  # reader thread only
        self._lock = threading.Lock()  # _streams, _pending: event loop and reader thread
        self._seq = itertools.count()
        self._outbox: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._dead = threading.Event()
        self._failed: BaseException | None = None  # set once, under _lock, by _fail_all
        self._last_heard = time.monotonic()  # the last message from the engine (reader thread)
        self._warned = False  # the watchdog warned of this silence
        self._hung: str | None = None  # why the watchdog killed the process
        self._conn = self.launcher.launch(self.spec, start_timeout)
        try:
            ready = self._await_ready(start_timeout, cancel)
        except BaseException:  # a signal, or Ctrl-C, while it loads: the process goes too
            self._kill()
            raise
        self.info: EngineInfo = dataclasses.replace(ready.info, tokenizer=tokenizer)
        self.stats: SchedulerStats = ready.stats
        self.pid = ready.pid
        self.makes_text = ready.wants_text and not self.spec.detokenize  # here, not there
        logger.info("%s: engine process pid %d ready (%s threads, OMP_WAIT_POLICY=%s)", name,
                    self.pid, spec.threads or "default", self.spec.resolved_wait_policy())

    @property
    def pending_adds(self) -> int:
        """Adds (and session releases) sent and not yet answered (not yet in
        :attr:`stats`)."""
        return len(self._pending)

    def _await_ready(self, timeout: float, cancel: threading.Event | None) -> _Ready:
        """The engine's ready message; EngineStartError if it fails, dies, takes longer than
        ``timeout`` or ``cancel`` is set (another replica failed to start)."""
        deadline = time.monotonic() + timeout
        try:
            while not self._conn.poll(0.1):
                if cancel is not None and cancel.is_set():
                    raise EngineStartError("start cancelled")
                if not self.launcher.alive():
                    raise EngineStartError(f"{self.launcher.death()} before it was ready")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine process was not ready after "
                                           f"{timeout:.0f} s")
            message = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as error:
            gone = time.monotonic() + 2  # the pipe closes as the process ends: its exit says why
            while self.launcher.alive() and time.monotonic() < gone:
                time.sleep(0.05)
            why = f"{self.launcher.death()} before it was ready" if not self.launcher.alive() \
                else f"the engine process closed its pipe before it was ready: {error!r}"
            self._kill()
            raise EngineStartError(f"{why}{_main_guard_hint()}") from None
        except EngineStartError:
            self._kill()
            raise
        if isinstance(message, _Failed):
            self._kill()
            raise EngineStartError(message.message)
        assert isinstance(message, _Ready), message
        return message

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        for target, suffix in ((self._read, "reader"), (self._write, "sender")):
            thread = threading.Thread(target=target, name=f"{self.name}-{suffix}", daemon=True)
            thread.start()
            self._threads.append(thread)

    async def stop(self) -> None:
        """Stop the engine process (what it was running ends with EngineDeadError)."""
        self.ask_to_stop()
        await asyncio.to_thread(self.join)

    def ask_to_stop(self) -> None:
        """Tell the engine process to stop; :meth:`join` waits for it (where no event loop
        runs: at the interpreter's exit, where no worker thread may start any more)."""
        self._stopping = True
        if self._threads:
            self._outbox.put(("stop", None))
            self._outbox.put(None)
        else:  # never started: no sender thread carries the message (it waited 10 s, killed)
            with contextlib.suppress(OSError, ValueError):  # the process is gone already
                _send(self._conn, [("stop", None)])

    def join(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        self.launcher.join(timeout)
        if self.launcher.alive():
            self._kill()
        self.launcher.close()
        self._conn.close()
        for thread in self._threads:
            thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _kill(self) -> None:
        self.launcher.kill()
        self.launcher.join(10)

    @property
    def is_running(self) -> bool:
        return bool(self._threads) and not self._dead.is_set() and not self._stopping

    def health(self) -> str | None:
        return None

    def engine_figures(self) -> list[EngineFigures]:
        return [EngineFigures(0, self.stats, self.invariant_violations)]

    def router_figures(self) -> RouterFigures | None:
        return None

    # -- requests --------------------------------------------------------------------------

    async def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]],
                           arrival_time: float | None = None) -> RequestStream:
        """As :meth:`AsyncEngine.add_requests`; the engine's refusal (RequestError,
        QueueFullError, ...) is raised here."""
        if not self.is_running:
            raise EngineDeadError(self._death_message())
        request_ids = [request_id for request_id, _, _ in items]
        stream = RequestStream(request_ids, self)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        when = time.monotonic() if arrival_time is None else arrival_time
        payload: list[AddItem] = []
        texts: list[tuple[str, list[int], SamplingParams]] = []
        for request_id, prompt, params in items:
            ids = self._prompt_ids(prompt)
            if ids is not None:
                prompt = ids
                texts.append((request_id, ids, params))
            payload.append((request_id, prompt, params, when))
        seq = next(self._seq)
        with self._lock:
            if self._failed is not None:  # it died after the check above
                raise self._failed
            # The engine would refuse an id in use too, but only after its stream here had
            # been replaced and then dropped, leaving the first request's client unanswered.
            seen: set[str] = set()
            for request_id in request_ids:
                if request_id in self._streams or request_id in seen:
                    raise RequestError(f"request {request_id}: request id {request_id!r} is "
                                       "already in use")
                seen.add(request_id)
            for request_id in request_ids:
                self._streams[request_id] = stream
            self._pending[seq] = _Pending(future, request_ids, texts)
        self._outbox.put(("add", (seq, payload)))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        return stream

    def _prompt_ids(self, prompt: Prompt) -> list[int] | None:
        """The prompt as token ids when the text is made here (text and chat prompts are
        encoded here, as the engine would); None to leave it to the engine, which reports a
        bad prompt."""
        if not self.makes_text:
            return None
        try:
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            items = list(prompt)
            if items and all(isinstance(item, dict) for item in items):
                return self.tokenizer.encode_chat(items)
            return items if all(isinstance(t, int) for t in items) else None
        except Exception:  # the engine refuses it with the same error, to the client
            return None

    def abort(self, *request_ids: str) -> None:
        """As :meth:`AsyncEngine.abort`: safe from any thread; unknown ids are ignored."""
        if request_ids:
            self._outbox.put(("abort", list(request_ids)))

    async def release_session(self, session_id: str, tenant: str | None) -> None:
        """As :meth:`AsyncEngine.release_session`; answered like an add."""
        if not self.is_running:
            raise EngineDeadError(self._death_message())
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        seq = next(self._seq)
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._pending[seq] = _Pending(future, [], [])
        self._outbox.put(("release", (seq, session_id, tenant)))
        await asyncio.wrap_future(future)

    # -- threads ---------------------------------------------------------------------------

    def _write(self) -> None:
        while True:
            command = self._outbox.get()
            batch: list[_Command] = []
            while command is not None:
                batch.append(command)
                try:
                    command = self._outbox.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    _send(self._conn, batch)
                except (OSError, ValueError):  # the process is gone: the reader reports it
                    return
            if command is None:
                return

    def _read(self) -> None:
        timeout = self.spec.step_timeout
        interval = None if timeout is None else min(1.0, timeout / 4)
        try:
            while True:
                if not self._conn.poll(interval):
                    self._watch()
                    continue
                message = pickle.loads(self._conn.recv_bytes())
                self._last_heard, self._warned = time.monotonic(), False
                self._receive(message)
        except (EOFError, OSError, ValueError):
            pass
        except BaseException:  # a message that cannot be read is as bad as a dead process
            logger.exception("%s: reading the engine's messages failed", self.name)
        if self._stopping:
            return
        self._dead.set()
        self.launcher.join(1.0)
        self.error = EngineDeadError(self._death_message())
        logger.error("%s", self.error)
        self.stats = self.stats.at_rest()  # its requests fail: gauges to 0, counters kept
        self._text.clear()  # this (the reader) thread's: its requests' texts end here
        self._fail_all(self.error)
        if self.on_death is not None:
            self.on_death(self)

    def _death_message(self) -> str:
        if self._stopping:
            return "the engine was shut down"
        return self._hung or self.launcher.death()

    def _silent_for(self) -> float | None:
        """Seconds the engine has owed a message (it has work and sent nothing), or None
        when it owes none (idle, by its last stats, and no add unanswered)."""
        now = time.monotonic()
        stats = self.stats
        if stats.num_running or stats.num_waiting or stats.num_swapped:
            return now - self._last_heard
        with self._lock:
            oldest = min((sent.sent for sent in self._pending.values()), default=None)
        return None if oldest is None else now - max(oldest, self._last_heard)

    def _watch(self) -> None:
        """The step watchdog (the class docstring); on the reader thread, between messages."""
        limit = self.spec.step_timeout
        silent = self._silent_for()
        if limit is None or silent is None or self._hung is not None:
            return
        if silent >= limit:
            self._hung = (f"the engine process (pid {self.pid}) finished no step in "
                          f"{limit:g} s with work queued and was killed as hung "
                          f"(--engine-step-timeout {limit:g})")
            self.launcher.kill()  # the pipe closes: the death path logs it, fails its requests
        elif silent >= limit / 2 and not self._warned:
            self._warned = True
            logger.warning("%s: the engine process (pid %d) has finished no step in %.1f s "
                           "with work queued; it is killed as hung at %g s "
                           "(--engine-step-timeout)", self.name, self.pid, silent, limit)

    def _receive(self, out: _Out) -> None:
        for seq, error in out.replies:
            with self._lock:
                add = self._pending.pop(seq)
                if error is not None:
                    for request_id in add.request_ids:
                        self._streams.pop(request_id, None)
            if error is None:
                for request_id, prompt_ids, params in add.texts:
                    self._text.open(request_id, prompt_ids, params)
            # the caller may have gone meanwhile; its stream asked to abort the requests
            settle(add.future, error)
        if out.stats is not None:
            self.stats = out.stats
            self.idle_checks, self.invariant_violations = \
                out.idle_checks, out.invariant_violations
        for report in out.reports:
            if self._text:  # the observers count what the clients get, as in-process
                report, finishes = self._text.apply(report)
                if finishes:
                    self._outbox.put(("finish", finishes))
            notify(self.observers, report)  # before the clients hear (AsyncEngine._notify)
            self._deliver(report.chunks)

    def _deliver(self, chunks: list[CompletionChunk]) -> None:
        with self._lock:
            routed = route_chunks(self._streams, chunks)
        if routed and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, routed)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._failed = self._failed or error
            streams = list({id(s): s for s in self._streams.values()}.values())
            pending = list(self._pending.values())
            self._streams.clear()
            self._pending.clear()
        for sent in pending:
            if not sent.future.done():
                settle(sent.future, error)
        if self._loop is not None and streams and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, [(s, error) for s in streams])
